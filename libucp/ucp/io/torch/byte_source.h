// ByteSource: random-access reads of a file (pread) or of an in-memory buffer (the fuzzer), with
// every read bounds-checked against the size, so a reader never trusts an offset it parsed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "ucp/base/result.h"
#include "ucp/base/status.h"
#include "ucp/io/raw_file.h"

namespace ucp::torch {

class ByteSource {
 public:
  /// Opens a regular file for pread.
  /// Errors: kNotFound (missing), kIoError (open or fstat failed, not a regular file).
  static Result<std::shared_ptr<const ByteSource>> OpenFile(const std::filesystem::path& path);
  /// Wraps a copy of `bytes`; `name` stands for the file name in messages.
  static std::shared_ptr<const ByteSource> FromBuffer(std::span<const std::byte> bytes,
                                                      std::string name);

  ~ByteSource();
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;

  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }

  /// Fills `out` from `offset`.
  /// Errors: kDataLoss when [offset, offset + out.size()) is not inside the file (naming the file,
  /// both numbers and the file size); kIoError when pread fails.
  Status ReadAt(int64_t offset, std::span<std::byte> out) const;
  /// Checks that the file is still the one opened (device, inode, size, mtime); Ok for a buffer.
  /// Errors: kDataLoss naming the file and what changed (io::CheckFileUnchanged); kIoError.
  Status CheckUnchanged() const;

  /// ReadAt into a new string of `n` bytes.
  Result<std::string> ReadString(int64_t offset, int64_t n) const;

 private:
  ByteSource() = default;
  int fd_ = -1;
  io::FileIdentity identity_;  // at open, for a file
  std::string buffer_;
  int64_t size_ = 0;
  std::string name_;
};

/// CRC-32 (ISO-HDLC, the zip checksum) of `bytes`, continuing from `crc` (0 to start).
/// Eight bytes per step (slicing-by-8, about 4x the byte loop), as checksums of whole
/// checkpoints are on the critical path of a verified conversion.
uint32_t Crc32(std::span<const std::byte> bytes, uint32_t crc = 0);
/// The byte-at-a-time reference Crc32 is tested against.
uint32_t Crc32Reference(std::span<const std::byte> bytes, uint32_t crc = 0);
/// The CRC-32 of A followed by B from crc_a = Crc32(A), crc_b = Crc32(B) and len_b = |B| in
/// bytes, without B's bytes: writers that receive a record's bytes out of order (from many
/// threads) checksum each piece as it passes and combine the pieces in offset order at the end.
/// O(log len_b) multiplications in GF(2)[x] modulo the CRC polynomial.
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, int64_t len_b);

}  // namespace ucp::torch
