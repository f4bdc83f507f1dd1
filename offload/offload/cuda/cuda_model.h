// The model on the GPU (issue 12): the CPU model's graph (offload/model/model_graph.h, the same
// RunGraph) over the CUDA ops (cuda_ops.h), fp32 activations in device memory. Checked
// against the CPU model on the same weights and batch by cuda_model_test (label gpu).
//
// Its GEMMs (every matrix product, the classifier's too) read either the fp32 weights (kFp32:
// cuBLAS in pedantic fp32, within 1e-5 of the CPU model) or the bf16 training weights with the
// activations rounded to bf16 and fp32 accumulation on the tensor cores (kBf16: what bf16
// training runs on a GPU; within bf16's bounds of the CPU model). kBf16 also runs attention
// through tensor-core GEMMs (AttentionForwardGemm: bf16 q, k, v and probabilities, fp32 softmax
// and accumulation) instead of the fused fp32 kernels, or, with AttentionKernel::kFlash, through
// the tiled flash kernels (AttentionForwardFlash: the same rounding, no T x T buffers). Norms, embeddings, the classifier's
// softmax and every stored activation stay fp32 either way, reading the fp32 weights (with kBf16
// only those: Fp32Layout::kPacked).
//
// Ulysses sequence parallelism (SequenceParallel): the CPU model's exchanges (offload/model/
// ulysses.h), their strided moves run as kernels on the model's stream (cuda_move_rows.h) and
// their all-to-alls over NCCL or staged through pinned host memory, so each rank of an sp group
// holds its shard of the positions as the CPU model's does.
//
// The trainer runs it through cuda_train_device.h (`ucp-train --device cuda`). Backward hooks are
// passed through (the overlapped pipeline's: cuda_train_device.cc orders each bucket's copy after
// its group's kernels with an event).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/model/model.h"
#include "ucp/base/result.h"

namespace ucp::offload::cuda {

/// What the model's matrix products read (see the file comment).
enum class GemmInputs : uint8_t { kFp32, kBf16 };

/// The resident fp32 weights' layout: the whole flat layout, or (kBf16 only) packed to model.h
/// Fp32ReadRanges, the ranges back to back (packed_fp32_elements() floats). The bf16 GEMMs read
/// no fp32 matrix, so a packed copy saves its owner 4 B per matrix parameter of device memory.
enum class Fp32Layout : uint8_t { kWhole, kPacked };

/// How kBf16 runs attention (cuda_ops.h): kGemm, the batched GEMMs over T x T buffers (any
/// head_dim); kFlash, the flash kernels (head_dim 64, 80, 96 or 128; no GEMM attention scratch).
enum class AttentionKernel : uint8_t { kGemm, kFlash };

/// Ulysses sequence parallelism on the GPU (see the file comment); comm null: none.
struct SequenceParallel {
  /// The sp group (rank = shard index; not owned): every batch is agreed over it before any
  /// exchange, and without all_to_all the exchanges go through pinned host memory over it.
  Communicator* comm = nullptr;
  /// The all-to-all of device memory, queued on `stream` (a cudaStream_t): P blocks of n floats
  /// each way, block j of recv from rank j's block r (NcclCommunicator::AllToAll); empty: staged
  /// through the host over comm (a copy each way and the stream's synchronisation).
  std::function<Status(const float* send, float* recv, int64_t n, void* stream)> all_to_all;
  /// With all_to_all: how a run waits for the model's stream (NcclCommunicator::Synchronize,
  /// which turns a peer's failure into an error where a plain wait would hang); empty: a plain
  /// wait.
  std::function<Status(void* stream)> synchronize;
};

class CudaModel {
 public:
  /// Activations for micro-batches up to max_batch x max_seq_len on the current device (and,
  /// for kBf16, the bf16 scratch its GEMMs round their inputs into). With `sp` over P ranks,
  /// max_seq_len is the whole sample's (model.h Model::Create): the activations hold this rank's
  /// max_seq_len / P positions, and every Forward and ForwardBackward is collective over the
  /// group, each rank passing its shard (Batch::position_offset = rank x shard length).
  /// Errors: kInvalidArgument (config, sizes, the sequence-parallel rules; kFlash beside kFp32
  /// or with a head_dim the flash kernels do not take), kDeviceError (no device, allocation,
  /// cuBLAS), kResourceExhausted (memory). `recompute`: as model.h Model::Create's (the
  /// recomputed layers keep their outputs and share one layer's other activations; backward
  /// reruns their kernels, which are deterministic, so the bits are those of keeping them all).
  static Result<CudaModel> Create(const ModelConfig& config, int64_t max_batch,
                                  int64_t max_seq_len, GemmInputs gemm = GemmInputs::kFp32,
                                  AttentionKernel attention = AttentionKernel::kGemm,
                                  SequenceParallel sp = {},
                                  Recompute recompute = Recompute::None());
  CudaModel(CudaModel&&) noexcept;
  CudaModel& operator=(CudaModel&&) noexcept;
  ~CudaModel();

  const ModelConfig& config() const;
  /// The CPU model's parameter table: the same flat layout.
  const std::vector<ParamInfo>& params() const;
  int64_t num_params() const;

  /// The sp group's size (1: no sequence parallelism), and whether its all-to-alls run on the
  /// device (SequenceParallel::all_to_all) rather than through the host.
  int sp_size() const;
  bool sp_on_device() const;
  GemmInputs gemm() const;
  AttentionKernel attention() const;
  Recompute recompute() const;
  /// The floats of Fp32Layout::kPacked's weights (kBf16; 0 for kFp32).
  int64_t packed_fp32_elements() const;

  /// `weights` and `grads`: device (or managed) pointers to num_params() floats; the batch's
  /// tokens are host memory (copied in). As Model::Forward / ForwardBackward (backward adds into
  /// grads), synchronised at the end (the loss is returned to the host). `weights16`: the bf16
  /// bits of the same weights, same layout (kBf16 only, required there; the caller keeps the
  /// two in step: the fp32 weights are the bf16 ones widened). `fp32`: kPacked, `weights` holds
  /// packed_fp32_elements() floats (kBf16 only).
  /// Errors: kInvalidArgument (batch sizes, a token >= vocab, weights16 missing or not wanted,
  /// kPacked beside fp32 GEMMs; under SP any rank's refusal, or shards that are not one
  /// sample's, on every rank), kDeviceError, those of the sp group's communicator.
  Result<double> Forward(const float* weights, const Batch& batch,
                         const uint16_t* weights16 = nullptr,
                         Fp32Layout fp32 = Fp32Layout::kWhole);
  /// `hook` (optional): RunGraph's, called on this thread as each grad group's backward kernels
  /// are queued on stream(); record an event there to order work after them.
  Result<double> ForwardBackward(const float* weights, float* grads, const Batch& batch,
                                 float grad_scale, const BackwardHook* hook = nullptr,
                                 const uint16_t* weights16 = nullptr,
                                 Fp32Layout fp32 = Fp32Layout::kWhole);
  /// On streamed weights (model.h WeightWindows): the windows hand out device pointers into
  /// `arena` (fp32 weights and, at the same offsets in their own arena, gradients) whose bf16
  /// bits are `arena16` at the same element offsets (kBf16 only; the GEMMs find a slot's bf16
  /// twin by its offset in the arena). Acquire and Release run on this thread, between the
  /// kernels they order themselves against on stream(). Errors: as above, and the windows'.
  Result<double> Forward(WeightWindows& windows, const Batch& batch, const float* arena,
                         const uint16_t* arena16 = nullptr);
  Result<double> ForwardBackward(WeightWindows& windows, const Batch& batch, float grad_scale,
                                 const BackwardHook* hook, const float* arena,
                                 const uint16_t* arena16 = nullptr);
  /// The stream every kernel of the model runs on (a cudaStream_t).
  void* stream() const;

  /// Device time by op, for the benchmarks: with ProfileOps(true) each op of every run records
  /// an event on stream() where it begins (an op's time lasts to the next one's start), summed
  /// by op (a matrix product by its sizes, "matmul fwd C->OC") once the run has synchronised.
  /// TakeOpTimes returns the sums since the last call, largest first. Off by default (an event
  /// per op; the kernels themselves are unchanged).
  struct OpTime {
    std::string op;
    int64_t calls = 0;
    double ms = 0;
    /// the matrix products' (2 per multiply-add) and attention's (its causal products, whatever
    /// the kernel computes); 0 for other ops
    double flops = 0;
  };
  void ProfileOps(bool on);
  std::vector<OpTime> TakeOpTimes();

 private:
  struct Impl;
  explicit CudaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::offload::cuda
