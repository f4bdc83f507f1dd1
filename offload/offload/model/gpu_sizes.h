// The CUDA model's device buffers, sized on the host (issue 12): cuda_ops.cu and cuda_model.cc
// size their scratch with these functions, and the memory plan (offload/train/memory_plan.h)
// counts the same bytes in its GPU column, so the plan and the allocations cannot disagree.
// Header-only, free of CUDA and of ucp's C++20 headers: nvcc compiles cuda_ops.cu with it, and
// the trainer library, which does not link the CUDA engine, includes it too.
#pragma once

#include <algorithm>
#include <cstdint>

namespace ucp::offload::gpu {

/// Where the mixed GEMMs' second operand (the input, N x C) starts in their bf16 scratch: after
/// the output gradient's N x OC, rounded up to 8 elements (16 bytes, as the tensor-core kernels
/// want their operands aligned).
inline int64_t MixedMatmulInputOffset(int64_t N, int64_t OC) { return (N * OC + 7) / 8 * 8; }

/// The bf16 elements the mixed GEMMs (bf16 training) round their two operands into:
/// cuda_ops.h MatmulForwardMixed / MatmulBackwardMixed.
inline int64_t MixedMatmulScratch(int64_t N, int64_t C, int64_t OC) {
  return MixedMatmulInputOffset(N, OC) + N * C;
}

/// The fused attention backward's floats (each query's sum_j p_j dp_j).
inline int64_t AttentionBackwardScratch(int64_t B, int64_t T, int64_t NH) { return B * NH * T; }

/// The fused classifier (cuda_ops.h ClassifierForwardBackward) computes its logits a block of
/// rows at a time, at most kClassifierBlockFloats floats (1 GiB) of them, so its scratch does not
/// grow with the tokens of a step (at 64K tokens and a 128K vocabulary the whole logits would be
/// 32 GiB). ClassifierMostRows: a block's most rows (`most_rows` > 0: that many instead, for
/// tests).
inline constexpr int64_t kClassifierBlockFloats = int64_t{1} << 28;
inline int64_t ClassifierMostRows(int64_t V, int64_t most_rows = 0) {
  if (most_rows > 0) return most_rows;
  const int64_t most = kClassifierBlockFloats / (V > 0 ? V : 1);
  return most > 0 ? most : 1;
}
/// The rows of each block for N rows: equal blocks (the last no shorter than the others by more
/// than one row), as the CPU's ops::ClassifierBlockRows, so no block's GEMM is thin.
inline int64_t ClassifierBlockRows(int64_t N, int64_t V, int64_t most_rows = 0) {
  const int64_t most = ClassifierMostRows(V, most_rows);
  const int64_t blocks = (N + most - 1) / most;
  return blocks > 0 ? (N + blocks - 1) / blocks : 0;
}
/// The fused classifier's floats for up to N rows: a block's logits (min(N, most) rows x V), then
/// N doubles of per-row losses and a flag.
inline int64_t ClassifierScratch(int64_t N, int64_t V, int64_t most_rows = 0) {
  const int64_t rows = std::min(N, ClassifierMostRows(V, most_rows));
  return ((rows * V + 1) / 2) * 2 + 2 * N + 2;
}

/// The GEMM attention (cuda_ops.h AttentionForwardGemm): the score buffers of one pass are at
/// most this many bytes by default, but always hold one KV group of (sequence, head) pairs.
inline constexpr int64_t kAttnPassBytes = int64_t{2} << 30;
inline constexpr int64_t kAttnAlign = 256;
/// The device pointer arrays it keeps, one of B NH entries per kind.
inline constexpr int64_t kAttnPtrKinds = 11;
inline int64_t AttnAlignUp(int64_t n) { return (n + kAttnAlign - 1) / kAttnAlign * kAttnAlign; }

/// One (sequence, head) pair's pass buffers: scores / probabilities (fp32), their bf16 copy, dP
/// (fp32), and the per-head dk and dv.
inline int64_t AttnPairBytes(int64_t T, int64_t hd) { return T * T * (4 + 2 + 4) + 2 * T * hd * 4; }

/// Byte offsets of the GEMM attention's buffers in its scratch.
struct AttnScratch {
  int64_t qkv16 = 0, dout16 = 0, ptrs = 0, fixed = 0;
  int64_t S = 0, P16 = 0, dP = 0, dK = 0, dV = 0, total = 0;
};

inline AttnScratch AttnLayout(int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                              int64_t pairs) {
  AttnScratch a;
  const int64_t N = B * T, row = (NH + 2 * KV) * hd;
  a.dout16 = AttnAlignUp(N * row * 2);
  a.ptrs = a.dout16 + AttnAlignUp(N * NH * hd * 2);
  a.fixed = a.ptrs + AttnAlignUp(kAttnPtrKinds * B * NH * static_cast<int64_t>(sizeof(void*)));
  a.S = a.fixed;
  a.P16 = a.S + AttnAlignUp(pairs * T * T * 4);
  a.dP = a.P16 + AttnAlignUp(pairs * T * T * 2);
  a.dK = a.dP + AttnAlignUp(pairs * T * T * 4);
  a.dV = a.dK + AttnAlignUp(pairs * T * hd * 4);
  a.total = a.dV + AttnAlignUp(pairs * T * hd * 4);
  return a;
}

/// The GEMM attention's scratch: its fixed part and `pairs_per_pass` pairs (0: as many as
/// kAttnPassBytes holds, rounded to whole KV groups, at least one group, at most B NH).
inline int64_t AttentionGemmScratchBytes(int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                         int64_t pairs_per_pass = 0) {
  if (B < 1 || T < 1 || NH < 1 || KV < 1 || hd < 1 || NH % KV != 0) return 0;
  const int64_t hpg = NH / KV;
  int64_t pairs = pairs_per_pass > 0
                      ? (pairs_per_pass + hpg - 1) / hpg * hpg
                      : std::max(hpg, kAttnPassBytes / AttnPairBytes(T, hd) / hpg * hpg);
  pairs = std::min(pairs, B * NH);
  // The slack the pass buffers keep for their alignment.
  return AttnLayout(B, T, NH, KV, hd, pairs).fixed + pairs * AttnPairBytes(T, hd) +
         5 * kAttnAlign;
}

/// The flash attention's scratch (cuda_ops.h AttentionForwardFlash / AttentionBackwardFlash),
/// byte offsets: the bf16 copy of qkv (its kernels read bf16 tiles), of dout (backward), and each
/// query's D (backward; B NH T floats).
struct FlashScratch {
  int64_t qkv16 = 0, dout16 = 0, d = 0, total = 0;
};
inline FlashScratch FlashLayout(int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  FlashScratch f;
  const int64_t N = B * T;
  f.dout16 = AttnAlignUp(N * (NH + 2 * KV) * hd * 2);
  f.d = f.dout16 + AttnAlignUp(N * NH * hd * 2);
  f.total = f.d + AttnAlignUp(B * NH * T * 4);
  return f;
}
inline int64_t FlashAttentionScratchBytes(int64_t B, int64_t T, int64_t NH, int64_t KV,
                                          int64_t hd) {
  if (B < 1 || T < 1 || NH < 1 || KV < 1 || hd < 1) return 0;
  return FlashLayout(B, T, NH, KV, hd).total;
}

/// What CudaModel::Create allocates besides its activations (graph::Acts), for micro-batches of
/// up to max_batch x max_seq_len tokens; gemm_bf16: the bf16 GEMMs' and GEMM attention's
/// scratch too; flash_attention (with gemm_bf16): the flash kernels' scratch instead of the GEMM
/// attention's.
struct ModelScratch {
  int64_t attn_floats = 0;      ///< AttentionBackwardScratch
  int64_t classifier_floats = 0;
  int64_t gemm16 = 0;           ///< bf16 elements: the largest GEMM's MixedMatmulScratch
  int64_t attn_gemm_bytes = 0;  ///< AttentionGemmScratchBytes
  int64_t flash_bytes = 0;      ///< FlashAttentionScratchBytes
  int64_t token_ints = 0;       ///< the inputs, targets and their runs by token (int32)
  int64_t bytes() const {
    return (attn_floats + classifier_floats) * 4 + gemm16 * 2 + attn_gemm_bytes + flash_bytes +
           token_ints * 4;
  }
};

/// `c`: a ModelConfig (model.h; a template so this header needs none of it); gated_ffn: the
/// FFN's first GEMM is 2 x ffn_hidden wide (LLaMA's SwiGLU). sp > 1: Ulysses sequence
/// parallelism (offload/model/ulysses.h; the caller has checked its rules): the position-wise ops
/// run on this rank's max_seq_len / sp positions, attention on the whole sequence of its
/// heads / sp query heads and their KV heads (kv_heads / sp, or one replicated group).
template <typename Config>
ModelScratch CudaModelScratch(const Config& c, bool gated_ffn, int64_t max_batch,
                              int64_t max_seq_len, bool gemm_bf16,
                              bool flash_attention = false, int64_t sp = 1) {
  ModelScratch s;
  const int64_t rows = max_batch * (max_seq_len / sp);
  const int64_t NHl = c.heads / sp, KVl = c.kv_heads % sp == 0 ? c.kv_heads / sp : 1;
  s.attn_floats = AttentionBackwardScratch(max_batch, max_seq_len, NHl);
  s.classifier_floats = ClassifierScratch(rows, c.vocab);
  s.token_ints = 4 * rows + 1;  // inputs, targets, GroupTokens's order and starts
  if (gemm_bf16) {
    // Every (in, out) width of the layers' GEMMs.
    const int64_t C = c.hidden, ah = c.heads * c.head_dim;
    const int64_t qkv = (c.heads + 2 * c.kv_heads) * c.head_dim;
    const int64_t F = c.ffn_hidden, F1 = gated_ffn ? 2 * F : F;
    const int64_t V = c.vocab;
    const int64_t widths[4][2] = {{C, qkv}, {ah, C}, {C, F1}, {F, C}};
    for (const auto& w : widths) {
      s.gemm16 = std::max(s.gemm16, MixedMatmulScratch(rows, w[0], w[1]));
    }
    // The classifier's GEMMs, a block of rows at a time.
    s.gemm16 = std::max(s.gemm16,
                        MixedMatmulScratch(std::min(rows, ClassifierMostRows(V)), C, V));
    if (flash_attention) {
      s.flash_bytes =
          FlashAttentionScratchBytes(max_batch, max_seq_len, NHl, KVl, c.head_dim);
    } else {
      s.attn_gemm_bytes =
          AttentionGemmScratchBytes(max_batch, max_seq_len, NHl, KVl, c.head_dim);
    }
  }
  return s;
}

}  // namespace ucp::offload::gpu
