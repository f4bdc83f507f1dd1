// The trainer's CUDA device; see cuda_train_device.h.
#include "offload/cuda/cuda_train_device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/cuda/cuda_adam.h"
#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_model.h"
#include "offload/cuda/cuda_ops.h"
#include "offload/cuda/cuda_ordered_sum.h"
#include "offload/cuda/cuda_pipeline.h"
#include "offload/cuda/cuda_status.h"
#ifdef UCP_OFFLOAD_HAVE_NCCL
#include "offload/cuda/nccl_communicator.h"
#endif
#include "offload/model/model_graph.h"
#include "offload/train/page_vector.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload::cuda {
namespace {

Status Cuda(cudaError_t err, const std::string& what) { return CudaStatus(err, what); }

// The device memory of the data-parallel reductions (one ExchangeChunk's: packed, received,
// summed, and an all-reduce's scratch), about this many floats (128 MiB), so that it does not
// grow with the model.
constexpr int64_t kReduceScratchFloats = int64_t{32} << 20;

// With TrainDeviceSpec::stream_weights the device's weights, compute copy and gradients are the
// WeightWindowBook's arena (the head, the embeddings and two layer windows), and the device is
// the graph's WeightWindows. When the graph acquires a layer the next one's weights cross into
// the other window on the copy stream (after an event recorded where the graph released that
// window's last layer, so no queued kernel still reads it) and widen there, recording the
// window's ready event, which the model's stream waits for at that layer's acquire. Everything
// else (a group not prefetched, the gradients in and out) is queued on the model's stream where
// the graph acquires or releases, between the kernels before and after it.
class CudaTrainDevice final : public TrainDevice, public WeightWindows {
 public:
  CudaTrainDevice(TrainDeviceSpec spec, CudaModel model)
      : spec_(std::move(spec)), model_(std::move(model)) {
    // (Known before Init, which may fail early: the destructor selects it.)
    if (cudaGetDevice(&device_) != cudaSuccess) cudaGetLastError();
  }

  ~CudaTrainDevice() override {
#ifdef UCP_OFFLOAD_HAVE_NCCL
    // First, aborting (NcclCommunicator's destructor): after a failure on this rank alone, work
    // queued for peers that will never join it must not hold the synchronisations below.
    nccl_.reset();
#endif
    // Every stream of the device, the pipeline's copy stream too: after an error a copy into
    // the host buffers unregistered below may still be queued there.
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    auto destroy = [](std::span<cudaEvent_t> events) {
      for (cudaEvent_t e : events) {
        if (e) cudaEventDestroy(e);
      }
    };
    destroy(group_done_);
    destroy(window_free_);
    destroy(window_ready_);
    destroy(staged_grads_);
    destroy(staged_weights_);
    destroy({&model_done_, 1});
    if (h2d_stream_) cudaStreamDestroy(h2d_stream_);
    for (void* p : registered_) cudaHostUnregister(p);
    for (void* p : {static_cast<void*>(d_w32_), static_cast<void*>(d_w16_),
                    static_cast<void*>(d_grads_), static_cast<void*>(d_master_),
                    static_cast<void*>(d_m_), static_cast<void*>(d_v_),
                    static_cast<void*>(d_norm_), static_cast<void*>(d_reduce_)}) {
      if (p) cudaFree(p);
    }
    if (h_reduce_) cudaFreeHost(h_reduce_);
    if (stream_) cudaStreamDestroy(stream_);
    cudaGetLastError();  // a failure here (already reported or moot) is not the next user's
  }

  Status Init() {
    const int64_t n = model_.num_params();
    // bf16 training needs no host fp32 weights (the device widens its own): may be empty.
    const auto w32 = static_cast<int64_t>(spec_.h_weights32.size());
    // Staged host buffers: windows of host_window elements, not the whole model.
    const int64_t hn = spec_.host_window > 0 ? kStagedSlots * spec_.host_window : n;
    if (spec_.host_window != 0) {
      UCP_RETURN_IF_ERROR(CheckStagedSpec(spec_, n, "CUDA device"));
    } else if (static_cast<int64_t>(spec_.h_grads.size()) != n ||
        (w32 != n && !(w32 == 0 && spec_.weights == LowpDType::kBf16)) ||
        (lowp() && static_cast<int64_t>(spec_.h_weights16.size()) != n)) {
      return InvalidArgumentError("CUDA device: host buffers do not hold the model's " +
                                  std::to_string(n) + " parameters");
    }
    UCP_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                             "copy stream"));
    // One event per grad group: recorded on the model's stream when the group's backward
    // kernels are queued, waited on by the pipeline's copy stream (--pipeline overlap).
    UCP_RETURN_IF_ERROR(Cuda(cudaGetDevice(&device_), "CUDA device: current device"));
    UCP_ASSIGN_OR_RETURN(group_ranges_, GradGroupRanges(spec_.model));
    group_done_.assign(group_ranges_.size(), nullptr);
    for (cudaEvent_t& e : group_done_) {
      UCP_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                               "CUDA device: grad-group events"));
    }
    UCP_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&model_done_, cudaEventDisableTiming),
                             "CUDA device: the model stream's event"));
    if (spec_.host_window > 0) {
      UCP_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&h2d_stream_, cudaStreamNonBlocking),
                               "CUDA device: the staged weights' stream"));
      for (int k = 0; k < kStagedSlots; ++k) {
        for (cudaEvent_t* e : {&staged_grads_[k], &staged_weights_[k]}) {
          UCP_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                                   "CUDA device: the staged windows' events"));
        }
      }
    }
    if (spec_.stream_weights) {
      if (!spec_.device_pieces.empty()) {
        return InvalidArgumentError("CUDA device: streamed weights hold no device pieces "
                                    "(--gpu-tail-buckets needs resident weights)");
      }
      book_.emplace(group_ranges_);
      for (cudaEvent_t* e : {&window_free_[0], &window_free_[1], &window_free_[2],
                             &window_free_[3], &window_ready_[0], &window_ready_[1],
                             &window_ready_[2], &window_ready_[3]}) {
        UCP_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                                 "CUDA device: weight-window events"));
      }
    }
    // Streamed: the arena; only bf16 crosses as training-dtype bits (fp16 and fp32 as the host's
    // fp32 compute copy). Resident beside the bf16 GEMMs, which read only the bf16 weights: the
    // compute copy packed to what the norms, biases and embeddings read (Fp32ReadRanges).
    const int64_t dn = book_ ? book_->elements() : n;
    if (!book_ && model_.gemm() == GemmInputs::kBf16) {
      UCP_ASSIGN_OR_RETURN(auto ranges, Fp32ReadRanges(spec_.model), "CUDA device");
      packed_.emplace(std::move(ranges));
    }
    UCP_RETURN_IF_ERROR(Alloc(&d_w32_, w32_elements() * 4, "fp32 compute weights"));
    UCP_RETURN_IF_ERROR(Alloc(&d_grads_, dn * 4, "gradients"));
    if (!book_) {
      // GradNormChunks' sums: a double and a float per chunk.
      UCP_RETURN_IF_ERROR(Alloc(&d_norm_, NumGradNormChunks(n) * 12, "gradient norm sums"));
    }
    if (book_ ? spec_.weights == LowpDType::kBf16 : lowp()) {
      UCP_RETURN_IF_ERROR(Alloc(&d_w16_, dn * 2, "training-dtype weights"));
    }
    for (const DevicePiece& pc : spec_.device_pieces) pieces_n_ += pc.n;
    if (pieces_n_ > 0) {
      UCP_RETURN_IF_ERROR(Alloc(&d_master_, pieces_n_ * 4, "device masters"));
      UCP_RETURN_IF_ERROR(Alloc(&d_m_, pieces_n_ * 4, "device exp_avg"));
      UCP_RETURN_IF_ERROR(Alloc(&d_v_, pieces_n_ * 4, "device exp_avg_sq"));
    }
    // Pinned host memory: the copies run at the link's rate and need no bounce buffer.
    UCP_RETURN_IF_ERROR(Register(spec_.h_grads.data(), hn * 4, "host gradients"));
    UCP_RETURN_IF_ERROR(Register(spec_.h_weights32.data(), w32 * 4, "host fp32 weights"));
    if (lowp()) UCP_RETURN_IF_ERROR(Register(spec_.h_weights16.data(), hn * 2, "host weights"));
    return InitReduce();
  }

  // The data-parallel reduction on the GPUs (TrainDeviceSpec::reduce): NCCL's communicator,
  // started over the host's (a collective: every rank's device gets here in the same order), and
  // the scratch of one chunk. Without NCCL in the build, the chunks are reduced on the host.
  Status InitReduce() {
    if (spec_.reduce.comm == nullptr) return Status::Ok();
    const int64_t ranks = spec_.reduce.comm->size();
    // Chunks of chunk_len_ elements: one chunk's scratch is packed (up to P chunks), received
    // (P) and summed (1), plus an all-reduce's (about 2 + 1/P).
    chunk_len_ = spec_.reduce.chunk > 0
                     ? spec_.reduce.chunk
                     : std::max<int64_t>(1, kReduceScratchFloats / (2 * ranks + 4));
    const int64_t n = model_.num_params();
    UCP_ASSIGN_OR_RETURN(step_chunks_, PlanDeviceReduce(spec_, n, chunk_len_, "CUDA device"));
    UCP_ASSIGN_OR_RETURN(bucket_chunks_, PlanDeviceBuckets(spec_, n, chunk_len_, "CUDA device"));
#ifdef UCP_OFFLOAD_HAVE_NCCL
    UCP_ASSIGN_OR_RETURN(const bool shared, SharesAGpu(*spec_.reduce.comm));
    if (shared) return Status::Ok();  // NCCL takes one rank per GPU: the host reduces
    UCP_ASSIGN_OR_RETURN(nccl_, NcclCommunicator::Create(*spec_.reduce.comm, device_),
                         "CUDA device: the GPUs' communicator");
    reduce_floats_ =
        (2 * ranks + 1) * chunk_len_ + nccl_->AllReduceDeterministicScratch(chunk_len_);
    UCP_RETURN_IF_ERROR(Alloc(&d_reduce_, reduce_floats_ * 4, "the reduction's chunk"));
    UCP_RETURN_IF_ERROR(Cuda(cudaMallocHost(reinterpret_cast<void**>(&h_reduce_),
                                            static_cast<size_t>(chunk_len_) * 4),
                             "CUDA device: the reduction's pinned chunk (" +
                                 std::to_string((chunk_len_ * 4) >> 20) + " MiB)"));
#endif
    return Status::Ok();
  }

  // Whether two ranks of `comm` run on one GPU (several processes on a machine with fewer
  // GPUs): each rank's GPU UUID summed into its own slots (int64 sums are exact), compared.
  static Result<bool> SharesAGpu(Communicator& comm) {
    int dev = 0;
    cudaDeviceProp prop{};
    UCP_RETURN_IF_ERROR(Cuda(cudaGetDevice(&dev), "CUDA device: current device"));
    UCP_RETURN_IF_ERROR(Cuda(cudaGetDeviceProperties(&prop, dev), "CUDA device: its UUID"));
    std::vector<int64_t> ids(2 * static_cast<size_t>(comm.size()), 0);
    std::memcpy(&ids[2 * static_cast<size_t>(comm.rank())], prop.uuid.bytes, 16);
    UCP_RETURN_IF_ERROR(comm.AllReduce(std::span<int64_t>(ids), ReduceOp::kSum),
                        "CUDA device: the ranks' GPUs");
    for (size_t a = 0; a < ids.size(); a += 2) {
      for (size_t b = a + 2; b < ids.size(); b += 2) {
        if (ids[a] == ids[b] && ids[a + 1] == ids[b + 1]) return true;
      }
    }
    return false;
  }

  std::string Describe() const override {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, dev);
    return "cuda:" + std::to_string(dev) + " " + prop.name + " (" +
           std::to_string(prop.totalGlobalMem >> 20) + " MiB), " +
           std::to_string(device_bytes() >> 20) + " MiB of weights, gradients and optimizer "
           "state; " + std::to_string(pieces_n_) + " parameters stepped by the device Adam; " +
           std::to_string(registered_.size()) + " of " + std::to_string(to_pin_) +
           " host buffers pinned; " +
           (model_.gemm() == GemmInputs::kBf16 ? "bf16" : "fp32") + " GEMMs" +
           (packed_ ? "; fp32 compute copy packed to the " + std::to_string(packed_->elements()) +
                          " parameters no GEMM reads"
                    : "") +
           (book_ ? "; weights streamed: the embeddings, the head and 2 layer windows" : "") +
           (model_.sp_size() > 1
                ? "; Ulysses over " + std::to_string(model_.sp_size()) + " ranks (all-to-alls " +
                      (model_.sp_on_device() ? "over NCCL)" : "through the host)")
                : "") +
           WhereReduced();
  }

  // Describe's words on the data-parallel reduction (InitReduce).
  std::string WhereReduced() const {
    if (spec_.reduce.comm == nullptr) return "";
    if (d_reduce_ == nullptr) {
      return "; gradients reduced on the host (no NCCL, or ranks sharing a GPU)";
    }
    if (!spec_.reduce.buckets.empty()) return "; each bucket reduced on the GPUs (NCCL)";
    return std::string("; gradients ") +
           (spec_.reduce.all_reduce ? "all-reduced" : "reduce-scattered") + " on the GPUs (NCCL)";
  }

  Status UploadWeights() override {
    UCP_RETURN_IF_ERROR(NotStaged("UploadWeights"));
    if (book_) {
      book_->WeightsChanged();  // each group crosses when the graph next acquires it
      return Status::Ok();
    }
    const int64_t n = model_.num_params();
    if (spec_.weights == LowpDType::kBf16) {
      // bf16 over the link (2 B/param), widened on the device (exact).
      UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d_w16_, spec_.h_weights16.data(), n * 2,
                                               cudaMemcpyHostToDevice, stream_),
                               "weights to the device"));
      UCP_RETURN_IF_ERROR(Widen(0, n, stream_));
    } else {
      UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d_w32_, spec_.h_weights32.data(), n * 4,
                                               cudaMemcpyHostToDevice, stream_),
                               "weights to the device"));
    }
    return Cuda(cudaStreamSynchronize(stream_), "weights to the device");
  }

  Status ZeroGrads() override {
    if (book_) {
      book_->NewStep();  // each group's gradients are zeroed in its window when backward acquires it
      return Status::Ok();
    }
    UCP_RETURN_IF_ERROR(Cuda(cudaMemsetAsync(d_grads_, 0, model_.num_params() * 4, stream_),
                             "zeroing gradients"));
    return Cuda(cudaStreamSynchronize(stream_), "zeroing gradients");
  }

  Result<double> ForwardBackward(const Batch& batch, float grad_scale,
                                 const BackwardHook* hook) override {
    // With several processes the overlapped step runs backward on a worker thread, and the
    // current device is per thread.
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    UCP_RETURN_IF_ERROR(AfterStagedWeights());
    if (hook == nullptr) return RunModel(batch, grad_scale, nullptr);
    // Each group's event is recorded before the pipeline hears of the group, so the copy of
    // its bucket waits for exactly the kernels queued so far.
    Status recorded;
    BackwardHook h;
    h.on_backward_begin = hook->on_backward_begin;
    h.on_group_needed = hook->on_group_needed;
    h.on_group_done = [&](int k) {
      if (k < 0 || k >= static_cast<int>(group_done_.size())) {
        if (recorded.ok()) recorded = InternalError("grad group " + std::to_string(k));
      } else if (const cudaError_t e = cudaEventRecord(
                     group_done_[static_cast<size_t>(k)], static_cast<cudaStream_t>(model_.stream()));
                 e != cudaSuccess) {
        if (recorded.ok()) recorded = Cuda(e, "recording grad group " + std::to_string(k));
        // The bucket's reader would wait on a stale event: the whole stream instead, so it
        // never reads gradients backward has not finished (the step then fails with the error).
        cudaStreamSynchronize(static_cast<cudaStream_t>(model_.stream()));
      }
      if (hook->on_group_done) hook->on_group_done(k);
    };
    Result<double> loss = RunModel(batch, grad_scale, &h);
    UCP_RETURN_IF_ERROR(recorded);
    return loss;
  }

  Result<double> Forward(const Batch& batch) override {
    // (As ForwardBackward: the current device is per thread.)
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    UCP_RETURN_IF_ERROR(AfterStagedWeights());
    if (book_) {
      Result<double> r = model_.Forward(*this, batch, d_w32_, GemmWeights());
      if (!r.ok()) book_->ReleaseAll();
      return r;
    }
    return model_.Forward(d_w32_, batch, GemmWeights(), Fp32());
  }

  // Staged host buffers: gradients cross host-ward on the copy stream, weights device-ward on
  // their own stream (the link is full duplex), each after the kernels queued on the model's
  // stream so far; each slot's last copies record an event WaitStaged waits for.
  Status GradsRangeToHostAsync(int64_t begin, int64_t n, int slot, int64_t at) override {
    UCP_RETURN_IF_ERROR(
        CheckStagedRange(spec_, model_.num_params(), begin, n, slot, "CUDA device", at));
    UCP_RETURN_IF_ERROR(AfterModel(stream_));
    staged_bytes_ += n * 4;
    UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(spec_.h_grads.data() + slot * spec_.host_window + at,
                                             d_grads_ + begin, static_cast<size_t>(n) * 4,
                                             cudaMemcpyDeviceToHost, stream_),
                             "gradients to the host window"));
    return Cuda(cudaEventRecord(staged_grads_[slot], stream_), "gradients to the host window");
  }

  Status WeightsRangeToDeviceAsync(int64_t begin, int64_t n, int slot) override {
    UCP_RETURN_IF_ERROR(
        CheckStagedRange(spec_, model_.num_params(), begin, n, slot, "CUDA device"));
    UCP_RETURN_IF_ERROR(AfterModel(h2d_stream_));
    staged_bytes_ += n * 2;
    UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d_w16_ + begin,
                                             spec_.h_weights16.data() + slot * spec_.host_window,
                                             static_cast<size_t>(n) * 2, cudaMemcpyHostToDevice,
                                             h2d_stream_),
                             "weights from the host window"));
    UCP_RETURN_IF_ERROR(Widen(begin, n, h2d_stream_));
    return Cuda(cudaEventRecord(staged_weights_[slot], h2d_stream_),
                "weights from the host window");
  }

  Status WaitStaged(int slot) override {
    UCP_RETURN_IF_ERROR(CheckStagedSlot(spec_, slot, "CUDA device"));
    UCP_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(staged_grads_[slot]), "the host window"));
    return Cuda(cudaEventSynchronize(staged_weights_[slot]), "the host window");
  }

  Status WeightsRangeToHost(int64_t begin, int64_t n) override {
    UCP_RETURN_IF_ERROR(CheckStagedRange(spec_, model_.num_params(), begin, n, 0, "CUDA device"));
    UCP_RETURN_IF_ERROR(AfterModel(stream_));
    for (cudaEvent_t e : staged_weights_) {  // after the weights queued device-ward
      UCP_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(stream_, e, 0), "weights to the host window"));
    }
    staged_bytes_ += n * 2;
    UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(spec_.h_weights16.data(), d_w16_ + begin,
                                             static_cast<size_t>(n) * 2, cudaMemcpyDeviceToHost,
                                             stream_),
                             "weights to the host window"));
    return Cuda(cudaStreamSynchronize(stream_), "weights to the host window");
  }

  Status GradsToHost() override {
    UCP_RETURN_IF_ERROR(NotStaged("GradsToHost"));
    if (book_) {
      // The released groups' gradients crossed as backward completed them (the model's run
      // synchronised its stream); a group backward has not reached holds zeros.
      for (int k = 0; k < book_->groups(); ++k) book_->ZeroGradsNotOnHost(k, spec_.h_grads);
      return Status::Ok();
    }
    UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(spec_.h_grads.data(), d_grads_,
                                             model_.num_params() * 4, cudaMemcpyDeviceToHost,
                                             stream_),
                             "gradients to the host"));
    return Cuda(cudaStreamSynchronize(stream_), "gradients to the host");
  }

  // The reductions (TrainDeviceSpec::reduce). On the GPUs (RunChunksOnGpus) each chunk is
  // packed from the device's gradients, exchanged over NCCL and summed in rank order there, and
  // only this rank's result crosses to the host. Without NCCL (the build's, or ranks sharing a
  // GPU) the gradients cross and the host runs the same chunks (ExchangeOnHost). The same bits
  // either way.
  Status ReduceGradsToHost(std::span<float> h_block) override {
    if (spec_.reduce.comm == nullptr || spec_.reduce.all_reduce ||
        !spec_.reduce.buckets.empty()) {
      return TrainDevice::ReduceGradsToHost(h_block);
    }
    UCP_RETURN_IF_ERROR(CheckReduceOutput(h_block, spec_.reduce.block, "CUDA device", "the block"));
    if (HasNccl()) return RunChunksOnGpus(step_chunks_, nullptr, h_block, "reducing gradients");
    UCP_RETURN_IF_ERROR(GradsToHost());
    return ExchangeOnHost(step_chunks_, *spec_.reduce.comm, spec_.h_grads, host_send_, host_recv_,
                          h_block);
  }

  // ZeRO-0: every rank's h_grads the whole sum.
  Status AllReduceGradsToHost() override {
    if (spec_.reduce.comm == nullptr || !spec_.reduce.all_reduce) {
      return TrainDevice::AllReduceGradsToHost();
    }
    if (HasNccl()) {
      return RunChunksOnGpus(step_chunks_, nullptr, spec_.h_grads, "reducing gradients");
    }
    UCP_RETURN_IF_ERROR(GradsToHost());
    return ExchangeOnHost(step_chunks_, *spec_.reduce.comm, spec_.h_grads, host_send_, host_recv_,
                          spec_.h_grads);
  }

  // --pipeline overlap: bucket `group`'s exchange, once backward has completed the group.
  Status ExchangeBucketToHost(int group, std::span<float> sum) override {
    if (spec_.reduce.comm == nullptr || spec_.reduce.buckets.empty()) {
      return TrainDevice::ExchangeBucketToHost(group, sum);
    }
    if (group < 0 || group >= static_cast<int>(bucket_chunks_.size())) {
      return InvalidArgumentError("CUDA device: no grad group " + std::to_string(group));
    }
    const auto k = static_cast<size_t>(group);
    UCP_RETURN_IF_ERROR(CheckReduceOutput(sum, spec_.reduce.buckets[k].sum_n, "CUDA device",
                                          "the bucket's sum"));
    if (HasNccl()) {
      return RunChunksOnGpus(bucket_chunks_[k], group_done_[k], sum,
                             "exchanging grad group " + std::to_string(group));
    }
    UCP_RETURN_IF_ERROR(GroupGradsToHost(group));
    return ExchangeOnHost(bucket_chunks_[k], *spec_.reduce.comm, spec_.h_grads, host_send_,
                          host_recv_, sum);
  }

  bool HasNccl() const {
#ifdef UCP_OFFLOAD_HAVE_NCCL
    return nccl_ != nullptr;
#else
    return false;
#endif
  }

#ifdef UCP_OFFLOAD_HAVE_NCCL
  // ExchangeOnHost's chunks on the GPUs, after `after` (a grad group's event; null: the model's
  // stream so far), each chunk's result copied into `out` at its begin.
  Status RunChunksOnGpus(std::span<const ExchangeChunk> chunks, cudaEvent_t after,
                         std::span<float> out, const std::string& what) {
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    UCP_RETURN_IF_ERROR(after != nullptr ? Cuda(cudaStreamWaitEvent(stream_, after, 0), what)
                                         : AfterModel(stream_));
    const int64_t ranks = nccl_->size();
    const bool out_pinned = IsPinned(out.data());
    float* packed = d_reduce_;
    float* received = packed + ranks * chunk_len_;
    float* summed = received + ranks * chunk_len_;
    float* scratch = summed + chunk_len_;
    std::vector<int64_t> recv_counts(static_cast<size_t>(ranks));
    for (const ExchangeChunk& c : chunks) {
      const bool all_reduce = c.send_counts.empty();
      float* to = all_reduce ? summed : packed;
      int64_t copied = 0;
      for (const GradCopy& cp : c.copies) copied += cp.n;
      if (copied < c.packed()) {  // a flat view's padding
        UCP_RETURN_IF_ERROR(
            Cuda(cudaMemsetAsync(to, 0, static_cast<size_t>(c.packed()) * 4, stream_), what));
      }
      for (const GradCopy& cp : c.copies) {
        UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(to + cp.to, d_grads_ + cp.from,
                                                 static_cast<size_t>(cp.n) * 4,
                                                 cudaMemcpyDeviceToDevice, stream_),
                                 what));
      }
      if (all_reduce) {
        UCP_RETURN_IF_ERROR(nccl_->AllReduceDeterministic(summed, c.recv_n, scratch,
                                                          SumOrder::kRankOrder, stream_),
                            what);
      } else {
        std::fill(recv_counts.begin(), recv_counts.end(), c.recv_n);
        UCP_RETURN_IF_ERROR(nccl_->AllToAllV(packed, c.send_counts.data(), received,
                                             recv_counts.data(), stream_),
                            what);
        UCP_RETURN_IF_ERROR(
            OrderedSumOnDevice(summed, received, ranks, c.recv_n, false, stream_), what);
      }
      if (c.recv_n > 0 && out_pinned) {
        UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(out.data() + c.begin, summed,
                                                 static_cast<size_t>(c.recv_n) * 4,
                                                 cudaMemcpyDeviceToHost, stream_),
                                 what));
      } else if (c.recv_n > 0) {
        // Pageable `out` (the trainer's reduced block, a bucket's sum): a copy into it would
        // block this thread inside CUDA until every NCCL call queued before it had finished,
        // where a dead peer would hang it for ever; Synchronize waits polling NCCL's errors.
        UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(h_reduce_, summed,
                                                 static_cast<size_t>(c.recv_n) * 4,
                                                 cudaMemcpyDeviceToHost, stream_),
                                 what));
        UCP_RETURN_IF_ERROR(nccl_->Synchronize(stream_), what);
        std::memcpy(out.data() + c.begin, h_reduce_, static_cast<size_t>(c.recv_n) * 4);
      }
    }
    return nccl_->Synchronize(stream_);
  }
#else
  Status RunChunksOnGpus(std::span<const ExchangeChunk>, cudaEvent_t, std::span<float>,
                         const std::string&) {
    return FailedPreconditionError("CUDA device: this build has no NCCL");
  }
#endif

  Status GroupGradsToHost(int group) override {
    UCP_RETURN_IF_ERROR(NotStaged("GroupGradsToHost"));
    if (group < 0 || group >= static_cast<int>(group_ranges_.size())) {
      return InvalidArgumentError("CUDA device: no grad group " + std::to_string(group));
    }
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    if (book_) {
      // Its event follows the copy the release queued.
      UCP_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(group_done_[static_cast<size_t>(group)]),
                               "gradients of grad group " + std::to_string(group) + " to the host"));
      book_->ZeroGradsNotOnHost(group, spec_.h_grads);
      return Status::Ok();
    }
    const auto [b, e] = group_ranges_[static_cast<size_t>(group)];
    UCP_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(stream_, group_done_[static_cast<size_t>(group)], 0),
                             "ordering the copy of grad group " + std::to_string(group)));
    UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(spec_.h_grads.data() + b, d_grads_ + b,
                                             static_cast<size_t>(e - b) * 4,
                                             cudaMemcpyDeviceToHost, stream_),
                             "gradients of grad group " + std::to_string(group) + " to the host"));
    return Cuda(cudaStreamSynchronize(stream_), "gradients to the host");
  }

  Status PushState(std::span<const float> master, std::span<const float> exp_avg,
                   std::span<const float> exp_avg_sq) override {
    return MoveState(const_cast<float*>(master.data()), const_cast<float*>(exp_avg.data()),
                     const_cast<float*>(exp_avg_sq.data()), cudaMemcpyHostToDevice);
  }
  Status PullState(std::span<float> master, std::span<float> exp_avg,
                   std::span<float> exp_avg_sq) override {
    return MoveState(master.data(), exp_avg.data(), exp_avg_sq.data(), cudaMemcpyDeviceToHost);
  }

  Status StepDevicePieces(int64_t step, float lr, float grad_scale) override {
    if (pieces_n_ == 0) return Status::Ok();
    AdamConfig ac = spec_.adam;
    ac.lr = lr;
    UCP_ASSIGN_OR_RETURN(const AdamStepScalars s, MakeAdamStepScalars(ac, step));
    int64_t at = 0;
    for (const DevicePiece& pc : spec_.device_pieces) {
      DeviceAdamSpans d{d_master_ + at, d_grads_ + pc.model_offset, d_m_ + at, d_v_ + at,
                        d_w16_ + pc.model_offset, ToDevice(spec_.weights), pc.n};
      UCP_RETURN_IF_ERROR(AdamStepDevice(ToDevice(s, ac.decoupled), grad_scale, d, stream_));
      // The host's copy of the weights stays whole (checkpoints and the next upload read it).
      UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(spec_.h_weights16.data() + pc.model_offset,
                                               d_w16_ + pc.model_offset, pc.n * 2,
                                               cudaMemcpyDeviceToHost, stream_),
                               "device-stepped weights to the host"));
      at += pc.n;
    }
    return Cuda(cudaStreamSynchronize(stream_), "device Adam");
  }

  DevicePipelineView PipelineView() override {
    // Streamed: the pipeline's "device" buffers are the host's own (its copies are no-ops).
    if (book_) return {spec_.h_grads, spec_.h_weights16};
    const size_t n = static_cast<size_t>(model_.num_params());
    return {std::span<const float>(d_grads_, n),
            lowp() ? std::span<uint16_t>(d_w16_, n) : std::span<uint16_t>()};
  }

  Result<std::unique_ptr<PipelineBackend>> MakePipelineBackend() override {
    UCP_RETURN_IF_ERROR(NotStaged("the overlapped pipeline"));
    if (book_) {
      // The gradients are read on the host once their group's event (after the copy the
      // release queued) has passed.
      return std::unique_ptr<PipelineBackend>(std::make_unique<HostViewBackend>(
          [this](int k) -> Status {
            if (k < 0 || k >= static_cast<int>(group_done_.size())) {
              return InternalError("pipeline bucket " + std::to_string(k) + " is no grad group");
            }
            // (On the pipeline's copy thread: its device first, or CUDA would make GPU 0's
            // context for it on a node whose process uses another GPU.)
            UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
            return Cuda(cudaEventSynchronize(group_done_[static_cast<size_t>(k)]),
                        "gradients of bucket " + std::to_string(k) + " to the host");
          }));
    }
    return CudaPipelineBackend([this](int k, void* copy_stream) -> Status {
      if (k < 0 || k >= static_cast<int>(group_done_.size())) {
        return InternalError("pipeline bucket " + std::to_string(k) + " is no grad group");
      }
      return Cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(copy_stream),
                                      group_done_[static_cast<size_t>(k)], 0),
                  "ordering the copy of bucket " + std::to_string(k) + " after its backward");
    });
  }

  Status WeightsWritten() override {
    if (book_) return UploadWeights();
    const int64_t n = model_.num_params();
    if (spec_.weights == LowpDType::kBf16) {
      UCP_RETURN_IF_ERROR(Widen(0, n, stream_));
    } else {
      // fp16: as UploadWeights, the host's widened compute copy (no fp16 widening kernel).
      UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d_w32_, spec_.h_weights32.data(), n * 4,
                                               cudaMemcpyHostToDevice, stream_),
                               "weights to the device"));
    }
    return Cuda(cudaStreamSynchronize(stream_), "widening the weights");
  }

  // On the model's stream, so the group's forward kernels, queued after it, read the widened
  // copy; the weights themselves crossed on the pipeline's copy stream, which the caller waited
  // for (Pipeline::WaitFinished).
  Status GroupWeightsWritten(int group) override {
    if (group < 0 || group >= static_cast<int>(group_ranges_.size())) {
      return InvalidArgumentError("CUDA device: no grad group " + std::to_string(group));
    }
    if (book_) return book_->GroupWeightsChanged(group);
    const auto [b, e] = group_ranges_[static_cast<size_t>(group)];
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    if (spec_.weights == LowpDType::kBf16) {
      return Widen(b, e - b, static_cast<cudaStream_t>(model_.stream()));
    }
    return Cuda(cudaMemcpyAsync(d_w32_ + b, spec_.h_weights32.data() + b, (e - b) * 4,
                                cudaMemcpyHostToDevice, static_cast<cudaStream_t>(model_.stream())),
                "weights of grad group " + std::to_string(group) + " to the device");
  }

  int64_t device_bytes() const override {
    if (book_) {
      return book_->elements() * (8 + (spec_.weights == LowpDType::kBf16 ? 2 : 0));
    }
    const int64_t n = model_.num_params();
    return n * 4 + w32_elements() * 4 + (lowp() ? n * 2 : 0) + pieces_n_ * 12 + reduce_floats_ * 4;
  }
  int64_t streamed_bytes() const override { return moved_; }
  int64_t staged_bytes() const override { return staged_bytes_; }
  bool SumsGradNorm() const override { return !book_; }

  // On the model's stream, after backward: only the sums cross (12 bytes per chunk).
  Status GradNormChunks(std::span<double> partial, std::span<float> maxabs) override {
    if (book_) {
      return FailedPreconditionError("CUDA device: streamed weights leave the gradient norm to "
                                     "the host (their gradients are there)");
    }
    const int64_t n = model_.num_params();
    UCP_RETURN_IF_ERROR(CheckGradNormSpans(n, partial, maxabs, "CUDA device"));
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    const int64_t chunks = NumGradNormChunks(n);
    auto ms = static_cast<cudaStream_t>(model_.stream());
    double* d_partial = reinterpret_cast<double*>(d_norm_);
    float* d_max = reinterpret_cast<float*>(d_norm_ + chunks * 8);
    UCP_RETURN_IF_ERROR(cuda::GradNormChunks(d_grads_, n, kGradNormChunk, d_partial, d_max, ms));
    UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(partial.data(), d_partial, chunks * 8,
                                             cudaMemcpyDeviceToHost, ms),
                             "gradient norm sums to the host"));
    UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(maxabs.data(), d_max, chunks * 4,
                                             cudaMemcpyDeviceToHost, ms),
                             "gradient norm sums to the host"));
    return Cuda(cudaStreamSynchronize(ms), "the gradient norm");
  }

  // WeightWindows (streamed): the graph's calls, on the model's thread. Each crossing is queued
  // on the model's stream, between the kernels before and after it.
  Result<Slot> Acquire(int group, bool grads) override {
    UCP_ASSIGN_OR_RETURN(WeightWindowBook::Use u, book_->Acquire(group, grads), "CUDA device");
    auto ms = static_cast<cudaStream_t>(model_.stream());
    const std::string what = "grad group " + std::to_string(group) + " to the device";
    // A prefetch into this window (of this group, or one it replaced) may still be in flight.
    UCP_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(ms, window_ready_[u.store], 0),
                             "ordering the weights of " + what));
    if (u.load_weights) UCP_RETURN_IF_ERROR(LoadWeights(u, ms));
    if (std::optional<WeightWindowBook::Use> next = book_->PrefetchAfter(group, grads)) {
      // The next layer into the other window once the kernels queued before its last release
      // have run, on the copy stream, while this layer computes.
      UCP_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(stream_, window_free_[next->store], 0),
                               "ordering the prefetch after grad group " + std::to_string(group)));
      UCP_RETURN_IF_ERROR(LoadWeights(*next, stream_));
      UCP_RETURN_IF_ERROR(Cuda(cudaEventRecord(window_ready_[next->store], stream_),
                               "recording the prefetch after grad group " +
                                   std::to_string(group)));
    }
    if (grads && u.grads_from_host) {
      // An earlier micro-batch's sum: backward adds into it, as into resident gradients.
      UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d_grads_ + u.offset, spec_.h_grads.data() + u.begin,
                                               u.n * 4, cudaMemcpyHostToDevice, ms),
                               "gradients of " + what));
      moved_ += u.n * 4;
    } else if (grads) {
      UCP_RETURN_IF_ERROR(Cuda(cudaMemsetAsync(d_grads_ + u.offset, 0, u.n * 4, ms),
                               "zeroing the gradients of grad group " + std::to_string(group)));
    }
    return Slot{d_w32_ + u.offset, grads ? d_grads_ + u.offset : nullptr};
  }

  Status Release(int group, bool grads) override {
    UCP_ASSIGN_OR_RETURN(WeightWindowBook::Use u, book_->Release(group, grads), "CUDA device");
    auto ms = static_cast<cudaStream_t>(model_.stream());
    if (grads) {
      // The group's gradients leave; the hook's event (ForwardBackward) is recorded after this.
      moved_ += u.n * 4;
      UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(spec_.h_grads.data() + u.begin, d_grads_ + u.offset,
                                               u.n * 4, cudaMemcpyDeviceToHost, ms),
                               "gradients of grad group " + std::to_string(group) + " to the host"));
    }
    // Every kernel reading the window is queued: a prefetch may overwrite it after this point.
    return Cuda(cudaEventRecord(window_free_[u.store], ms),
                "releasing grad group " + std::to_string(group));
  }

  void WeightsInFlight() override {
    if (book_) book_->WeightsInFlight();
  }

 private:
  bool lowp() const { return spec_.weights != LowpDType::kFp32; }

  // The model on the resident buffers, or on the windows (the arena's bases for the bf16
  // GEMMs' lookup); a graph stopped early leaves nothing held.
  Result<double> RunModel(const Batch& batch, float grad_scale, const BackwardHook* hook) {
    if (!book_) {
      return model_.ForwardBackward(d_w32_, d_grads_, batch, grad_scale, hook, GemmWeights(),
                                    Fp32());
    }
    Result<double> r = model_.ForwardBackward(*this, batch, grad_scale, hook, d_w32_,
                                              GemmWeights());
    if (!r.ok()) book_->ReleaseAll();
    return r;
  }

  // Streamed: a group's weights into its place in the arena on `stream`: bf16 over the link,
  // widened on the device (exact), as UploadWeights; fp16 and fp32 as the host's fp32 copy.
  Status LoadWeights(const WeightWindowBook::Use& u, cudaStream_t stream) {
    const std::string what = "weights of grad group at " + std::to_string(u.begin) +
                             " to the device";
    if (spec_.weights == LowpDType::kBf16) {
      UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d_w16_ + u.offset, spec_.h_weights16.data() + u.begin,
                                               u.n * 2, cudaMemcpyHostToDevice, stream),
                               what));
      moved_ += u.n * 2;
      return CastBf16ToFp32(d_w16_ + u.offset, d_w32_ + u.offset, u.n, stream);
    }
    moved_ += u.n * 4;
    return Cuda(cudaMemcpyAsync(d_w32_ + u.offset, spec_.h_weights32.data() + u.begin, u.n * 4,
                                cudaMemcpyHostToDevice, stream),
                what);
  }

  // The streamed device's pipeline backend: its spans are host memory (the CPU backend's copies,
  // which are no-ops there), read once `wait` says the bucket's gradients have landed.
  class HostViewBackend final : public PipelineBackend {
   public:
    explicit HostViewBackend(std::function<Status(int)> wait)
        : wait_(std::move(wait)), cpu_(CpuPipelineBackend()) {}
    Result<bool> GradToHost(const Bucket& bucket, std::span<const float> d_grad,
                            std::span<float> h_grad, std::span<uint16_t> h_grad16,
                            bool fp16_range) override {
      UCP_RETURN_IF_ERROR(wait_(bucket.index));
      return cpu_->GradToHost(bucket, d_grad, h_grad, h_grad16, fp16_range);
    }
    Status WeightsToDevice(const Bucket& bucket, std::span<const uint16_t> h_out,
                           std::span<uint16_t> d_weights) override {
      return cpu_->WeightsToDevice(bucket, h_out, d_weights);
    }

   private:
    std::function<Status(int)> wait_;
    std::unique_ptr<PipelineBackend> cpu_;
  };
  Status NotStaged(const char* what) const { return CheckNotStaged(spec_, "CUDA device", what); }
  // `stream` waits for what the model's stream has queued so far.
  Status AfterModel(cudaStream_t stream) {
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    UCP_RETURN_IF_ERROR(Cuda(cudaEventRecord(model_done_, static_cast<cudaStream_t>(model_.stream())),
                             "ordering after the model's stream"));
    return Cuda(cudaStreamWaitEvent(stream, model_done_, 0), "ordering after the model's stream");
  }
  // Staged: the model's next kernels run after the weights queued device-ward.
  Status AfterStagedWeights() {
    if (spec_.host_window == 0) return Status::Ok();
    for (cudaEvent_t e : staged_weights_) {
      UCP_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(model_.stream()), e, 0),
                               "ordering the model after the staged weights"));
    }
    return Status::Ok();
  }
  // The fp32 compute copy's floats: the streamed arena, the packed parameters or all.
  int64_t w32_elements() const {
    return book_ ? book_->elements() : packed_ ? packed_->elements() : model_.num_params();
  }
  Fp32Layout Fp32() const { return packed_ ? Fp32Layout::kPacked : Fp32Layout::kWhole; }
  // The compute copy of the flat [begin, begin + n) widened from the device's bf16 weights on
  // `stream` (exact): all of it, or where packed the parts the copy holds (a kernel per part:
  // about two per layer).
  Status Widen(int64_t begin, int64_t n, cudaStream_t stream) {
    if (!packed_) return CastBf16ToFp32(d_w16_ + begin, d_w32_ + begin, n, stream);
    return packed_->ForEachIn(begin, begin + n, [&](int64_t b, int64_t at, int64_t k) {
      return CastBf16ToFp32(d_w16_ + b, d_w32_ + at, k, stream);
    });
  }
  // The bf16 weights the model's GEMMs read (GemmInputs::kBf16); null for the fp32 GEMMs.
  const uint16_t* GemmWeights() const {
    return model_.gemm() == GemmInputs::kBf16 ? d_w16_ : nullptr;
  }

  template <typename T>
  Status Alloc(T** p, int64_t bytes, const char* what) {
    return Cuda(cudaMalloc(reinterpret_cast<void**>(p), static_cast<size_t>(bytes > 0 ? bytes : 1)),
                std::string("CUDA device: ") + what + " (" + std::to_string(bytes >> 20) + " MiB)");
  }

  // Pins the buffer's pages. CUDA refuses a copy whose host range is partly pinned
  // (cudaErrorInvalidValue), so only a buffer that owns its pages is pinned: the trainer's are
  // PageVectors (page_vector.h: page-aligned, rounded up to whole pages). One that does not start
  // on a page stays pageable, which only makes its copies slower (Describe counts the pinned).
  Status Register(void* p, int64_t bytes, const char* what) {
    if (bytes == 0) return Status::Ok();
    ++to_pin_;
    if (!StartsOnPage(p)) return Status::Ok();
    const size_t page = HostPageBytes();
    const size_t len = (static_cast<size_t>(bytes) + page - 1) / page * page;
    UCP_RETURN_IF_ERROR(Cuda(cudaHostRegister(p, len, cudaHostRegisterDefault),
                             std::string("CUDA device: pinning the ") + what));
    registered_.push_back(p);
    return Status::Ok();
  }

  // Whether host memory at `p` is pinned (registered, or allocated so): only then does a copy
  // into it run asynchronously.
  static bool IsPinned(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeHost;
  }

  Status MoveState(float* master, float* m, float* v, cudaMemcpyKind kind) {
    int64_t at = 0;
    const bool up = kind == cudaMemcpyHostToDevice;
    for (const DevicePiece& pc : spec_.device_pieces) {
      const size_t bytes = static_cast<size_t>(pc.n) * 4;
      float* host[3] = {master + pc.state_offset, m + pc.state_offset, v + pc.state_offset};
      float* dev[3] = {d_master_ + at, d_m_ + at, d_v_ + at};
      for (int k = 0; k < 3; ++k) {
        UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(up ? dev[k] : host[k], up ? host[k] : dev[k],
                                                 bytes, kind, stream_),
                                 up ? "optimizer state to the device"
                                    : "optimizer state to the host"));
      }
      at += pc.n;
    }
    return Cuda(cudaStreamSynchronize(stream_), "optimizer state transfer");
  }

  TrainDeviceSpec spec_;
  CudaModel model_;
  cudaStream_t stream_ = nullptr;
  float* d_w32_ = nullptr;
  uint16_t* d_w16_ = nullptr;
  float* d_grads_ = nullptr;
  float* d_master_ = nullptr;
  float* d_m_ = nullptr;
  float* d_v_ = nullptr;
  uint8_t* d_norm_ = nullptr;  // GradNormChunks: the chunks' doubles, then their floats
  // The reductions' chunks (the synchronous step's; by grad group the buckets') of chunk_len_
  // elements, and on the GPUs NCCL and one chunk's scratch; without NCCL the host's scratch.
  std::vector<ExchangeChunk> step_chunks_;
  std::vector<std::vector<ExchangeChunk>> bucket_chunks_;
  int64_t chunk_len_ = 0;
#ifdef UCP_OFFLOAD_HAVE_NCCL
  std::unique_ptr<NcclCommunicator> nccl_;
#endif
  float* d_reduce_ = nullptr;
  float* h_reduce_ = nullptr;  // pinned: a chunk's sum on its way to a pageable host buffer
  int64_t reduce_floats_ = 0;
  std::vector<float> host_send_, host_recv_;
  int64_t pieces_n_ = 0;
  int64_t staged_bytes_ = 0;
  std::optional<WeightWindowBook> book_;  // streamed weights; empty: resident
  std::optional<graph::PackedIndex> packed_;  // resident beside bf16 GEMMs: d_w32_'s layout
  // By arena store (WeightWindowBook::Use::store): recorded where the graph released its group
  // (model's stream), and after a prefetch into it (copy stream).
  cudaEvent_t window_free_[4] = {nullptr, nullptr, nullptr, nullptr};
  cudaEvent_t window_ready_[4] = {nullptr, nullptr, nullptr, nullptr};
  int64_t moved_ = 0;
  int device_ = 0;
  std::vector<std::pair<int64_t, int64_t>> group_ranges_;
  std::vector<cudaEvent_t> group_done_;
  cudaEvent_t model_done_ = nullptr;  // AfterModel's
  cudaStream_t h2d_stream_ = nullptr;  // staged: the weights device-ward
  cudaEvent_t staged_grads_[kStagedSlots] = {nullptr, nullptr};
  cudaEvent_t staged_weights_[kStagedSlots] = {nullptr, nullptr};
  std::vector<void*> registered_;
  int to_pin_ = 0;
};

}  // namespace

Status CheckCudaDevice() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess && count > 0) return Status::Ok();
  cudaGetLastError();  // clear the sticky error for later calls
  return DeviceError(std::string("--device cuda: no CUDA device visible") +
                     (err == cudaSuccess ? std::string()
                                         : std::string(" (") + cudaGetErrorName(err) + ": " +
                                               cudaGetErrorString(err) + ")"));
}

Result<int64_t> CudaDeviceMemory(int rank) {
  const int count = DeviceCount();
  if (count == 0) return DeviceError("CUDA device: no CUDA device");
  cudaDeviceProp prop{};
  const int gpu = LauncherLocalRank(rank) % count;
  UCP_RETURN_IF_ERROR(Cuda(cudaGetDeviceProperties(&prop, gpu),
                           "CUDA device: the properties of GPU " + std::to_string(gpu)));
  return static_cast<int64_t>(prop.totalGlobalMem);
}

namespace {

// How the model's Ulysses exchanges move (spec.sp_comm; none without): over an NCCL
// communicator of the sp group where each of its ranks has a GPU of its own and nothing else of
// this device uses NCCL at the same time, else staged through the host over spec.sp_comm.
// (With --pipeline overlap the buckets' NCCL exchanges run on the communicator's thread while
// backward runs: NCCL asks that communicators used concurrently be driven in the same order on
// every rank, which the buckets' timing does not promise.) The communicator is owned by the
// returned functions, so by the model. Collective over the sp group.
Result<SequenceParallel> SequenceExchange(const TrainDeviceSpec& spec) {
  SequenceParallel sp;
  if (spec.sp_comm == nullptr || spec.sp_comm->size() == 1) return sp;
  sp.comm = spec.sp_comm;
#ifdef UCP_OFFLOAD_HAVE_NCCL
  if (!spec.reduce.buckets.empty()) return sp;
  UCP_ASSIGN_OR_RETURN(const bool shared, CudaTrainDevice::SharesAGpu(*spec.sp_comm));
  if (shared) return sp;
  int device = 0;
  UCP_RETURN_IF_ERROR(Cuda(cudaGetDevice(&device), "CUDA device: current device"));
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> made,
                       NcclCommunicator::Create(*spec.sp_comm, device),
                       "CUDA device: the sequence-parallel GPUs' communicator");
  std::shared_ptr<NcclCommunicator> nccl(std::move(made));
  // (SequenceParallel's n is one block's floats; NcclCommunicator's, the whole buffer's.)
  sp.all_to_all = [nccl](const float* send, float* recv, int64_t n, void* stream) {
    return nccl->AllToAll(send, recv, n * nccl->size(), static_cast<cudaStream_t>(stream));
  };
  sp.synchronize = [nccl](void* stream) {
    return nccl->Synchronize(static_cast<cudaStream_t>(stream));
  };
#endif
  return sp;
}

}  // namespace

Result<std::unique_ptr<TrainDevice>> MakeCudaTrainDevice(const TrainDeviceSpec& spec) {
  const int count = DeviceCount();
  if (count == 0) return DeviceError("CUDA device: no CUDA device");
  // The node's processes take its GPUs in turn (by their rank on the node, not in the world).
  UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(LauncherLocalRank(spec.rank) % count),
                           "CUDA device: selecting a GPU"));
  // bf16 GEMMs read the device's bf16 training weights (d_w16_), which every upload, the
  // pipeline's write-back and the device Adam keep current; fp16 and fp32 training read fp32.
  const bool bf16 = spec.gemm_bf16 && spec.weights == LowpDType::kBf16;
  UCP_ASSIGN_OR_RETURN(SequenceParallel sp, SequenceExchange(spec));
  UCP_ASSIGN_OR_RETURN(CudaModel model,
                       CudaModel::Create(spec.model, spec.max_batch, spec.seq_len,
                                         bf16 ? GemmInputs::kBf16 : GemmInputs::kFp32,
                                         bf16 && spec.flash_attention ? AttentionKernel::kFlash
                                                                      : AttentionKernel::kGemm,
                                         std::move(sp), spec.recompute));
  auto dev = std::make_unique<CudaTrainDevice>(spec, std::move(model));
  UCP_RETURN_IF_ERROR(dev->Init());
  return std::unique_ptr<TrainDevice>(std::move(dev));
}

}  // namespace ucp::offload::cuda
