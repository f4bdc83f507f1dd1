// The file executor: runs a convert::Plan between any tensor source and any tensor sink (the
// per-rank format, the universal format, a trainer's memory). Target tensors are processed in
// parallel with oneTBB; each op reads only the flat element range its box spans (HDF5
// hyperslabs underneath), and a byte budget bounds the buffers alive at once, so peak memory is
// a few of the largest target tensors, not the checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
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
};

/// Where finished target tensors go. Must be safe to call from many threads.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  /// Takes one complete target tensor (dtype and shape as in `tensor`).
  /// Errors: whatever the format reports.
  virtual Status Write(const convert::TensorInfo& tensor, Tensor data) = 0;
};

struct ExecOptions {
  /// Upper bound on the bytes of buffers in flight (targets plus source reads); 0: unbounded.
  /// A single tensor larger than the budget still runs, alone.
  int64_t memory_limit_bytes = int64_t{512} << 20;
  /// Only these target indices (empty: all). Check ops always run for the params they touch.
  std::vector<int32_t> targets;
  /// Run kCheckEqual ops (replicated copies agree bitwise).
  bool run_checks = true;
  /// Called after each finished target with (done, total); from any thread.
  std::function<void(int64_t, int64_t)> progress;
};

struct ExecStats {
  int64_t targets_written = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t peak_in_flight_bytes = 0;
};

/// Builds target tensor `target` of `plan` from `source` (zero-initialised, then every op whose
/// dst is `target`, in plan order).
/// Errors: as TensorSource, kInvalidArgument (op out of its tensor's bounds: a plan bug
/// surfaced as an error), kUnimplemented (average of a non-floating dtype), cast errors.
Result<Tensor> MaterializeTarget(const convert::Plan& plan, int32_t target,
                                 const TensorSource& source);

/// Runs the plan: every (selected) target is materialised and handed to `sink`; check ops are
/// verified. Stops at the first error (no further targets are started).
/// Errors: as MaterializeTarget and the sink; kDataLoss "parameter \"X\" state \"S\":
/// replicated copies differ at element E" for a failed check.
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
