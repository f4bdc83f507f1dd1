// ReadVerifier: per record, the hashed pieces (combinable checksums) or the hash frontier (XXH3).
#include "ucp/io/read_verifier.h"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>

#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/checksum.h"

namespace ucp::io {

namespace {
constexpr int64_t kPieceBytes = int64_t{4} << 20;
}  // namespace

struct ReadVerifier::Counters {
  std::atomic<int64_t> observed{0};
  std::atomic<int64_t> reread{0};
};

struct ReadVerifier::Record {
  bool combinable = false;
  int64_t size = 0;
  uint64_t expected = 0;
  Combinable fn;
  std::string mismatch;
  Reader reader;

  std::mutex mu;
  bool done = false;
  Status result;
  // Combinable: the hashed pieces, begin -> (end, hash), disjoint and never adjacent (adjacent
  // pieces are combined as they meet, so a record read in order is one piece).
  struct Piece {
    int64_t end;
    uint64_t hash;
  };
  std::map<int64_t, Piece> pieces;
  // XXH3: bytes [0, frontier) are in `hasher`.
  int64_t frontier = 0;
  std::unique_ptr<Xxh3Hasher> hasher;

  // Adds [a, b) with hash h; [a, b) overlaps no piece. Requires mu.
  void InsertDisjoint(int64_t a, int64_t b, uint64_t h) {
    auto next = pieces.lower_bound(a);
    auto cur = pieces.end();
    if (next != pieces.begin()) {
      auto prev = std::prev(next);
      if (prev->second.end == a) {
        prev->second.hash = fn.combine(prev->second.hash, h, b - a);
        prev->second.end = b;
        cur = prev;
      }
    }
    if (cur == pieces.end()) cur = pieces.emplace(a, Piece{b, h}).first;
    if (next != pieces.end() && next->first == cur->second.end) {
      cur->second.hash =
          fn.combine(cur->second.hash, next->second.hash, next->second.end - next->first);
      cur->second.end = next->second.end;
      pieces.erase(next);
    }
  }
  // The ranges of [a, b) no piece covers. Requires mu.
  std::vector<std::pair<int64_t, int64_t>> Gaps(int64_t a, int64_t b) const {
    std::vector<std::pair<int64_t, int64_t>> gaps;
    int64_t cursor = a;
    auto it = pieces.upper_bound(a);
    if (it != pieces.begin()) --it;
    for (; it != pieces.end() && it->first < b; ++it) {
      if (it->second.end <= cursor) continue;
      if (it->first > cursor) gaps.emplace_back(cursor, it->first);
      cursor = std::max(cursor, it->second.end);
    }
    if (cursor < b) gaps.emplace_back(cursor, b);
    return gaps;
  }
  bool Complete() const {
    if (!combinable) return frontier == size;
    return size == 0 ? false
                     : pieces.size() == 1 && pieces.begin()->first == 0 &&
                           pieces.begin()->second.end == size;
  }
  // Compares the finished hash. Requires mu and Complete() (or size 0).
  Status Compare() {
    uint64_t h;
    if (combinable) {
      h = size == 0 ? fn.hash({}, 0) : pieces.begin()->second.hash;
    } else {
      h = hasher->Digest();
    }
    done = true;
    pieces.clear();
    hasher.reset();
    result = h == expected ? Status::Ok() : DataLossError(mismatch);
    return result;
  }
};

ReadVerifier::ReadVerifier() : counters_(std::make_unique<Counters>()) {}
ReadVerifier::~ReadVerifier() = default;

int32_t ReadVerifier::AddCombinable(int64_t size, uint64_t expected, Combinable hash,
                                    std::string mismatch, Reader reader) {
  auto r = std::make_unique<Record>();
  r->combinable = true;
  r->size = size;
  r->expected = expected;
  r->fn = hash;
  r->mismatch = std::move(mismatch);
  r->reader = std::move(reader);
  records_.push_back(std::move(r));
  return static_cast<int32_t>(records_.size() - 1);
}

int32_t ReadVerifier::AddXxh3(int64_t size, uint64_t expected, std::string mismatch,
                              Reader reader) {
  auto r = std::make_unique<Record>();
  r->size = size;
  r->expected = expected;
  r->mismatch = std::move(mismatch);
  r->reader = std::move(reader);
  r->hasher = std::make_unique<Xxh3Hasher>();
  records_.push_back(std::move(r));
  return static_cast<int32_t>(records_.size() - 1);
}

int32_t ReadVerifier::num_records() const { return static_cast<int32_t>(records_.size()); }
int64_t ReadVerifier::record_size(int32_t record) const { return records_[record]->size; }
int64_t ReadVerifier::bytes_observed() const { return counters_->observed.load(); }
int64_t ReadVerifier::bytes_reread() const { return counters_->reread.load(); }

int64_t ReadVerifier::bytes_pending() const {
  int64_t total = 0;
  for (const auto& r : records_) {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->done) continue;
    if (!r->combinable) {
      total += r->size - r->frontier;
      continue;
    }
    for (const auto& [a, b] : r->Gaps(0, r->size)) total += b - a;
  }
  return total;
}

Status ReadVerifier::FirstFailure() const {
  for (const auto& r : records_) {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->done && !r->result.ok()) return r->result;
  }
  return Status::Ok();
}

Status ReadVerifier::Observe(int32_t record, int64_t offset, std::span<const std::byte> bytes) {
  if (record < 0 || record >= num_records()) {
    return OutOfRangeError("checksummed record " + std::to_string(record) + " of " +
                           std::to_string(num_records()));
  }
  Record& r = *records_[record];
  const int64_t n = static_cast<int64_t>(bytes.size());
  if (offset < 0 || offset > r.size || n > r.size - offset) {
    return OutOfRangeError("bytes [" + std::to_string(offset) + ", " + std::to_string(offset + n) +
                           ") are outside the checksummed record of " + std::to_string(r.size) +
                           " bytes (" + r.mismatch + ")");
  }
  if (n == 0) return Status::Ok();
  if (!r.combinable) {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.done) return r.result;
    if (offset > r.frontier || offset + n <= r.frontier) return Status::Ok();
    const int64_t skip = r.frontier - offset;
    r.hasher->Update(bytes.subspan(static_cast<size_t>(skip)));
    counters_->observed += n - skip;
    r.frontier = offset + n;
    return r.Complete() ? r.Compare() : Status::Ok();
  }
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.done) return r.result;
  }
  // Hash outside the lock: the threads reading one big record (a flat fp32 partition) hash
  // their pieces in parallel and only the combining is serialized.
  const uint64_t h = r.fn.hash(bytes, 0);
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.done) return r.result;
  const auto gaps = r.Gaps(offset, offset + n);
  if (gaps.size() == 1 && gaps[0].first == offset && gaps[0].second == offset + n) {
    r.InsertDisjoint(offset, offset + n, h);
    counters_->observed += n;
  } else {
    // Overlaps bytes already hashed (a range read twice): hash only the new ones.
    for (const auto& [a, b] : gaps) {
      const auto sub = bytes.subspan(static_cast<size_t>(a - offset), static_cast<size_t>(b - a));
      r.InsertDisjoint(a, b, r.fn.hash(sub, 0));
      counters_->observed += b - a;
    }
  }
  return r.Complete() ? r.Compare() : Status::Ok();
}

Status ReadVerifier::Finish(int32_t record) {
  if (record < 0 || record >= num_records()) {
    return OutOfRangeError("checksummed record " + std::to_string(record) + " of " +
                           std::to_string(num_records()));
  }
  Record& r = *records_[record];
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.done) return r.result;
  const auto gaps = r.combinable ? r.Gaps(0, r.size)
                                 : std::vector<std::pair<int64_t, int64_t>>{{r.frontier, r.size}};
  std::vector<std::byte> buf;
  for (const auto& [a, b] : gaps) {
    if (a >= b) continue;
    buf.resize(static_cast<size_t>(std::min(kPieceBytes, b - a)));
    uint64_t h = 0;
    for (int64_t at = a; at < b;) {
      const int64_t n = std::min(kPieceBytes, b - at);
      const std::span<std::byte> piece(buf.data(), static_cast<size_t>(n));
      UCP_RETURN_IF_ERROR(r.reader(at, piece));
      if (r.combinable) {
        h = r.fn.hash(piece, h);
      } else {
        r.hasher->Update(piece);
      }
      counters_->reread += n;
      progress::AddBytes(n);
      at += n;
    }
    if (r.combinable) {
      r.InsertDisjoint(a, b, h);
    } else {
      r.frontier = b;
    }
  }
  return r.Compare();
}

}  // namespace ucp::io
