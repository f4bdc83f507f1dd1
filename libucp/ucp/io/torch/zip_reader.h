// A strict reader of the zip container torch.save writes (formats.md 1.2): the central directory
// is the truth (torch's local headers carry zero sizes), zip64 is parsed, and every name, count,
// offset and size is checked before it is used. Only stored (method 0) records are read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/io/torch/byte_source.h"

namespace ucp::torch {

struct ZipEntry {
  std::string name;  ///< the full name, "<prefix>/<record>"
  int64_t local_header_offset = 0;
  int64_t data_offset = 0;  ///< where the stored bytes start
  int64_t size = 0;         ///< uncompressed (= stored) bytes
  uint32_t crc32 = 0;       ///< from the central directory; 0 may mean "not recorded"
};

class ZipReader {
 public:
  /// Parses the end records and the central directory, and checks each local header.
  /// Errors: kDataLoss for any structural fault (missing or inconsistent end records, counts that
  /// do not fit the directory, names with "..", absolute names, a name outside the archive's
  /// single prefix, duplicates, records past the directory or overlapping each other, local
  /// headers that disagree with the directory); kUnimplemented for compressed or encrypted
  /// records and multi-disk archives; kIoError from reads.
  static Result<ZipReader> Open(std::shared_ptr<const ByteSource> source);

  /// The text before the first '/' of the first entry ("archive", "model_state_dict", ...).
  const std::string& prefix() const { return prefix_; }
  const std::vector<ZipEntry>& entries() const { return entries_; }
  const ByteSource& source() const { return *source_; }
  std::shared_ptr<const ByteSource> shared_source() const { return source_; }

  /// The entry "<prefix>/<record>", or nullptr.
  const ZipEntry* Find(std::string_view record) const;

  /// Reads a whole record, refusing records over `max_bytes`, and checks its CRC-32 when
  /// `verify_crc` and the directory's CRC is not 0.
  /// Errors: kResourceExhausted (over max_bytes), kDataLoss (CRC mismatch), kIoError.
  Result<std::string> ReadRecord(const ZipEntry& entry, int64_t max_bytes, bool verify_crc) const;

 private:
  std::shared_ptr<const ByteSource> source_;
  std::string prefix_;
  std::vector<ZipEntry> entries_;
  std::unordered_map<std::string, size_t> by_name_;
};

}  // namespace ucp::torch
