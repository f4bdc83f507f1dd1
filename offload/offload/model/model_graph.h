// The model's graph, shared by the CPU model (model.cc) and the CUDA model (offload/cuda/
// cuda_model.h): the flat parameter layout, the activation buffers and RunGraph, the forward
// and backward written once over an ops policy (the CPU's fast ops, the scalar reference in
// double, or the GPU's kernels), so every backend runs the same graph in the same order.
// Internal to the engine: not part of the model's API (model.h).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "offload/model/model.h"
#include "offload/model/ops.h"
#include "ucp/base/check.h"
#include "ucp/base/result.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload::graph {

// Offsets (elements) of one layer's parameters in the flat buffer; -1 where the family has none.
struct LayerOffsets {
  int64_t ln1_w = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, proj_w = -1, proj_b = -1;
  int64_t ln2_w = -1, ln2_b = -1, fc_w = -1, fc_b = -1, fc2_w = -1, fc2_b = -1;
};

struct Layout {
  std::vector<ParamInfo> params;
  int64_t wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1, out = -1;
  std::vector<LayerOffsets> layers;
  int64_t total = 0;
};

// The canonical parameter list (model.cc).
Result<Layout> BuildLayout(const ModelConfig& c);

// Activations and backward scratch for up to `rows` = max_batch * max_seq_len tokens.
// Vec: std::vector<T> on the host; on the GPU a device vector (cuda_model.cc) with the same
// assign(n, 0), data() and size(), plus Upload(const std::vector<T>&).
// Recomputed layers (Recompute: the first r) share one slot of the per-layer buffers but
// resid_out (each layer's output, the next one's input), which each of their forwards
// overwrites (RunGraph reruns a layer's forward before its backward); the others have their own.
template <typename T, typename Vec = std::vector<T>>
struct Acts {
  int64_t rows = 0, max_t = 0;
  Recompute recompute;
  Vec encoded, ln1, ln1_mean, ln1_rstd, qkv, atty, lse, resid_mid, ln2, ln2_mean,
      ln2_rstd, fch, fch_act, resid_out, lnf, lnf_mean, lnf_rstd, tmp;
  Vec dres, dln, dfch_act, dfch, datty, dqkv;
  Vec rope_cos, rope_sin;  // [max_t, head_dim/2]

  // max_rows: tokens of the largest batch (this shard's under SP); max_seq: the largest position
  // + 1 (the RoPE tables); qkv_width: values per row of the saved qkv, (NH + 2 KV) hd, or under SP
  // P (NH/P + 2 KV_r) hd (the gathered heads of UlyssesGeometry, per local row).
  void Allocate(const ModelConfig& c, int64_t max_rows, int64_t max_seq, int64_t qkv_width,
                Recompute rc = Recompute::None()) {
    rows = max_rows;
    max_t = max_seq;
    recompute = rc;
    ForEachBuffer(c, max_rows, max_seq, qkv_width,
                  [](Vec& v, int64_t n) { v.assign(static_cast<size_t>(n), T(0)); });
    if (c.family == Family::kLlama) {
      std::vector<T> cos_h(rope_cos.size()), sin_h(rope_sin.size());
      ops::ref::RopeTables<T>(cos_h.data(), sin_h.data(), max_seq, c.head_dim,
                              static_cast<double>(c.rope_theta));
      Upload(rope_cos, cos_h);
      Upload(rope_sin, sin_h);
    }
  }
  static void Upload(std::vector<T>& v, const std::vector<T>& h) { v = h; }
  template <typename V>
  static void Upload(V& v, const std::vector<T>& h) {
    v.Upload(h);
  }

  // The layers the per-layer buffers other than resid_out hold, and layer l's place in them:
  // the recomputed layers' shared slot 0, then one each for the others.
  int64_t layer_slots(const ModelConfig& c) const { return Slot(c, c.layers - 1) + 1; }
  int64_t Slot(const ModelConfig& c, int64_t l) const {
    const int64_t r = recompute.Of(c.layers);
    return l < r ? 0 : (r > 0 ? 1 : 0) + (l - r);
  }

  // Every buffer with its element count (for `recompute`, set first): Allocate sizes them,
  // ActivationBytes (the memory plan) adds them up, so the two cannot disagree.
  template <typename Sizer>
  void ForEachBuffer(const ModelConfig& c, int64_t max_rows, int64_t max_seq, int64_t qkv_width,
                     Sizer&& sz) {
    const int64_t L = c.layers, S = layer_slots(c), C = c.hidden, N = max_rows;
    const int64_t qkv_dim = (c.heads + 2 * c.kv_heads) * c.head_dim, ah = c.heads * c.head_dim;
    const int64_t F = c.ffn_hidden, F1 = c.family == Family::kGpt ? F : 2 * F;
    sz(encoded, N * C);
    sz(ln1, S * N * C), sz(ln1_mean, S * N), sz(ln1_rstd, S * N);
    sz(qkv, S * N * qkv_width), sz(atty, S * N * ah), sz(lse, S * N * c.heads);
    sz(resid_mid, S * N * C);
    sz(ln2, S * N * C), sz(ln2_mean, S * N), sz(ln2_rstd, S * N);
    sz(fch, S * N * F1), sz(fch_act, S * N * F), sz(resid_out, L * N * C);
    sz(lnf, N * C), sz(lnf_mean, N), sz(lnf_rstd, N), sz(tmp, N * C);
    sz(dres, N * C), sz(dln, N * C), sz(dfch_act, N * F), sz(dfch, N * F1), sz(datty, N * ah);
    sz(dqkv, N * qkv_dim);
    if (c.family == Family::kLlama) {
      sz(rope_cos, max_seq * c.head_dim / 2), sz(rope_sin, max_seq * c.head_dim / 2);
    }
  }
};

// Grad group k's first element (Model::grad_groups: 0 the head, 1 + (L-1-l) layer l, L+1 the
// embeddings; each contiguous in model order), and the group an element belongs to.
inline int64_t GroupBegin(const ModelConfig& cfg, const Layout& lay, int64_t k) {
  if (k == 0) return lay.lnf_w;
  if (k == cfg.layers + 1) return 0;
  return lay.layers[static_cast<size_t>(cfg.layers - k)].ln1_w;
}
inline int64_t GroupOf(const ModelConfig& cfg, const Layout& lay, int64_t off) {
  if (off >= lay.lnf_w) return 0;
  int64_t lo = 0, hi = cfg.layers;  // the layer l with ln1_w <= off < the next one's
  if (cfg.layers == 0 || off < lay.layers[0].ln1_w) return cfg.layers + 1;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (lay.layers[static_cast<size_t>(mid)].ln1_w <= off) lo = mid; else hi = mid;
  }
  return 1 + (cfg.layers - 1 - lo);
}

// A packed copy of some of the flat layout's elements (model.h Fp32ReadRanges: the CUDA model's
// fp32 compute copy beside bf16 GEMMs): the ranges back to back, in order.
class PackedIndex {
 public:
  PackedIndex() = default;
  explicit PackedIndex(std::vector<std::pair<int64_t, int64_t>> ranges)
      : ranges_(std::move(ranges)) {
    starts_.reserve(ranges_.size());
    for (const auto& [b, e] : ranges_) {
      starts_.push_back(elements_);
      elements_ += e - b;
    }
  }
  int64_t elements() const { return elements_; }
  // Flat element `off`'s place in the copy, or -1 where the copy does not hold it.
  int64_t At(int64_t off) const {
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), off,
                               [](int64_t v, const std::pair<int64_t, int64_t>& r) {
                                 return v < r.first;
                               });
    if (it == ranges_.begin() || off >= (--it)->second) return -1;
    return starts_[static_cast<size_t>(it - ranges_.begin())] + (off - it->first);
  }
  // f(flat_begin, packed_begin, n) -> Status for each part of the flat [begin, end) the copy
  // holds, ascending; stops at the first error.
  template <typename F>
  Status ForEachIn(int64_t begin, int64_t end, F&& f) const {
    for (size_t i = 0; i < ranges_.size(); ++i) {
      const int64_t b = std::max(begin, ranges_[i].first), e = std::min(end, ranges_[i].second);
      if (b < e) UCP_RETURN_IF_ERROR(f(b, starts_[i] + (b - ranges_[i].first), e - b));
    }
    return Status::Ok();
  }

 private:
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  std::vector<int64_t> starts_;
  int64_t elements_ = 0;
};

// An ops policy may keep the weights its own way (the CUDA model's bf16 GEMMs beside a packed
// fp32 copy that holds no GEMM matrix: cuda_model.cc) by defining
//   const T* Fp32Weight(int64_t off)  a resident norm's, bias's or embedding's weights, and
//   GemmWeight(int64_t off, const T* windowed)  what its GEMMs (the classifier's too) take for
//       the matrix at `off`: `windowed` is its place in a streamed window, null when resident.
// RunGraph then reads every weight through them; otherwise at w + off (or in its window).
template <typename Ops, typename T>
concept OwnsWeights = requires(Ops& ops, int64_t off, const T* p) {
  { ops.Fp32Weight(off) } -> std::convertible_to<const T*>;
  ops.GemmWeight(off, p);
};

// A policy whose attention backward can use the forward's output (the CUDA flash kernels: each
// query's D = dout . out instead of a second walk over the keys) has
//   AttentionBackwardWithOutput(dqkv, dout, qkv, out, lse, B, T, NH, KV, hd)
// and RunGraph passes it the output where it still holds (no sequence parallelism).
template <typename Ops, typename T>
concept TakesAttentionOutput = requires(Ops& ops, T* d, const T* c, int64_t n) {
  ops.AttentionBackwardWithOutput(d, c, c, c, c, n, n, n, n, n);
};

// The scalar reference ops in T (the double reference, model.h RefForwardBackward).
template <typename T>
struct RefOps {
  std::vector<T> logits;
  void Zero(T* p, int64_t n) { std::fill(p, p + n, T(0)); }
  // clang-format off
  template <typename... A> void EncoderForward(A... a) { ops::ref::EncoderForward<T>(a...); }
  template <typename... A> void EncoderBackward(A... a) { ops::ref::EncoderBackward<T>(a...); }
  template <typename... A> void LayerNormForward(A... a) { ops::ref::LayerNormForward<T>(a...); }
  template <typename... A> void LayerNormBackward(A... a) { ops::ref::LayerNormBackward<T>(a...); }
  template <typename... A> void RmsNormForward(A... a) { ops::ref::RmsNormForward<T>(a...); }
  template <typename... A> void RmsNormBackward(A... a) { ops::ref::RmsNormBackward<T>(a...); }
  template <typename... A> void MatmulForward(A... a) { ops::ref::MatmulForward<T>(a...); }
  template <typename... A> void MatmulBackward(A... a) { ops::ref::MatmulBackward<T>(a...); }
  template <typename... A> void AttentionForward(A... a) { ops::ref::AttentionForward<T>(a...); }
  template <typename... A> void AttentionBackward(A... a) { ops::ref::AttentionBackward<T>(a...); }
  template <typename... A> void RopeForward(A... a) { ops::ref::RopeForward<T>(a...); }
  template <typename... A> void RopeBackward(A... a) { ops::ref::RopeBackward<T>(a...); }
  template <typename... A> void GeluForward(A... a) { ops::ref::GeluForward<T>(a...); }
  template <typename... A> void GeluBackward(A... a) { ops::ref::GeluBackward<T>(a...); }
  template <typename... A> void SwigluForward(A... a) { ops::ref::SwigluForward<T>(a...); }
  template <typename... A> void SwigluBackward(A... a) { ops::ref::SwigluBackward<T>(a...); }
  template <typename... A> void ResidualForward(A... a) { ops::ref::ResidualForward<T>(a...); }
  // clang-format on
  double Classifier(T* dx, T* dw, const T* x, const T* w, const int32_t* tg, int64_t N, int64_t C,
                    int64_t V, T grad_scale) {
    logits.resize(static_cast<size_t>(N * V));
    return ops::ref::ClassifierForwardBackward<T>(dx, dw, logits.data(), x, w, tg, N, C, V,
                                                  grad_scale);
  }
};

// RunGraph's sp where sequences are not sharded (sp == nullptr): its calls are never reached.
template <typename T>
struct NoSequenceParallel {
  struct Geo {
    int64_t P = 1, NHl = 0, KVl = 0;
  };
  const Geo& geo() const { return geo_; }
  T* qkv_local() { return nullptr; }
  T* att_full() { return nullptr; }
  T* dqkv_full() { return nullptr; }
  T* out_full() { return nullptr; }
  int64_t qkv_width() const { return 0; }
  template <typename... A> Status QkvToHeads(A...) { return Unsupported(); }
  template <typename... A> Status HeadsToSeq(A...) { return Unsupported(); }
  template <typename... A> Status SeqToHeads(A...) { return Unsupported(); }
  template <typename... A> Status HeadsToQkv(A...) { return Unsupported(); }
  static Status Unsupported() { return UnimplementedError("sequence parallelism here"); }
  Geo geo_;
};

// Forward (and backward when g != nullptr, or with windows when `backward`) of the whole model;
// returns the loss sum. Tn tokens per sequence at positions [pos0, pos0 + Tn); sp: null, or this
// rank's Ulysses exchange, the batch then being this rank's shard (fails only when the
// communicator does). win: null (the weights and gradients are the flat w and g), or streamed
// weights (model.h WeightWindows; w and g are then null and T is float).
template <typename T, typename Ops, typename ActsT, typename SP>
Result<double> RunGraph(Ops& ops, const ModelConfig& cfg, const Layout& lay, ActsT& a, const T* w,
                        T* g, const int32_t* inputs, const int32_t* targets, int64_t B, int64_t Tn,
                        int64_t pos0, T grad_scale, SP* sp, const BackwardHook* hook = nullptr,
                        WeightWindows* win = nullptr, bool backward = false) {
  auto Str = [](int64_t v) { return std::to_string(v); };
  // Streamed: each group's base pointers while it is acquired (null otherwise), by group.
  const int64_t num_groups = cfg.layers + 2;
  std::vector<const T*> wbase;
  std::vector<T*> gbase;
  if (win != nullptr) {
    if constexpr (!std::is_same_v<T, float>) {
      return InvalidArgumentError("streamed weights need fp32 compute");
    }
    wbase.assign(static_cast<size_t>(num_groups), nullptr);
    gbase.assign(static_cast<size_t>(num_groups), nullptr);
  }
  const bool bwd = win != nullptr ? backward : g != nullptr;
  auto Acquire = [&](int64_t k, bool grads) -> Status {
    if (win == nullptr) return Status::Ok();
    if constexpr (std::is_same_v<T, float>) {
      UCP_ASSIGN_OR_RETURN(WeightWindows::Slot s, win->Acquire(static_cast<int>(k), grads),
                           "weights of grad group " + Str(k));
      wbase[static_cast<size_t>(k)] = s.weights;
      gbase[static_cast<size_t>(k)] = s.grads;
    }
    return Status::Ok();
  };
  auto Release = [&](int64_t k, bool grads) -> Status {
    if (win == nullptr) return Status::Ok();
    wbase[static_cast<size_t>(k)] = nullptr;
    gbase[static_cast<size_t>(k)] = nullptr;
    return win->Release(static_cast<int>(k), grads).WithContext("weights of grad group " + Str(k));
  };
  const bool gpt = cfg.family == Family::kGpt;
  const int64_t C = cfg.hidden, NH = cfg.heads, KV = cfg.kv_heads, hd = cfg.head_dim;
  const int64_t qkv_dim = (NH + 2 * KV) * hd, ah = NH * hd, F = cfg.ffn_hidden;
  const int64_t F1 = gpt ? F : 2 * F, N = B * Tn, R = a.rows, V = cfg.vocab;
  const T eps = static_cast<T>(cfg.norm_eps);
  // The saved qkv: [N, qkv_dim], or under SP the gathered heads [B, P Tn, Wl].
  const int64_t qkv_width = sp ? sp->qkv_width() : qkv_dim;
  auto P = [&](int64_t off) -> const T* {
    if (off < 0) return nullptr;
    if (win == nullptr) {
      if constexpr (OwnsWeights<Ops, T>) {
        return ops.Fp32Weight(off);
      } else {
        return w + off;
      }
    }
    const int64_t k = GroupOf(cfg, lay, off);
    UCP_CHECK(wbase[static_cast<size_t>(k)] != nullptr);  // the graph acquires before it reads
    return wbase[static_cast<size_t>(k)] + (off - GroupBegin(cfg, lay, k));
  };
  // A GEMM's matrix (the classifier's too).
  auto M = [&](int64_t off) {
    if constexpr (OwnsWeights<Ops, T>) {
      return ops.GemmWeight(off, win != nullptr ? P(off) : nullptr);
    } else {
      return P(off);
    }
  };
  auto G = [&](int64_t off) -> T* {
    if (off < 0) return nullptr;
    if (win == nullptr) return g + off;
    const int64_t k = GroupOf(cfg, lay, off);
    UCP_CHECK(gbase[static_cast<size_t>(k)] != nullptr);
    return gbase[static_cast<size_t>(k)] + (off - GroupBegin(cfg, lay, k));
  };
  const T* rope_cos = gpt ? nullptr : a.rope_cos.data() + pos0 * (hd / 2);
  const T* rope_sin = gpt ? nullptr : a.rope_sin.data() + pos0 * (hd / 2);
  // Layer l's slice of a per-layer activation of `dim` values per row: its own, or for the
  // first `recomputed` layers the slot they share (Acts::Slot); Out(l) is layer l's output, kept
  // for every layer, and In(l) its input.
  const int64_t recomputed = a.recompute.Of(cfg.layers);
  auto At = [&](auto& v, int64_t l, int64_t dim) { return v.data() + a.Slot(cfg, l) * R * dim; };
  auto Out = [&](int64_t l) { return a.resid_out.data() + l * R * C; };
  auto In = [&](int64_t l) -> const T* { return l == 0 ? a.encoded.data() : Out(l - 1); };
  auto Norm = [&](T* out, T* mean, T* rstd, const T* x, int64_t w_off, int64_t b_off) {
    if (gpt) {
      ops.LayerNormForward(out, mean, rstd, x, P(w_off), P(b_off), N, C, eps);
    } else {
      ops.RmsNormForward(out, rstd, x, P(w_off), N, C, eps);
    }
  };
  auto NormBackward = [&](T* dx, const T* dout, const T* x, const T* mean, const T* rstd,
                          int64_t w_off, int64_t b_off) {
    if (gpt) {
      ops.LayerNormBackward(dx, G(w_off), G(b_off), dout, x, P(w_off), mean, rstd, N, C);
    } else {
      ops.RmsNormBackward(dx, G(w_off), dout, x, P(w_off), rstd, N, C);
    }
  };
  // Layer l's forward, In(l) -> Out(l), its activations into At(.., l, ..); its weights are
  // acquired. Forward runs it once per layer; with recomputation backward runs it again.
  auto LayerForward = [&](int64_t l) -> Status {
    const LayerOffsets& o = lay.layers[l];
    const T* x = In(l);
    T* ln1 = At(a.ln1, l, C);
    T* qkv = At(a.qkv, l, qkv_width);
    T* atty = At(a.atty, l, ah);
    T* resid_mid = At(a.resid_mid, l, C);
    T* ln2 = At(a.ln2, l, C);
    T* fch = At(a.fch, l, F1);
    T* fch_act = At(a.fch_act, l, F);
    Norm(ln1, At(a.ln1_mean, l, 1), At(a.ln1_rstd, l, 1), x, o.ln1_w, o.ln1_b);
    T* qkv_shard = sp ? sp->qkv_local() : qkv;  // [N, qkv_dim], this batch's positions
    ops.MatmulForward(qkv_shard, ln1, M(o.qkv_w), P(o.qkv_b), N, C, qkv_dim);
    if (!gpt) ops.RopeForward(qkv_shard, rope_cos, rope_sin, B, Tn, NH, KV, hd);
    if (sp == nullptr) {
      ops.AttentionForward(atty, At(a.lse, l, NH), qkv, B, Tn, NH, KV, hd);
    } else {
      const auto& u = sp->geo();
      UCP_RETURN_IF_ERROR(sp->QkvToHeads(qkv_shard, qkv, B, Tn), "in layer " + Str(l));
      ops.AttentionForward(sp->att_full(), At(a.lse, l, NH), qkv, B, u.P * Tn, u.NHl, u.KVl, hd);
      UCP_RETURN_IF_ERROR(sp->HeadsToSeq(sp->att_full(), atty, B, Tn), "in layer " + Str(l));
    }
    ops.MatmulForward(a.tmp.data(), atty, M(o.proj_w), P(o.proj_b), N, ah, C);
    ops.ResidualForward(resid_mid, x, a.tmp.data(), N * C);
    Norm(ln2, At(a.ln2_mean, l, 1), At(a.ln2_rstd, l, 1), resid_mid, o.ln2_w, o.ln2_b);
    ops.MatmulForward(fch, ln2, M(o.fc_w), P(o.fc_b), N, C, F1);
    if (gpt) {
      ops.GeluForward(fch_act, fch, N * F);
    } else {
      ops.SwigluForward(fch_act, fch, N, F);
    }
    ops.MatmulForward(a.tmp.data(), fch_act, M(o.fc2_w), P(o.fc2_b), N, F, C);
    ops.ResidualForward(Out(l), resid_mid, a.tmp.data(), N * C);
    return Status::Ok();
  };

  // ---- forward (grad groups as below: L+1 the embeddings, 1 + (L-1-l) layer l, 0 the head)
  auto GroupNeeded = [&](int64_t k) {
    if (hook != nullptr && hook->on_group_needed) hook->on_group_needed(static_cast<int>(k));
  };
  const int64_t emb = cfg.layers + 1;
  GroupNeeded(emb);
  UCP_RETURN_IF_ERROR(Acquire(emb, false));
  const T* wpe = gpt ? P(lay.wpe) + pos0 * C : nullptr;
  ops.EncoderForward(a.encoded.data(), inputs, P(lay.wte), wpe, B, Tn, C);
  UCP_RETURN_IF_ERROR(Release(emb, false));
  for (int64_t l = 0; l < cfg.layers; ++l) {
    const int64_t k = 1 + (cfg.layers - 1 - l);
    GroupNeeded(k);
    UCP_RETURN_IF_ERROR(Acquire(k, false));
    UCP_RETURN_IF_ERROR(LayerForward(l));
    UCP_RETURN_IF_ERROR(Release(k, false));
  }
  const T* x = cfg.layers > 0 ? Out(cfg.layers - 1) : a.encoded.data();
  GroupNeeded(0);
  // The head (with tied embeddings the classifier reads, and backward adds into, the
  // embeddings' matrix: they stay acquired until the encoder's backward).
  UCP_RETURN_IF_ERROR(Acquire(0, bwd));
  if (cfg.tied_embeddings) UCP_RETURN_IF_ERROR(Acquire(emb, bwd));
  Norm(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), x, lay.lnf_w, lay.lnf_b);
  const int64_t head = cfg.tied_embeddings ? lay.wte : lay.out;
  T* dlnf = a.dln.data();
  if (bwd) ops.Zero(dlnf, N * C);
  const double loss = ops.Classifier(bwd ? dlnf : nullptr, bwd ? G(head) : nullptr, a.lnf.data(),
                                     M(head), targets, N, C, V, grad_scale);
  if (!bwd) {
    UCP_RETURN_IF_ERROR(Release(0, false));
    if (cfg.tied_embeddings) UCP_RETURN_IF_ERROR(Release(emb, false));
    return loss;
  }

  // ---- backward: dres is the gradient of the residual stream, flowing down the layers.
  T* dres = a.dres.data();
  ops.Zero(dres, N * C);
  // Grad groups (Model::grad_groups): 0 the head, 1 + (L-1-l) layer l, L+1 the embeddings.
  auto GroupDone = [&](int64_t k) {
    if (hook != nullptr && hook->on_group_done) hook->on_group_done(static_cast<int>(k));
  };
  if (hook != nullptr && hook->on_backward_begin) hook->on_backward_begin();
  NormBackward(dres, dlnf, x, a.lnf_mean.data(), a.lnf_rstd.data(), lay.lnf_w, lay.lnf_b);
  UCP_RETURN_IF_ERROR(Release(0, true));
  GroupDone(0);
  for (int64_t l = cfg.layers - 1; l >= 0; --l) {
    const LayerOffsets& o = lay.layers[l];
    const int64_t k = 1 + (cfg.layers - 1 - l);
    UCP_RETURN_IF_ERROR(Acquire(k, true));
    // The shared slot holds the last recomputed layer's activations from forward; the others'
    // are rerun.
    if (l + 1 < recomputed) {
      UCP_RETURN_IF_ERROR(LayerForward(l), "recomputing layer " + Str(l) + " for backward");
    }
    T* qkv = At(a.qkv, l, qkv_width);
    // MLP branch.
    ops.Zero(a.dfch_act.data(), N * F);
    ops.MatmulBackward(a.dfch_act.data(), G(o.fc2_w), G(o.fc2_b), dres, At(a.fch_act, l, F),
                       M(o.fc2_w), N, F, C);
    ops.Zero(a.dfch.data(), N * F1);
    if (gpt) {
      ops.GeluBackward(a.dfch.data(), At(a.fch, l, F1), a.dfch_act.data(), N * F);
    } else {
      ops.SwigluBackward(a.dfch.data(), At(a.fch, l, F1), a.dfch_act.data(), N, F);
    }
    ops.Zero(a.dln.data(), N * C);
    ops.MatmulBackward(a.dln.data(), G(o.fc_w), G(o.fc_b), a.dfch.data(), At(a.ln2, l, C),
                       M(o.fc_w), N, C, F1);
    NormBackward(dres, a.dln.data(), At(a.resid_mid, l, C), At(a.ln2_mean, l, 1),
                 At(a.ln2_rstd, l, 1), o.ln2_w, o.ln2_b);
    // Attention branch.
    ops.Zero(a.datty.data(), N * ah);
    ops.MatmulBackward(a.datty.data(), G(o.proj_w), G(o.proj_b), dres, At(a.atty, l, ah),
                       M(o.proj_w), N, ah, C);
    ops.Zero(a.dqkv.data(), N * qkv_dim);
    if (sp == nullptr) {
      if constexpr (TakesAttentionOutput<Ops, T>) {
        // atty still holds the forward's output (the projection's backward just read it).
        ops.AttentionBackwardWithOutput(a.dqkv.data(), a.datty.data(), qkv, At(a.atty, l, ah),
                                        At(a.lse, l, NH), B, Tn, NH, KV, hd);
      } else {
        ops.AttentionBackward(a.dqkv.data(), a.datty.data(), qkv, At(a.lse, l, NH), B, Tn, NH,
                              KV, hd);
      }
    } else {
      const auto& u = sp->geo();
      UCP_RETURN_IF_ERROR(sp->SeqToHeads(a.datty.data(), sp->att_full(), B, Tn),
                          "in the backward of layer " + Str(l));
      ops.Zero(sp->dqkv_full(), N * qkv_width);
      if constexpr (TakesAttentionOutput<Ops, T>) {
        // The forward's output by heads, brought back from atty (which the projection's
        // backward just read) as its gradient was: the same values attention wrote.
        T* out_full = nullptr;
        if (ops.AttentionReadsOutput()) {
          out_full = sp->out_full();
          UCP_RETURN_IF_ERROR(sp->SeqToHeads(At(a.atty, l, ah), out_full, B, Tn),
                              "in the backward of layer " + Str(l));
        }
        ops.AttentionBackwardWithOutput(sp->dqkv_full(), sp->att_full(), qkv, out_full,
                                        At(a.lse, l, NH), B, u.P * Tn, u.NHl, u.KVl, hd);
      } else {
        ops.AttentionBackward(sp->dqkv_full(), sp->att_full(), qkv, At(a.lse, l, NH), B,
                              u.P * Tn, u.NHl, u.KVl, hd);
      }
      UCP_RETURN_IF_ERROR(sp->HeadsToQkv(sp->dqkv_full(), a.dqkv.data(), B, Tn),
                          "in the backward of layer " + Str(l));
    }
    if (!gpt) ops.RopeBackward(a.dqkv.data(), rope_cos, rope_sin, B, Tn, NH, KV, hd);
    ops.Zero(a.dln.data(), N * C);
    ops.MatmulBackward(a.dln.data(), G(o.qkv_w), G(o.qkv_b), a.dqkv.data(), At(a.ln1, l, C),
                       M(o.qkv_w), N, C, qkv_dim);
    NormBackward(dres, a.dln.data(), In(l), At(a.ln1_mean, l, 1), At(a.ln1_rstd, l, 1), o.ln1_w,
                 o.ln1_b);
    UCP_RETURN_IF_ERROR(Release(k, true));
    GroupDone(k);
  }
  if (!cfg.tied_embeddings) UCP_RETURN_IF_ERROR(Acquire(emb, true));
  ops.EncoderBackward(G(lay.wte), gpt ? G(lay.wpe) + pos0 * C : nullptr, dres, inputs, B, Tn, C);
  UCP_RETURN_IF_ERROR(Release(emb, true));
  GroupDone(emb);
  return loss;
}

}  // namespace ucp::offload::graph
