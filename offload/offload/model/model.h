// The engine's models: GPT-2 / Megatron GPT and LLaMA, forward and backward on the CPU in fp32,
// written llm.c style as one flat function per op (ops.h, each with a scalar reference twin).
// Parameters are named and shaped exactly as ucp's canonical names at tp=1, pp=1 (patterns/
// gpt.json, llama.json), with the vocabulary rows padded as the tp=1 rank holds them, so a
// checkpoint slice is a parameter with no translation.
//
// The model is stateless across calls apart from its activation scratch: the caller owns the
// weights (fp32, the compute copy; the trainer widens its bf16/fp16 weights into it) and the
// gradients (fp32, accumulated with +=, so micro-batches add up).
//
// Sequence parallelism (DeepSpeed-Ulysses): a Model created with an sp communicator of size
// P > 1 is one of the P ranks that process the same samples, each holding a contiguous shard of
// T/P positions. Everything position-wise runs on the shard; attention runs over the whole
// sequence for this rank's heads, between two all-to-alls (model.cc has the layout). The trainer
// only creates the model with the sp group and passes each rank its shard with position_offset.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"
#include "ucp/patterns/model.h"

namespace ucp::offload {

class Communicator;

enum class Family : uint8_t { kGpt, kLlama };

/// Which layers a model recomputes rather than keeps (activation checkpointing; Megatron's "full"
/// recomputation by "block": the first `layers` layers). Those layers keep only their output
/// (the next layer's input) and share one layer's worth of the rest, which backward refills by
/// rerunning each of them from its input just before its backward (the last of them is still
/// there from forward); the other layers keep everything (model.cc lists it). 0: none; at least
/// the model's layers (All()): every layer, the least memory. The ops are deterministic, so a
/// rerun writes the bits the first run wrote and the gradients are bitwise those of the model
/// that keeps everything; the cost is one more forward of the recomputed layers, up to about a
/// third more compute, which MFU (ModelStepFlops) does not count.
struct Recompute {
  int64_t layers = 0;
  static constexpr Recompute None() { return {0}; }
  static constexpr Recompute All() { return {std::numeric_limits<int64_t>::max()}; }
  /// The layers recomputed in a model of `total` layers.
  constexpr int64_t Of(int64_t total) const {
    return layers < 0 ? 0 : layers < total ? layers : total;
  }
  bool operator==(const Recompute&) const = default;
};

/// Hyper-parameters the math needs. From a patterns::ModelSpec (FromSpec) or set by hand in tests.
struct ModelConfig {
  Family family = Family::kGpt;
  int64_t vocab = 0;         ///< real vocabulary; the loss and logits cover only these rows
  int64_t padded_vocab = 0;  ///< rows of the embedding / output matrices (vocab rounded up to
                             ///< make_vocab_size_divisible_by, as the tp=1 rank holds them)
  int64_t hidden = 0;
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;  ///< == heads for GPT
  int64_t head_dim = 0;  ///< from the preset, never re-derived
  int64_t ffn_hidden = 0;
  int64_t max_positions = 0;  ///< longest sequence (GPT: rows of the position embedding)
  bool tied_embeddings = true;
  float norm_eps = 1e-5f;       ///< LayerNorm (GPT) and RMSNorm (LLaMA)
  float rope_theta = 10000.0f;  ///< LLaMA only; half-split (rotate_half) rotary over head_dim

  /// Errors: kInvalidArgument naming the hyper-parameter (unknown family, heads % kv_heads,
  /// non-positive sizes).
  static Result<ModelConfig> FromSpec(const patterns::ModelSpec& spec);
};

/// One parameter of the flat weight / gradient buffers.
struct ParamInfo {
  std::string name;            ///< canonical global name ("layers.3.mlp.dense_h_to_4h.weight")
  std::vector<int64_t> shape;  ///< as the tp=1 rank holds it (vocab rows padded)
  int64_t offset = 0;          ///< in elements, into the flat buffers
  int64_t numel = 0;
};

/// Parameters whose gradients one backward completes together: params()[first_param, end_param).
struct GradGroup {
  std::string name;  ///< "head" (final norm, untied output layer), "layers.N", "embedding"
  int64_t first_param = 0;
  int64_t end_param = 0;
};

/// What ForwardBackward tells its caller during backward, on the calling thread (so a callback
/// must be short: it hands the work to other threads). For the offloaded optimizer pipeline
/// (offload/engine), whose buckets leave while backward goes on.
struct BackwardHook {
  /// When backward starts (the loss and the classifier's gradient are done). Optional.
  std::function<void()> on_backward_begin;
  /// When the gradients of grad_groups()[group] are complete (this call's += is done and nothing
  /// later in this call writes them), in the order of grad_groups(). Optional.
  std::function<void(int group)> on_group_done;
  /// Forward is about to read the weights of grad_groups()[group] for the first time in this
  /// call, in forward's order (the embeddings, the layers up, the head); it may block until they
  /// are ready (the pipeline's finish under forward, pipeline.h StartFinish). Optional.
  std::function<void(int group)> on_group_needed;
};

/// Streamed weights (issue 12, "adaptive weight placement"; docs/offload.md, "Weight streaming"):
/// where each grad group's weights and gradients are while the graph uses them, when a device
/// holds only a few groups at a time. The graph acquires a group before it first reads the
/// group's weights (forward) or adds into its gradients (backward, `grads` true), and releases it
/// when it is done with them: in backward the release means the group's gradients are complete
/// for this call (the device then moves them out). Calls on the model's thread, in the graph's
/// order: forward acquires and releases the embeddings, each layer up, then the head (and, with
/// tied embeddings, the embeddings again for the classifier, kept through backward); backward the
/// head, each layer down, the embeddings. A group is acquired at most once at a time.
class WeightWindows {
 public:
  virtual ~WeightWindows() = default;
  /// Where group `group`'s first element is: weights (and, with `grads`, gradients; else null),
  /// each the group's elements contiguous in model order.
  struct Slot {
    const float* weights = nullptr;
    float* grads = nullptr;
  };
  virtual Result<Slot> Acquire(int group, bool grads) = 0;
  virtual Status Release(int group, bool grads) = 0;
};

/// What one training micro-batch is: B sequences of T tokens, inputs and next-token targets.
/// A target < 0 contributes no loss (padding / masked). Under sequence parallelism over P ranks
/// it is this rank's shard: T = the sample length / P tokens of each of the B samples.
struct Batch {
  std::span<const int32_t> inputs;   ///< [B, T]
  std::span<const int32_t> targets;  ///< [B, T]
  int64_t batch = 0;                 ///< B
  int64_t seq_len = 0;               ///< T, this shard's tokens per sequence
  /// The position of token t is position_offset + t (GPT's position-embedding row, LLaMA's RoPE
  /// angle); position_offset + T <= the model's max_seq_len. Under sequence parallelism rank r
  /// holds positions [position_offset, position_offset + T) of the sample, and the ranks' shards
  /// must be consecutive in rank order: position_offset == base + r * T with one base (usually
  /// 0, so position_offset = r * T), the same B and the same T on every rank.
  int64_t position_offset = 0;
};

/// Checks that Ulysses sequence parallelism over `sp` ranks fits `config` and samples of
/// `seq_len` tokens (DeepSpeed's rules): heads % sp == 0; kv_heads % sp == 0 (each rank takes
/// kv_heads / sp KV heads) or sp % kv_heads == 0 (each KV head is replicated on the sp / kv_heads
/// ranks whose query heads use it); seq_len % sp == 0. sp == 1 always fits. A pure function, for
/// the trainer's layout checks; Model::Create applies it to max_seq_len.
/// Errors: kInvalidArgument naming the numbers (sp < 1, heads, kv_heads, seq_len).
Status ValidateSequenceParallel(const ModelConfig& config, int64_t sp, int64_t seq_len);

/// The model's parameter table and grad groups, without creating a model (Model::params() and
/// grad_groups() of a model of this config). Errors: kInvalidArgument (config).
struct ParamTable {
  std::vector<ParamInfo> params;
  std::vector<GradGroup> groups;
  int64_t total = 0;  ///< elements of the flat weight / gradient buffers
};
Result<ParamTable> ModelParamTable(const ModelConfig& config);

/// The bytes Model::Create(config, max_batch, max_seq_len, num_threads, sp group of `sp`,
/// recompute) allocates for activations, backward scratch and the ops' scratch: a pure function
/// (for the memory plan, offload/train/memory_plan.h), equal to that model's activation_bytes().
/// Errors: kInvalidArgument (config, sizes, the sequence-parallel rules, recompute.layers < 0).
Result<int64_t> ActivationBytes(const ModelConfig& config, int64_t max_batch, int64_t max_seq_len,
                                int num_threads, int sp = 1,
                                Recompute recompute = Recompute::None());

/// What the CUDA model (offload/cuda/cuda_model.h) allocates on the device for micro-batches of
/// up to max_batch x max_seq_len tokens: its activations (the same buffers as the CPU model's)
/// and its scratch (offload/model/gpu_sizes.h; with gemm_bf16 the bf16 GEMMs' and the GEMM
/// attention's, or with flash_attention as well the flash kernels' in the GEMM attention's
/// place). With an sp group of `sp` ranks, this rank's shard of the activations and Ulysses'
/// buffers (and, for the flash kernels, the output by heads their backward reads); with
/// `recompute`, the activations it keeps. Host code: the memory plan's GPU column.
/// Errors: as ActivationBytes.
Result<int64_t> DeviceActivationBytes(const ModelConfig& config, int64_t max_batch,
                                      int64_t max_seq_len, bool gemm_bf16,
                                      bool flash_attention = false, int sp = 1,
                                      Recompute recompute = Recompute::None());

/// The floats of Ulysses' largest exchange over `sp` ranks (qkv's, each rank's max_seq_len / sp
/// positions of up to max_batch sequences): its send buffer, and its receive buffer; 0 at sp = 1.
/// A GPU whose sp exchanges do not go over NCCL stages them through two pinned host buffers of
/// this size (offload/cuda/cuda_model.h), which the memory plan's host column counts.
/// Errors: as ActivationBytes.
Result<int64_t> UlyssesExchangeFloats(const ModelConfig& config, int64_t max_batch,
                                      int64_t max_seq_len, int sp);

/// The flat layout's element ranges [begin, end) that a model whose GEMMs read bf16 weights
/// (the CUDA model's GemmInputs::kBf16) still reads in fp32: every parameter but the GEMMs'
/// matrices, i.e. the norms, the biases and the embeddings (the encoder looks its rows up in
/// fp32; tied embeddings are the head's matrix too, so they stay). Ascending, adjacent ones
/// merged. The CUDA device packs its fp32 compute copy to these (a 10B LLaMA: 0.6% of it), and
/// the memory plan counts the same elements. Errors: kInvalidArgument (config).
Result<std::vector<std::pair<int64_t, int64_t>>> Fp32ReadRanges(const ModelConfig& config);

/// Model FLOPs of one forward + backward over batch x seq_len tokens (the MFU numerator):
/// 6 x the matrix parameters the tokens multiply (the head included; embedding lookups are not
/// products) per token, plus causal attention's two products, 6 x layers x seq_len x heads x
/// head_dim per token (12 for the full square, halved for causality).
double ModelStepFlops(const ModelConfig& config, const ParamTable& table, int64_t batch,
                      int64_t seq_len);

class Model {
 public:
  /// Allocates activation scratch for micro-batches up to `max_batch` x `max_seq_len`.
  /// `num_threads` bounds every parallel region (BLAS and oneTBB together).
  /// `sp_comm`: the sequence-parallel group (rank = shard index), not owned, used from the
  /// calling thread only and kept until the model is destroyed; null or of size 1: no sequence
  /// parallelism. With P = sp_comm->size() > 1, max_seq_len is the whole sample's length (each
  /// shard holds at most max_seq_len / P positions) and ValidateSequenceParallel(config, P,
  /// max_seq_len) must pass. `recompute`: the layers backward reruns rather than finds kept
  /// (Recompute; the same bits either way).
  /// Errors: kInvalidArgument (config; max_seq_len > max_positions for GPT; the sequence-parallel
  /// rules; recompute.layers < 0), kResourceExhausted.
  static Result<Model> Create(const ModelConfig& config, int64_t max_batch, int64_t max_seq_len,
                              int num_threads, Communicator* sp_comm = nullptr,
                              Recompute recompute = Recompute::None());
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model();

  const ModelConfig& config() const;
  /// In canonical order (the rule set's template order, layers expanded), tiling [0, num_params).
  const std::vector<ParamInfo>& params() const;
  int64_t num_params() const;
  /// The sequence-parallel size P and this rank's shard index (1 and 0 without SP).
  int sp_size() const;
  int sp_rank() const;
  /// The bytes this model holds for activations and scratch (what ActivationBytes predicts).
  int64_t activation_bytes() const;
  Recompute recompute() const;

  /// Sum over the batch of the per-token cross-entropy (natural log) of tokens with target >= 0,
  /// in double (under SP: over this shard's tokens). Writes nothing but scratch.
  /// Under SP, Forward and ForwardBackward are collective over the sp group: every rank makes the
  /// same calls in the same order. They first agree on the batch (one all-reduce of 9 int64), so
  /// a batch refused on any rank is refused on all of them, before any all-to-all.
  /// Errors: kInvalidArgument (sizes, a token >= vocab, position_offset; under SP also a peer's
  /// refusal, or shards that are not consecutive or differ in B or T); kIoError when the sp
  /// communicator fails (the peers may then be stuck in a collective: Abort the job).
  Result<double> Forward(std::span<const float> weights, const Batch& batch);

  /// Forward, then backward of `grad_scale * sum of per-token losses`, adding the gradients into
  /// `grads` (+=, fp32, the same layout as weights). Returns the same loss sum as Forward. The
  /// trainer passes grad_scale = loss_scale / (global count of target tokens), so the gradients
  /// are those of the mean loss over the global batch whatever the micro-batching.
  /// Deterministic: the same inputs and thread count give the same bits (under SP: and the same
  /// P). Under SP, `grads` gets this shard's partial sums (sum them over the dp x sp ranks) and
  /// the loss is this shard's sum. Errors: as Forward.
  Result<double> ForwardBackward(std::span<const float> weights, std::span<float> grads,
                                 const Batch& batch, float grad_scale);

  /// The groups backward completes, in the order it completes them: "head" (final norm and, when
  /// untied, the output layer), then "layers.L-1" down to "layers.0", then "embedding" (with
  /// tied embeddings it also holds the head's matrix, whose gradient the encoder adds last).
  /// Together they tile [0, params().size()).
  const std::vector<GradGroup>& grad_groups() const;

  /// ForwardBackward, calling `hook` as backward completes each grad group. The arithmetic and
  /// its bits are the plain overload's; the plain overload runs no hook code at all.
  /// Errors: as ForwardBackward (a refused batch calls no hook).
  Result<double> ForwardBackward(std::span<const float> weights, std::span<float> grads,
                                 const Batch& batch, float grad_scale, const BackwardHook& hook);

  /// Forward / ForwardBackward on streamed weights: the graph reads each group's weights and
  /// adds into its gradients where `windows` puts them (the same arithmetic, so the same bits as
  /// the flat overloads on the same values). `hook` may be null. Errors: as ForwardBackward, and
  /// what `windows` returns (the call then stops).
  Result<double> Forward(WeightWindows& windows, const Batch& batch);
  Result<double> ForwardBackward(WeightWindows& windows, const Batch& batch, float grad_scale,
                                 const BackwardHook* hook);

 private:
  struct Impl;
  explicit Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::offload
