// ZipWriter: writes the zip container torch.load reads (formats.md 1.2, "minimal writer recipe"):
// stored records whose data starts on a 64-byte boundary (padding in an "FB" local extra field),
// real CRC-32s, zip64 records when sizes or offsets need them, and always a zip64 end record, as
// torch's own writer does. The file appears atomically: it is written under a `.tmp-` sibling
// name, fsynced, renamed over the target and its directory fsynced.
//
// A record may also be reserved: its header is written and room left for its data, which is then
// written in pieces, in any order and from many threads (pwrite), each piece checksummed as it
// passes. Finish combines the pieces' CRC-32s in offset order, checks that they tile the record
// exactly, and patches the header. This is how a checkpoint's flat optimizer partitions are
// written from parameter slices as they stream in, without holding a partition in memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
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
  /// Finish fsyncs the file and, after the rename, its directory. False: Finish only starts
  /// writeback, for a file written inside a temporary folder that is fsynced whole before it is
  /// renamed into place (ADR 0004).
  bool sync = true;
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

  /// Appends the header of a stored record of `size` bytes and leaves room for its data, which
  /// WriteReserved writes later. Returns the record's handle for WriteReserved.
  /// Errors: as AddRecord.
  Result<int32_t> ReserveRecord(std::string_view name, uint64_t size);

  /// Writes bytes [offset, offset + data.size()) of reserved record `record` and notes their
  /// CRC-32. Thread-safe (also with itself on the same record) but not with AddRecord,
  /// ReserveRecord or Finish. Pieces must not overlap and must cover the record by Finish.
  /// Errors: kInvalidArgument (no such record, a range outside it, writer finished); kIoError.
  Status WriteReserved(int32_t record, uint64_t offset, std::span<const std::byte> data);

  /// Writes the central directory and end records, fsyncs, renames into place, fsyncs the dir
  /// (without ZipWriteOptions::sync: starts writeback and renames). Reserved records get the
  /// CRC-32 of their pieces in their local header and directory entry.
  /// Errors: kIoError; kInvalidArgument when already finished; kInternal naming the file, record
  /// and byte offset when a reserved record's pieces leave a gap or overlap (a writer bug).
  Status Finish();

 private:
  struct Entry {
    std::string name;
    uint64_t offset = 0, size = 0;  // offset: of the local header
    uint32_t crc = 0;
    bool zip64 = false;
  };
  // A reserved record's data position and the pieces written into it so far.
  struct Reserved {
    size_t entry = 0;
    uint64_t data_offset = 0;
    struct Piece {
      uint64_t offset = 0, size = 0;
      uint32_t crc = 0;
    };
    std::mutex mu;
    std::vector<Piece> pieces;
  };
  Result<Entry> AppendHeader(std::string_view name, uint64_t size, uint32_t crc);
  Status FinishReserved(Reserved& r);
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
  std::vector<std::unique_ptr<Reserved>> reserved_;
  std::unordered_set<std::string> names_;
  bool finished_ = false;
};

}  // namespace ucp::torch
