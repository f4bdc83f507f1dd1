// ReadVerifier: checks the checksums of a source's records (zip records, datasets) from the
// bytes a conversion reads anyway, so a verified conversion reads each source byte once
// (issue 14) instead of a checksum pass followed by the conversion's own reads.
//
// A record is a byte range [0, size) with one stored checksum. Observe() is handed the bytes of
// every read as it returns; a record whose checksum can be combined from pieces (CRC-32) takes
// them in any order and from many threads, a record hashed in order only (XXH3) takes the bytes
// that continue where its hash stopped and leaves the rest for Finish(). A record is compared
// as soon as its last byte has been hashed (the read that completes it fails on a mismatch);
// Finish() reads and hashes only the ranges no read covered (padding, states the plan does not
// need, bytes read out of order) and compares what is left. A conversion commits its output
// only after Finish() of every record passed, so a corrupt byte anywhere still leaves no output.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ucp/base/status.h"

namespace ucp::io {

class ReadVerifier {
 public:
  /// A checksum that can be computed piecewise: hash(bytes, seed) continues `seed` over bytes
  /// (seed 0 starts), combine(h_a, h_b, len_b) is the hash of A followed by B (CRC-32).
  struct Combinable {
    uint64_t (*hash)(std::span<const std::byte> bytes, uint64_t seed) = nullptr;
    uint64_t (*combine)(uint64_t h_a, uint64_t h_b, int64_t len_b) = nullptr;
  };
  /// Reads bytes [offset, offset + out.size()) of a record (for Finish).
  using Reader = std::function<Status(int64_t offset, std::span<std::byte> out)>;

  ReadVerifier();
  ~ReadVerifier();
  ReadVerifier(const ReadVerifier&) = delete;
  ReadVerifier& operator=(const ReadVerifier&) = delete;

  /// Adds a record checked with a combinable checksum. `mismatch` is the whole error message a
  /// wrong checksum gives (naming file and record). Not thread-safe: add every record before
  /// the reads start. Returns the record's index.
  int32_t AddCombinable(int64_t size, uint64_t expected, Combinable hash, std::string mismatch,
                        Reader reader);
  /// Adds a record checked with XXH3-64 (seed 0), which is hashed in order only.
  int32_t AddXxh3(int64_t size, uint64_t expected, std::string mismatch, Reader reader);

  int32_t num_records() const;
  int64_t record_size(int32_t record) const;

  /// Bytes [offset, offset + bytes.size()) of `record`, as a read returned them. Thread-safe.
  /// Errors: kDataLoss (the record's mismatch message) when these bytes complete the record and
  /// its checksum differs, and every later call for a record that failed; kOutOfRange for a
  /// range outside the record (a caller bug).
  Status Observe(int32_t record, int64_t offset, std::span<const std::byte> bytes);

  /// Reads the bytes of `record` that Observe did not hash (through its Reader, in pieces of
  /// at most 4 MiB) and compares its checksum. Thread-safe across records.
  /// Errors: kDataLoss (the mismatch message), the Reader's errors.
  Status Finish(int32_t record);

  /// The mismatch of the first record (in record order) already found corrupt, or Ok.
  Status FirstFailure() const;

  /// Bytes hashed from Observe, and bytes Finish read.
  int64_t bytes_observed() const;
  int64_t bytes_reread() const;
  /// Bytes Finish would still read (not yet hashed), over all records.
  int64_t bytes_pending() const;

 private:
  struct Record;
  std::vector<std::unique_ptr<Record>> records_;
  struct Counters;
  std::unique_ptr<Counters> counters_;
};

}  // namespace ucp::io
