// TorchWriter: storage keys in pickle order, then the records of the minimal writer recipe.
#include "ucp/io/torch/torch_writer.h"

#include <limits>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/torch/pickler.h"
#include "ucp/io/torch/unpickler.h"

namespace ucp::torch {

TorchWriter::TorchWriter(TorchWriteOptions options) : options_(std::move(options)) {}

Result<const PyValue*> TorchWriter::AddTensor(ConstTensorView view, bool requires_grad,
                                              bool is_parameter) {
  UCP_RETURN_IF_ERROR(ValidateView(view, "tensor to write"));
  TensorRef t;
  t.dtype = view.dtype;
  t.size = view.shape;
  t.stride = ContiguousStrides(view.shape);
  t.requires_grad = requires_grad;
  t.is_parameter = is_parameter;
  t.storage.dtype =
      StorageClassForDType(view.dtype).empty() ? std::nullopt : std::optional<DType>(view.dtype);
  t.storage.location = "cpu";
  t.storage.num_bytes = static_cast<int64_t>(view.bytes.size());
  t.storage.numel = t.storage.dtype ? view.num_elements() : t.storage.num_bytes;
  const PyValue* node = arena_.Tensor(std::move(t));
  views_.emplace(node, view);
  return node;
}

Result<const PyValue*> TorchWriter::AddOwnedTensor(Tensor tensor, bool requires_grad,
                                                   bool is_parameter) {
  owned_.push_back(std::move(tensor));
  return AddTensor(owned_.back().view(), requires_grad, is_parameter);
}

Result<const PyValue*> TorchWriter::CopyFrom(const TorchFile& file, const PyValue& value) {
  std::unordered_map<const PyValue*, const PyValue*> done;
  return Copy(file, value, 0, done);
}

Result<const PyValue*> TorchWriter::Copy(const TorchFile& file, const PyValue& v, int depth,
                                         std::unordered_map<const PyValue*, const PyValue*>& done) {
  constexpr int kMaxDepth = 1000;
  if (depth > kMaxDepth) {
    return InvalidArgumentError("value copied from " + file.name() + " is nested deeper than " +
                                std::to_string(kMaxDepth) + " levels");
  }
  if (auto it = done.find(&v); it != done.end()) return it->second;
  // A global in a written file is imported (and called) by torch.load: carry only those the
  // loaders need, whatever the source's reader accepted as inert (IsCarriedGlobal).
  const PyValue* global = v.kind() == PyKind::kGlobal ? &v
                          : v.kind() == PyKind::kObject ? v.callable()
                                                        : nullptr;
  if (global != nullptr && global->kind() == PyKind::kGlobal) {
    const std::string dotted =
        std::string(global->global_module()) + "." + std::string(global->global_name());
    if (!IsCarriedGlobal(dotted)) {
      return UnimplementedError(file.name() + ": a carried value holds the pickled global '" +
                                dotted +
                                "', which ucp does not write into a checkpoint (torch.load would "
                                "import and call it); only torch's, argparse's, numpy's and the "
                                "DeepSpeed/Megatron classes their loaders need are carried");
    }
  }
  auto copy_opt = [&](const PyValue* p) -> Result<const PyValue*> {
    if (p == nullptr) return static_cast<const PyValue*>(nullptr);
    return Copy(file, *p, depth + 1, done);
  };
  PyValue* out = nullptr;
  switch (v.kind()) {
    case PyKind::kNone:
    case PyKind::kBool:
    case PyKind::kInt:
    case PyKind::kBigInt:
    case PyKind::kFloat:
    case PyKind::kStr:
    case PyKind::kBytes:
    case PyKind::kGlobal:
    case PyKind::kStorage:
      return &v;  // immutable leaves: share them
    case PyKind::kTensor: {
      UCP_ASSIGN_OR_RETURN(Tensor t, file.ReadTensor(v.tensor()));
      UCP_ASSIGN_OR_RETURN(
          const PyValue* node,
          AddOwnedTensor(std::move(t), v.tensor().requires_grad, v.tensor().is_parameter));
      if (v.tensor().state != nullptr) {
        UCP_ASSIGN_OR_RETURN(const PyValue* st, copy_opt(v.tensor().state));
        TensorRef ref = node->tensor();
        ref.state = st;
        PyValue* with_state = arena_.Tensor(std::move(ref));
        views_.emplace(with_state, views_.at(node));
        views_.erase(node);
        node = with_state;
      }
      done[&v] = node;
      return node;
    }
    case PyKind::kList:
    case PyKind::kSet:
    case PyKind::kTuple:
      out = v.kind() == PyKind::kList  ? arena_.List()
            : v.kind() == PyKind::kSet ? arena_.Set()
                                       : arena_.Tuple();
      out->SetTypeName(v.type_name());
      done[&v] = out;
      for (const PyValue* i : v.items()) {
        UCP_ASSIGN_OR_RETURN(const PyValue* c, copy_opt(i));
        out->Append(c);
      }
      return out;
    case PyKind::kDict:
      out = arena_.Dict();
      out->SetTypeName(v.type_name());
      done[&v] = out;
      for (const auto& [k, val] : v.entries()) {
        UCP_ASSIGN_OR_RETURN(const PyValue* ck, copy_opt(k));
        UCP_ASSIGN_OR_RETURN(const PyValue* cv, copy_opt(val));
        out->SetItem(ck, cv);
      }
      break;
    case PyKind::kObject: {
      PyValue* args = arena_.Tuple();
      for (const PyValue* i : v.items()) {
        UCP_ASSIGN_OR_RETURN(const PyValue* c, copy_opt(i));
        args->Append(c);
      }
      out = arena_.Object(v.callable(), args, v.is_newobj());
      done[&v] = out;
      break;
    }
  }
  UCP_ASSIGN_OR_RETURN(const PyValue* st, copy_opt(v.state()));
  out->SetState(st);
  return out;
}

Result<DeferredTensor> TorchWriter::AddDeferredTensor(DType dtype, const Shape& shape,
                                                      int64_t storage_numel, bool requires_grad) {
  UCP_ASSIGN_OR_RETURN(int64_t numel, CheckedProduct(shape, "deferred tensor shape"));
  const int64_t item = DTypeSizeBytes(dtype);
  if (storage_numel < numel || storage_numel > std::numeric_limits<int64_t>::max() / item) {
    return InvalidArgumentError("deferred tensor of " + std::to_string(numel) +
                                " elements cannot view a storage of " +
                                std::to_string(storage_numel) + " elements");
  }
  TensorRef t;
  t.dtype = dtype;
  t.size = shape;
  t.stride = ContiguousStrides(shape);
  t.requires_grad = requires_grad;
  t.storage.dtype =
      StorageClassForDType(dtype).empty() ? std::nullopt : std::optional<DType>(dtype);
  t.storage.location = "cpu";
  t.storage.num_bytes = storage_numel * item;
  t.storage.numel = t.storage.dtype ? storage_numel : t.storage.num_bytes;
  const PyValue* node = arena_.Tensor(std::move(t));
  const int32_t id = num_deferred_++;
  deferred_.emplace(node, Deferred{id, storage_numel * item});
  return DeferredTensor{node, id};
}

Status TorchWriter::Lay(const std::filesystem::path& path, const PyValue& root, bool allow_deferred,
                        std::optional<ZipWriter>& zip, std::vector<int32_t>& record_of) {
  const std::string& prefix = options_.archive_name;
  if (prefix.empty() || prefix.find('/') != std::string::npos || prefix == "..") {
    return InvalidArgumentError("torch archive name '" + prefix + "' must be one path component");
  }
  struct Record {
    std::string key;
    const ConstTensorView* view = nullptr;  // eager
    const Deferred* deferred = nullptr;
  };
  std::vector<Record> records;
  std::unordered_map<const PyValue*, std::string> keys;
  StorageAssigner assign = [&](const PyValue& tensor) -> Result<StorageRef> {
    Record r;
    if (auto it = views_.find(&tensor); it != views_.end()) {
      r.view = &it->second;
    } else if (auto d = deferred_.find(&tensor); d != deferred_.end()) {
      if (!allow_deferred) {
        return InvalidArgumentError("a deferred tensor can only be written by WriteStreamed");
      }
      r.deferred = &d->second;
    } else {
      return InvalidArgumentError("tensor of storage '" + tensor.tensor().storage.key +
                                  "' was not added with this writer's AddTensor, so its bytes " +
                                  "are unknown; read it and add it");
    }
    StorageRef s = tensor.tensor().storage;
    auto [k, fresh] = keys.try_emplace(&tensor, std::to_string(records.size()));
    if (fresh) {
      r.key = k->second;
      records.push_back(r);
    }
    s.key = k->second;
    return s;
  };
  UCP_ASSIGN_OR_RETURN(std::string pickle, PickleValue(root, assign),
                       "while pickling for " + path.string());
  UCP_ASSIGN_OR_RETURN(ZipWriter z, ZipWriter::Create(path, options_.zip));
  zip.emplace(std::move(z));
  UCP_RETURN_IF_ERROR(zip->AddRecord(prefix + "/data.pkl", pickle));
  UCP_RETURN_IF_ERROR(zip->AddRecord(prefix + "/byteorder", "little"));
  record_of.assign(static_cast<size_t>(num_deferred_), -1);
  for (const Record& r : records) {
    const std::string name = prefix + "/data/" + r.key;
    if (r.view != nullptr) {
      std::span<const std::byte> piece = r.view->bytes;
      UCP_RETURN_IF_ERROR(
          zip->AddRecord(name, std::span<const std::span<const std::byte>>(&piece, 1)));
    } else {
      UCP_ASSIGN_OR_RETURN(record_of[static_cast<size_t>(r.deferred->id)],
                           zip->ReserveRecord(name, static_cast<uint64_t>(r.deferred->num_bytes)));
    }
  }
  return zip->AddRecord(prefix + "/version", "3\n");
}

Status TorchWriter::Write(const std::filesystem::path& path, const PyValue& root) {
  std::optional<ZipWriter> zip;
  std::vector<int32_t> record_of;
  UCP_RETURN_IF_ERROR(Lay(path, root, /*allow_deferred=*/false, zip, record_of));
  return zip->Finish();
}

Result<StreamedTorchFile> TorchWriter::WriteStreamed(const std::filesystem::path& path,
                                                     const PyValue& root) {
  std::optional<ZipWriter> zip;
  std::vector<int32_t> record_of;
  UCP_RETURN_IF_ERROR(Lay(path, root, /*allow_deferred=*/true, zip, record_of));
  return StreamedTorchFile(std::move(*zip), path, std::move(record_of));
}

Status StreamedTorchFile::WriteStorage(int32_t id, int64_t byte_offset,
                                       std::span<const std::byte> data) {
  if (id < 0 || static_cast<size_t>(id) >= record_of_.size() ||
      record_of_[static_cast<size_t>(id)] < 0 || byte_offset < 0) {
    return InvalidArgumentError(path_.string() + ": deferred tensor " + std::to_string(id) +
                                " is not in the file");
  }
  return zip_.WriteReserved(record_of_[static_cast<size_t>(id)], static_cast<uint64_t>(byte_offset),
                            data);
}

}  // namespace ucp::torch
