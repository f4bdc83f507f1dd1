// The Python value model that the safe unpickler produces and the pickler consumes: None, bool,
// int (plus a big-int form), float, str, bytes, list, tuple, dict, set, tensor references, inert
// objects and global references. Nodes live in a PyArena and point to each other with raw
// pointers, so the aliasing a pickle memo creates (and even a cycle a hostile pickle builds) needs
// no reference counting and cannot leak.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"

namespace ucp::torch {

class PyValue;

/// One storage as a persistent id names it: `('storage', torch.XStorage, key, location, numel)`.
struct StorageRef {
  std::string key;       ///< "0", "1", ... (zip) or a memory address string (legacy)
  std::string location;  ///< "cpu", "cuda:0", ...; informational
  /// The storage's element type; nullopt for torch.UntypedStorage (bytes).
  std::optional<DType> dtype;
  int64_t numel = 0;      ///< elements of `dtype` (bytes when untyped)
  int64_t num_bytes = 0;  ///< numel * element size, checked
};

/// A tensor view of a storage, as `_rebuild_tensor_v2/_v3` describe it. Offsets, sizes and
/// strides are in elements of `dtype`.
struct TensorRef {
  StorageRef storage;
  DType dtype = DType::kFp32;
  int64_t storage_offset = 0;
  Shape size;
  std::vector<int64_t> stride;
  bool requires_grad = false;
  bool is_parameter = false;  ///< wrapped in `_rebuild_parameter(_with_state)`
  /// Python attributes set by `_rebuild_from_type_v2` or `_rebuild_parameter_with_state`.
  const PyValue* state = nullptr;

  int64_t num_elements() const { return NumElementsOrDie(size); }
  /// True when the strides are row-major for `size` (dims of size 1 may have any stride).
  bool IsContiguous() const;
};

enum class PyKind : uint8_t {
  kNone,
  kBool,
  kInt,     ///< fits int64
  kBigInt,  ///< LONG1/LONG4 beyond int64: little-endian two's complement bytes
  kFloat,
  kStr,
  kBytes,
  kList,
  kTuple,
  kDict,
  kSet,
  kTensor,
  kStorage,  ///< a bare storage (a persistent id that no rebuild consumed)
  kObject,   ///< an inert object: callable(args) [+ BUILD state], never executed
  kGlobal,   ///< a reference to "module.name": a dtype, a class, a function
};

/// "none", "int", "dict", ...: for messages.
std::string_view PyKindName(PyKind kind);

/// Whether `s` is well-formed UTF-8 (shortest forms, at most U+10FFFF). `allow_surrogates`
/// also accepts encoded U+D800..U+DFFF, as Python's BINUNICODE does ('surrogatepass'), which is
/// how a Python 3 pickle carries a str holding lone surrogates (old Megatron args). A Python 2
/// pickle's STRING opcodes carry raw bytes that may be neither.
bool IsUtf8(std::string_view s, bool allow_surrogates);

/// One Python value. Created by PyArena; containers hold pointers to other arena nodes.
class PyValue {
 public:
  PyKind kind() const { return kind_; }
  bool is_none() const { return kind_ == PyKind::kNone; }

  bool bool_value() const { return bool_; }
  int64_t int_value() const { return int_; }
  double float_value() const { return float_; }
  /// Str: UTF-8 text. Bytes and BigInt: raw bytes. Global: "module.name".
  const std::string& str() const { return str_; }

  /// List, tuple, set items; the args tuple's items of an object.
  const std::vector<const PyValue*>& items() const { return items_; }
  /// Dict entries in insertion order (later SETITEMs of an equal key replace the value).
  const std::vector<std::pair<const PyValue*, const PyValue*>>& entries() const { return entries_; }

  /// The container's Python type when it is not the plain builtin: "collections.OrderedDict"
  /// for a dict, "torch.Size" for a tuple, "builtins.frozenset" for a set; empty otherwise.
  const std::string& type_name() const { return type_name_; }

  /// Object: the callable global (a kGlobal node) and whether NEWOBJ (cls.__new__) made it.
  const PyValue* callable() const { return callable_; }
  bool is_newobj() const { return newobj_; }
  /// Object, or OrderedDict: the BUILD argument, or nullptr.
  const PyValue* state() const { return state_; }
  /// Object: "module.name" of its callable ("argparse.Namespace", "numpy.dtype", ...); for an
  /// enum member pickled as getattr(EnumClass, 'name'), the enum class.
  std::string_view class_name() const;

  const TensorRef& tensor() const { return tensor_; }
  const StorageRef& storage() const { return storage_; }

  /// Dict lookup by str key; nullptr when absent or not a dict.
  const PyValue* Get(std::string_view key) const;
  /// Global: the module and the name it was pickled with ("torch._utils", "_rebuild_tensor_v2").
  std::string_view global_module() const { return std::string_view(str_).substr(0, module_len_); }
  std::string_view global_name() const {
    return std::string_view(str_).substr(std::min(str_.size(), module_len_ + 1));
  }
  /// Dict lookup by int key; nullptr when absent or not a dict.
  const PyValue* Get(int64_t key) const;
  /// Dict lookup that reports a missing key or a non-dict. `what` names the value in errors.
  /// Errors: kNotFound naming the key and `what`; kDataLoss when this is not a dict.
  Result<const PyValue*> Find(std::string_view key, std::string_view what) const;

  /// The dtype a `torch.<dtype>` global names.
  /// Errors: kDataLoss when this is not a torch dtype global; kUnimplemented for a torch dtype
  /// ucp has no DType for (complex, quantized).
  Result<DType> AsDType() const;

  // Mutation, for the unpickler and for callers building a value to write. Keys are compared by
  // value for str, int, bool and None; other keys are appended without a duplicate check.
  void Append(const PyValue* v) { items_.push_back(v); }
  void SetItem(const PyValue* key, const PyValue* value);
  void SetState(const PyValue* state) { state_ = state; }
  void SetTypeName(std::string name) { type_name_ = std::move(name); }
  /// Containers below this node, as the unpickler counts them while building (1 for a container
  /// of scalars, 0 for a scalar); it bounds nesting before any recursive walk sees the value.
  uint32_t nesting() const { return nesting_; }
  void set_nesting(uint32_t n) { nesting_ = n; }

 private:
  friend class PyArena;
  static std::optional<std::string> IndexKey(const PyValue* key);

  PyKind kind_ = PyKind::kNone;
  bool bool_ = false;
  bool newobj_ = false;
  uint32_t nesting_ = 0;
  int64_t int_ = 0;
  size_t module_len_ = 0;
  double float_ = 0;
  std::string str_;
  std::string type_name_;
  std::vector<const PyValue*> items_;
  std::vector<std::pair<const PyValue*, const PyValue*>> entries_;
  std::unordered_map<std::string, size_t> index_;  // IndexKey -> position in entries_
  const PyValue* callable_ = nullptr;
  const PyValue* state_ = nullptr;
  TensorRef tensor_;
  StorageRef storage_;
};

/// Owns PyValues. Pointers stay valid for the arena's life (a deque never moves its elements).
class PyArena {
 public:
  PyArena() = default;
  PyArena(const PyArena&) = delete;
  PyArena& operator=(const PyArena&) = delete;
  PyArena(PyArena&&) = default;
  PyArena& operator=(PyArena&&) = default;

  PyValue* None();
  PyValue* Bool(bool v);
  PyValue* Int(int64_t v);
  /// Little-endian two's complement bytes of an integer too large for int64.
  PyValue* BigInt(std::string le_bytes);
  PyValue* Float(double v);
  PyValue* Str(std::string utf8);
  PyValue* Bytes(std::string bytes);
  PyValue* List();
  PyValue* Tuple(std::vector<const PyValue*> items = {});
  /// A dict; ordered=true makes a collections.OrderedDict.
  PyValue* Dict(bool ordered = false);
  PyValue* Set();
  /// torch.Size(dims).
  PyValue* TorchSize(std::span<const int64_t> dims);
  /// A global "module.name"; the one-argument form splits at the last '.'.
  PyValue* Global(std::string module, std::string name);
  PyValue* Global(std::string_view module_dot_name);
  /// `torch.<dtype>`, e.g. torch.float16.
  PyValue* DTypeGlobal(DType dtype);
  PyValue* Tensor(TensorRef ref);
  PyValue* Storage(StorageRef ref);
  /// An inert object: `callable(*args)` (REDUCE) or `callable.__new__(callable, *args)` (NEWOBJ).
  /// `callable` must be a kGlobal node and `args` a tuple.
  PyValue* Object(const PyValue* callable, const PyValue* args, bool newobj);

  size_t size() const { return nodes_.size(); }

 private:
  PyValue* New(PyKind kind);
  std::deque<PyValue> nodes_;
};

/// Maps `torch.<name>` dtype names ("float16", "half", "bfloat16", ...) to a DType; nullopt when
/// the name is a torch dtype ucp lacks or not a dtype at all.
std::optional<DType> DTypeFromTorchName(std::string_view name);
/// True for every torch dtype attribute name (including ones ucp has no DType for).
bool IsTorchDTypeName(std::string_view name);

}  // namespace ucp::torch
