// TorchWriter: builds a Python value (dicts, lists, tuples, scalars, tensors, OrderedDict,
// torch.Size, dtype globals, inert objects carried over from a read) and writes it as a zip-format
// torch.save file that real torch.load reads. Tensor bytes are streamed from the caller's memory,
// or, for deferred tensors, written into the laid-out file later (StreamedTorchFile).
#pragma once

#include <deque>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/io/torch/py_value.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/torch/zip_writer.h"
#include "ucp/tensor/tensor.h"

namespace ucp::torch {

struct TorchWriteOptions {
  /// The record prefix ("archive/" is what torch.save uses for a buffer).
  std::string archive_name = "archive";
  ZipWriteOptions zip;
};

/// A torch.save file laid out by TorchWriter::WriteStreamed whose deferred storages are still
/// being written: the pickle, the eager tensors and every record header are on disk, and each
/// deferred storage is a reserved zip record (zip_writer.h).
class StreamedTorchFile {
 public:
  StreamedTorchFile(StreamedTorchFile&&) noexcept = default;
  StreamedTorchFile& operator=(StreamedTorchFile&&) = delete;
  StreamedTorchFile(const StreamedTorchFile&) = delete;

  /// Writes bytes [byte_offset, byte_offset + data.size()) of deferred tensor `id`'s storage.
  /// Thread-safe; ranges of one storage must not overlap.
  /// Errors: kInvalidArgument (an id the pickle does not reference, a range outside the
  /// storage); kIoError.
  Status WriteStorage(int32_t id, int64_t byte_offset, std::span<const std::byte> data);

  /// Completes the file (zip directory, CRC-32s of the deferred storages) and renames it into
  /// place. Errors: as ZipWriter::Finish (kInternal when a storage is not written exactly once).
  Status Finish() { return zip_.Finish(); }

  const std::filesystem::path& path() const { return path_; }

 private:
  friend class TorchWriter;
  StreamedTorchFile(ZipWriter zip, std::filesystem::path path, std::vector<int32_t> record_of)
      : zip_(std::move(zip)), path_(std::move(path)), record_of_(std::move(record_of)) {}
  ZipWriter zip_;
  std::filesystem::path path_;
  std::vector<int32_t> record_of_;  // per deferred id: the reserved zip record, or -1
};

/// A tensor node whose storage bytes are written later; `id` names it to
/// StreamedTorchFile::WriteStorage.
struct DeferredTensor {
  const PyValue* node = nullptr;
  int32_t id = -1;
};

class TorchWriter {
 public:
  explicit TorchWriter(TorchWriteOptions options = {});

  /// Where to build the value to write. Values from other arenas (a TorchFile's root, say) may
  /// be mixed in; they must outlive Write.
  PyArena& arena() { return arena_; }

  /// A tensor node for `view`, which must stay valid until Write returns: its bytes are written
  /// from there. fp8 dtypes are written with `_rebuild_tensor_v3` and an UntypedStorage, which
  /// torch 2.1+ reads (torch 1.13 has no fp8).
  /// Errors: kInvalidArgument when the view's byte count does not match its dtype and shape.
  Result<const PyValue*> AddTensor(ConstTensorView view, bool requires_grad = false,
                                   bool is_parameter = false);

  /// The same for a tensor the writer keeps (moved in) until it is destroyed.
  /// Errors: as AddTensor.
  Result<const PyValue*> AddOwnedTensor(Tensor tensor, bool requires_grad = false,
                                        bool is_parameter = false);

  /// A tensor of `dtype` and `shape` whose bytes are not known yet: a contiguous view of the
  /// first elements of a storage of `storage_numel` elements (at least the shape's; DeepSpeed
  /// saves trimmed views of padded partitions). Only WriteStreamed can write it.
  /// Errors: kInvalidArgument (storage_numel smaller than the shape, or a size that overflows).
  Result<DeferredTensor> AddDeferredTensor(DType dtype, const Shape& shape, int64_t storage_numel,
                                           bool requires_grad = false);

  /// Copies `value`, read from `file`, into this writer's arena: containers are copied (shared
  /// nodes stay shared), each tensor is read from `file` (contiguous now; views of one storage
  /// become separate storages) and owned by the writer, scalars, globals and inert objects are
  /// carried over with their arguments and BUILD state. This is how client state such as
  /// argparse.Namespace or a DeepSpeed loss scaler passes through a conversion.
  /// Errors: kInvalidArgument (nesting deeper than 1000); errors of TorchFile::ReadTensor.
  Result<const PyValue*> CopyFrom(const TorchFile& file, const PyValue& value);

  /// Pickles `root` and writes the file atomically: data.pkl, byteorder, data/<k> per tensor in
  /// the order the pickle meets them, version. Storage keys are "0", "1", ... in that order.
  /// Errors: kInvalidArgument (a tensor not made by this writer's AddTensor, a value the
  /// pickler refuses, an archive name with '/'); kIoError.
  Status Write(const std::filesystem::path& path, const PyValue& root);

  /// As Write, but for a value with deferred tensors: lays the file out (every record header,
  /// the pickle and the eager tensors are written, each deferred storage gets room in its zip
  /// record) and returns it open, for the storages to be written and the file finished.
  /// Errors: as Write.
  Result<StreamedTorchFile> WriteStreamed(const std::filesystem::path& path, const PyValue& root);

 private:
  TorchWriteOptions options_;
  PyArena arena_;
  Result<const PyValue*> Copy(const TorchFile& file, const PyValue& v, int depth,
                              std::unordered_map<const PyValue*, const PyValue*>& done);

  struct Deferred {
    int32_t id = -1;
    int64_t num_bytes = 0;
  };
  Status Lay(const std::filesystem::path& path, const PyValue& root, bool allow_deferred,
             std::optional<ZipWriter>& zip, std::vector<int32_t>& record_of);

  std::unordered_map<const PyValue*, ConstTensorView> views_;
  std::unordered_map<const PyValue*, Deferred> deferred_;
  int32_t num_deferred_ = 0;
  std::deque<Tensor> owned_;
};

}  // namespace ucp::torch
