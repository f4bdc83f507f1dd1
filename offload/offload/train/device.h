// Where the trainer's forward and backward run (issue 12): the trainer's one code path takes a
// TrainDevice, the way RunGraph takes an ops policy. Without one (RunOptions::device "cpu") the
// CPU model computes on the host buffers as it always did; with one (ucp-train --device cuda,
// offload/cuda/cuda_train_device.h) the device holds the training-dtype weights and computes the
// gradients, which come to the host for the same norm, clipping, CPU Adam on the fp32 masters and
// copy-out, after which the updated weights go back. Everything the checkpoint holds (weights,
// masters, Adam states, client state) stays in host memory, so saves and restores are the CPU
// trainer's, and a checkpoint of one engine resumes on the other.
//
// The trainer library does not link CUDA: the CLI passes a factory (RunOptions::device_factory).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/engine/pipeline.h"
#include "offload/model/model.h"
#include "offload/optim/adam.h"
#include "offload/train/grad_norm.h"
#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload {

/// Elements [model_offset, model_offset + n) of the weights and gradients (model order), which are
/// elements [state_offset, state_offset + n) of the optimizer state in host memory.
struct DevicePiece {
  int64_t model_offset = 0;
  int64_t state_offset = 0;
  int64_t n = 0;
};

/// Model elements [model_offset, model_offset + n) of the gradient are elements
/// [flat_offset, flat_offset + n) of block `block` of the ZeRO flat view (the trainer's pieces).
struct FlatPiece {
  int block = 0;
  int64_t model_offset = 0;
  int64_t flat_offset = 0;
  int64_t n = 0;
};

/// --pipeline overlap with several processes: how one grad group's gradients are reduced as
/// backward completes them (the trainer's bucket exchange; TrainDevice::ExchangeBucketToHost).
/// ZeRO 1-3: the group's pieces of every rank's block, packed in rank order, send_counts[r] of
/// them for rank r; each rank receives sum_n floats (its pieces) from every rank and adds them
/// in rank order. ZeRO-0 (no counts): the group's pieces, packed and all-reduced.
struct BucketExchange {
  struct Range {
    int64_t model_offset = 0;
    int64_t n = 0;
  };
  std::vector<Range> pack;                        ///< from the model's gradient, in this order
  std::vector<int64_t> send_counts, recv_counts;  ///< per rank; empty: ZeRO-0's all-reduce
  int64_t sum_n = 0;                              ///< the result's floats
  int64_t packed() const {
    int64_t n = 0;
    for (const Range& r : pack) n += r.n;
    return n;
  }
};

/// Several processes, each with a device: the step's reduction of the gradients runs where they
/// are. With --pipeline sync, at ZeRO stages 1-3 a reduce-scatter (TrainDevice::
/// ReduceGradsToHost: only each rank's block crosses to the host), at stage 0 an all-reduce
/// (all_reduce; TrainDevice::AllReduceGradsToHost); with --pipeline overlap each bucket's
/// exchange (buckets; TrainDevice::ExchangeBucketToHost).
struct DeviceReduceSpec {
  /// The data-parallel ranks (the host's communicator: a GPU device starts NCCL's over it);
  /// null: the host reduces (GradsToHost, then the trainer's reduce-scatter or all-reduce).
  Communicator* comm = nullptr;
  /// ZeRO-0: every rank's whole gradient becomes the sum (block and pieces unused).
  bool all_reduce = false;
  /// Elements per block of the flat view; comm->size() blocks.
  int64_t block = 0;
  /// Every block's pieces; the view's other elements (padding) are zero.
  std::vector<FlatPiece> pieces;
  /// Elements reduced at once (ExchangeChunk); 0: the device's choice (the twin's small, a
  /// GPU's from its scratch budget). Tests set it to cross chunk boundaries.
  int64_t chunk = 0;
  /// --pipeline overlap: each grad group's exchange (ExchangeBucketToHost); then block, pieces
  /// and all_reduce are unused.
  std::vector<BucketExchange> buckets;
};

/// A copy of n gradient elements from the model (element `from`) into an exchange's packed
/// floats (element `to`).
struct GradCopy {
  int64_t from = 0;
  int64_t to = 0;
  int64_t n = 0;
};

/// The unit of work of every reduction on the devices (ReduceGradsToHost, AllReduceGradsToHost,
/// ExchangeBucketToHost), the same for the CPU twin and the GPU. ZeRO 1-3: the packed floats are
/// send_counts[r] for rank r, in rank order; each rank receives recv_n floats from every rank and
/// adds them in rank order (AllToAllV, then OrderedSum). An all-reduce (no counts): recv_n packed
/// floats, all-reduced (AllReduceDeterministic). `copies` fill the packed floats from the model's
/// gradient, the rest are zero (a flat view's padding); reduced, the recv_n floats are the
/// result's [begin, begin + recv_n). Every rank has the same chunks (their counts are every
/// rank's alike), and the adds are elementwise, so cutting a reduction into chunks does not
/// change its bits.
struct ExchangeChunk {
  int64_t begin = 0;
  std::vector<int64_t> send_counts;
  int64_t recv_n = 0;
  std::vector<GradCopy> copies;
  /// The packed floats: the counts' sum, or recv_n for an all-reduce.
  int64_t packed() const {
    if (send_counts.empty()) return recv_n;
    int64_t n = 0;
    for (int64_t c : send_counts) n += c;
    return n;
  }
};

/// The chunks of `chunk` elements of each segment that cover bucket `ex` over `ranks` ranks.
/// Errors: kInvalidArgument (counts not of `ranks`, or not the packed ranges'; chunk < 1).
Result<std::vector<ExchangeChunk>> PlanBucketChunks(const BucketExchange& ex, int ranks,
                                                    int64_t chunk);

/// A flat view's reduce-scatter (the synchronous step at ZeRO 1-3) as chunks of `chunk` block
/// elements (the last one shorter) covering spec.block: chunk c packs block elements
/// [c.begin, c.begin + c.recv_n) of every block (block r's at r recv_n), and its sum is that
/// range of this rank's block. The bits are Communicator::ReduceScatterDeterministic's (rank
/// order) over the view. For `ranks` blocks of a model of `numel` elements.
/// Errors: kInvalidArgument (a piece outside the model, its block or [0, ranks); chunk < 1).
Result<std::vector<ExchangeChunk>> PlanReduceChunks(const DeviceReduceSpec& spec, int ranks,
                                                    int64_t numel, int64_t chunk);

/// Chunks on the host, from the model's gradients `grads` into `out`: the trainer's bucket
/// exchange (one chunk), the CPU twin's reductions and a GPU's without NCCL. `grads` and `out`
/// may be the same floats (an all-reduce in place). `send` and `recv` are scratch (grown as
/// needed). Errors: kInvalidArgument (a chunk past `out`), those of the communicator.
Status ExchangeOnHost(std::span<const ExchangeChunk> chunks, Communicator& comm,
                      std::span<const float> grads, std::vector<float>& send,
                      std::vector<float>& recv, std::span<float> out);

struct TrainDeviceSpec;
/// The synchronous step's chunks for spec.reduce (PlanReduceChunks; an all-reduce: the whole
/// gradient's, PlanBucketChunks), after checking it against the rest of the spec (resident
/// weights, whole host buffers, no device pieces); no reduce spec, or buckets: no chunks. `who`
/// names the device in errors. Errors: kInvalidArgument.
Result<std::vector<ExchangeChunk>> PlanDeviceReduce(const TrainDeviceSpec& spec, int64_t numel,
                                                    int64_t chunk, const char* who);

/// PlanBucketChunks for each of spec.reduce.buckets, after checking their ranges against the
/// model's `numel` elements; none: no chunks. Errors: kInvalidArgument naming `who`.
Result<std::vector<std::vector<ExchangeChunk>>> PlanDeviceBuckets(const TrainDeviceSpec& spec,
                                                                   int64_t numel, int64_t chunk,
                                                                   const char* who);

/// Checks that a reduction's output holds the floats it should (`what` names them).
/// Errors: kInvalidArgument naming `who`.
Status CheckReduceOutput(std::span<const float> out, int64_t want, const char* who,
                         const char* what);

/// What the trainer tells the device when it is made.
struct TrainDeviceSpec {
  ModelConfig model;
  LowpDType weights = LowpDType::kBf16;  ///< the training dtype (kFp32: fp32 weights)
  int64_t max_batch = 1;                 ///< the micro-batch
  int64_t seq_len = 1;
  int rank = 0;  ///< this process's rank (picks the device: rank % device count)
  int threads = 1;  ///< the host threads of the run (the CPU twin's model uses them)
  /// Host buffers the device copies from and to (registered as pinned memory by the CUDA device,
  /// so the copies run at the link's speed): the gradient, the training-dtype weights (bf16/fp16
  /// bits; empty for fp32), the fp32 weights (fp16 and fp32 training; empty for bf16, whose
  /// weights the device widens itself). Kept alive by the trainer.
  /// Each should be a PageVector's (page_vector.h): the CUDA device pins whole pages, so a buffer
  /// must own its pages; one not starting on a page is left pageable.
  std::span<float> h_grads;
  std::span<uint16_t> h_weights16;
  std::span<float> h_weights32;
  /// The pieces whose fp32 master and Adam states live on the device and are stepped there by a
  /// device Adam (--gpu-tail-buckets: the buckets backward completes last); empty: none.
  std::vector<DevicePiece> device_pieces;
  AdamConfig adam;
  /// bf16 training only: the model's GEMMs read the bf16 weights, with bf16-rounded activations
  /// and fp32 accumulation (RunOptions::gpu_gemm "auto"); false: they read the fp32 copy.
  bool gemm_bf16 = false;
  /// With gemm_bf16: attention through the flash kernels instead of the GEMM attention
  /// (RunOptions::gpu_attention "flash").
  bool flash_attention = false;
  /// RunOptions::recompute, resolved: the layers the device's model recomputes in backward.
  Recompute recompute;
  /// Streamed weights (RunOptions::weights; docs/offload.md, "Weight streaming"): the device
  /// holds the embeddings' and the head's grad groups, and two windows of one layer each (the
  /// layer in use and the next). Each layer's weights cross from h_weights16 (h_weights32 for
  /// fp16 and fp32) when the graph needs them, in forward and again in backward, and its
  /// gradients leave for h_grads as soon as backward completes them (with several
  /// micro-batches the host's partial sum comes back first, so the sums are the resident
  /// device's, bit for bit). The host buffers then always hold the gradients: GradsToHost and
  /// GroupGradsToHost move nothing, and the pipeline's "device" buffers are the host's own.
  /// No device pieces.
  bool stream_weights = false;
  /// Staged host buffers (RunOptions::host_buffers "staged"; docs/offload.md, "Staged host
  /// buffers"): 0, the host buffers above hold the whole model; else h_grads and h_weights16
  /// each hold kStagedSlots windows of host_window elements (slot s at s * host_window) through
  /// which the trainer moves any range of the model (GradsRangeToHostAsync,
  /// WeightsRangeToDeviceAsync, WaitStaged; WeightsRangeToHost), one window crossing while the
  /// host works on the other, so the host keeps no whole copy of the gradients or weights: 6
  /// B/parameter less host memory. bf16 training with resident weights only (h_weights32 empty,
  /// no streaming, no device pieces); UploadWeights, GradsToHost, GroupGradsToHost and the
  /// pipeline are then refused.
  int64_t host_window = 0;
  /// Ulysses sequence parallelism (model.h): the sp group this rank's device shares each sample
  /// with (rank = shard index; not owned); null: none. seq_len is then the whole sample's, and
  /// each ForwardBackward and Forward is collective over the group, each rank passing its shard.
  /// A GPU device moves the heads over NCCL where each rank of the group has its own GPU and no
  /// bucket exchange (reduce.buckets) runs beside backward, else through the host over this
  /// communicator.
  Communicator* sp_comm = nullptr;
  /// The step's reduction on the devices (see DeviceReduceSpec); comm null: none. Resident
  /// weights with whole host buffers only (no streaming, no staging, no device pieces).
  DeviceReduceSpec reduce;
};

/// What the overlapped pipeline (--pipeline overlap, offload/engine/pipeline.h) moves on the
/// device: its gradients and training-dtype weights, model order. Device memory on a GPU (only
/// the device's PipelineBackend touches it).
struct DevicePipelineView {
  std::span<const float> grads;
  std::span<uint16_t> weights16;
};

class TrainDevice {
 public:
  virtual ~TrainDevice() = default;
  /// One line: the device's name and memory.
  virtual std::string Describe() const = 0;
  /// Whether the model's forward and backward compute on this host's cores (the CPU twin), so
  /// an overlapped CPU Adam shares them with backward (DefaultAdamThreads); a GPU's do not.
  virtual bool ComputesOnHost() const { return false; }
  /// The host's training-dtype weights (TrainDeviceSpec::h_weights16 or h_weights32) are new:
  /// copy them to the device (and widen them there into the compute copy).
  virtual Status UploadWeights() = 0;
  /// Zeroes the device gradients (the start of a step).
  virtual Status ZeroGrads() = 0;
  /// As Model::ForwardBackward on the device's weights, adding into the device gradients. With a
  /// hook (the overlapped pipeline's), on_group_done(k) is called once group k's gradient is
  /// complete in device order: a backend from MakePipelineBackend orders its copy of bucket k
  /// after it (on a GPU the hook runs when the kernels are queued, not when they have run).
  virtual Result<double> ForwardBackward(const Batch& batch, float grad_scale,
                                         const BackwardHook* hook) = 0;
  /// As Model::Forward.
  virtual Result<double> Forward(const Batch& batch) = 0;
  /// The device gradients into TrainDeviceSpec::h_grads (all of them; the device pieces' too, so
  /// the host's norm covers every element).
  virtual Status GradsToHost() = 0;
  /// The device gradients of grad group `group` (ModelParamTable's groups; contiguous in model
  /// order) into TrainDeviceSpec::h_grads, once the backward kernels queued before the hook's
  /// on_group_done(group) have run: --pipeline overlap with several processes, where each bucket
  /// is reduced on the host while backward goes on. Any thread (the reduction's).
  virtual Status GroupGradsToHost(int group) = 0;
  /// The device pieces' state: host -> device (after an init or a restore) and device -> host
  /// (before a save or StateForTest). `master`, `exp_avg`, `exp_avg_sq` are the host state
  /// buffers (state order). No-ops without device pieces.
  virtual Status PushState(std::span<const float> master, std::span<const float> exp_avg,
                           std::span<const float> exp_avg_sq) = 0;
  virtual Status PullState(std::span<float> master, std::span<float> exp_avg,
                           std::span<float> exp_avg_sq) = 0;
  /// One AdamW step of the device pieces from the device gradients times `grad_scale` (the
  /// host's clip / loss-scale multiplier), writing their training-dtype weights on the device
  /// (bitwise the CPU Adam's step of the same pieces: offload/cuda/cuda_adam.h).
  virtual Status StepDevicePieces(int64_t step, float lr, float grad_scale) = 0;
  /// --pipeline overlap: the device memory the pipeline moves, and a backend that moves it (on
  /// its own copy stream, each bucket's gradient copied once the backward kernels of its grad
  /// group have run). Errors: kDeviceError (streams, events).
  virtual DevicePipelineView PipelineView() = 0;
  virtual Result<std::unique_ptr<PipelineBackend>> MakePipelineBackend() = 0;
  /// The pipeline has written the updated training-dtype weights into PipelineView().weights16
  /// (and the trainer its host copies, h_weights16 and, widened, h_weights32): rebuild the
  /// device's compute copy from them (UploadWeights without the weights crossing again).
  virtual Status WeightsWritten() = 0;
  /// WeightsWritten for grad group `group`'s weights alone (GradGroupRanges), ordered before
  /// the device's next kernels: the forward hook of a finish under forward (pipeline.h
  /// StartFinish) calls it once the group's weights have crossed. Errors: kInvalidArgument (no
  /// such group), kDeviceError.
  virtual Status GroupWeightsWritten(int group) = 0;
  /// The host's training-dtype weights are being rewritten under the next forward (the finish,
  /// pipeline.h StartFinish): each group's are final once GroupWeightsWritten(group) is called
  /// for it, so a streamed device must not read them ahead (its prefetch) before then.
  virtual void WeightsInFlight() {}
  /// Staged host buffers (TrainDeviceSpec::host_window), window `slot` (h at slot * window):
  /// queue the device gradients of model elements [begin, begin + n) into h_grads' window at
  /// element `at` of it (after the kernels queued so far), or the n training-dtype weights in
  /// h_weights16's window to model elements [begin, begin + n) on the device, widened into the
  /// compute copy there (the device's next kernels run after it). WaitStaged(slot): every copy
  /// queued for the slot is done (its windows may be read or rewritten). WeightsRangeToHost: the
  /// device's weights of [begin, begin + n) into window 0 of h_weights16, done on return (saves).
  /// Errors: kFailedPrecondition (not staged), kInvalidArgument (a range outside the model or
  /// longer than the window, no such slot), kDeviceError.
  virtual Status GradsRangeToHostAsync(int64_t begin, int64_t n, int slot, int64_t at) {
    (void)begin, (void)n, (void)slot, (void)at;
    return FailedPreconditionError("this device has no staged host buffers");
  }
  virtual Status WeightsRangeToDeviceAsync(int64_t begin, int64_t n, int slot) {
    (void)begin, (void)n, (void)slot;
    return FailedPreconditionError("this device has no staged host buffers");
  }
  virtual Status WaitStaged(int slot) {
    (void)slot;
    return FailedPreconditionError("this device has no staged host buffers");
  }
  virtual Status WeightsRangeToHost(int64_t begin, int64_t n) {
    (void)begin, (void)n;
    return FailedPreconditionError("this device has no staged host buffers");
  }
  /// The queued copies above, waited for: window 0.
  Status GradsRangeToHost(int64_t begin, int64_t n) {
    if (Status st = GradsRangeToHostAsync(begin, n, 0, 0); !st.ok()) return st;
    return WaitStaged(0);
  }
  Status WeightsRangeToDevice(int64_t begin, int64_t n) {
    if (Status st = WeightsRangeToDeviceAsync(begin, n, 0); !st.ok()) return st;
    return WaitStaged(0);
  }
  /// The gradient norm's chunk sums over the device's gradients, computed where they are:
  /// partial[c] and maxabs[c] for chunk c of kGradNormChunk elements, the bits grad_norm.h's
  /// SumSquaresAndMax gives over the same values, after the backward queued so far. The trainer
  /// asks when those are the step's gradients (one process), so the host reads them only for
  /// Adam. Only where SumsGradNorm(). Spans of NumGradNormChunks(parameters).
  /// Errors: kFailedPrecondition (a device that does not sum), kInvalidArgument (span sizes),
  /// kDeviceError.
  virtual Status GradNormChunks(std::span<double> partial, std::span<float> maxabs) {
    (void)partial, (void)maxabs;
    return FailedPreconditionError("this device leaves the gradient norm to the host");
  }
  /// Whether GradNormChunks computes the sums; the same answer every step (not with streamed
  /// weights: not all the gradients are on the device). Where it does, the overlapped pipeline
  /// also leaves the host's sums as the buckets land undone.
  virtual bool SumsGradNorm() const { return false; }
  /// TrainDeviceSpec::reduce given: the step's gradients summed over reduce.comm's ranks, and
  /// block rank() of the sum in the flat view into `h_block` (reduce.block floats), after the
  /// backward queued so far. The bits are Communicator::ReduceScatterDeterministic's (rank
  /// order) over every rank's gradients packed into the view, chunk by chunk (PlanReduceChunks):
  /// the host trainer's reduction. Only the block crosses to the host: on GPUs the packing and
  /// the sums are the devices' (NCCL, nccl_communicator.h).
  /// Errors: kFailedPrecondition (no reduce spec), kInvalidArgument (h_block's size), those of
  /// the communicators (kDeviceError, kIoError).
  virtual Status ReduceGradsToHost(std::span<float> h_block) {
    (void)h_block;
    return FailedPreconditionError("this device leaves the gradients' reduction to the host");
  }
  /// TrainDeviceSpec::reduce given with all_reduce (ZeRO-0): the step's gradients summed over
  /// reduce.comm's ranks into h_grads (every rank the whole sum). The bits are
  /// Communicator::AllReduceDeterministic's (rank order) of every rank's gradients.
  /// Errors: kFailedPrecondition (no such reduce spec), those of the communicators and the copy.
  virtual Status AllReduceGradsToHost() {
    return FailedPreconditionError("this device leaves the gradients' reduction to the host");
  }
  /// TrainDeviceSpec::reduce.buckets given (--pipeline overlap, several processes): grad group
  /// `group`'s exchange (reduce.buckets[group]) from the device's gradients, once the backward
  /// kernels queued before the hook's on_group_done(group) have run, into `sum`: the bits of
  /// ExchangeOnHost over the same gradients. On GPUs the packing, the exchange and the
  /// adds are the devices' (NCCL); only the sum crosses. Any thread (the reduction's).
  /// Errors: kFailedPrecondition (no buckets), kInvalidArgument (no such group, sum's size),
  /// those of the communicators.
  virtual Status ExchangeBucketToHost(int group, std::span<float> sum) {
    (void)group, (void)sum;
    return FailedPreconditionError("this device leaves the buckets' reduction to the host");
  }
  /// Device memory in use, bytes.
  virtual int64_t device_bytes() const = 0;
  /// Bytes through the staged windows (TrainDeviceSpec::host_window) since the device was made:
  /// gradients host-ward, weights device-ward and back; 0 when not staged.
  virtual int64_t staged_bytes() const { return 0; }
  /// Bytes moved between host and device by the streamed placement since the device was made
  /// (weights in, gradients out and, with micro-batches, back in); 0 when resident.
  virtual int64_t streamed_bytes() const { return 0; }
};

/// TrainDevice::GradNormChunks's spans hold NumGradNormChunks(n) values each.
/// Errors: kInvalidArgument naming `who`.
Status CheckGradNormSpans(int64_t n, std::span<const double> partial, std::span<const float> maxabs,
                          const char* who);

/// Each grad group's elements of the flat buffers, [begin, end), in ModelParamTable's order.
Result<std::vector<std::pair<int64_t, int64_t>>> GradGroupRanges(const ModelConfig& config);

/// The windows per staged host buffer (TrainDeviceSpec::host_window).
inline constexpr int kStagedSlots = 2;

/// Checks a staged range (TrainDevice::GradsRangeToHostAsync and the others) against the
/// model's `numel` elements, the spec's window (from element `at` of it) and the slots; `who`
/// names the device.
Status CheckStagedRange(const TrainDeviceSpec& spec, int64_t numel, int64_t begin, int64_t n,
                        int slot, const char* who, int64_t at = 0);
/// Checks that the spec has staged host buffers and `slot` is one of their windows.
Status CheckStagedSlot(const TrainDeviceSpec& spec, int slot, const char* who);
/// Refuses `what` (a call that needs the whole host buffers) when the spec's are staged.
Status CheckNotStaged(const TrainDeviceSpec& spec, const char* who, const char* what);
/// Checks a spec with staged host buffers (host_window > 0) for what they run with.
Status CheckStagedSpec(const TrainDeviceSpec& spec, int64_t numel, const char* who);

/// The bookkeeping of streamed weights (TrainDeviceSpec::stream_weights), the same for the CPU
/// twin and the CUDA device: an arena of elements() values per buffer (weights, compute copy,
/// gradients) holds the head's group, the embeddings' group and two windows of the largest
/// layer; which group is in which window, whether its weights there are current, whether the
/// host holds this step's gradients of a group. The device moves the bytes it says.
class WeightWindowBook {
 public:
  /// `ranges`: GradGroupRanges (the head first, the embeddings last).
  explicit WeightWindowBook(std::vector<std::pair<int64_t, int64_t>> ranges);
  /// A group sits in the arena at an offset congruent to its model offset modulo kAlign
  /// elements, so every parameter has the alignment it has in the resident buffers (512 B of
  /// fp32, 256 B of bf16): the GPU's GEMM libraries pick their kernels by alignment, and the
  /// same kernels give the same bits. Each store has kAlign - 1 elements of slack for it.
  static constexpr int64_t kAlign = 128;
  /// The arena for a head of `head`, embeddings of `embeddings` and layers of at most `layer`
  /// elements (what the memory plan counts).
  static int64_t ArenaElements(int64_t head, int64_t embeddings, int64_t layer) {
    return head + embeddings + 2 * layer + 4 * (kAlign - 1);
  }
  int64_t elements() const { return elements_; }
  int groups() const { return static_cast<int>(ranges_.size()); }
  std::pair<int64_t, int64_t> range(int group) const { return ranges_[static_cast<size_t>(group)]; }

  /// What an Acquire must do: the group's `n` elements sit at `offset` in the arena (model
  /// elements [begin, begin + n)); load its weights there when `load_weights`; with grads, copy
  /// the host's partial sum there when `grads_from_host`, else zero them.
  struct Use {
    int64_t offset = 0, begin = 0, n = 0;
    int store = 0;  ///< 0 the head's, 1 the embeddings', 2 and 3 the layer windows
    bool load_weights = false, grads_from_host = false;
  };
  /// Errors: kInvalidArgument (no such group), kFailedPrecondition (acquired twice; no window
  /// free: the graph holds one layer at a time).
  Result<Use> Acquire(int group, bool grads);
  /// The group is released; with grads the device copies its gradients at use.offset to the host
  /// and the book marks them there. Errors: kInvalidArgument, kFailedPrecondition (not held).
  Result<Use> Release(int group, bool grads);
  /// After Acquire(group, grads) of a layer: the layer the graph takes next (forward the one
  /// above, backward the one below), placed in the other window so its weights can cross while
  /// the graph computes this one; none when it is the last, or already there and current. The
  /// device copies its weights at once (on a GPU after the other window's last release, on a
  /// copy stream); an Acquire then finds them current, unless the host's weights of that group
  /// changed in between (GroupWeightsChanged: the finish under the next forward), when they
  /// cross again.
  std::optional<Use> PrefetchAfter(int group, bool grads);
  /// The host's weights changed (all, or one group's): they cross again at the next Acquire.
  void WeightsChanged();
  Status GroupWeightsChanged(int group);
  /// The host's weights are being rewritten (TrainDevice::WeightsInFlight): no group is
  /// prefetched until GroupWeightsChanged says its weights are final.
  void WeightsInFlight();
  /// A new step: no group's gradients are on the host yet.
  void NewStep();
  bool grads_on_host(int group) const { return grads_on_host_[static_cast<size_t>(group)] != 0; }
  /// The host's gradients of `group` are zeroed unless this step's are there: a group backward
  /// has not reached holds the device's zeros (GradsToHost and GroupGradsToHost).
  void ZeroGradsNotOnHost(int group, std::span<float> h_grads) const;
  /// After a graph that stopped early: nothing is held.
  void ReleaseAll();

 private:
  Status Check(int group) const;
  Use Place(int group) const;
  Use Take(int group, bool grads);
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  int64_t elements_ = 0;
  int64_t store_offset_[4] = {0, 0, 0, 0};  // the head, the embeddings, the two layer windows
  int store_group_[4] = {-1, -1, -1, -1};
  int last_layer_ = -1;
  std::vector<int> where_;  // by group: its store, -1 none
  // By group (uint8_t, not vector<bool>: another thread may read an element between steps).
  std::vector<uint8_t> loaded_, grads_on_host_, held_, in_flight_;
};

using TrainDeviceFactory =
    std::function<Result<std::unique_ptr<TrainDevice>>(const TrainDeviceSpec& spec)>;

/// The CPU twin of a device (RunOptions::device "twin"): host buffers stand in for device memory
/// (its own compute copy widened from the uploaded weights, its own gradients, its own masters
/// and Adam states for the device pieces, stepped by AdamStepFused with the multiplier), the CPU
/// model computes. It runs the trainer's device code path in CI: training through it is bitwise
/// the CPU trainer's (offload_train_test DeviceTwin.*), so what differs on a GPU is the kernels.
/// With spec.stream_weights it streams as the spec says, its "device" memory the resident
/// groups and the two layer windows (device_bytes()).
/// Errors: kInvalidArgument (the spec; device pieces with streaming), kResourceExhausted.
Result<std::unique_ptr<TrainDevice>> MakeCpuTwinDevice(const TrainDeviceSpec& spec);

}  // namespace ucp::offload
