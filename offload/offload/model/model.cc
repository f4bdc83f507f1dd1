// GPT and LLaMA, forward and backward, as one graph templated on the ops (fast fp32 or the scalar
// reference in double), so the model and its oracle cannot drift apart.
//
// THE MATH (the single source of truth; a PyTorch reference copies this block).
//   Notation: x rows are tokens, N = B*T; Linear layers store weight [out, in] and compute
//   y = x W^T (+ b). Names are the canonical parameter names (patterns/gpt.json, llama.json).
//   Embedding and output matrices have padded_vocab rows; rows >= vocab are never read by the
//   loss and get exactly zero gradient.
//
//   GPT:
//     x = wte[tok] + wpe[pos]                      embedding.word/position_embeddings.weight
//     per layer:
//       h = LN1(x)                                 input_layernorm.{weight,bias}
//       qkv = h Wqkv^T + bqkv                      self_attention.query_key_value.{weight,bias}
//       a = attention(qkv)
//       x = x + (a Wo^T + bo)                      self_attention.dense.{weight,bias}
//       h = LN2(x)                                 post_attention_layernorm.{weight,bias}
//       x = x + (gelu_tanh(h W1^T + b1) W2^T + b2) mlp.dense_h_to_4h / mlp.dense_4h_to_h
//     x = LN_f(x)                                  final_layernorm.{weight,bias}
//     logits = x wte[:vocab]^T (tied) or x output_layer[:vocab]^T
//     LN(x) = (x - mean) / sqrt(var + eps) * w + b, biased variance, eps = norm_eps (1e-5).
//   LLaMA (no biases, no position embedding):
//     x = wte[tok]
//     per layer:
//       h = RMSNorm1(x)                            input_layernorm.weight
//       qkv = h Wqkv^T; RoPE on every q and k head
//       x = x + attention(qkv) Wo^T
//       h = RMSNorm2(x)                            post_attention_layernorm.weight
//       [gate | up] = h W1^T                       W1 = mlp.dense_h_to_4h.weight [2*ffn, hidden]:
//                                                  rows [0, ffn) gate, rows [ffn, 2 ffn) up
//       x = x + (silu(gate) * up) W2^T             mlp.dense_4h_to_h.weight
//     x = RMSNorm_f(x)                             final_layernorm.weight
//     logits = x output_layer[:vocab]^T (untied) or x wte[:vocab]^T (tied)
//     RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w, eps = norm_eps (1e-5).
//   Fused QKV rows (Megatron interleaved_groups): kv_heads groups; group g holds, in order, the q
//     rows of its heads/kv_heads query heads (head after head, head_dim rows each), then k
//     (head_dim rows), then v (head_dim rows). Query head h uses group h / (heads / kv_heads).
//     GPT is kv_heads == heads: per head [q | k | v].
//   Attention: per (sequence, query head), causal, s_tj = (q_t . k_j) / sqrt(head_dim) for j <= t,
//     softmax over j in fp32 with the max subtracted, a_t = sum_j p_tj v_j; the heads' outputs are
//     concatenated head after head: a[:, h*head_dim:(h+1)*head_dim].
//   Positions: token t of a Batch is at p = position_offset + t (0 unless the batch is a shard
//     of longer sequences, as under sequence parallelism): GPT adds wpe[p], LLaMA rotates by p.
//   RoPE (rotate_half, HF LLaMA / Megatron non-interleaved): position p as above; for i in
//     [0, head_dim/2): inv_freq_i = theta^(-2i/head_dim), angle = p * inv_freq_i, with inv_freq,
//     angle, cos and sin all evaluated in DOUBLE and cos/sin then rounded to float once (torch:
//     (p.double()[:, None] * inv_freq.double()).cos().float()). This differs from HF's float32
//     inv_freq by ~1 ulp of the angle; we pick double so the value does not depend on how a library
//     rounds float32 pow. Then (x_i, x_{i+d/2}) -> (x_i cos - x_{i+d/2} sin, x_{i+d/2} cos + x_i
//     sin), theta = rope_theta (10000).
//   silu(g) = g / (1 + exp(-g)); gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
//   Loss: sum over positions with target >= 0 of -log softmax(logits[:vocab])[target] (natural
//     log), returned in double; ForwardBackward backpropagates grad_scale * sum and ADDS the
//     gradients into `grads`. With tied embeddings wte gets the embedding and the classifier
//     gradients.
//   Sequence parallelism (DeepSpeed-Ulysses, P = sp ranks, rank r holds positions
//     [position_offset, position_offset + T) with position_offset = base + r T): the graph above,
//     unchanged, with attention(qkv) computed over all P T positions of the sample. Every other
//     op is position-wise, so it runs on the shard alone; attention is per head, so an all-to-all
//     gives each rank the whole sequence of NH/P query heads (and their KV heads), causal by
//     absolute position, and a second one returns the output rows to their shards (layout and
//     head assignment: offload/model/ulysses.h). Backward is the same transposed: the adjoint of
//     an all-to-all is the reverse all-to-all, and the adjoint of handing one KV head to several
//     ranks is the sum of their KV gradients (in rank order). The loss is the shard's sum and
//     every weight gradient is the shard's partial sum; the sum over the P shards is the loss and
//     the gradient of the whole sequence, up to the order of the adds (~1e-6 relative in fp32).
//
// Activations kept for backward (per layer, llm.c's layout): the norm outputs and their
// statistics, qkv (after RoPE; under SP the gathered [B, T, local heads] copy attention reads),
// the attention output and its row log-sum-exp (the probabilities are recomputed in backward),
// the residual stream after attention and after the MLP, the MLP's pre-activation and activation.
// Recomputed layers (Recompute: the first r) keep only the residual stream after the layer; the
// rest of theirs is one layer's, rewritten by the rerun of each one's forward before its backward.
#include "offload/model/model.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

#include "offload/comm/communicator.h"
#include "offload/model/gpu_sizes.h"
#include "offload/model/model_graph.h"
#include "offload/model/model_ref.h"
#include "offload/model/ops.h"
#include "offload/model/ulysses.h"
#include "ucp/base/check.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload {

using graph::Acts;
using graph::BuildLayout;
using graph::LayerOffsets;
using graph::Layout;
using graph::RefOps;
using graph::RunGraph;
using graph::UlyssesGeometry;
using HostUlysses = graph::Ulysses<float, graph::HostUlyssesBackend<float>>;

namespace {

std::string Str(int64_t v) { return std::to_string(v); }

Status ValidateConfig(const ModelConfig& c) {
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab", c.vocab},       {"padded_vocab", c.padded_vocab},
      {"hidden", c.hidden},     {"layers", c.layers},
      {"heads", c.heads},       {"kv_heads", c.kv_heads},
      {"head_dim", c.head_dim}, {"ffn_hidden", c.ffn_hidden}};
  for (const auto& [name, v] : positive) {
    if (v < 1) return InvalidArgumentError(std::string(name) + "=" + Str(v) + " must be >= 1");
  }
  if (c.padded_vocab < c.vocab) {
    return InvalidArgumentError("padded_vocab=" + Str(c.padded_vocab) + " < vocab=" + Str(c.vocab));
  }
  if (c.heads % c.kv_heads != 0) {
    return InvalidArgumentError("heads=" + Str(c.heads) +
                                " not divisible by kv_heads=" + Str(c.kv_heads));
  }
  if (c.family == Family::kGpt) {
    if (c.kv_heads != c.heads) {
      return InvalidArgumentError("gpt: kv_heads=" + Str(c.kv_heads) +
                                  " must equal heads=" + Str(c.heads));
    }
    if (c.max_positions < 1) {
      return InvalidArgumentError("gpt: max_positions=" + Str(c.max_positions) + " must be >= 1");
    }
  } else if (c.head_dim % 2 != 0) {
    return InvalidArgumentError("llama: head_dim=" + Str(c.head_dim) + " must be even (RoPE)");
  }
  if (!(c.norm_eps > 0.0f)) return InvalidArgumentError("norm_eps must be > 0");
  return Status::Ok();
}


// The canonical parameter list, mirroring the "parameters" templates of patterns/gpt.json and
// patterns/llama.json (model_test checks the two agree) with the vocabulary rows padded.
}  // namespace

Result<graph::Layout> graph::BuildLayout(const ModelConfig& c) {
  UCP_RETURN_IF_ERROR(ValidateConfig(c));
  Layout lay;
  const bool gpt = c.family == Family::kGpt;
  const int64_t C = c.hidden, qkv_rows = (c.heads + 2 * c.kv_heads) * c.head_dim;
  const int64_t ah = c.heads * c.head_dim, F = c.ffn_hidden;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    ParamInfo p;
    p.name = std::move(name);
    p.numel = 1;
    for (int64_t d : shape) p.numel *= d;
    p.shape = std::move(shape);
    p.offset = lay.total;
    lay.total += p.numel;
    lay.params.push_back(std::move(p));
    return lay.params.back().offset;
  };
  lay.wte = add("embedding.word_embeddings.weight", {c.padded_vocab, C});
  if (gpt) lay.wpe = add("embedding.position_embeddings.weight", {c.max_positions, C});
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "layers." + Str(l) + ".";
    LayerOffsets o;
    o.ln1_w = add(p + "input_layernorm.weight", {C});
    if (gpt) o.ln1_b = add(p + "input_layernorm.bias", {C});
    o.qkv_w = add(p + "self_attention.query_key_value.weight", {qkv_rows, C});
    if (gpt) o.qkv_b = add(p + "self_attention.query_key_value.bias", {qkv_rows});
    o.proj_w = add(p + "self_attention.dense.weight", {C, ah});
    if (gpt) o.proj_b = add(p + "self_attention.dense.bias", {C});
    o.ln2_w = add(p + "post_attention_layernorm.weight", {C});
    if (gpt) o.ln2_b = add(p + "post_attention_layernorm.bias", {C});
    o.fc_w = add(p + "mlp.dense_h_to_4h.weight", {gpt ? F : 2 * F, C});
    if (gpt) o.fc_b = add(p + "mlp.dense_h_to_4h.bias", {F});
    o.fc2_w = add(p + "mlp.dense_4h_to_h.weight", {C, F});
    if (gpt) o.fc2_b = add(p + "mlp.dense_4h_to_h.bias", {C});
    lay.layers.push_back(o);
  }
  lay.lnf_w = add("final_layernorm.weight", {C});
  if (gpt) lay.lnf_b = add("final_layernorm.bias", {C});
  if (!c.tied_embeddings) lay.out = add("output_layer.weight", {c.padded_vocab, C});
  return lay;
}

namespace {


// The fast fp32 ops, all on the Parallel's arena.
struct FastOps {
  Parallel* par;
  void Zero(float* p, int64_t n) {
    par->For(n, [&](int, int64_t i0, int64_t i1) { std::fill(p + i0, p + i1, 0.0f); });
  }
  // clang-format off
  template <typename... A> void EncoderForward(A... a) { ops::EncoderForward(*par, a...); }
  template <typename... A> void EncoderBackward(A... a) { ops::EncoderBackward(*par, a...); }
  template <typename... A> void LayerNormForward(A... a) { ops::LayerNormForward(*par, a...); }
  template <typename... A> void LayerNormBackward(A... a) { ops::LayerNormBackward(*par, a...); }
  template <typename... A> void RmsNormForward(A... a) { ops::RmsNormForward(*par, a...); }
  template <typename... A> void RmsNormBackward(A... a) { ops::RmsNormBackward(*par, a...); }
  template <typename... A> void MatmulForward(A... a) { ops::MatmulForward(*par, a...); }
  template <typename... A> void MatmulBackward(A... a) { ops::MatmulBackward(*par, a...); }
  template <typename... A> void AttentionForward(A... a) { ops::AttentionForward(*par, a...); }
  template <typename... A> void AttentionBackward(A... a) { ops::AttentionBackward(*par, a...); }
  template <typename... A> void RopeForward(A... a) { ops::RopeForward(*par, a...); }
  template <typename... A> void RopeBackward(A... a) { ops::RopeBackward(*par, a...); }
  template <typename... A> void GeluForward(A... a) { ops::GeluForward(*par, a...); }
  template <typename... A> void GeluBackward(A... a) { ops::GeluBackward(*par, a...); }
  template <typename... A> void SwigluForward(A... a) { ops::SwigluForward(*par, a...); }
  template <typename... A> void SwigluBackward(A... a) { ops::SwigluBackward(*par, a...); }
  template <typename... A> void ResidualForward(A... a) { ops::ResidualForward(*par, a...); }
  // clang-format on
  double Classifier(float* dx, float* dw, const float* x, const float* w, const int32_t* tg,
                    int64_t N, int64_t C, int64_t V, float grad_scale) {
    return ops::ClassifierForwardBackward(*par, dx, dw, x, w, tg, N, C, V, grad_scale);
  }
};

// max_seq_len: the most tokens per sequence of the batch (the shard's under SP); max_position:
// the exclusive bound of position_offset + seq_len (the model's max_seq_len).
Status ValidateBatch(const ModelConfig& c, const Batch& batch, int64_t max_batch,
                     int64_t max_seq_len, int64_t max_position) {
  if (batch.batch < 1 || batch.batch > max_batch) {
    return InvalidArgumentError("batch=" + Str(batch.batch) + " not in [1, " + Str(max_batch) +
                                "]");
  }
  if (batch.seq_len < 1 || batch.seq_len > max_seq_len) {
    return InvalidArgumentError("seq_len=" + Str(batch.seq_len) + " not in [1, " +
                                Str(max_seq_len) + "]");
  }
  if (batch.position_offset < 0 || batch.position_offset > max_position - batch.seq_len) {
    return InvalidArgumentError(
        "position_offset=" + Str(batch.position_offset) + " with seq_len=" + Str(batch.seq_len) +
        " reaches past max_seq_len=" + Str(max_position) + " positions (or is negative)");
  }
  const int64_t n = batch.batch * batch.seq_len;
  if (static_cast<int64_t>(batch.inputs.size()) != n ||
      static_cast<int64_t>(batch.targets.size()) != n) {
    return InvalidArgumentError("inputs/targets hold " + Str(batch.inputs.size()) + "/" +
                                Str(batch.targets.size()) + " tokens, batch*seq_len=" + Str(n));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (batch.inputs[i] < 0 || batch.inputs[i] >= c.vocab) {
      return InvalidArgumentError("input token " + Str(batch.inputs[i]) + " at index " + Str(i) +
                                  " not in [0, vocab=" + Str(c.vocab) + ")");
    }
    if (batch.targets[i] >= c.vocab) {
      return InvalidArgumentError("target token " + Str(batch.targets[i]) + " at index " + Str(i) +
                                  " >= vocab=" + Str(c.vocab));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<ModelConfig> ModelConfig::FromSpec(const patterns::ModelSpec& spec) {
  ModelConfig c;
  if (spec.family == "gpt") {
    c.family = Family::kGpt;
  } else if (spec.family == "llama") {
    c.family = Family::kLlama;
  } else {
    return InvalidArgumentError("model \"" + spec.name + "\": family \"" + spec.family +
                                "\" is not gpt or llama");
  }
  auto get = [&](const char* key, int64_t fallback) {
    auto it = spec.hyper.find(key);
    return it == spec.hyper.end() ? fallback : it->second;
  };
  for (const char* key : {"hidden", "layers", "heads", "vocab", "ffn_hidden"}) {
    if (!spec.hyper.contains(key)) {
      return InvalidArgumentError("model \"" + spec.name + "\": missing hyper-parameter " + key);
    }
  }
  c.hidden = get("hidden", 0);
  c.layers = get("layers", 0);
  c.heads = get("heads", 0);
  c.kv_heads = get("kv_heads", c.heads);
  c.head_dim = get("head_dim", c.heads > 0 ? c.hidden / c.heads : 0);
  c.ffn_hidden = get("ffn_hidden", 0);
  c.vocab = get("vocab", 0);
  c.max_positions = get("max_positions", 0);
  c.tied_embeddings = get("tied_embeddings", 0) != 0;
  const int64_t divisible_by = get("make_vocab_size_divisible_by", 1);
  if (divisible_by < 1) {
    return InvalidArgumentError("model \"" + spec.name + "\": make_vocab_size_divisible_by=" +
                                Str(divisible_by) + " must be >= 1");
  }
  c.padded_vocab = (c.vocab + divisible_by - 1) / divisible_by * divisible_by;
  UCP_RETURN_IF_ERROR(ValidateConfig(c), "model \"" + spec.name + "\"");
  return c;
}

Result<std::vector<ParamInfo>> ModelParams(const ModelConfig& config) {
  UCP_ASSIGN_OR_RETURN(Layout lay, BuildLayout(config));
  return std::move(lay.params);
}

Result<double> RefForwardBackward(const ModelConfig& config, std::span<const double> weights,
                                  std::span<double> grads, const Batch& batch, double grad_scale) {
  UCP_ASSIGN_OR_RETURN(Layout lay, BuildLayout(config));
  const int64_t max_seq = std::max(batch.seq_len, int64_t{1});
  const int64_t max_position = std::max(batch.position_offset, int64_t{0}) + max_seq;
  if (config.family == Family::kGpt &&
      batch.position_offset + batch.seq_len > config.max_positions) {
    return InvalidArgumentError("position_offset=" + Str(batch.position_offset) +
                                " + seq_len=" + Str(batch.seq_len) +
                                " > max_positions=" + Str(config.max_positions));
  }
  UCP_RETURN_IF_ERROR(
      ValidateBatch(config, batch, std::max(batch.batch, int64_t{1}), max_seq, max_position));
  if (static_cast<int64_t>(weights.size()) != lay.total ||
      (!grads.empty() && static_cast<int64_t>(grads.size()) != lay.total)) {
    return InvalidArgumentError("weights/grads hold " + Str(weights.size()) + "/" +
                                Str(grads.size()) + " values, the model has " + Str(lay.total));
  }
  Acts<double> acts;
  const int64_t qkv_dim = (config.heads + 2 * config.kv_heads) * config.head_dim;
  acts.Allocate(config, batch.batch * batch.seq_len, max_position, qkv_dim);
  RefOps<double> ops;
  return RunGraph<double>(ops, config, lay, acts, weights.data(),
                          grads.empty() ? nullptr : grads.data(), batch.inputs.data(),
                          batch.targets.data(), batch.batch, batch.seq_len, batch.position_offset,
                          grad_scale, static_cast<graph::NoSequenceParallel<double>*>(nullptr));
}

Status ValidateSequenceParallel(const ModelConfig& config, int64_t sp, int64_t seq_len) {
  if (sp < 1) return InvalidArgumentError("sequence-parallel size sp=" + Str(sp) + " < 1");
  if (sp == 1) return Status::Ok();
  const std::string ulysses = "ulysses sequence parallelism over sp=" + Str(sp) + " ranks: ";
  if (config.heads < 1 || config.kv_heads < 1 || config.heads % sp != 0) {
    return InvalidArgumentError(ulysses + "heads=" + Str(config.heads) +
                                " not divisible by sp (each rank takes heads/sp query heads)");
  }
  if (config.kv_heads % sp != 0 && sp % config.kv_heads != 0) {
    return InvalidArgumentError(ulysses + "kv_heads=" + Str(config.kv_heads) +
                                " neither divisible by sp nor dividing it (KV heads are split "
                                "or replicated whole)");
  }
  if (seq_len < 1 || seq_len % sp != 0) {
    return InvalidArgumentError(ulysses + "seq_len=" + Str(seq_len) +
                                " tokens not a positive multiple of sp");
  }
  return Status::Ok();
}

struct Model::Impl {
  ModelConfig config;
  Layout layout;
  int64_t max_batch = 0, max_seq_len = 0;
  int num_threads = 1;
  Parallel par{1};
  Acts<float> acts;
  std::unique_ptr<HostUlysses> sp;  // null without sequence parallelism

  Status Validate(std::span<const float> weights, std::span<float> grads, bool backward,
                  const Batch& batch, bool windows = false) const {
    const int64_t shard_len = sp ? max_seq_len / sp->geo().P : max_seq_len;
    UCP_RETURN_IF_ERROR(ValidateBatch(config, batch, max_batch, shard_len, max_seq_len));
    if (windows) return Status::Ok();  // the windows hold the weights and gradients
    if (static_cast<int64_t>(weights.size()) != layout.total) {
      return InvalidArgumentError("weights hold " + Str(weights.size()) +
                                  " values, the model has " + Str(layout.total));
    }
    if (backward && static_cast<int64_t>(grads.size()) != layout.total) {
      return InvalidArgumentError("grads hold " + Str(grads.size()) + " values, the model has " +
                                  Str(layout.total));
    }
    return Status::Ok();
  }

  std::vector<GradGroup> groups;  // Model::grad_groups

  Result<double> Run(std::span<const float> weights, std::span<float> grads, bool backward,
                     const Batch& batch, float grad_scale, const BackwardHook* hook = nullptr,
                     WeightWindows* windows = nullptr) {
    const Status valid = Validate(weights, grads, backward, batch, windows != nullptr);
    if (sp) {
      UCP_RETURN_IF_ERROR(sp->Agree(valid, batch, backward));
    } else {
      UCP_RETURN_IF_ERROR(valid);
    }
    // The ops split every GEMM over the arena themselves (ops.cc, Gemm), so OpenBLAS must run
    // each call on its caller's thread. The setting is process-global: set it on every call.
    openblas_set_num_threads(1);
    FastOps ops{&par};
    return RunGraph<float>(ops, config, layout, acts, windows ? nullptr : weights.data(),
                           backward && !windows ? grads.data() : nullptr, batch.inputs.data(),
                           batch.targets.data(), batch.batch, batch.seq_len, batch.position_offset,
                           grad_scale, sp.get(), hook, windows, backward);
  }
};

// The grad groups of a layout (Model::grad_groups): the params before "layers.0." are the
// embeddings, then each layer's run, then the head.
static std::vector<GradGroup> BuildGradGroups(const ModelConfig& c, const Layout& lay) {
  const auto& ps = lay.params;
  const int64_t np = static_cast<int64_t>(ps.size());
  std::vector<int64_t> layer_begin(static_cast<size_t>(c.layers) + 1, np);
  int64_t i = 0;
  while (i < np && ps[i].name.rfind("layers.", 0) != 0) ++i;
  const int64_t emb_end = i;
  for (int64_t l = 0; l < c.layers; ++l) {
    layer_begin[l] = i;
    const std::string prefix = "layers." + Str(l) + ".";
    while (i < np && ps[i].name.rfind(prefix, 0) == 0) ++i;
  }
  layer_begin[c.layers] = i;
  std::vector<GradGroup> g;
  g.push_back({"head", i, np});
  for (int64_t l = c.layers - 1; l >= 0; --l) {
    g.push_back({"layers." + Str(l), layer_begin[l], layer_begin[l + 1]});
  }
  g.push_back({"embedding", 0, emb_end});
  return g;
}

// The grad groups by parameter name (BuildGradGroups) must be the groups the graph finds by
// offset (graph::GroupBegin / GroupOf, which the streamed weights' lookups use): each group's
// first element where GroupBegin puts it, and every element of it in it.
static Status CheckGradGroups(const ModelConfig& c, const Layout& lay,
                              const std::vector<GradGroup>& groups) {
  for (size_t k = 0; k < groups.size(); ++k) {
    const GradGroup& g = groups[k];
    if (g.first_param >= g.end_param) continue;
    const int64_t begin = lay.params[static_cast<size_t>(g.first_param)].offset;
    const ParamInfo& last = lay.params[static_cast<size_t>(g.end_param - 1)];
    const int64_t kk = static_cast<int64_t>(k);
    if (begin != graph::GroupBegin(c, lay, kk) || graph::GroupOf(c, lay, begin) != kk ||
        graph::GroupOf(c, lay, last.offset + last.numel - 1) != kk) {
      return InternalError("grad group " + g.name + " (parameters " + Str(g.first_param) + " to " +
                           Str(g.end_param) + ") is not the graph's group " + Str(kk));
    }
  }
  return Status::Ok();
}

// The floats of the ops' shared scratch (Parallel::Reserve) for `rows` tokens.
static size_t ScratchFloats(const ModelConfig& c, int64_t rows, int64_t max_seq_len,
                            int num_threads) {
  return std::max(ops::ClassifierScratch(rows, c.vocab, num_threads),
                  ops::OpsScratch(rows,
                                  std::max({c.hidden, c.ffn_hidden * 2,
                                            (c.heads + 2 * c.kv_heads) * c.head_dim}),
                                  max_seq_len, c.head_dim, num_threads));
}

Result<ParamTable> ModelParamTable(const ModelConfig& config) {
  UCP_ASSIGN_OR_RETURN(Layout lay, BuildLayout(config));
  ParamTable t;
  t.groups = BuildGradGroups(config, lay);
  UCP_RETURN_IF_ERROR(CheckGradGroups(config, lay, t.groups));
  t.params = std::move(lay.params);
  t.total = lay.total;
  return t;
}

double ModelStepFlops(const ModelConfig& c, const ParamTable& table, int64_t batch,
                      int64_t seq_len) {
  int64_t matrix = 0;
  for (const ParamInfo& p : table.params) {
    // Position embeddings are a lookup; so are the word embeddings unless they are the head too.
    const bool lookup = p.name.find("position_embeddings") != std::string::npos ||
                        (p.name.find("word_embeddings") != std::string::npos &&
                         !c.tied_embeddings);
    if (p.shape.size() == 2 && !lookup) matrix += p.numel;
  }
  const double tokens = static_cast<double>(batch) * static_cast<double>(seq_len);
  return tokens * (6.0 * static_cast<double>(matrix) +
                   6.0 * static_cast<double>(c.layers) * static_cast<double>(seq_len) *
                       static_cast<double>(c.heads * c.head_dim));
}

Result<std::vector<std::pair<int64_t, int64_t>>> Fp32ReadRanges(const ModelConfig& config) {
  UCP_ASSIGN_OR_RETURN(Layout lay, BuildLayout(config));
  std::vector<int64_t> matrices;  // the offsets of what the GEMMs read in bf16
  for (const graph::LayerOffsets& o : lay.layers) {
    matrices.insert(matrices.end(), {o.qkv_w, o.proj_w, o.fc_w, o.fc2_w});
  }
  if (lay.out >= 0) matrices.push_back(lay.out);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const ParamInfo& p : lay.params) {
    if (std::find(matrices.begin(), matrices.end(), p.offset) != matrices.end()) continue;
    if (!ranges.empty() && ranges.back().second == p.offset) {
      ranges.back().second += p.numel;
    } else {
      ranges.emplace_back(p.offset, p.offset + p.numel);
    }
  }
  return ranges;
}

// The sizes every memory function below takes, checked alike (`who` names the function).
static Status CheckShardSizes(const char* who, const ModelConfig& config, int64_t max_batch,
                              int64_t max_seq_len, int sp) {
  if (max_batch < 1 || max_seq_len < 1 || sp < 1) {
    return InvalidArgumentError(std::string(who) + ": batch=" + Str(max_batch) +
                                ", seq_len=" + Str(max_seq_len) + ", sp=" + Str(sp) +
                                " must be >= 1");
  }
  UCP_RETURN_IF_ERROR(ValidateConfig(config));
  return ValidateSequenceParallel(config, sp, max_seq_len);
}

static Status CheckRecompute(const char* who, Recompute recompute) {
  if (recompute.layers >= 0) return Status::Ok();
  return InvalidArgumentError(std::string(who) + ": recompute.layers=" + Str(recompute.layers) +
                              " < 0");
}

// The activations of this rank's shard, in elements, as Model::Create and CudaModel::Create
// allocate them: the graph's buffers for max_batch x max_seq_len / sp rows and, at sp > 1,
// Ulysses' (with the output by heads when `output_full`). The sizes are checked.
static int64_t ShardActivationElements(const ModelConfig& config, int64_t max_batch,
                                       int64_t max_seq_len, int sp, bool output_full,
                                       Recompute recompute) {
  const int64_t rows = max_batch * (max_seq_len / sp);
  int64_t qkv_width = (config.heads + 2 * config.kv_heads) * config.head_dim, elements = 0;
  if (sp > 1) {
    const UlyssesGeometry geo(config, sp, 0);  // every rank's buffers have the same sizes
    elements += HostUlysses::Elements(geo, rows, output_full);
    qkv_width = geo.P * geo.Wl;
  }
  Acts<float> counter;  // sizes only: nothing is allocated
  counter.recompute = recompute;
  counter.ForEachBuffer(config, rows, max_seq_len, qkv_width,
                        [&](std::vector<float>&, int64_t n) { elements += n; });
  return elements;
}

Result<int64_t> ActivationBytes(const ModelConfig& config, int64_t max_batch, int64_t max_seq_len,
                                int num_threads, int sp, Recompute recompute) {
  if (num_threads < 1) {
    return InvalidArgumentError("ActivationBytes: threads=" + Str(num_threads) + " must be >= 1");
  }
  UCP_RETURN_IF_ERROR(CheckShardSizes("ActivationBytes", config, max_batch, max_seq_len, sp));
  UCP_RETURN_IF_ERROR(CheckRecompute("ActivationBytes", recompute));
  const int64_t rows = max_batch * (max_seq_len / sp);
  const int64_t elements =
      ShardActivationElements(config, max_batch, max_seq_len, sp, false, recompute) +
      static_cast<int64_t>(ScratchFloats(config, rows, max_seq_len, num_threads));
  return elements * static_cast<int64_t>(sizeof(float));
}

Result<int64_t> DeviceActivationBytes(const ModelConfig& config, int64_t max_batch,
                                      int64_t max_seq_len, bool gemm_bf16,
                                      bool flash_attention, int sp, Recompute recompute) {
  UCP_RETURN_IF_ERROR(
      CheckShardSizes("DeviceActivationBytes", config, max_batch, max_seq_len, sp));
  UCP_RETURN_IF_ERROR(CheckRecompute("DeviceActivationBytes", recompute));
  const int64_t elements = ShardActivationElements(config, max_batch, max_seq_len, sp,
                                                   gemm_bf16 && flash_attention, recompute);
  return elements * static_cast<int64_t>(sizeof(float)) +
         gpu::CudaModelScratch(config, config.family != Family::kGpt, max_batch, max_seq_len,
                                gemm_bf16, flash_attention, sp)
             .bytes();
}

Result<int64_t> UlyssesExchangeFloats(const ModelConfig& config, int64_t max_batch,
                                      int64_t max_seq_len, int sp) {
  UCP_RETURN_IF_ERROR(
      CheckShardSizes("UlyssesExchangeFloats", config, max_batch, max_seq_len, sp));
  if (sp == 1) return int64_t{0};
  const UlyssesGeometry geo(config, sp, 0);
  return max_batch * (max_seq_len / sp) * geo.P * geo.Wl;
}

int64_t Model::activation_bytes() const {
  int64_t elements = impl_->sp ? impl_->sp->allocated() : 0;
  impl_->acts.ForEachBuffer(impl_->config, impl_->acts.rows, impl_->acts.max_t,
                            1,  // the widths do not matter: only the sizes are read
                            [&](const std::vector<float>& v, int64_t) {
                              elements += static_cast<int64_t>(v.size());
                            });
  elements += static_cast<int64_t>(impl_->par.scratch_floats());
  return elements * static_cast<int64_t>(sizeof(float));
}

Recompute Model::recompute() const { return impl_->acts.recompute; }

Result<Model> Model::Create(const ModelConfig& config, int64_t max_batch, int64_t max_seq_len,
                            int num_threads, Communicator* sp_comm, Recompute recompute) {
  UCP_ASSIGN_OR_RETURN(Layout layout, BuildLayout(config));
  if (max_batch < 1 || max_seq_len < 1) {
    return InvalidArgumentError("max_batch=" + Str(max_batch) +
                                " and max_seq_len=" + Str(max_seq_len) + " must be >= 1");
  }
  if (config.family == Family::kGpt && max_seq_len > config.max_positions) {
    return InvalidArgumentError("max_seq_len=" + Str(max_seq_len) +
                                " > max_positions=" + Str(config.max_positions));
  }
  if (num_threads < 1) return InvalidArgumentError("num_threads=" + Str(num_threads) + " < 1");
  UCP_RETURN_IF_ERROR(CheckRecompute("Model::Create", recompute));
  const int sp = sp_comm ? sp_comm->size() : 1;
  UCP_RETURN_IF_ERROR(ValidateSequenceParallel(config, sp, max_seq_len),
                      "while creating the model (seq_len = its max_seq_len)");
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->layout = std::move(layout);
  impl->max_batch = max_batch;
  impl->max_seq_len = max_seq_len;
  impl->num_threads = num_threads;
  impl->groups = BuildGradGroups(config, impl->layout);
  UCP_RETURN_IF_ERROR(CheckGradGroups(config, impl->layout, impl->groups));
  impl->par = Parallel(num_threads);
  // Under SP the activations hold this rank's shard of every sequence.
  const int64_t rows = max_batch * (max_seq_len / sp);
  // The model's only allocations: std::bad_alloc is caught here, at its one source (ADR 0001).
  try {
    int64_t qkv_width = (config.heads + 2 * config.kv_heads) * config.head_dim;
    if (sp > 1) {
      impl->sp = std::make_unique<HostUlysses>(
          sp_comm, graph::HostUlyssesBackend<float>{&impl->par, sp_comm}, config);
      impl->sp->Allocate(rows);
      qkv_width = impl->sp->qkv_width();
    }
    impl->acts.Allocate(config, rows, max_seq_len, qkv_width, recompute);
    impl->par.Reserve(ScratchFloats(config, rows, max_seq_len, num_threads));
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("activations for " + Str(max_batch) + " x " + Str(max_seq_len) +
                                  " tokens do not fit in memory");
  }
  return Model(std::move(impl));
}

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

const ModelConfig& Model::config() const { return impl_->config; }
const std::vector<ParamInfo>& Model::params() const { return impl_->layout.params; }
int64_t Model::num_params() const { return impl_->layout.total; }
int Model::sp_size() const { return impl_->sp ? static_cast<int>(impl_->sp->geo().P) : 1; }
int Model::sp_rank() const { return impl_->sp ? static_cast<int>(impl_->sp->geo().r) : 0; }

Result<double> Model::Forward(std::span<const float> weights, const Batch& batch) {
  return impl_->Run(weights, {}, false, batch, 0.0f);
}

Result<double> Model::ForwardBackward(std::span<const float> weights, std::span<float> grads,
                                      const Batch& batch, float grad_scale) {
  return impl_->Run(weights, grads, true, batch, grad_scale);
}

const std::vector<GradGroup>& Model::grad_groups() const { return impl_->groups; }

Result<double> Model::ForwardBackward(std::span<const float> weights, std::span<float> grads,
                                      const Batch& batch, float grad_scale,
                                      const BackwardHook& hook) {
  return impl_->Run(weights, grads, true, batch, grad_scale, &hook);
}

Result<double> Model::Forward(WeightWindows& windows, const Batch& batch) {
  return impl_->Run({}, {}, false, batch, 0.0f, nullptr, &windows);
}

Result<double> Model::ForwardBackward(WeightWindows& windows, const Batch& batch,
                                      float grad_scale, const BackwardHook* hook) {
  return impl_->Run({}, {}, true, batch, grad_scale, hook, &windows);
}

}  // namespace ucp::offload
