// ZipWriter: writes the zip container torch.load reads (formats.md 1.2, "minimal writer recipe"):
// stored records whose data starts on a 64-byte boundary (padding in an "FB" local extra field),
// real CRC-32s, zip64 records when sizes or offsets need them, and always a zip64 end record, as
// torch's own writer does. The file appears atomically: it is written under a `.tmp-` sibling
// name, fsynced, renamed over the target and its directory fsynced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "ucp/base/result.h"

namespace ucp::torch {

struct ZipWriteOptions {
  /// Alignment of each record's data from the start of the file.
  int64_t alignment = 64;
  /// Give every entry zip64 extra fields, even small ones (tests the zip64 paths cheaply).
  bool force_zip64 = false;
};

class ZipWriter {
 public:
  /// Creates the temporary file next to `path`. The directory must exist.
  /// Errors: kIoError (with errno text); kInvalidArgument for an alignment that is not a power
  /// of two in [1, 4096].
  static Result<ZipWriter> Create(const std::filesystem::path& path, ZipWriteOptions options = {});

  ZipWriter(ZipWriter&& o) noexcept;
  ZipWriter& operator=(ZipWriter&&) = delete;
  ZipWriter(const ZipWriter&) = delete;
  /// Removes the temporary file unless Finish succeeded.
  ~ZipWriter();

  /// Appends one stored record named `name`, its data gathered from `pieces` in order (written
  /// straight from the caller's memory, never copied into one buffer).
  /// Errors: kInvalidArgument (duplicate or unsafe name, writer finished); kIoError.
  Status AddRecord(std::string_view name, std::span<const std::span<const std::byte>> pieces);
  Status AddRecord(std::string_view name, std::string_view data);

  /// Writes the central directory and end records, fsyncs, renames into place, fsyncs the dir.
  /// Errors: kIoError; kInvalidArgument when already finished.
  Status Finish();

 private:
  struct Entry {
    std::string name;
    uint64_t offset = 0, size = 0;
    uint32_t crc = 0;
    bool zip64 = false;
  };
  ZipWriter() = default;
  Status WriteRaw(const void* data, size_t n);
  Status Flush();
  Status Buffer(std::string_view bytes);

  std::filesystem::path path_, temp_;
  ZipWriteOptions options_;
  int fd_ = -1;
  uint64_t offset_ = 0;
  std::string buf_;
  std::vector<Entry> entries_;
  std::unordered_set<std::string> names_;
  bool finished_ = false;
};

}  // namespace ucp::torch
