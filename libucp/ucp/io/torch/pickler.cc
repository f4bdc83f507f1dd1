// Pickler: one recursive emitter with a memo of emitted nodes (BINPUT/BINGET).
#include "ucp/io/torch/pickler.h"

#include <bit>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "ucp/base/status_macros.h"
#include "ucp/io/torch/unpickler.h"

namespace ucp::torch {
namespace {

constexpr int kMaxDepth = 1000;
constexpr size_t kBatch = 1000;  // items per APPENDS/SETITEMS, as CPython's pickler does

class Emitter {
 public:
  explicit Emitter(const StorageAssigner& assign) : assign_(assign) {}

  Result<std::string> Run(const PyValue& root) {
    Op(0x80);
    out_.push_back(2);
    UCP_RETURN_IF_ERROR(Save(root, 0));
    Op('.');
    return std::move(out_);
  }

 private:
  void Op(uint8_t op) { out_.push_back(static_cast<char>(op)); }
  void LE(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  }
  void Put() {
    const uint32_t idx = next_memo_++;
    if (idx < 256) {
      Op('q');
      LE(idx, 1);
    } else {
      Op('r');
      LE(idx, 4);
    }
  }
  void Get(uint32_t idx) {
    if (idx < 256) {
      Op('h');
      LE(idx, 1);
    } else {
      Op('j');
      LE(idx, 4);
    }
  }
  bool Memoized(const void* key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) return false;
    Get(it->second);
    return true;
  }
  void Remember(const void* key) {
    memo_[key] = next_memo_;
    Put();
  }

  void Int(int64_t v) {
    if (v >= 0 && v < 256) {
      Op('K');
      LE(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      Op('M');
      LE(static_cast<uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      Op('J');
      LE(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      // LONG1 with the fewest bytes that keep the sign bit right.
      std::string b;
      uint64_t u = static_cast<uint64_t>(v);
      for (int i = 0; i < 8; ++i) b.push_back(static_cast<char>((u >> (8 * i)) & 0xFF));
      while (b.size() > 1) {
        uint8_t last = static_cast<uint8_t>(b.back()), prev = static_cast<uint8_t>(b[b.size() - 2]);
        if ((last == 0 && !(prev & 0x80)) || (last == 0xFF && (prev & 0x80)))
          b.pop_back();
        else
          break;
      }
      Long(b);
    }
  }
  void Long(const std::string& le) {
    if (le.size() < 256) {
      Op(0x8a);
      LE(le.size(), 1);
    } else {
      Op(0x8b);
      LE(le.size(), 4);
    }
    out_ += le;
  }
  void Str(std::string_view s) {
    Op('X');
    LE(s.size(), 4);
    out_.append(s);
  }
  // Python 2's str: SHORT_BINSTRING / BINSTRING (protocol 2 has them; Python 3 reads them with
  // the `encoding` given to the unpickler, as it reads the file it came from).
  void ByteStr(std::string_view s) {
    if (s.size() < 256) {
      Op('U');
      LE(s.size(), 1);
    } else {
      Op('T');
      LE(s.size(), 4);
    }
    out_.append(s);
  }
  Status Global(std::string_view module, std::string_view name) {
    if (module.empty() || name.empty()) {
      return InvalidArgumentError("global '" + std::string(module) + "." + std::string(name) +
                                  "' needs a module and a name");
    }
    std::string key = std::string(module) + "\n" + std::string(name);
    auto it = globals_.find(key);
    if (it != globals_.end()) {
      Get(it->second);
      return Status::Ok();
    }
    Op('c');
    // Python 3 maps builtins to __builtin__ for protocol 2, and torch's unpickler expects it.
    out_ += module == "builtins" ? std::string("__builtin__") : std::string(module);
    out_ += "\n";
    out_.append(name);
    out_ += "\n";
    globals_[key] = next_memo_;
    Put();
    return Status::Ok();
  }
  Status GlobalOf(std::string_view dotted) {
    size_t dot = dotted.rfind('.');
    if (dot == std::string_view::npos) return Global({}, dotted);
    return Global(dotted.substr(0, dot), dotted.substr(dot + 1));
  }
  void EmptyOrderedDict() {
    (void)Global("collections", "OrderedDict");
    Op(')');
    Op('R');
  }

  Status Items(const std::vector<const PyValue*>& items, int depth) {
    for (size_t i = 0; i < items.size(); i += kBatch) {
      Op('(');
      for (size_t j = i; j < std::min(items.size(), i + kBatch); ++j) {
        UCP_RETURN_IF_ERROR(Save(*items[j], depth + 1));
      }
      Op('e');
    }
    return Status::Ok();
  }
  Status Tuple(const std::vector<const PyValue*>& items, int depth) {
    if (items.empty()) {
      Op(')');
      return Status::Ok();
    }
    if (items.size() > 3) Op('(');
    for (const PyValue* v : items) UCP_RETURN_IF_ERROR(Save(*v, depth + 1));
    Op(items.size() == 1 ? 0x85 : items.size() == 2 ? 0x86 : items.size() == 3 ? 0x87 : 't');
    return Status::Ok();
  }
  void Ints(const std::vector<int64_t>& v) {
    if (v.empty()) {
      Op(')');
      return;
    }
    if (v.size() > 3) Op('(');
    for (int64_t x : v) Int(x);
    Op(v.size() == 1 ? 0x85 : v.size() == 2 ? 0x86 : v.size() == 3 ? 0x87 : 't');
  }

  // The persistent id ('storage', <storage class>, key, location, numel) and BINPERSID ('Q') that
  // stand for a storage in the pickle; its bytes are the data/<key> record.
  Status PersistentStorage(const StorageRef& s) {
    Op('(');
    Str("storage");
    UCP_RETURN_IF_ERROR(s.dtype ? GlobalOf(StorageClassForDType(*s.dtype))
                                : Global("torch", "UntypedStorage"));
    Str(s.key);
    Str(s.location.empty() ? "cpu" : s.location);
    Int(s.numel);
    Op('t');
    Op('Q');
    return Status::Ok();
  }

  // The argument tuple of _rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
  // OrderedDict()), or of v3 (UntypedStorage plus a dtype) for dtypes with no storage class (fp8).
  Status RebuildArgs(const TensorRef& t, const StorageRef& s, bool requires_grad) {
    Op('(');
    UCP_RETURN_IF_ERROR(PersistentStorage(s));
    Int(t.storage_offset);
    Ints(t.size);
    Ints(t.stride);
    Op(requires_grad ? 0x88 : 0x89);
    EmptyOrderedDict();
    if (!s.dtype) UCP_RETURN_IF_ERROR(Global("torch", DTypeTorchName(t.dtype)));
    Op('t');
    return Status::Ok();
  }
  Status RebuildFn(const StorageRef& s) {
    return Global("torch._utils", s.dtype ? "_rebuild_tensor_v2" : "_rebuild_tensor_v3");
  }

  Status Tensor(const PyValue& v, int depth) {
    UCP_ASSIGN_OR_RETURN(StorageRef s, assign_(v));
    const TensorRef& t = v.tensor();
    if (t.is_parameter) {
      // The inner tensor's requires_grad is False; the Parameter carries the real flag.
      const bool with_state = t.state != nullptr;
      UCP_RETURN_IF_ERROR(Global(
          "torch._utils", with_state ? "_rebuild_parameter_with_state" : "_rebuild_parameter"));
      Op('(');
      UCP_RETURN_IF_ERROR(RebuildFn(s));
      UCP_RETURN_IF_ERROR(RebuildArgs(t, s, false));
      Op('R');
      Op(t.requires_grad ? 0x88 : 0x89);
      EmptyOrderedDict();
      if (with_state) UCP_RETURN_IF_ERROR(Save(*t.state, depth + 1));
      Op('t');
      Op('R');
    } else if (t.state != nullptr) {
      // A plain tensor with Python attributes: torch 2.x's _rebuild_from_type_v2.
      UCP_RETURN_IF_ERROR(Global("torch._tensor", "_rebuild_from_type_v2"));
      Op('(');
      UCP_RETURN_IF_ERROR(RebuildFn(s));
      UCP_RETURN_IF_ERROR(Global("torch", "Tensor"));
      UCP_RETURN_IF_ERROR(RebuildArgs(t, s, t.requires_grad));
      UCP_RETURN_IF_ERROR(Save(*t.state, depth + 1));
      Op('t');
      Op('R');
    } else {
      UCP_RETURN_IF_ERROR(RebuildFn(s));
      UCP_RETURN_IF_ERROR(RebuildArgs(t, s, t.requires_grad));
      Op('R');
    }
    Remember(&v);
    return Status::Ok();
  }

  Status Save(const PyValue& v, int depth) {
    if (depth > kMaxDepth) {
      return InvalidArgumentError("value to pickle is nested deeper than " +
                                  std::to_string(kMaxDepth) + " levels");
    }
    if (Memoized(&v)) return Status::Ok();
    switch (v.kind()) {
      case PyKind::kNone:
        Op('N');
        return Status::Ok();
      case PyKind::kBool:
        Op(v.bool_value() ? 0x88 : 0x89);
        return Status::Ok();
      case PyKind::kInt:
        Int(v.int_value());
        return Status::Ok();
      case PyKind::kBigInt:
        Long(v.str());
        return Status::Ok();
      case PyKind::kFloat: {
        Op('G');
        uint64_t bits = std::bit_cast<uint64_t>(v.float_value());
        for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
        return Status::Ok();
      }
      case PyKind::kStr:
        // A str that BINUNICODE cannot carry (Python would refuse to decode it) came from a
        // Python 2 pickle's STRING opcode as raw bytes: write it back the way it was written.
        if (!IsUtf8(v.str(), /*allow_surrogates=*/true)) {
          ByteStr(v.str());
          return Status::Ok();
        }
        Str(v.str());
        return Status::Ok();
      case PyKind::kBytes: {
        // Protocol 2 has no bytes opcode: _codecs.encode(<bytes as latin-1 text>, 'latin1').
        UCP_RETURN_IF_ERROR(Global("_codecs", "encode"));
        std::string utf8;
        for (unsigned char c : v.str()) {
          if (c < 0x80) {
            utf8.push_back(static_cast<char>(c));
          } else {
            utf8.push_back(static_cast<char>(0xC0 | (c >> 6)));
            utf8.push_back(static_cast<char>(0x80 | (c & 0x3F)));
          }
        }
        Str(utf8);
        Str("latin1");
        Op(0x86);
        Op('R');
        return Status::Ok();
      }
      case PyKind::kList:
        Op(']');
        Remember(&v);
        return Items(v.items(), depth);
      case PyKind::kTuple: {
        if (!in_progress_.insert(&v).second) {
          return InvalidArgumentError("cannot pickle a cycle through a tuple");
        }
        if (v.type_name() == "torch.Size") {
          UCP_RETURN_IF_ERROR(Global("torch", "Size"));
          UCP_RETURN_IF_ERROR(Tuple(v.items(), depth));
          Op(0x85);
          Op('R');
        } else {
          UCP_RETURN_IF_ERROR(Tuple(v.items(), depth));
        }
        in_progress_.erase(&v);
        Remember(&v);
        return Status::Ok();
      }
      case PyKind::kDict: {
        const bool ordered = v.type_name() == "collections.OrderedDict";
        if (ordered)
          EmptyOrderedDict();
        else
          Op('}');
        Remember(&v);
        const auto& e = v.entries();
        for (size_t i = 0; i < e.size(); i += kBatch) {
          Op('(');
          for (size_t j = i; j < std::min(e.size(), i + kBatch); ++j) {
            UCP_RETURN_IF_ERROR(Save(*e[j].first, depth + 1));
            UCP_RETURN_IF_ERROR(Save(*e[j].second, depth + 1));
          }
          Op('u');
        }
        if (ordered && v.state() != nullptr) {
          UCP_RETURN_IF_ERROR(Save(*v.state(), depth + 1));
          Op('b');
        }
        return Status::Ok();
      }
      case PyKind::kSet: {
        const bool frozen = v.type_name() == "builtins.frozenset";
        UCP_RETURN_IF_ERROR(Global("builtins", frozen ? "frozenset" : "set"));
        Op(']');
        UCP_RETURN_IF_ERROR(Items(v.items(), depth));
        Op(0x85);
        Op('R');
        Remember(&v);
        return Status::Ok();
      }
      case PyKind::kTensor:
        return Tensor(v, depth);
      case PyKind::kStorage:
        return PersistentStorage(v.storage());
      case PyKind::kGlobal:
        return Global(v.global_module(), v.global_name());
      case PyKind::kObject: {
        const PyValue* fn = v.callable();
        if (fn == nullptr || fn->kind() != PyKind::kGlobal) {
          return InvalidArgumentError("object to pickle has no global callable");
        }
        UCP_RETURN_IF_ERROR(Save(*fn, depth + 1));
        UCP_RETURN_IF_ERROR(Tuple(v.items(), depth));
        Op(v.is_newobj() ? 0x81 : 'R');
        Remember(&v);
        if (v.state() != nullptr) {
          UCP_RETURN_IF_ERROR(Save(*v.state(), depth + 1));
          Op('b');
        }
        return Status::Ok();
      }
    }
    return InternalError("unknown PyKind");
  }

  const StorageAssigner& assign_;
  std::string out_;
  std::unordered_map<const void*, uint32_t> memo_;
  std::unordered_map<std::string, uint32_t> globals_;
  std::unordered_set<const void*> in_progress_;
  uint32_t next_memo_ = 0;
};

}  // namespace

Result<std::string> PickleValue(const PyValue& root, const StorageAssigner& assign) {
  Emitter e(assign);
  return e.Run(root);
}

}  // namespace ucp::torch
