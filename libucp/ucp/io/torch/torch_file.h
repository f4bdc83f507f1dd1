// TorchFile: reads a torch.save file (the zip format of torch 1.6+ and the legacy pickle-stream
// format) without Python. Opening parses the container and the pickle into a PyValue tree;
// tensor bytes are read later, on request, with pread, so memory is bounded by the tensors asked
// for, not by the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/io/torch/py_value.h"
#include "ucp/io/torch/unpickler.h"
#include "ucp/tensor/tensor.h"

namespace ucp::torch {

enum class TorchFormat : uint8_t { kZip, kLegacy };

struct TorchReadOptions {
  PickleOptions pickle;
  /// Check the CRC-32 of data.pkl and of every storage record read whole (a directory CRC of 0
  /// means "not recorded" and is not checked).
  bool verify_crc32 = true;
  /// The largest data.pkl accepted (it is read into memory).
  int64_t max_pickle_bytes = int64_t{1} << 31;
};

/// Where one storage's bytes are in the file.
struct StorageRecord {
  std::string key;
  int64_t data_offset = 0;
  int64_t num_bytes = 0;
  uint32_t crc32 = 0;  ///< zip only; 0 when not recorded
};

class TorchFile {
 public:
  /// Opens and parses a torch.save file.
  /// Errors: kNotFound (no file); kDataLoss (bad magic, zip faults, pickle faults, forbidden
  /// globals, storages that do not match their records, trailing bytes in a legacy file);
  /// kUnimplemented (TorchScript archives, big-endian files, unsupported opcodes or dtypes,
  /// zip versions outside 1..10); kResourceExhausted; kIoError.
  static Result<TorchFile> Open(const std::filesystem::path& path,
                                const TorchReadOptions& options = {});
  /// The same, from bytes in memory (copied); `name` stands for the file in messages.
  /// Errors: as Open.
  static Result<TorchFile> OpenBuffer(std::span<const std::byte> bytes,
                                      const TorchReadOptions& options = {},
                                      std::string name = "<memory>");

  TorchFile(TorchFile&&) noexcept;
  TorchFile& operator=(TorchFile&&) noexcept;
  ~TorchFile();

  TorchFormat format() const;
  /// The file name used in messages.
  const std::string& name() const;
  /// The unpickled object (for a state_dict, an OrderedDict of tensors).
  const PyValue& root() const;
  /// Every storage the pickle references, by first reference.
  const std::vector<StorageRecord>& storages() const;

  /// The view `ref` describes, gathered by its strides into a new contiguous tensor.
  /// Errors: kNotFound (storage key not in this file); kDataLoss (the view does not fit its
  /// storage, or a CRC mismatch when the read covers the whole record); kResourceExhausted;
  /// kIoError.
  Result<Tensor> ReadTensor(const TensorRef& ref) const;

  /// Reads `out.size()` bytes starting `byte_offset` bytes into a contiguous tensor's data (the
  /// DeepSpeed converter reads pieces of big flat fp32 partitions this way).
  /// Errors: kFailedPrecondition (the view is not contiguous); kOutOfRange (the range is not
  /// inside the tensor's bytes); kNotFound, kDataLoss, kIoError as ReadTensor.
  Status ReadTensorBytes(const TensorRef& ref, int64_t byte_offset, std::span<std::byte> out) const;

  /// Streams the record of `storage` (one of storages()) in bounded chunks and compares its
  /// CRC-32 with the zip directory's, so a reader of byte ranges can still prove a whole record
  /// intact. Legacy files and a directory CRC of 0 record none: Ok.
  /// Errors: kDataLoss naming the file and record on a mismatch; kIoError.
  Status VerifyStorageCrc32(const StorageRecord& storage) const;

  /// One read of the source (issue 14): from this call on, each storage record's CRC-32 is
  /// computed from the bytes ReadTensorBytes and ReadTensor return (pieces in any order, from
  /// many threads), and a record is compared as soon as its last byte has been read: the read
  /// that completes a corrupt record fails with kDataLoss naming the file and record. Zip files
  /// read with verify_crc32 only (legacy files record no checksums). Not thread-safe: call it
  /// before the reads start; calling it again starts over.
  void VerifyReads();
  /// After the last read: with VerifyReads on, reads only the bytes of `storage`'s record that
  /// no read returned (padding, states the plan does not need) and compares its CRC-32; without
  /// it, VerifyStorageCrc32. Thread-safe across records.
  /// Errors: as VerifyStorageCrc32.
  Status FinishVerifiedReads(const StorageRecord& storage) const;
  /// The first record (in storages() order) whose CRC-32 failed during the reads, or Ok.
  Status VerifyReadsFailure() const;
  /// Since VerifyReads: bytes whose CRC came from the conversion's reads, and bytes
  /// FinishVerifiedReads read only for their CRC.
  int64_t verify_bytes_observed() const;
  int64_t verify_bytes_reread() const;

  /// Checks that the file is still the one opened: same device, inode, size and mtime (issue 16
  /// #8). Called after the last read and before committing an output made from it. Ok for a
  /// file opened from a buffer.
  /// Errors: kDataLoss naming the file and what changed; kIoError.
  Status CheckSourceUnchanged() const;

 private:
  struct Impl;
  explicit TorchFile(std::unique_ptr<Impl> impl);
  static Result<TorchFile> OpenSource(std::shared_ptr<const ByteSource> source,
                                      const TorchReadOptions& options);
  std::unique_ptr<Impl> impl_;
};

/// Gathers a strided view out of `storage` (the bytes of its whole storage) into `out`, which
/// must hold num_elements * element size bytes. The view must already be validated.
void GatherStrided(std::span<const std::byte> storage, const TensorRef& ref,
                   std::span<std::byte> out);

}  // namespace ucp::torch
