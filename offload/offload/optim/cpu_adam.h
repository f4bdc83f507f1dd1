// CpuAdam: the multithreaded CPU Adam of the offload engine. It owns a oneTBB arena with the
// caller's thread count and steps one bucket (a sub-group of parameters or fragments) at a time,
// so the engine can step each gradient bucket as it arrives, speculatively if it wants to roll
// the step back once the global gradient norm is known.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "offload/optim/adam.h"
#include "ucp/base/result.h"

namespace ucp::offload {

class CpuAdam {
 public:
  /// Elements per task: 16 Ki fp32 = 64 KiB per stream, 7 streams within a 512 KiB L2.
  static constexpr size_t kBlockElems = size_t{16} << 10;

  /// `cpus` (empty: not pinned): the thread in the pool's slot i runs on cpus[i % size] while it
  /// steps (the caller's thread takes slot 0), and gets its own CPU mask back when it leaves
  /// (cpu_affinity.h; Linux). The bits do not depend on it.
  /// Errors: kInvalidArgument (config, num_threads < 1, a CPU the calling thread may not run
  /// on), kFailedPrecondition (path not available), kUnimplemented (cpus off Linux).
  static Result<CpuAdam> Create(const AdamConfig& config, int num_threads,
                                SimdPath path = BestSimdPath(), std::vector<int> cpus = {});

  CpuAdam(CpuAdam&&) noexcept;
  CpuAdam& operator=(CpuAdam&&) noexcept;
  ~CpuAdam();

  const AdamConfig& config() const;
  /// Sets the learning rate of the next steps (a schedule changes it every step).
  /// Errors: kInvalidArgument (not finite or negative); the rate is unchanged then.
  Status set_lr(float lr);
  int num_threads() const;
  SimdPath path() const;
  const std::vector<int>& cpus() const;  ///< as given to Create (empty: not pinned)

  /// Where one parallel pass of `tasks` tasks ran: each task's ThisThreadCpus, seen from inside
  /// the pool (a pinned pool's tasks each see one CPU of cpus()). For tests and ucp-bench adam.
  /// Errors: kInvalidArgument (tasks < 1), a pinning failure, ThisThreadCpus's.
  Result<std::vector<std::vector<int>>> TaskCpus(int tasks);

  /// Steps every entry of `bucket` with step number `step` (1-based, adam.h), in parallel over
  /// blocks of kBlockElems. Every entry is validated before any is stepped. The result is
  /// bitwise the same for any thread count and any grouping of elements into buckets.
  /// Errors: as AdamStep, with the entry's index in the message; nothing is stepped then.
  Status StepBucket(int64_t step, std::span<const AdamSpans> bucket);

  /// As StepBucket, saving the pre-step state of entry i into snapshots[i] in the same pass.
  /// Errors: as StepBucket and AdamStepSpeculative; kInvalidArgument (snapshot count differs).
  Status StepBucketSpeculative(int64_t step, std::span<const AdamSpans> bucket,
                               std::span<const AdamSnapshot> snapshots);

  /// What StepBucketFused does with snapshots[i]: nothing (empty), save the pre-step state into it
  /// (a speculative step), or read the pre-step state from it (the clip correction).
  enum class SnapshotUse : uint8_t { kNone, kSave, kSource };

  /// AdamStepFused over every entry of `bucket` with gradient multiplier `grad_scale`, in
  /// parallel over blocks as StepBucket; the same bits for any thread count and grouping.
  /// Errors: as AdamStepFused, with the entry's index; kInvalidArgument (snapshot count is not
  /// the bucket's with kSave/kSource, or not 0 with kNone). Nothing is stepped on an error.
  Status StepBucketFused(int64_t step, std::span<const AdamSpans> bucket,
                         std::span<const AdamSnapshot> snapshots, SnapshotUse use,
                         float grad_scale);

  /// Undoes one StepBucketSpeculative bitwise (parallel copy of the snapshots back).
  /// Errors: as AdamRollback, with the entry's index; kInvalidArgument (count differs).
  Status RollbackBucket(std::span<const AdamSpans> bucket, std::span<const AdamSnapshot> snapshots);

  /// The memory-bandwidth probe: Adam's streams (read p, g, m, v; write p, m, v in place), with
  /// the same threads, blocks and vector width, and no arithmetic to speak of. Values are
  /// unchanged (it adds 0 * x). For ucp-bench adam.
  /// Errors: kInvalidArgument (sizes differ).
  Status BandwidthProbe(std::span<float> p, std::span<const float> g, std::span<float> m,
                        std::span<float> v);

 private:
  struct Impl;
  explicit CpuAdam(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::offload
