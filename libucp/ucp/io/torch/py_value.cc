// PyValue and PyArena: construction, dict indexing and the torch dtype name table.
#include "ucp/io/torch/py_value.h"

#include <array>

namespace ucp::torch {
namespace {

struct TorchDTypeName {
  std::string_view name;
  std::optional<DType> dtype;
};

// Every attribute of the torch module that is a torch.dtype, canonical names and aliases. The
// ones without a DType are still legal globals (a Namespace may carry torch.complex64).
constexpr std::array<TorchDTypeName, 38> kTorchDTypeNames = {{
    {"float64", DType::kFp64},         {"double", DType::kFp64},
    {"float32", DType::kFp32},         {"float", DType::kFp32},
    {"float16", DType::kFp16},         {"half", DType::kFp16},
    {"bfloat16", DType::kBf16},        {"float8_e4m3fn", DType::kFp8E4m3},
    {"float8_e5m2", DType::kFp8E5m2},  {"int8", DType::kInt8},
    {"int16", DType::kInt16},          {"short", DType::kInt16},
    {"int32", DType::kInt32},          {"int", DType::kInt32},
    {"int64", DType::kInt64},          {"long", DType::kInt64},
    {"uint8", DType::kUint8},          {"bool", DType::kBool},
    {"complex32", std::nullopt},       {"chalf", std::nullopt},
    {"complex64", std::nullopt},       {"cfloat", std::nullopt},
    {"complex128", std::nullopt},      {"cdouble", std::nullopt},
    {"float8_e4m3fnuz", std::nullopt}, {"float8_e5m2fnuz", std::nullopt},
    {"uint16", std::nullopt},          {"uint32", std::nullopt},
    {"uint64", std::nullopt},          {"qint8", std::nullopt},
    {"quint8", std::nullopt},          {"qint32", std::nullopt},
    {"quint4x2", std::nullopt},        {"quint2x4", std::nullopt},
    {"bits8", std::nullopt},           {"bits16", std::nullopt},
    {"float8_e8m0fnu", std::nullopt},  {"float4_e2m1fn_x2", std::nullopt},
}};

const TorchDTypeName* LookupTorchDType(std::string_view name) {
  for (const auto& e : kTorchDTypeNames) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

}  // namespace

std::optional<DType> DTypeFromTorchName(std::string_view name) {
  const TorchDTypeName* e = LookupTorchDType(name);
  return e ? e->dtype : std::nullopt;
}

bool IsTorchDTypeName(std::string_view name) { return LookupTorchDType(name) != nullptr; }

bool TensorRef::IsContiguous() const {
  int64_t expected = 1;
  for (size_t i = size.size(); i-- > 0;) {
    if (size[i] != 1 && stride[i] != expected) return false;
    expected *= size[i];
  }
  return true;
}

bool IsUtf8(std::string_view s, bool allow_surrogates) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len = 0;
    uint32_t cp = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i < static_cast<size_t>(len)) return false;
    for (int k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF) return false;
    if (!allow_surrogates && cp >= 0xD800 && cp <= 0xDFFF) return false;
    i += static_cast<size_t>(len);
  }
  return true;
}

std::string_view PyKindName(PyKind kind) {
  switch (kind) {
    case PyKind::kNone:
      return "none";
    case PyKind::kBool:
      return "bool";
    case PyKind::kInt:
      return "int";
    case PyKind::kBigInt:
      return "bigint";
    case PyKind::kFloat:
      return "float";
    case PyKind::kStr:
      return "str";
    case PyKind::kBytes:
      return "bytes";
    case PyKind::kList:
      return "list";
    case PyKind::kTuple:
      return "tuple";
    case PyKind::kDict:
      return "dict";
    case PyKind::kSet:
      return "set";
    case PyKind::kTensor:
      return "tensor";
    case PyKind::kStorage:
      return "storage";
    case PyKind::kObject:
      return "object";
    case PyKind::kGlobal:
      return "global";
  }
  return "unknown";
}

std::string_view PyValue::class_name() const {
  if (kind_ != PyKind::kObject || callable_ == nullptr) return {};
  // getattr(EnumClass, 'member') is how Python 3.11+ pickles an enum member: name the class.
  if (callable_->str() == "builtins.getattr" && !items_.empty() &&
      items_[0]->kind() == PyKind::kGlobal) {
    return items_[0]->str();
  }
  return callable_->str();
}

std::optional<std::string> PyValue::IndexKey(const PyValue* key) {
  switch (key->kind_) {
    case PyKind::kStr:
      return "s" + key->str_;
    // Python: True == 1 and hash(True) == hash(1), so bools and ints share one key space.
    case PyKind::kInt:
      return "i" + std::to_string(key->int_);
    case PyKind::kBool:
      return "i" + std::to_string(key->bool_ ? 1 : 0);
    case PyKind::kNone:
      return std::string("n");
    default:
      return std::nullopt;
  }
}

void PyValue::SetItem(const PyValue* key, const PyValue* value) {
  std::optional<std::string> ik = IndexKey(key);
  if (ik) {
    auto [it, inserted] = index_.try_emplace(*ik, entries_.size());
    if (!inserted) {
      entries_[it->second].second = value;
      return;
    }
  }
  entries_.emplace_back(key, value);
}

const PyValue* PyValue::Get(std::string_view key) const {
  if (kind_ != PyKind::kDict) return nullptr;
  std::string ik = "s";
  ik.append(key);
  auto it = index_.find(ik);
  return it == index_.end() ? nullptr : entries_[it->second].second;
}

const PyValue* PyValue::Get(int64_t key) const {
  if (kind_ != PyKind::kDict) return nullptr;
  auto it = index_.find("i" + std::to_string(key));
  return it == index_.end() ? nullptr : entries_[it->second].second;
}

Result<const PyValue*> PyValue::Find(std::string_view key, std::string_view what) const {
  if (kind_ != PyKind::kDict) {
    return DataLossError(std::string(what) + " is a " + std::string(PyKindName(kind_)) +
                         ", not a dict, looking for key '" + std::string(key) + "'");
  }
  const PyValue* v = Get(key);
  if (v == nullptr) {
    return NotFoundError("key '" + std::string(key) + "' not found in " + std::string(what));
  }
  return v;
}

Result<DType> PyValue::AsDType() const {
  constexpr std::string_view kPrefix = "torch.";
  if (kind_ != PyKind::kGlobal || !str_.starts_with(kPrefix) ||
      !IsTorchDTypeName(std::string_view(str_).substr(kPrefix.size()))) {
    return DataLossError("expected a torch dtype global, got " + std::string(PyKindName(kind_)) +
                         (kind_ == PyKind::kGlobal ? " " + str_ : std::string()));
  }
  std::optional<DType> d = DTypeFromTorchName(std::string_view(str_).substr(kPrefix.size()));
  if (!d) return UnimplementedError("torch dtype " + str_ + " has no ucp dtype");
  return *d;
}

PyValue* PyArena::New(PyKind kind) {
  PyValue& v = nodes_.emplace_back();
  v.kind_ = kind;
  return &v;
}

PyValue* PyArena::None() { return New(PyKind::kNone); }
PyValue* PyArena::Bool(bool b) {
  PyValue* v = New(PyKind::kBool);
  v->bool_ = b;
  return v;
}
PyValue* PyArena::Int(int64_t i) {
  PyValue* v = New(PyKind::kInt);
  v->int_ = i;
  return v;
}
PyValue* PyArena::BigInt(std::string le_bytes) {
  PyValue* v = New(PyKind::kBigInt);
  v->str_ = std::move(le_bytes);
  return v;
}
PyValue* PyArena::Float(double f) {
  PyValue* v = New(PyKind::kFloat);
  v->float_ = f;
  return v;
}
PyValue* PyArena::Str(std::string s) {
  PyValue* v = New(PyKind::kStr);
  v->str_ = std::move(s);
  return v;
}
PyValue* PyArena::Bytes(std::string s) {
  PyValue* v = New(PyKind::kBytes);
  v->str_ = std::move(s);
  return v;
}
PyValue* PyArena::List() { return New(PyKind::kList); }
PyValue* PyArena::Tuple(std::vector<const PyValue*> items) {
  PyValue* v = New(PyKind::kTuple);
  v->items_ = std::move(items);
  return v;
}
PyValue* PyArena::Dict(bool ordered) {
  PyValue* v = New(PyKind::kDict);
  if (ordered) v->type_name_ = "collections.OrderedDict";
  return v;
}
PyValue* PyArena::Set() { return New(PyKind::kSet); }
PyValue* PyArena::TorchSize(std::span<const int64_t> dims) {
  PyValue* v = New(PyKind::kTuple);
  v->type_name_ = "torch.Size";
  for (int64_t d : dims) v->items_.push_back(Int(d));
  return v;
}
PyValue* PyArena::Global(std::string module, std::string name) {
  PyValue* v = New(PyKind::kGlobal);
  v->module_len_ = module.size();
  v->str_ = std::move(module) + "." + name;
  return v;
}
PyValue* PyArena::Global(std::string_view module_dot_name) {
  size_t dot = module_dot_name.rfind('.');
  if (dot == std::string_view::npos) return Global(std::string(), std::string(module_dot_name));
  return Global(std::string(module_dot_name.substr(0, dot)),
                std::string(module_dot_name.substr(dot + 1)));
}
PyValue* PyArena::DTypeGlobal(DType dtype) {
  return Global("torch." + std::string(DTypeTorchName(dtype)));
}
PyValue* PyArena::Tensor(TensorRef ref) {
  PyValue* v = New(PyKind::kTensor);
  v->tensor_ = std::move(ref);
  return v;
}
PyValue* PyArena::Storage(StorageRef ref) {
  PyValue* v = New(PyKind::kStorage);
  v->storage_ = std::move(ref);
  return v;
}
PyValue* PyArena::Object(const PyValue* callable, const PyValue* args, bool newobj) {
  UCP_CHECK(callable != nullptr && callable->kind() == PyKind::kGlobal);
  UCP_CHECK(args != nullptr && args->kind() == PyKind::kTuple);
  PyValue* v = New(PyKind::kObject);
  v->callable_ = callable;
  v->items_ = args->items();
  v->newobj_ = newobj;
  return v;
}

}  // namespace ucp::torch
