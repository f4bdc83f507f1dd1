// The safe unpickler: a loop over opcodes with a value stack, a mark stack and a bounded memo.
// Calls (REDUCE, NEWOBJ, BUILD) dispatch on the callable's allowlisted name; nothing runs.
#include "ucp/io/torch/unpickler.h"

#include <array>
#include <bit>
#include <charconv>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <new>
#include <stdexcept>
#include <algorithm>
#include <unordered_map>
#include <vector>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"

namespace ucp::torch {
namespace {

struct StorageClass {
  std::string_view name;
  std::optional<DType> dtype;
  bool supported;
};

constexpr std::array<StorageClass, 19> kStorageClasses = {{
    {"torch.FloatStorage", DType::kFp32, true},
    {"torch.DoubleStorage", DType::kFp64, true},
    {"torch.HalfStorage", DType::kFp16, true},
    {"torch.BFloat16Storage", DType::kBf16, true},
    {"torch.LongStorage", DType::kInt64, true},
    {"torch.IntStorage", DType::kInt32, true},
    {"torch.ShortStorage", DType::kInt16, true},
    {"torch.CharStorage", DType::kInt8, true},
    {"torch.ByteStorage", DType::kUint8, true},
    {"torch.BoolStorage", DType::kBool, true},
    {"torch.UntypedStorage", std::nullopt, true},
    {"torch.ComplexFloatStorage", std::nullopt, false},
    {"torch.ComplexDoubleStorage", std::nullopt, false},
    {"torch.ComplexHalfStorage", std::nullopt, false},
    {"torch.QInt8Storage", std::nullopt, false},
    {"torch.QUInt8Storage", std::nullopt, false},
    {"torch.QInt32Storage", std::nullopt, false},
    {"torch.QUInt4x2Storage", std::nullopt, false},
    {"torch.QUInt2x4Storage", std::nullopt, false},
}};

// Globals that are always allowed: what a plain torch.save of tensors, state dicts and
// optimizer states needs (torch 2.x's weights_only list, minus what only executes code).
constexpr std::array<std::string_view, 22> kTorchGlobals = {
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._tensor._rebuild_from_type_v2",
    "collections.OrderedDict",
    "torch.Size",
    "torch.Tensor",
    "torch.nn.parameter.Parameter",
    "torch.device",
    "torch.storage.TypedStorage",
    "torch.storage.UntypedStorage",
    "_codecs.encode",
    "builtins.set",
    "builtins.frozenset",
    "builtins.bytearray",
    "builtins.slice",
    "builtins.getattr",
    "builtins.complex",
    "torch.serialization._get_layout",
    "torch.strided",
};

// Allowed outside strict mode, as inert objects only.
constexpr std::array<std::string_view, 9> kInertGlobals = {
    "argparse.Namespace",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.random._pickle.__randomstate_ctor",
    "numpy.random._pickle.__bit_generator_ctor",
};
constexpr std::array<std::string_view, 2> kInertPrefixes = {"deepspeed.", "megatron."};

// Modules refused whatever follows: a prefix match on these is never an inert class.
constexpr std::array<std::string_view, 6> kNeverModules = {"os",  "posix",      "nt",
                                                           "sys", "subprocess", "builtins"};

bool IsInertClass(std::string_view name, const PickleOptions& options) {
  if (options.strict_globals) return false;
  for (auto g : kInertGlobals) {
    if (g == name) return true;
  }
  for (auto p : kInertPrefixes) {
    if (name.starts_with(p) && name.size() > p.size()) return true;
  }
  return false;
}

// Callables whose REDUCE builds an inert object (never executed).
bool IsInertCallable(std::string_view name, const PickleOptions& options) {
  return name == "torch.device" || name == "builtins.slice" || name == "builtins.complex" ||
         IsInertClass(name, options);
}

constexpr std::array<std::string_view, 256> MakeOpNames() {
  std::array<std::string_view, 256> n{};
  n['('] = "MARK";
  n['.'] = "STOP";
  n['0'] = "POP";
  n['1'] = "POP_MARK";
  n['2'] = "DUP";
  n['F'] = "FLOAT";
  n['I'] = "INT";
  n['J'] = "BININT";
  n['K'] = "BININT1";
  n['L'] = "LONG";
  n['M'] = "BININT2";
  n['N'] = "NONE";
  n['P'] = "PERSID";
  n['Q'] = "BINPERSID";
  n['R'] = "REDUCE";
  n['S'] = "STRING";
  n['T'] = "BINSTRING";
  n['U'] = "SHORT_BINSTRING";
  n['V'] = "UNICODE";
  n['X'] = "BINUNICODE";
  n['a'] = "APPEND";
  n['b'] = "BUILD";
  n['c'] = "GLOBAL";
  n['d'] = "DICT";
  n['}'] = "EMPTY_DICT";
  n['e'] = "APPENDS";
  n['g'] = "GET";
  n['h'] = "BINGET";
  n['i'] = "INST";
  n['j'] = "LONG_BINGET";
  n['l'] = "LIST";
  n[']'] = "EMPTY_LIST";
  n['o'] = "OBJ";
  n['p'] = "PUT";
  n['q'] = "BINPUT";
  n['r'] = "LONG_BINPUT";
  n['s'] = "SETITEM";
  n['t'] = "TUPLE";
  n[')'] = "EMPTY_TUPLE";
  n['u'] = "SETITEMS";
  n['G'] = "BINFLOAT";
  n['B'] = "BINBYTES";
  n['C'] = "SHORT_BINBYTES";
  n[0x80] = "PROTO";
  n[0x81] = "NEWOBJ";
  n[0x82] = "EXT1";
  n[0x83] = "EXT2";
  n[0x84] = "EXT4";
  n[0x85] = "TUPLE1";
  n[0x86] = "TUPLE2";
  n[0x87] = "TUPLE3";
  n[0x88] = "NEWTRUE";
  n[0x89] = "NEWFALSE";
  n[0x8a] = "LONG1";
  n[0x8b] = "LONG4";
  n[0x8c] = "SHORT_BINUNICODE";
  n[0x8d] = "BINUNICODE8";
  n[0x8e] = "BINBYTES8";
  n[0x8f] = "EMPTY_SET";
  n[0x90] = "ADDITEMS";
  n[0x91] = "FROZENSET";
  n[0x92] = "NEWOBJ_EX";
  n[0x93] = "STACK_GLOBAL";
  n[0x94] = "MEMOIZE";
  n[0x95] = "FRAME";
  n[0x96] = "BYTEARRAY8";
  n[0x97] = "NEXT_BUFFER";
  n[0x98] = "READONLY_BUFFER";
  return n;
}
constexpr std::array<std::string_view, 256> kOpNames = MakeOpNames();

// Decodes UTF-8 into code points; false on malformed input. Surrogates are accepted because
// Python pickles str with 'surrogatepass'.
bool DecodeUtf8(std::string_view s, std::vector<uint32_t>* out) {
  size_t i = 0;
  while (i < s.size()) {
    uint8_t c = static_cast<uint8_t>(s[i]);
    int n;
    uint32_t cp;
    if (c < 0x80) {
      cp = c;
      n = 0;
    } else if ((c & 0xE0) == 0xC0) {
      cp = c & 0x1F;
      n = 1;
    } else if ((c & 0xF0) == 0xE0) {
      cp = c & 0x0F;
      n = 2;
    } else if ((c & 0xF8) == 0xF0) {
      cp = c & 0x07;
      n = 3;
    } else
      return false;
    if (n > 0 && i + static_cast<size_t>(n) >= s.size()) return false;
    for (int k = 1; k <= n; ++k) {
      uint8_t cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMin[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF) return false;
    if (out) out->push_back(cp);
    i += n + 1;
  }
  return true;
}

class Machine {
 public:
  Machine(const ByteSource& src, int64_t begin, int64_t end, PyArena& arena,
          const PickleOptions& options, const PersistentLoader& load, std::string_view what)
      : src_(src),
        begin_(begin),
        end_(end),
        pos_(begin),
        arena_(arena),
        options_(options),
        load_(load),
        what_(what) {
    arena_seen_ = arena.size();
    max_memory_ = options.max_memory_bytes > 0
                      ? options.max_memory_bytes
                      : PickleOptions::kMemoryBaseBytes +
                            PickleOptions::kMemoryPerPickleByte * std::max<int64_t>(end - begin, 0);
  }

  Result<UnpickleResult> Run();

 private:
  static constexpr int64_t kChunk = 1 << 16;
  static constexpr int64_t kMaxLine = 1 << 12;
  static constexpr int kMaxDims = 64;

  Status Fault(std::string_view msg) const {
    return DataLossError("pickle opcode " + OpName() + " at offset " +
                         std::to_string(op_pos_ - begin_) + " of " + std::string(what_) + ": " +
                         std::string(msg));
  }
  Status Unsupported(std::string_view msg) const {
    return UnimplementedError("pickle opcode " + OpName() + " at offset " +
                              std::to_string(op_pos_ - begin_) + " of " + std::string(what_) +
                              ": " + std::string(msg));
  }
  std::string OpName() const {
    std::string_view n = kOpNames[op_];
    if (!n.empty()) return std::string(n);
    char buf[8];
    std::snprintf(buf, sizeof(buf), "0x%02x", op_);
    return buf;
  }

  Status Exhausted(std::string_view msg) const {
    return ResourceExhaustedError("pickle opcode " + OpName() + " at offset " +
                                  std::to_string(op_pos_ - begin_) + " of " + std::string(what_) +
                                  ": " + std::string(msg));
  }

  // Budgets: memory accounted per value, items per container and in all, nesting depth.
  Status Charge(int64_t bytes) {
    memory_ += bytes;
    if (memory_ > max_memory_) {
      return Exhausted("values need more than " + std::to_string(max_memory_) +
                       " bytes (the memory budget for a pickle of " +
                       std::to_string(end_ - begin_) + " bytes)");
    }
    return Status::Ok();
  }
  // `parent` gains `n` children (the last of them `child`; nullptr: nesting unchanged).
  Status AddItems(PyValue* parent, int64_t n, int64_t container_size) {
    items_ += n;
    if (container_size > options_.max_items || items_ > options_.max_items) {
      return Exhausted("more than " + std::to_string(options_.max_items) + " items");
    }
    return Charge(n * static_cast<int64_t>(parent->kind() == PyKind::kDict ? 96 : 8));
  }
  Status Nest(PyValue* parent, const PyValue* child) {
    if (child == nullptr) return Status::Ok();
    const uint32_t n = std::max(parent->nesting(), child->nesting() + 1);
    if (static_cast<int64_t>(n) > options_.max_nesting_depth) {
      return Exhausted("values nested deeper than " + std::to_string(options_.max_nesting_depth) +
                       " levels");
    }
    parent->set_nesting(n);
    return Status::Ok();
  }
  template <typename Range>
  Status NestAll(PyValue* parent, const Range& children) {
    parent->set_nesting(std::max<uint32_t>(parent->nesting(), 1));
    for (const PyValue* c : children) UCP_RETURN_IF_ERROR(Nest(parent, c));
    return Status::Ok();
  }
  // Shared immutable singletons: a flat list of N Nones costs N pointers, not N nodes.
  PyValue* SharedNone() {
    if (none_ == nullptr) none_ = arena_.None();
    return none_;
  }
  PyValue* SharedBool(bool v) {
    PyValue*& b = v ? true_ : false_;
    if (b == nullptr) b = arena_.Bool(v);
    return b;
  }

  // Input.
  Result<std::string_view> Take(int64_t n);
  Result<uint64_t> TakeLE(int bytes);
  Result<std::string_view> Line();

  // Stack.
  Status Push(PyValue* v) {
    if (static_cast<int64_t>(stack_.size() + marks_.size()) >= options_.max_stack_depth) {
      return ResourceExhaustedError("pickle stack of " + std::string(what_) + " exceeds " +
                                    std::to_string(options_.max_stack_depth) +
                                    " entries at offset " + std::to_string(op_pos_ - begin_));
    }
    stack_.push_back(v);
    return Status::Ok();
  }
  Result<PyValue*> Pop() {
    if (stack_.size() <= Floor()) return Fault("stack underflow");
    PyValue* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Result<PyValue*> Top() {
    if (stack_.size() <= Floor()) return Fault("stack underflow");
    return stack_.back();
  }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  Result<std::vector<PyValue*>> PopMark() {
    if (marks_.empty()) return Fault("no MARK on the stack");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyValue*> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }

  // Memo.
  Status MemoPut(uint64_t index) {
    UCP_ASSIGN_OR_RETURN(PyValue * top, Top());
    if (!memo_.count(index) && static_cast<int64_t>(memo_.size()) >= options_.max_memo_entries) {
      return ResourceExhaustedError("pickle memo of " + std::string(what_) + " exceeds " +
                                    std::to_string(options_.max_memo_entries) + " entries");
    }
    memo_[index] = top;
    return Status::Ok();
  }
  Status MemoGet(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Fault("memo index " + std::to_string(index) + " was never set");
    return Push(it->second);
  }

  Status DoOp();
  Status Global(std::string module, std::string name);
  Status Reduce();
  Status NewObj(PyValue* cls, PyValue* args);
  Status Build();
  Result<PyValue*> Call(const PyValue* fn, const PyValue* args);
  Result<PyValue*> RebuildTensor(std::string_view fn, const std::vector<const PyValue*>& a);
  Status SetItems(PyValue* target, const std::vector<PyValue*>& kv);
  Status PushString(std::string_view bytes, bool is_bytes);
  Status PushLong(std::string_view le);

  const ByteSource& src_;
  const int64_t begin_, end_;
  int64_t pos_;
  int64_t op_pos_ = 0;
  uint8_t op_ = 0;
  std::string buf_;
  int64_t buf_start_ = 0;
  PyArena& arena_;
  const PickleOptions& options_;
  const PersistentLoader& load_;
  std::string_view what_;
  std::vector<PyValue*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyValue*> memo_;
  bool stopped_ = false;
  int64_t max_memory_ = 0;
  int64_t memory_ = 0;
  int64_t items_ = 0;
  size_t arena_seen_ = 0;
  PyValue* none_ = nullptr;
  PyValue* true_ = nullptr;
  PyValue* false_ = nullptr;
};

Result<std::string_view> Machine::Take(int64_t n) {
  if (n < 0 || n > end_ - pos_) {
    return Fault("needs " + std::to_string(n) + " bytes but only " + std::to_string(end_ - pos_) +
                 " remain (truncated)");
  }
  const int64_t buf_end = buf_start_ + static_cast<int64_t>(buf_.size());
  if (pos_ < buf_start_ || pos_ + n > buf_end) {
    const int64_t want = std::max(n, std::min(kChunk, end_ - pos_));
    UCP_ASSIGN_OR_RETURN(buf_, src_.ReadString(pos_, want));
    buf_start_ = pos_;
  }
  std::string_view v(buf_.data() + (pos_ - buf_start_), static_cast<size_t>(n));
  pos_ += n;
  return v;
}

Result<uint64_t> Machine::TakeLE(int bytes) {
  UCP_ASSIGN_OR_RETURN(std::string_view b, Take(bytes));
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[i]);
  return v;
}

Result<std::string_view> Machine::Line() {
  // Text opcodes end at '\n'; a line is short, so read byte by byte through the buffer.
  const int64_t start = pos_;
  std::string line;
  while (true) {
    if (pos_ - start > kMaxLine) return Fault("text argument longer than 4096 bytes");
    UCP_ASSIGN_OR_RETURN(std::string_view c, Take(1));
    if (c[0] == '\n') break;
  }
  // The bytes are in buf_ unless a refill split them; re-read the whole line to be safe.
  const int64_t n = pos_ - start - 1;
  UCP_ASSIGN_OR_RETURN(buf_, src_.ReadString(start, n + 1));
  buf_start_ = start;
  return std::string_view(buf_.data(), static_cast<size_t>(n));
}

Status Machine::PushString(std::string_view bytes, bool is_bytes) {
  if (!is_bytes && !DecodeUtf8(bytes, nullptr)) return Fault("string is not valid UTF-8");
  UCP_RETURN_IF_ERROR(Charge(static_cast<int64_t>(bytes.size())));
  return Push(is_bytes ? arena_.Bytes(std::string(bytes)) : arena_.Str(std::string(bytes)));
}

Status Machine::PushLong(std::string_view le) {
  // Trim redundant sign-extension bytes, then use int64 when the value fits.
  size_t n = le.size();
  while (n > 1) {
    uint8_t last = static_cast<uint8_t>(le[n - 1]), prev = static_cast<uint8_t>(le[n - 2]);
    if ((last == 0x00 && !(prev & 0x80)) || (last == 0xFF && (prev & 0x80)))
      --n;
    else
      break;
  }
  if (n == 0) return Push(arena_.Int(0));
  if (n <= 8) {
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;) v = (v << 8) | static_cast<uint8_t>(le[i]);
    if (n < 8 && (static_cast<uint8_t>(le[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
    return Push(arena_.Int(static_cast<int64_t>(v)));
  }
  return Push(arena_.BigInt(std::string(le.substr(0, n))));
}

Status Machine::Global(std::string module, std::string name) {
  if (module == "__builtin__") module = "builtins";
  std::string full = module + "." + name;
  if (!IsAllowedGlobal(full, options_)) {
    return Fault("global '" + full + "' is not in the allowlist" +
                 (options_.strict_globals ? " (strict mode)" : ""));
  }
  return Push(arena_.Global(std::move(module), std::move(name)));
}

Status Machine::SetItems(PyValue* target, const std::vector<PyValue*>& kv) {
  if (target->kind() != PyKind::kDict) {
    return Fault("cannot set items on a " + std::string(PyKindName(target->kind())));
  }
  if (kv.size() % 2 != 0) return Fault("odd number of items for a dict");
  UCP_RETURN_IF_ERROR(AddItems(target, static_cast<int64_t>(kv.size() / 2),
                               static_cast<int64_t>(target->entries().size() + kv.size() / 2)));
  for (size_t i = 0; i < kv.size(); i += 2) {
    UCP_RETURN_IF_ERROR(Nest(target, kv[i]));
    UCP_RETURN_IF_ERROR(Nest(target, kv[i + 1]));
    target->SetItem(kv[i], kv[i + 1]);
  }
  target->set_nesting(std::max<uint32_t>(target->nesting(), 1));
  return Status::Ok();
}

Result<PyValue*> Machine::RebuildTensor(std::string_view fn, const std::vector<const PyValue*>& a) {
  const bool v3 = fn == "_rebuild_tensor_v3";
  const bool v1 = fn == "_rebuild_tensor";
  const size_t min_args = v1 ? 4 : v3 ? 7 : 6;
  const size_t max_args = v1 ? 4 : min_args + 1;
  if (a.size() < min_args || a.size() > max_args) {
    return Fault(std::string(fn) + " takes " + std::to_string(min_args) + " arguments, got " +
                 std::to_string(a.size()));
  }
  if (a[0]->kind() != PyKind::kStorage) {
    return Fault(std::string(fn) + " argument 0 is a " + std::string(PyKindName(a[0]->kind())) +
                 ", not a storage");
  }
  TensorRef t;
  t.storage = a[0]->storage();
  if (a[1]->kind() != PyKind::kInt || a[1]->int_value() < 0) {
    return Fault(std::string(fn) + " storage offset must be a non-negative int");
  }
  t.storage_offset = a[1]->int_value();
  auto ints = [&](const PyValue* v, std::vector<int64_t>& out, std::string_view field) -> Status {
    if (v->kind() != PyKind::kTuple)
      return Fault(std::string(fn) + " " + std::string(field) + " must be a tuple of ints");
    if (v->items().size() > kMaxDims) {
      return Fault(std::string(fn) + " " + std::string(field) + " has " +
                   std::to_string(v->items().size()) + " dims, more than 64");
    }
    for (const PyValue* d : v->items()) {
      if (d->kind() != PyKind::kInt || d->int_value() < 0) {
        return Fault(std::string(fn) + " " + std::string(field) +
                     " entries must be non-negative ints");
      }
      out.push_back(d->int_value());
    }
    return Status::Ok();
  };
  UCP_RETURN_IF_ERROR(ints(a[2], t.size, "size"));
  UCP_RETURN_IF_ERROR(ints(a[3], t.stride, "stride"));
  if (t.size.size() != t.stride.size()) {
    return Fault(std::string(fn) + " size has " + std::to_string(t.size.size()) +
                 " dims but stride has " + std::to_string(t.stride.size()));
  }
  if (!v1) {
    if (a[4]->kind() != PyKind::kBool) return Fault(std::string(fn) + " requires_grad not a bool");
    t.requires_grad = a[4]->bool_value();
  }
  if (v3) {
    auto d = a[6]->AsDType();
    if (!d.ok()) {
      if (d.status().code() == StatusCode::kUnimplemented) return Unsupported(d.status().message());
      return Fault(std::string(fn) + " argument 6: " + d.status().message());
    }
    t.dtype = *d;
    if (t.storage.dtype && *t.storage.dtype != t.dtype) {
      return Fault(std::string(fn) + " views a " + std::string(DTypeName(*t.storage.dtype)) +
                   " storage as " + std::string(DTypeName(t.dtype)));
    }
  } else {
    if (!t.storage.dtype) return Fault(std::string(fn) + " needs a typed storage");
    t.dtype = *t.storage.dtype;
  }
  // The view must lie inside the storage: (offset + sum (size-1)*stride + 1) * itemsize bytes.
  auto numel = CheckedProduct(t.size, "tensor size");
  if (!numel.ok()) return Fault(numel.status().message());
  if (*numel > 0) {
    int64_t last = t.storage_offset;
    for (size_t k = 0; k < t.size.size(); ++k) {
      auto step = CheckedMul(t.size[k] - 1, t.stride[k]);
      auto sum = step ? CheckedAdd(last, *step) : std::nullopt;
      if (!sum) return Fault(std::string(fn) + " size and stride overflow int64");
      last = *sum;
    }
    auto end_elems = CheckedAdd(last, 1);
    auto end_bytes = end_elems ? CheckedMul(*end_elems, DTypeSizeBytes(t.dtype)) : std::nullopt;
    if (!end_bytes || *end_bytes > t.storage.num_bytes) {
      return Fault("tensor view of storage '" + t.storage.key + "' (offset " +
                   std::to_string(t.storage_offset) + ", size " + ShapeToString(t.size) +
                   ", stride " + ShapeToString(t.stride) + ") reaches past its " +
                   std::to_string(t.storage.num_bytes) + " bytes");
    }
  }
  return arena_.Tensor(std::move(t));
}

Result<PyValue*> Machine::Call(const PyValue* fn, const PyValue* args) {
  if (fn->kind() != PyKind::kGlobal) {
    return Fault("cannot call a " + std::string(PyKindName(fn->kind())));
  }
  if (args->kind() != PyKind::kTuple) {
    return Fault("arguments of " + fn->str() + " are a " + std::string(PyKindName(args->kind())) +
                 ", not a tuple");
  }
  const std::string& name = fn->str();
  const auto& a = args->items();
  if (fn->global_module() == "torch._utils") {
    std::string_view f = fn->global_name();
    if (f == "_rebuild_tensor" || f == "_rebuild_tensor_v2" || f == "_rebuild_tensor_v3") {
      return RebuildTensor(f, a);
    }
    if (f == "_rebuild_parameter" || f == "_rebuild_parameter_with_state") {
      const size_t want = f == "_rebuild_parameter" ? 3 : 4;
      if (a.size() != want || a[0]->kind() != PyKind::kTensor || a[1]->kind() != PyKind::kBool) {
        return Fault(std::string(f) + " takes (tensor, requires_grad, hooks" +
                     (want == 4 ? ", state)" : ")"));
      }
      TensorRef t = a[0]->tensor();
      t.is_parameter = true;
      t.requires_grad = a[1]->bool_value();
      if (want == 4 && !(a[3]->kind() == PyKind::kDict && a[3]->entries().empty())) {
        t.state = a[3];
      }
      return arena_.Tensor(std::move(t));
    }
  }
  if (name == "torch._tensor._rebuild_from_type_v2") {
    if (a.size() != 4 || a[0]->kind() != PyKind::kGlobal || a[1]->kind() != PyKind::kGlobal ||
        a[2]->kind() != PyKind::kTuple) {
      return Fault("_rebuild_from_type_v2 takes (func, type, args, state)");
    }
    if (a[1]->str() != "torch.Tensor" && a[1]->str() != "torch.nn.parameter.Parameter") {
      return Fault("_rebuild_from_type_v2 of type " + a[1]->str() + " is not allowed");
    }
    UCP_ASSIGN_OR_RETURN(PyValue * inner, Call(a[0], a[2]));
    if (inner->kind() != PyKind::kTensor) return Fault("_rebuild_from_type_v2 made no tensor");
    TensorRef t = inner->tensor();
    if (a[1]->str() == "torch.nn.parameter.Parameter") t.is_parameter = true;
    if (!(a[3]->kind() == PyKind::kDict && a[3]->entries().empty()) && !a[3]->is_none()) {
      t.state = a[3];
    }
    return arena_.Tensor(std::move(t));
  }
  if (name == "collections.OrderedDict") {
    PyValue* d = arena_.Dict(true);
    if (a.size() > 1) return Fault("OrderedDict takes at most 1 argument");
    if (a.size() == 1) {
      if (a[0]->kind() != PyKind::kList && a[0]->kind() != PyKind::kTuple) {
        return Fault("OrderedDict argument must be a list of pairs");
      }
      for (const PyValue* kv : a[0]->items()) {
        if ((kv->kind() != PyKind::kTuple && kv->kind() != PyKind::kList) ||
            kv->items().size() != 2) {
          return Fault("OrderedDict argument must be a list of pairs");
        }
        d->SetItem(kv->items()[0], kv->items()[1]);
      }
    }
    return d;
  }
  if (name == "torch.Size") {
    if (a.size() != 1 || a[0]->kind() != PyKind::kTuple) return Fault("torch.Size takes a tuple");
    std::vector<int64_t> dims;
    for (const PyValue* d : a[0]->items()) {
      if (d->kind() != PyKind::kInt) return Fault("torch.Size entries must be ints");
      dims.push_back(d->int_value());
    }
    return arena_.TorchSize(dims);
  }
  if (name == "_codecs.encode") {
    if (a.size() != 2 || a[0]->kind() != PyKind::kStr || a[1]->kind() != PyKind::kStr ||
        (a[1]->str() != "latin1" && a[1]->str() != "latin-1")) {
      return Fault("_codecs.encode is only allowed as encode(str, 'latin1')");
    }
    std::vector<uint32_t> cps;
    if (!DecodeUtf8(a[0]->str(), &cps)) return Fault("_codecs.encode argument is not UTF-8");
    std::string bytes;
    bytes.reserve(cps.size());
    for (uint32_t cp : cps) {
      if (cp > 0xFF) return Fault("_codecs.encode: code point above 255 in a latin1 string");
      bytes.push_back(static_cast<char>(cp));
    }
    return arena_.Bytes(std::move(bytes));
  }
  if (name == "builtins.set" || name == "builtins.frozenset") {
    PyValue* s = arena_.Set();
    if (name == "builtins.frozenset") s->SetTypeName("builtins.frozenset");
    if (a.size() > 1) return Fault(name + " takes at most 1 argument");
    if (a.size() == 1) {
      if (a[0]->kind() != PyKind::kList && a[0]->kind() != PyKind::kTuple) {
        return Fault(name + " argument must be a list");
      }
      for (const PyValue* v : a[0]->items()) s->Append(v);
    }
    return s;
  }
  if (name == "builtins.bytearray") {
    if (a.empty()) return arena_.Bytes("");
    if (a.size() == 1 && a[0]->kind() == PyKind::kBytes) return arena_.Bytes(a[0]->str());
    return Fault("bytearray is only allowed on bytes");
  }
  if (name == "builtins.getattr") {
    if (a.size() != 2 || a[0]->kind() != PyKind::kGlobal || a[1]->kind() != PyKind::kStr) {
      return Fault("getattr is only allowed as getattr(class, 'name')");
    }
    if (!IsInertClass(a[0]->str(), options_)) {
      return Fault("getattr on '" + a[0]->str() + "' is not allowed (not an inert class)");
    }
    return arena_.Object(fn, args, false);
  }
  if (IsInertCallable(name, options_)) return arena_.Object(fn, args, false);
  return Fault("calling '" + name + "' is not allowed");
}

Status Machine::Reduce() {
  UCP_ASSIGN_OR_RETURN(PyValue * args, Pop());
  UCP_ASSIGN_OR_RETURN(PyValue * fn, Pop());
  UCP_ASSIGN_OR_RETURN(PyValue * out, Call(fn, args));
  if (out != args) UCP_RETURN_IF_ERROR(Nest(out, args));
  return Push(out);
}

Status Machine::NewObj(PyValue* cls, PyValue* args) {
  if (cls->kind() != PyKind::kGlobal) {
    return Fault("class is a " + std::string(PyKindName(cls->kind())) + ", not a global");
  }
  if (args->kind() != PyKind::kTuple) return Fault("arguments are not a tuple");
  if (cls->str() == "collections.OrderedDict" && args->items().empty()) {
    return Push(arena_.Dict(true));
  }
  if (!IsInertClass(cls->str(), options_)) {
    return Fault("cannot construct '" + cls->str() + "' (not an inert class)");
  }
  PyValue* obj = arena_.Object(cls, args, true);
  UCP_RETURN_IF_ERROR(Nest(obj, args));
  return Push(obj);
}

Status Machine::Build() {
  UCP_ASSIGN_OR_RETURN(PyValue * state, Pop());
  UCP_ASSIGN_OR_RETURN(PyValue * target, Top());
  if (target != state) UCP_RETURN_IF_ERROR(Nest(target, state));
  switch (target->kind()) {
    case PyKind::kObject:
    case PyKind::kTensor:
      target->SetState(state);
      return Status::Ok();
    case PyKind::kDict:
      if (target->type_name() == "collections.OrderedDict") {
        target->SetState(state);
        return Status::Ok();
      }
      [[fallthrough]];
    default:
      return Fault("BUILD on a " + std::string(PyKindName(target->kind())) + " is not allowed");
  }
}

Status Machine::DoOp() {
  switch (op_) {
    case 0x80: {  // PROTO
      UCP_ASSIGN_OR_RETURN(uint64_t p, TakeLE(1));
      if (p > 5) return Unsupported("protocol " + std::to_string(p) + " is newer than 5");
      return Status::Ok();
    }
    case 0x95: {  // FRAME: a length hint only; it must not promise more than remains
      UCP_ASSIGN_OR_RETURN(uint64_t n, TakeLE(8));
      if (n > static_cast<uint64_t>(end_ - pos_)) {
        return Fault("frame of " + std::to_string(n) + " bytes but only " +
                     std::to_string(end_ - pos_) + " remain");
      }
      return Status::Ok();
    }
    case '.':
      stopped_ = true;
      return Status::Ok();
    case '(':
      if (static_cast<int64_t>(stack_.size() + marks_.size()) >= options_.max_stack_depth) {
        return ResourceExhaustedError("pickle stack of " + std::string(what_) + " exceeds " +
                                      std::to_string(options_.max_stack_depth) + " entries");
      }
      marks_.push_back(stack_.size());
      return Status::Ok();
    case '0':
      return Pop().status();
    case '1':
      return PopMark().status();
    case '2': {
      UCP_ASSIGN_OR_RETURN(PyValue * v, Top());
      return Push(v);
    }
    case 'N':
      return Push(SharedNone());
    case 0x88:
      return Push(SharedBool(true));
    case 0x89:
      return Push(SharedBool(false));
    case 'J': {
      UCP_ASSIGN_OR_RETURN(uint64_t v, TakeLE(4));
      return Push(arena_.Int(static_cast<int32_t>(static_cast<uint32_t>(v))));
    }
    case 'K': {
      UCP_ASSIGN_OR_RETURN(uint64_t v, TakeLE(1));
      return Push(arena_.Int(static_cast<int64_t>(v)));
    }
    case 'M': {
      UCP_ASSIGN_OR_RETURN(uint64_t v, TakeLE(2));
      return Push(arena_.Int(static_cast<int64_t>(v)));
    }
    case 0x8a: {
      UCP_ASSIGN_OR_RETURN(uint64_t n, TakeLE(1));
      UCP_ASSIGN_OR_RETURN(std::string_view b, Take(static_cast<int64_t>(n)));
      return PushLong(b);
    }
    case 0x8b: {
      UCP_ASSIGN_OR_RETURN(uint64_t n, TakeLE(4));
      if (n > 0x7FFFFFFF) return Fault("negative LONG4 length");
      UCP_ASSIGN_OR_RETURN(std::string_view b, Take(static_cast<int64_t>(n)));
      return PushLong(b);
    }
    case 'I':
    case 'L': {
      UCP_ASSIGN_OR_RETURN(std::string_view line, Line());
      if (op_ == 'I' && line == "00") return Push(arena_.Bool(false));
      if (op_ == 'I' && line == "01") return Push(arena_.Bool(true));
      if (op_ == 'L' && !line.empty() && line.back() == 'L') line.remove_suffix(1);
      int64_t v = 0;
      auto [p, ec] = std::from_chars(line.data(), line.data() + line.size(), v);
      if (ec == std::errc::result_out_of_range) {
        return Unsupported("text integer beyond int64");
      }
      if (ec != std::errc() || p != line.data() + line.size() || line.empty()) {
        return Fault("bad text integer");
      }
      return Push(arena_.Int(v));
    }
    case 'F': {
      UCP_ASSIGN_OR_RETURN(std::string_view line, Line());
      double v = 0;
      auto [p, ec] = std::from_chars(line.data(), line.data() + line.size(), v);
      if (ec != std::errc() || p != line.data() + line.size() || line.empty()) {
        return Fault("bad text float");
      }
      return Push(arena_.Float(v));
    }
    case 'G': {
      UCP_ASSIGN_OR_RETURN(std::string_view b, Take(8));
      uint64_t bits = 0;
      for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(b[i]);  // big-endian
      return Push(arena_.Float(std::bit_cast<double>(bits)));
    }
    case 'X':
    case 'T':
    case 'B': {  // u32 length (BINSTRING's is signed, but torch never writes 2 GiB strings)
      UCP_ASSIGN_OR_RETURN(uint64_t n, TakeLE(4));
      if (op_ == 'T' && n > 0x7FFFFFFF) return Fault("negative BINSTRING length");
      UCP_ASSIGN_OR_RETURN(std::string_view s, Take(static_cast<int64_t>(n)));
      return op_ == 'T' ? Push(arena_.Str(std::string(s))) : PushString(s, op_ == 'B');
    }
    case 'U':
    case 'C':
    case 0x8c: {
      UCP_ASSIGN_OR_RETURN(uint64_t n, TakeLE(1));
      UCP_ASSIGN_OR_RETURN(std::string_view s, Take(static_cast<int64_t>(n)));
      return op_ == 'U' ? Push(arena_.Str(std::string(s))) : PushString(s, op_ == 'C');
    }
    case 0x8d:
    case 0x8e:
    case 0x96: {
      UCP_ASSIGN_OR_RETURN(uint64_t n, TakeLE(8));
      if (n > static_cast<uint64_t>(end_ - pos_)) {
        return Fault("length " + std::to_string(n) + " but only " + std::to_string(end_ - pos_) +
                     " bytes remain (truncated)");
      }
      UCP_ASSIGN_OR_RETURN(std::string_view s, Take(static_cast<int64_t>(n)));
      return PushString(s, op_ != 0x8d);
    }
    case ']':
      return Push(arena_.List());
    case ')':
      return Push(arena_.Tuple());
    case '}':
      return Push(arena_.Dict());
    case 0x8f:
      return Push(arena_.Set());
    case 'l':
    case 't':
    case 0x91: {
      UCP_ASSIGN_OR_RETURN(std::vector<PyValue*> items, PopMark());
      PyValue* v = op_ == 'l' ? arena_.List() : op_ == 't' ? arena_.Tuple() : arena_.Set();
      if (op_ == 0x91) v->SetTypeName("builtins.frozenset");
      UCP_RETURN_IF_ERROR(AddItems(v, static_cast<int64_t>(items.size()),
                                   static_cast<int64_t>(items.size())));
      UCP_RETURN_IF_ERROR(NestAll(v, items));
      for (PyValue* i : items) v->Append(i);
      return Push(v);
    }
    case 0x85:
    case 0x86:
    case 0x87: {
      const int n = op_ - 0x84;
      if (stack_.size() < Floor() + n) return Fault("stack underflow");
      std::vector<const PyValue*> items(stack_.end() - n, stack_.end());
      stack_.resize(stack_.size() - n);
      PyValue* t = arena_.Tuple(std::move(items));
      UCP_RETURN_IF_ERROR(AddItems(t, n, n));
      UCP_RETURN_IF_ERROR(NestAll(t, t->items()));
      return Push(t);
    }
    case 'd': {
      UCP_ASSIGN_OR_RETURN(std::vector<PyValue*> kv, PopMark());
      PyValue* d = arena_.Dict();
      UCP_RETURN_IF_ERROR(SetItems(d, kv));
      return Push(d);
    }
    case 'a': {
      UCP_ASSIGN_OR_RETURN(PyValue * v, Pop());
      UCP_ASSIGN_OR_RETURN(PyValue * list, Top());
      if (list->kind() != PyKind::kList) {
        return Fault("cannot append to a " + std::string(PyKindName(list->kind())));
      }
      UCP_RETURN_IF_ERROR(
          AddItems(list, 1, static_cast<int64_t>(list->items().size()) + 1));
      UCP_RETURN_IF_ERROR(NestAll(list, std::vector<const PyValue*>{v}));
      list->Append(v);
      return Status::Ok();
    }
    case 'e':
    case 0x90: {
      UCP_ASSIGN_OR_RETURN(std::vector<PyValue*> items, PopMark());
      UCP_ASSIGN_OR_RETURN(PyValue * target, Top());
      const PyKind want = op_ == 'e' ? PyKind::kList : PyKind::kSet;
      if (target->kind() != want) {
        return Fault("cannot add items to a " + std::string(PyKindName(target->kind())));
      }
      UCP_RETURN_IF_ERROR(
          AddItems(target, static_cast<int64_t>(items.size()),
                   static_cast<int64_t>(target->items().size() + items.size())));
      UCP_RETURN_IF_ERROR(NestAll(target, items));
      for (PyValue* i : items) target->Append(i);
      return Status::Ok();
    }
    case 's': {
      UCP_ASSIGN_OR_RETURN(PyValue * v, Pop());
      UCP_ASSIGN_OR_RETURN(PyValue * k, Pop());
      UCP_ASSIGN_OR_RETURN(PyValue * d, Top());
      return SetItems(d, {k, v});
    }
    case 'u': {
      UCP_ASSIGN_OR_RETURN(std::vector<PyValue*> kv, PopMark());
      UCP_ASSIGN_OR_RETURN(PyValue * d, Top());
      return SetItems(d, kv);
    }
    case 'g':
    case 'p': {
      UCP_ASSIGN_OR_RETURN(std::string_view line, Line());
      uint64_t idx = 0;
      auto [p, ec] = std::from_chars(line.data(), line.data() + line.size(), idx);
      if (ec != std::errc() || p != line.data() + line.size() || line.empty()) {
        return Fault("bad memo index");
      }
      return op_ == 'g' ? MemoGet(idx) : MemoPut(idx);
    }
    case 'h':
    case 'q': {
      UCP_ASSIGN_OR_RETURN(uint64_t idx, TakeLE(1));
      return op_ == 'h' ? MemoGet(idx) : MemoPut(idx);
    }
    case 'j':
    case 'r': {
      UCP_ASSIGN_OR_RETURN(uint64_t idx, TakeLE(4));
      return op_ == 'j' ? MemoGet(idx) : MemoPut(idx);
    }
    case 0x94:
      return MemoPut(memo_.size());
    case 'c': {
      UCP_ASSIGN_OR_RETURN(std::string_view m, Line());
      std::string module(m);
      UCP_ASSIGN_OR_RETURN(std::string_view n, Line());
      return Global(std::move(module), std::string(n));
    }
    case 0x93: {
      UCP_ASSIGN_OR_RETURN(PyValue * name, Pop());
      UCP_ASSIGN_OR_RETURN(PyValue * module, Pop());
      if (name->kind() != PyKind::kStr || module->kind() != PyKind::kStr) {
        return Fault("module and name must be str");
      }
      return Global(module->str(), name->str());
    }
    case 'R':
      return Reduce();
    case 0x81: {
      UCP_ASSIGN_OR_RETURN(PyValue * args, Pop());
      UCP_ASSIGN_OR_RETURN(PyValue * cls, Pop());
      return NewObj(cls, args);
    }
    case 0x92: {
      UCP_ASSIGN_OR_RETURN(PyValue * kwargs, Pop());
      UCP_ASSIGN_OR_RETURN(PyValue * args, Pop());
      UCP_ASSIGN_OR_RETURN(PyValue * cls, Pop());
      if (kwargs->kind() != PyKind::kDict || !kwargs->entries().empty()) {
        return Unsupported("keyword arguments are not supported");
      }
      return NewObj(cls, args);
    }
    case 'b':
      return Build();
    case 'Q': {
      UCP_ASSIGN_OR_RETURN(PyValue * pid, Pop());
      if (!load_) return Fault("persistent ids are not expected in this stream");
      auto r = load_(*pid);
      if (!r.ok()) {
        return Status(r.status().code(), "pickle opcode BINPERSID at offset " +
                                             std::to_string(op_pos_ - begin_) + " of " +
                                             std::string(what_) + ": " + r.status().message());
      }
      return Push(const_cast<PyValue*>(*r));
    }
    case 'P':
      return Unsupported("text persistent ids are not supported");
    case 'S':
    case 'V':
      return Unsupported("protocol 0 quoted strings are not supported");
    case 'i':
    case 'o':
      return Unsupported("INST and OBJ construct arbitrary classes");
    case 0x82:
    case 0x83:
    case 0x84:
      return Unsupported("the extension registry is not supported");
    case 0x97:
    case 0x98:
      return Unsupported("out-of-band buffers are not supported");
    default:
      return Fault("not a pickle opcode");
  }
}

Result<UnpickleResult> Machine::Run() {
  while (!stopped_) {
    op_pos_ = pos_;
    op_ = 0;
    if (pos_ >= end_) {
      return DataLossError("pickle " + std::string(what_) + " ends at offset " +
                           std::to_string(pos_ - begin_) + " without a STOP opcode (truncated)");
    }
    UCP_ASSIGN_OR_RETURN(std::string_view b, Take(1));
    op_ = static_cast<uint8_t>(b[0]);
    UCP_RETURN_IF_ERROR(DoOp());
    if (arena_.size() != arena_seen_) {
      const size_t made = arena_.size() - arena_seen_;
      arena_seen_ = arena_.size();
      UCP_RETURN_IF_ERROR(Charge(static_cast<int64_t>(made * sizeof(PyValue))));
    }
  }
  if (!marks_.empty() || stack_.size() != 1) {
    return Fault("STOP with " + std::to_string(stack_.size()) + " values and " +
                 std::to_string(marks_.size()) + " marks on the stack (want 1 and 0)");
  }
  return UnpickleResult{stack_.back(), pos_};
}

}  // namespace

Result<UnpickleResult> Unpickle(const ByteSource& source, int64_t begin, int64_t end,
                                PyArena& arena, const PickleOptions& options,
                                const PersistentLoader& load, std::string_view what) {
  UCP_CHECK(begin >= 0 && begin <= end);
  if (end > source.size()) {
    return DataLossError("pickle " + std::string(what) + " ends at " + std::to_string(end) +
                         ", past the end of " + source.name());
  }
  // The one place where the standard library can throw into the machine (allocation): a
  // pickle that defeats the budgets still ends as a Status, never as an abort.
  try {
    Machine m(source, begin, end, arena, options, load, what);
    return m.Run();
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("pickle " + std::string(what) +
                                  ": out of memory while unpickling");
  } catch (const std::length_error&) {
    return ResourceExhaustedError("pickle " + std::string(what) +
                                  ": out of memory while unpickling");
  }
}

Result<std::optional<DType>> StorageDTypeFromClass(std::string_view class_name) {
  for (const auto& c : kStorageClasses) {
    if (c.name == class_name) {
      if (!c.supported) {
        return UnimplementedError("storage type " + std::string(class_name) + " has no ucp dtype");
      }
      return c.dtype;
    }
  }
  return DataLossError("'" + std::string(class_name) + "' is not a torch storage class");
}

std::string_view StorageClassForDType(DType dtype) {
  for (const auto& c : kStorageClasses) {
    if (c.dtype == dtype) return c.name;
  }
  return {};
}

// The DeepSpeed and Megatron classes a carried value may name: what their checkpoints hold in
// the keys ucp carries over (client state, args, optimizer metadata).
constexpr std::array<std::string_view, 10> kCarriedClasses = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "megatron.core.enums.ModelType",
    "megatron.model.enums.PositionEmbeddingType",
    "megatron.model.enums.AttnMaskType",
    "megatron.model.enums.AttnType",
    "megatron.model.enums.LayerType",
    "megatron.model.enums.LayerNormType",
};

bool IsCarriedGlobal(std::string_view name) {
  if (name.starts_with("__builtin__.")) {
    return IsCarriedGlobal("builtins." + std::string(name.substr(12)));
  }
  PickleOptions strict;
  strict.strict_globals = true;
  if (IsAllowedGlobal(name, strict)) return true;
  for (auto g : kInertGlobals) {
    if (g == name) return true;
  }
  for (auto g : kCarriedClasses) {
    if (g == name) return true;
  }
  return false;
}

bool IsAllowedGlobal(std::string_view name, const PickleOptions& options) {
  for (auto g : kTorchGlobals) {
    if (g == name) return true;
  }
  for (const auto& c : kStorageClasses) {
    if (c.name == name) return true;
  }
  if (name.starts_with("torch.") && IsTorchDTypeName(name.substr(6))) return true;
  for (auto m : kNeverModules) {
    if (name.starts_with(m) && name.size() > m.size() && name[m.size()] == '.') return false;
  }
  return IsInertClass(name, options);
}

}  // namespace ucp::torch
