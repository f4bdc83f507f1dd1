// The file executor: runs a convert::Plan between any tensor source and any tensor sink (the
// per-rank format, the universal format, a trainer's memory). Target tensors are processed in
// parallel with oneTBB, each in windows of at most a few MiB that are built from the ops
// clipped to the window and streamed to the sink in order; each op reads only the elements its
// box needs (a row at a time, or its flat span when that is cheaper), so peak memory is a few
// windows per thread, whatever the size of the tensors or the checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/convert/plan.h"
#include "ucp/tensor/tensor.h"

namespace ucp::exec {

/// Where the plan's source tensors are read from. Must be safe to call from many threads.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  /// Reads elements [begin, end) of the row-major flattening of `tensor` (in tensor.dtype) into
  /// `out`, which holds exactly (end - begin) elements.
  /// Errors: whatever the format reports (kNotFound, kDataLoss, kOutOfRange, kIoError).
  virtual Status ReadFlatRange(const convert::TensorInfo& tensor, int64_t begin, int64_t end,
                               std::span<std::byte> out) const = 0;
  /// Reads `rows` pieces of `row_len` elements, piece i being elements [begin + i * stride,
  /// begin + i * stride + row_len) of the flattening, packed into `out` (rows * row_len
  /// elements): the rows of a transposed copy. The default reads each piece by ReadFlatRange; a
  /// source that can serve the pieces from memory overrides it to pay its lookups once.
  /// Errors: as ReadFlatRange.
  virtual Status ReadRows(const convert::TensorInfo& tensor, int64_t begin, int64_t stride,
                          int64_t rows, int64_t row_len, std::span<std::byte> out) const;
  /// Checks that the files read are still those first read (size, mtime, inode: see
  /// io::RawFileCache::CheckUnchanged, UniversalReader/DistReader::CheckSourcesUnchanged,
  /// TorchFile::CheckSourceUnchanged). ExecutePlan calls it once after the last read, before it
  /// returns and its caller commits. The default (a source with no files) is Ok.
  /// Errors: kDataLoss naming the file that changed during the run.
  virtual Status CheckUnchanged() const { return Status::Ok(); }
};

/// Where target tensors go, streamed window by window. Must be safe to call from many threads
/// for different tensors. The calls for one tensor come from one thread at a time and in order:
/// Begin, then WriteRange for consecutive element ranges that cover [0, elements) in increasing
/// order (none for an empty tensor), then Finish; a sink may hash or append as data arrives.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  /// Errors: whatever the format reports.
  virtual Status Begin(const convert::TensorInfo& tensor) {
    (void)tensor;
    return Status::Ok();
  }
  /// Elements [begin, end) of the tensor's row-major flattening, in tensor.dtype.
  /// Errors: whatever the format reports.
  virtual Status WriteRange(const convert::TensorInfo& tensor, int64_t begin, int64_t end,
                            std::span<const std::byte> data) = 0;
  /// Errors: whatever the format reports.
  virtual Status Finish(const convert::TensorInfo& tensor) {
    (void)tensor;
    return Status::Ok();
  }
};

struct ExecOptions {
  /// Upper bound on the bytes of buffers in flight (windows, read scratch); 0: unbounded. Sets
  /// the window size (a quarter of the budget per thread, between 64 KiB and 1 MiB, so that a
  /// window stays in cache while it is read, checked and written) and holds back new targets
  /// while spent.
  int64_t memory_limit_bytes = int64_t{512} << 20;
  /// Bytes per window; 0 derives it from memory_limit_bytes and the thread count.
  int64_t window_bytes = 0;
  /// Only these target indices (empty: all). Check ops always run for the params they touch.
  std::vector<int32_t> targets;
  /// Run kCheckEqual ops (replicated copies agree bitwise).
  bool run_checks = true;
  /// Called after each finished target with (done, total); from any thread.
  std::function<void(int64_t, int64_t)> progress;
  /// The phase the run announces with its bytes to the progress counters (base/progress.h);
  /// empty: the caller's phase stays (a run that only compares copies).
  std::string phase = "convert";
};

struct ExecStats {
  int64_t targets_written = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t peak_in_flight_bytes = 0;
};

/// A plan with its ops indexed by target: what the window builder works from. Building it
/// reads every op once.
class PlanIndex {
 public:
  explicit PlanIndex(const convert::Plan& plan);
  const convert::Plan& plan() const { return plan_; }
  /// The copy, fill and average ops writing `target`, in plan order.
  const std::vector<const convert::Op*>& OpsOf(int32_t target) const { return by_target_[target]; }
  /// The kCheckEqual ops.
  const std::vector<const convert::Op*>& checks() const { return checks_; }

 private:
  const convert::Plan& plan_;
  std::vector<std::vector<const convert::Op*>> by_target_;
  std::vector<const convert::Op*> checks_;
};

/// Builds target `target` window by window: calls fn(begin, end, bytes) for consecutive element
/// ranges covering the target in order, each at most max(window_bytes, one element) long. The
/// bytes are valid during the call only.
/// Errors: as TensorSource, fn's, kInvalidArgument (an op outside its tensor's bounds: a plan bug
/// surfaced as an error), kInternal (ops that leave part of the target unwritten), kUnimplemented
/// (average of a non-floating dtype), cast errors.
Status StreamTarget(const PlanIndex& index, int32_t target, const TensorSource& source,
                    int64_t window_bytes,
                    const std::function<Status(int64_t, int64_t, std::span<const std::byte>)>& fn);

/// Builds elements [begin, end) of target `target` into `out` (exactly that many elements of
/// the target's dtype).
/// Errors: kOutOfRange (no such target or range), kInvalidArgument (size of out), as
/// StreamTarget.
Status BuildTargetRange(const PlanIndex& index, int32_t target, const TensorSource& source,
                        int64_t begin, int64_t end, std::span<std::byte> out);

/// Builds target tensor `target` of `plan` whole, in memory (tests, small tensors).
/// Errors: kOutOfRange (no such target), as StreamTarget.
Result<Tensor> MaterializeTarget(const convert::Plan& plan, int32_t target,
                                 const TensorSource& source);

/// Runs the plan: every (selected) target is streamed to `sink`; check ops are verified. Stops
/// at the first error (no further targets are started).
/// Errors: as StreamTarget and the sink; kDataLoss "parameter \"X\" state \"S\":
/// replicated copies differ at element E" for a failed check; kDataLoss from
/// source.CheckUnchanged() when a source file changed during the run.
Result<ExecStats> ExecutePlan(const convert::Plan& plan, const TensorSource& source,
                              TensorSink& sink, const ExecOptions& options = {});

/// Limits the worker threads of every executor run while alive (0: the hardware default).
class ScopedThreadLimit {
 public:
  explicit ScopedThreadLimit(int threads);
  ~ScopedThreadLimit();
  ScopedThreadLimit(const ScopedThreadLimit&) = delete;
  ScopedThreadLimit& operator=(const ScopedThreadLimit&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Peak resident memory of this process so far, in bytes (getrusage ru_maxrss).
int64_t PeakRssBytes();

/// Parses "512M", "2G", "1048576", "64K" (binary units). Errors: kInvalidArgument.
Result<int64_t> ParseByteSize(std::string_view text);

}  // namespace ucp::exec
