// The offloaded optimizer pipeline (issue 12; docs/offload.md, "The pipeline (CPU twin)").
//
// Gradients live on the device; fp32 masters and Adam states on the host. Backward completes the
// gradients bucket by bucket (a bucket is one grad group of the model: a layer, the head or the
// embeddings, so a whole optimizer sub-group aligned to layers). As soon as a bucket is complete:
//   1. the copy stream moves it host-ward (fp32, or cast to bf16 to model a narrow link) and
//      checks it is finite (fp16: also within fp16's range);
//   2. the CPU Adam steps it SPECULATIVELY, with the gradient multiplier known before backward
//      (1 / loss_scale) folded in, saving the pre-step state into a snapshot in the same pass; a
//      bucket that failed the check is never stepped (deferred to validation);
// while backward goes on. The last `gpu_tail_buckets` buckets (the first layers and the
// embeddings, which backward finishes last) stay on the device and are stepped after backward.
// Once the global gradient norm and the overflow check are known (validation), Finish:
//   - commits (the final multiplier equals the speculative one: nothing to do);
//   - corrects for clipping in ONE fused pass per bucket (AdamStepFused reading the snapshot with
//     the final multiplier): bitwise the direct clipped step, so the correction has no error;
//   - or undoes the step exactly for an overflow (the snapshot copied back, bitwise).
// Then the updated low-precision weights go device-ward (StartFinish: bucket by bucket on the
// Adam thread, in forward's order, while the next step's forward waits for each as it reaches it).
// So the pipeline's training is bitwise the synchronous trainer's (tested over steps, GPT and
// LLaMA, bf16 and fp16, clipping on).
//
// Backends: the stages' data movement is behind PipelineBackend. CpuPipelineBackend ("the CPU
// twin") uses host buffers as device memory and the pipeline's threads as streams; a CUDA backend
// implements the same calls with async copies on a copy stream and events.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "offload/engine/trace.h"
#include "offload/model/model.h"
#include "offload/optim/adam.h"
#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload {

/// Elements [grad_offset, grad_offset + n) of the device gradient (and weights), model order, are
/// elements [state_offset, state_offset + n) of the host optimizer state.
struct BucketPiece {
  int64_t grad_offset = 0;
  int64_t state_offset = 0;
  int64_t n = 0;
};

/// A unit of reduction, transfer and optimizer step.
struct Bucket {
  std::string name;
  std::vector<BucketPiece> pieces;
  int index = -1;  ///< its place in the pipeline's buckets (set by Pipeline::Create)
};

/// The memory the pipeline steps (caller-owned, kept alive while the pipeline lives).
struct PipelineMemory {
  std::span<const float> d_grad;  ///< device gradients, model order
  std::span<uint16_t> d_weights;  ///< device bf16/fp16 weights, model order; empty for fp32
  std::span<float> h_master;      ///< host fp32 masters, state order
  std::span<float> h_exp_avg;
  std::span<float> h_exp_avg_sq;
  /// Data parallelism (docs/offload.md, "Data parallelism in the pipeline"): the host gradient in
  /// state order, filled by the caller with each bucket's gradient reduced over the ranks. When
  /// set, buckets come in through HostBucketReady (no copy stage, no tail buckets, no bf16 link).
  std::span<const float> h_reduced_grad;
  /// Optional host staging in the caller's memory, in the device's order (element i is
  /// d_grad's element i) and of its size: a device trainer's pinned buffers, which it reads in
  /// its own order (the gradient for the global norm once WaitGradients returns; the updated
  /// weights for checkpoints once Finish returns). Empty: the pipeline's own buffers, state
  /// order. `h_grad` is where the copy stage writes fp32 gradients (not with bf16_link or
  /// h_reduced_grad); `h_weights` where the Adam writes the updated low-precision weights.
  std::span<float> h_grad;
  std::span<uint16_t> h_weights;
};

struct PipelineOptions {
  AdamConfig adam;
  int adam_threads = 1;       ///< the CPU Adam's worker pool
  std::vector<int> adam_cpus;  ///< pins the pool (CpuAdam::Create's cpus); empty: not pinned
  int gpu_tail_buckets = 0;   ///< the buckets backward completes last that stay on the device
  /// The tail buckets are stepped by the caller (a device Adam on device-resident state), after
  /// Finish: their gradients still cross (the caller's global norm reads them; this needs the
  /// caller's h_grad) but the pipeline neither steps them nor sends their weights back.
  /// Otherwise the CPU Adam steps them in place after validation, standing in for a GPU Adam
  /// (host-addressable "device" memory only).
  bool tail_stepped_by_caller = false;
  bool bf16_link = false;     ///< gradients cross the link as bf16 (RNE): not bitwise the sync path
  /// false: no speculative step; a bucket's Adam waits for validation, which steps it with the
  /// final multiplier (the gradients still cross during backward). No snapshots (12 B per state
  /// element less host memory); with StartFinish the whole Adam runs under the next forward.
  bool speculate = true;
  LowpDType weights = LowpDType::kBf16;  ///< training dtype (kFp32: no low-precision copy)
  bool fp16_range_check = false;         ///< a |gradient| > 65504 is an overflow (fp16 training)
  TraceRecorder* trace = nullptr;        ///< optional, not owned
  /// Optional: called on the copy stage's thread once bucket k's gradient has crossed into
  /// memory.h_grad (model order; not with bf16_link or h_reduced_grad), before WaitGradients can
  /// return. The trainer starts the gradient norm's sums there while backward goes on. It must
  /// not block: the next bucket's copy waits for it.
  std::function<void(int)> on_grad_landed;
};

/// What validation decided for the step (Pipeline::Finish).
struct Validation {
  bool skip = false;        ///< overflow: undo every speculative step, update nothing
  float grad_scale = 1.0f;  ///< the final gradient multiplier (1 / loss_scale x clip factor)
};

/// What the last step did, per bucket kind (for logs and tests).
struct PipelineStats {
  int speculated = 0;   ///< stepped during backward
  int committed = 0;    ///< speculative steps kept as they were
  int corrected = 0;    ///< speculative steps re-taken from the snapshot (clipping)
  int rolled_back = 0;  ///< speculative steps undone (overflow)
  int deferred = 0;     ///< buckets with a non-finite (or fp16-overflowing) gradient: not stepped
  int device = 0;       ///< tail buckets stepped on the device after validation
  int held = 0;  ///< not speculated (speculation off, or not this step): stepped after it
};

/// The data movement of the stages. Each call handles one bucket and returns when it is done (on
/// a GPU: when the copy stream has finished it). A failed transfer (a CUDA error) is an error of
/// the step: Finish returns it, and the bucket is never stepped.
class PipelineBackend {
 public:
  virtual ~PipelineBackend() = default;
  /// Gradient device -> host: the bucket's pieces of `d_grad` into `h_grad` (fp32) or `h_grad16`
  /// (bf16 bits, RNE) at their state offsets. Returns whether every value is finite (and, with
  /// `fp16_range`, at most 65504 in magnitude).
  virtual Result<bool> GradToHost(const Bucket& bucket, std::span<const float> d_grad,
                                  std::span<float> h_grad, std::span<uint16_t> h_grad16,
                                  bool fp16_range) = 0;
  /// Weights host -> device: the bucket's pieces of `h_out` (state order) into `d_weights`.
  virtual Status WeightsToDevice(const Bucket& bucket, std::span<const uint16_t> h_out,
                                 std::span<uint16_t> d_weights) = 0;
  /// Whether the host can read and write the "device" spans (the CPU twin). When not, the tail
  /// buckets (stepped by the CPU Adam in place, standing in for a GPU Adam) and fp32 training
  /// (whose device weights are the host masters) are refused by Pipeline::Create.
  virtual bool host_addressable() const { return true; }
};

/// The CPU twin's backend: plain copies between host buffers.
std::unique_ptr<PipelineBackend> CpuPipelineBackend();

class Pipeline {
 public:
  /// `buckets` in the order backward completes them; their pieces must lie inside the memory's
  /// spans and not overlap. Starts the copy-stream and Adam threads.
  /// Errors: kInvalidArgument (a piece out of range, options), kResourceExhausted.
  static Result<std::unique_ptr<Pipeline>> Create(const PipelineOptions& options,
                                                  std::vector<Bucket> buckets,
                                                  const PipelineMemory& memory,
                                                  std::unique_ptr<PipelineBackend> backend);
  ~Pipeline();

  const std::vector<Bucket>& buckets() const;
  /// The CPU Adam's pool: its threads and the CPUs it is pinned to (empty: not pinned).
  int adam_threads() const;
  const std::vector<int>& adam_cpus() const;

  /// Starts a step: its 1-based optimizer step number, learning rate, and the gradient multiplier
  /// known before backward (1 / loss_scale). `speculate` false: this step's buckets are held
  /// for validation as without PipelineOptions::speculate (the same bits; a caller that expects
  /// the step to be clipped saves the speculative pass and its correction). Waits for a finish
  /// in flight (StartFinish) first.
  /// Errors: kFailedPrecondition (a step in flight), kInvalidArgument (lr), that finish's.
  Status Begin(int64_t step, float lr, float speculative_grad_scale, bool speculate = true);
  /// Bucket k's gradient is complete on the device: hand it to the copy stream. Non-blocking.
  void BucketReady(int k);
  /// A BackwardHook that calls BucketReady for grad group k (buckets built one per grad group)
  /// and records forward/backward events in the trace.
  BackwardHook Hook();
  /// The same hook, but bucket k's hand-over is `ready(k)` (the caller reduces it first and then
  /// calls HostBucketReady). Called on the thread that runs backward.
  BackwardHook Hook(std::function<void(int)> ready);
  /// Bucket k's gradient is in memory.h_reduced_grad (reduced over the ranks); `finite`: every
  /// value is finite (fp16: and within its range). Hands it straight to the Adam stage;
  /// non-blocking, any thread.
  void HostBucketReady(int k, bool finite);
  /// Waits until every bucket handed to the copy stage (BucketReady) has crossed to the host, so
  /// the host gradient staging is complete (the CPU Adam may still be stepping). Returns the
  /// first failed transfer (the step must then be cancelled). Any thread but the stages'.
  Status WaitGradients();
  /// Waits for every bucket, then commits, corrects or undoes (see the file comment) and moves
  /// the updated weights device-ward. Every bucket must have been handed over (BucketReady).
  /// Errors: kFailedPrecondition (no step begun; a bucket never handed over), the Adam's errors.
  Status Finish(const Validation& validation);
  /// Finish under the next step's forward: decides as Finish does (an overflow's undo runs
  /// here, and the stats are final when this returns), then hands each bucket's commit,
  /// correction or deferred step and its weights' trip device-ward to the Adam thread, in the
  /// order forward needs them (the last bucket first: the embeddings, then the first layers), and
  /// returns. The caller waits for a bucket with WaitFinished(k) before its forward reads the
  /// bucket's weights; the next Begin waits for all of them. The same bits as Finish.
  /// Errors: as Finish's (a bucket's failure comes from WaitFinished).
  Status StartFinish(const Validation& validation);
  /// Waits until bucket k's final weights are on the device; at once when no finish is in flight.
  /// Errors: the first failure of the finish in flight (it then undoes nothing: the step's state
  /// is partly updated, and the run must stop, as after a failed Finish).
  Status WaitFinished(int k);
  /// Whether WaitFinished(k) would return OK at once (bucket k's final weights are on the
  /// device, or no finish is in flight); false while it is in flight or if it failed. Never
  /// blocks: a forward looking one group ahead (a streamed device's prefetch) asks it.
  bool IsFinished(int k) const;
  /// Waits for every bucket of the finish in flight (a no-op without one).
  Status WaitFinished();
  /// Abandons the step in flight (backward failed): waits for the stages and undoes every
  /// speculative step. A no-op without a step in flight.
  Status Cancel();

  PipelineStats last_stats() const;
  /// The bytes of the pipeline's own host buffers (snapshots, gradient and weight staging).
  int64_t host_staging_bytes() const;

 private:
  struct Impl;
  explicit Pipeline(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::offload
