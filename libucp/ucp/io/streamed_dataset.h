// The pieces the HDF5 formats share for moving dataset bytes straight to and from files
// (io/raw_file.h): a dataset being filled in order with its running checksum, and the checksum
// of a stored dataset read back in bounded pieces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>

#include "ucp/base/result.h"
#include "ucp/base/status.h"
#include "ucp/io/checksum.h"
#include "ucp/io/raw_file.h"

namespace ucp::io {

/// One dataset whose bytes are written in order, each range starting where the last ended, at
/// `offset` in its file; XXH3 of its contents is computed as they arrive. Thread-safe (one
/// range at a time).
class StreamedDataset {
 public:
  /// `what` names the dataset in errors ("tensor \"x\" of rank_00001.h5"); `offset` is unused
  /// when num_elems is 0.
  StreamedDataset(std::string what, int64_t offset, int64_t num_elems, int64_t elem_bytes);

  /// Writes elements [begin_elem, begin_elem + data.size() / elem_bytes) into `file`.
  /// Errors: kAlreadyExists (already complete), kInvalidArgument (not where the last range
  /// ended, past the end, not whole elements), errors of RawFile::WriteAt.
  Status Append(RawFile& file, int64_t begin_elem, std::span<const std::byte> data);

  bool complete() const;
  int64_t elements_written() const;
  int64_t num_elems() const { return num_elems_; }
  /// "xxh3-64:..." of the whole contents; only meaningful once complete.
  std::string checksum() const;

 private:
  std::string what_;
  int64_t offset_;
  int64_t num_elems_;
  int64_t elem_bytes_;
  mutable std::mutex mu_;
  int64_t next_ = 0;
  Xxh3Hasher hasher_;
};

/// XXH3-64 of bytes [offset, offset + num_bytes) of `file`, read in pieces of at most
/// `piece_bytes` through a buffer that is grown once.
/// Errors: as RawFile::ReadAt.
Result<uint64_t> HashFileRange(const RawFile& file, int64_t offset, int64_t num_bytes,
                               int64_t piece_bytes = int64_t{4} << 20);

}  // namespace ucp::io
