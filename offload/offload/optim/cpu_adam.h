// CpuAdam: the multithreaded CPU Adam of the offload engine. It owns a oneTBB arena with the
// caller's thread count and steps one bucket (a sub-group of parameters or fragments) at a time,
// so the engine can step each gradient bucket as it arrives, speculatively if it wants to roll
// the step back once the global gradient norm is known.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "offload/optim/adam.h"
#include "ucp/base/result.h"

namespace ucp::offload {

class CpuAdam {
 public:
  /// Elements per task: 16 Ki fp32 = 64 KiB per stream, 7 streams within a 512 KiB L2.
  static constexpr size_t kBlockElems = size_t{16} << 10;

  /// Errors: kInvalidArgument (config, num_threads < 1), kFailedPrecondition (path not available).
  static Result<CpuAdam> Create(const AdamConfig& config, int num_threads,
                                SimdPath path = BestSimdPath());

  CpuAdam(CpuAdam&&) noexcept;
  CpuAdam& operator=(CpuAdam&&) noexcept;
  ~CpuAdam();

  const AdamConfig& config() const;
  /// Sets the learning rate of the next steps (a schedule changes it every step).
  /// Errors: kInvalidArgument (not finite or negative); the rate is unchanged then.
  Status set_lr(float lr);
  int num_threads() const;
  SimdPath path() const;

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
