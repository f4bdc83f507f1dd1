// SafetensorsFile: a validated safetensors file whose tensor bytes are read on demand by pread.
// Opening reads and checks the header only (docs/safetensors_format.md), so memory is bounded by
// the header and the ranges a caller asks for, not by the file: the conversion engine reads just
// the byte ranges its plan needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/safetensors/safetensors_header.h"
#include "ucp/tensor/tensor.h"

namespace ucp::safetensors {

/// Reader limits.
struct SafetensorsReadOptions {
  /// Headers larger than this are refused before they are read (the crate's MAX_HEADER_SIZE).
  int64_t max_header_bytes = kMaxHeaderBytes;
};

class SafetensorsFile {
 public:
  /// Opens and validates `path`. The file is opened with O_NONBLOCK and must be a regular file,
  /// so a FIFO or a device is refused instead of blocking.
  /// Errors: kNotFound (no such file); kDataLoss (not a regular file, or any header rule of
  /// ParseHeaderSize / ParseHeader, naming the file, tensor and field); kUnimplemented (a
  /// safetensors dtype ucp does not hold); kIoError.
  static Result<SafetensorsFile> Open(const std::filesystem::path& path,
                                      const SafetensorsReadOptions& options = {});
  /// Validates a whole file held in memory (copied); `name` stands for the path in messages. The
  /// fuzzer and tests use it.
  /// Errors: as Open, less kNotFound and kIoError.
  static Result<SafetensorsFile> OpenBuffer(std::span<const std::byte> bytes, std::string name,
                                            const SafetensorsReadOptions& options = {});

  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& o) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  /// The path (or buffer name) given to Open.
  const std::string& name() const { return name_; }
  int64_t file_size_bytes() const { return file_size_bytes_; }
  const SafetensorsHeader& header() const { return header_; }
  /// Every tensor in file order (by data offset).
  const std::vector<SafetensorsEntry>& entries() const { return header_.entries; }
  /// `__metadata__`, or nullopt when the file has none.
  const std::optional<std::map<std::string, std::string>>& metadata() const {
    return header_.metadata;
  }

  /// The entry named `tensor_name`.
  /// Errors: kNotFound naming the tensor and the file.
  Result<const SafetensorsEntry*> Find(std::string_view tensor_name) const;

  /// Reads bytes [byte_begin, byte_end) of `tensor` (offsets within the tensor's own bytes) into
  /// `out`, which must hold exactly byte_end - byte_begin bytes. `tensor` must be one of this
  /// file's entries(). Thread-safe.
  /// Errors: kInvalidArgument (not an entry of this file, or out has the wrong size);
  /// kOutOfRange (the range is not within the tensor); kDataLoss (the file shrank since it was
  /// opened); kIoError.
  Status ReadRange(const SafetensorsEntry& tensor, int64_t byte_begin, int64_t byte_end,
                   std::span<std::byte> out) const;

  /// Whether the file still is the one opened (device, inode, size, mtime), for a run that must
  /// not commit an output from a source that changed under it (issue 16 #8). Buffers: always ok.
  /// Errors: kDataLoss naming the file and what changed; kIoError.
  Status CheckUnchanged() const;

  /// Reads a whole tensor into a new contiguous Tensor of its dtype and shape.
  /// Errors: as ReadRange; kResourceExhausted when it cannot be allocated.
  Result<Tensor> ReadTensor(const SafetensorsEntry& tensor) const;

 private:
  SafetensorsFile() = default;
  static Result<SafetensorsFile> Load(SafetensorsFile f, const SafetensorsReadOptions& options);
  Status ReadAt(int64_t offset, std::span<std::byte> out) const;

  std::string name_;
  int fd_ = -1;                    // the open file, or -1 for a buffer
  std::vector<std::byte> buffer_;  // the whole file, for OpenBuffer
  int64_t file_size_bytes_ = 0;
  io::FileIdentity identity_;  // at open, for CheckUnchanged
  SafetensorsHeader header_;
};

}  // namespace ucp::safetensors
