// The model's ops on the GPU (issue 12): the contracts of offload/model/ops.h (same shapes, same
// layouts — the fused QKV row in Megatron's interleaved query groups, [gate | up] for SwiGLU —
// and backward ADDS into its outputs), so each kernel is checked against the CPU reference twin
// (ops::ref) by cuda_ops_test (label gpu, run by tests/gpu/run_gpu_checks.sh on a machine with a
// GPU). This header is plain C++: pointers are device pointers, the stream is a void*
// (cudaStream_t), so host code includes it without CUDA headers.
//
// Determinism: no atomics. Every sum over rows (dweight, dbias, the embedding gradient) and over
// queries (attention's dk, dv) runs in a fixed order, so the same inputs give the same bits run
// after run. They are not the CPU ops' bits (other summation orders; the GPU's expf/tanhf), so
// the checks use the tolerances stated in cuda_ops_test.cc.
//
// Attention is one fused kernel per direction (a warp per query, online softmax forward; the
// backward recomputes the probabilities from the saved log-sum-exp, FlashAttention's recipe),
// written for correctness first; GEMMs go through cuBLAS (fp32, or bf16 inputs with fp32
// accumulation and output: the Mixed functions, what bf16 training runs).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload::cuda {

/// A cuBLAS handle bound to one stream. Create it on the device that runs the ops.
class Blas {
 public:
  /// Errors: kDeviceError (no device, cuBLAS initialisation).
  static Result<Blas> Create(void* stream = nullptr);
  Blas(Blas&&) noexcept;
  Blas& operator=(Blas&&) noexcept;
  ~Blas();
  void* stream() const;
  void* handle() const;

 private:
  struct Impl;
  explicit Blas(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Every function launches on `stream` (Blas's for the GEMMs) and returns the launch's Status:
// kInvalidArgument for sizes, kDeviceError for a CUDA or cuBLAS failure (with its name).

Status EncoderForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                      int64_t B, int64_t T, int64_t C, void* stream);
/// The positions of a batch's tokens grouped by token (host side, for EncoderBackward): `order`
/// holds 0..N-1 sorted by token, positions ascending within a token; run r of one token is
/// order[starts[r], starts[r + 1]) (starts ends with N).
struct TokenRuns {
  std::vector<int32_t> order, starts;
  int64_t runs() const { return static_cast<int64_t>(starts.size()) - 1; }
};
void GroupTokens(const int32_t* tokens, int64_t n, TokenRuns& out);
/// dwte[tokens] += dout; dwpe[t] += sum_b dout[b, t] (when dwpe). `order` and `starts` (device
/// copies of GroupTokens's, `runs` runs): a block per (run, 256 channels) adds the run's rows
/// onto its token's row one by one in position order, the bits of a walk over the tokens in
/// order (deterministic where tokens repeat), with every run at once.
Status EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                       const int32_t* order, const int32_t* starts, int64_t runs, int64_t B,
                       int64_t T, int64_t C, void* stream);

Status LayerNormForward(float* out, float* mean, float* rstd, const float* inp,
                        const float* weight, const float* bias, int64_t N, int64_t C, float eps,
                        void* stream);
Status LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const float* weight, const float* mean,
                         const float* rstd, int64_t N, int64_t C, void* stream);
Status RmsNormForward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                      int64_t C, float eps, void* stream);
Status RmsNormBackward(float* dinp, float* dweight, const float* dout, const float* inp,
                       const float* weight, const float* rstd, int64_t N, int64_t C,
                       void* stream);

/// out[N, OC] = inp[N, C] @ weight[OC, C]^T (+ bias[OC]).
Status MatmulForward(const Blas& blas, float* out, const float* inp, const float* weight,
                     const float* bias, int64_t N, int64_t C, int64_t OC);
/// dinp += dout @ weight (when dinp), dweight += dout^T @ inp, dbias += column sums of dout.
Status MatmulBackward(const Blas& blas, float* dinp, float* dweight, float* dbias,
                      const float* dout, const float* inp, const float* weight, int64_t N,
                      int64_t C, int64_t OC);
/// The bf16 GEMM of training: out[N, OC] (fp32) = inp @ weight^T with bf16 inputs (bit
/// patterns) and fp32 accumulation (cuBLAS COMPUTE_32F), no bias.
Status MatmulForwardBf16(const Blas& blas, float* out, const uint16_t* inp,
                         const uint16_t* weight, int64_t N, int64_t C, int64_t OC);

/// The GEMMs of bf16 training (CudaModel with GemmInputs::kBf16): the fp32 activation (or
/// gradient) is rounded to bf16 (nearest even) into `scratch16`, the weights are the bf16
/// training weights, the products accumulate in fp32 on the tensor cores (cuBLAS's default math
/// for these calls alone: the handle stays pedantic for the fp32 GEMMs) into fp32 outputs; bias
/// and bias gradient stay fp32. The bf16 elements of scratch both need: MixedMatmulScratch.
int64_t MixedMatmulScratch(int64_t N, int64_t C, int64_t OC);
/// out[N, OC] = bf16(inp) @ weight16^T (+ bias).
Status MatmulForwardMixed(const Blas& blas, float* out, const float* inp, const uint16_t* weight16,
                          const float* bias, int64_t N, int64_t C, int64_t OC,
                          uint16_t* scratch16);
/// dinp += bf16(dout) @ weight16 (when dinp), dweight += bf16(dout)^T @ bf16(inp), dbias += the
/// column sums of dout (fp32).
Status MatmulBackwardMixed(const Blas& blas, float* dinp, float* dweight, float* dbias,
                           const float* dout, const float* inp, const uint16_t* weight16,
                           int64_t N, int64_t C, int64_t OC, uint16_t* scratch16);

/// Causal attention over the fused qkv[B, T, (NH + 2 KV) hd]: out[B, T, NH hd], lse[B, NH, T].
Status AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                        int64_t NH, int64_t KV, int64_t hd, void* stream);
/// The floats of scratch AttentionBackward needs: B NH T (each query's sum_j p_j dp_j).
int64_t AttentionBackwardScratch(int64_t B, int64_t T, int64_t NH);
/// dqkv += the gradient of AttentionForward. `scratch`: AttentionBackwardScratch floats.
Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                         float* scratch, int64_t B, int64_t T, int64_t NH, int64_t KV,
                         int64_t hd, void* stream);

/// Attention through tensor-core GEMMs (bf16 training; the same contract as AttentionForward /
/// AttentionBackward, and the same log-sum-exp): per (sequence, head) the scores
/// S = bf16(q) bf16(k)^T in fp32, the causal softmax in fp32, out = bf16(P) bf16(v); backward
/// recomputes P from lse, dV = P^T dout, dP = dout v^T, dS = P (dP - rowsum(P dP)) scale,
/// dq += dS k, dk = dS^T q, each group's dk and dv summed over its heads in head order
/// (deterministic). The T x T buffers of several (sequence, head) pairs per pass live in
/// `scratch`: AttentionGemmScratchBytes (about 2 GiB of pass buffers by default, or
/// `pairs_per_pass` pairs). Twice the FLOPs of a causal kernel (the masked half is computed),
/// at the tensor cores' rate. Errors: kInvalidArgument (sizes, too little scratch), kDeviceError.
int64_t AttentionGemmScratchBytes(int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                  int64_t pairs_per_pass = 0);
Status AttentionForwardGemm(const Blas& blas, float* out, float* lse, const float* qkv, int64_t B,
                            int64_t T, int64_t NH, int64_t KV, int64_t hd, void* scratch,
                            int64_t scratch_bytes);
Status AttentionBackwardGemm(const Blas& blas, float* dqkv, const float* dout, const float* qkv,
                             const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV,
                             int64_t hd, void* scratch, int64_t scratch_bytes);

/// Causal attention without T x T buffers (bf16 training): FlashAttention-2's tiling on the
/// tensor cores (cuda_flash.cu), the same contract and rounding as the GEMM attention above
/// (bf16 q, k, v, probabilities and dS; fp32 softmax, accumulation, lse and outputs), causal
/// FLOPs only. `scratch`: FlashAttentionScratchBytes (the bf16 copies of qkv and dout its tiles
/// are read from, and each query's D = sum_j p_j dp_j). Deterministic (no atomics). head_dim
/// 64, 80, 96 or 128 (FlashAttentionSupports). The backward's `out` is the forward's output, if the
/// caller still has it (else null): D is then dout . out, not a second walk over the keys (7
/// tile products per tile pair, not 9).
/// Errors: kInvalidArgument (sizes, head_dim, batch x heads > 65535, too little scratch),
/// kDeviceError.
bool FlashAttentionSupports(int64_t head_dim);
int64_t FlashAttentionScratchBytes(int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd);
Status AttentionForwardFlash(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                             int64_t NH, int64_t KV, int64_t hd, void* scratch,
                             int64_t scratch_bytes, void* stream);
Status AttentionBackwardFlash(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV,
                              int64_t hd, void* scratch, int64_t scratch_bytes, void* stream);

/// Rotates the q and k heads of qkv in place (half-split rotary); the tables are ops::RopeTables'
/// [T, hd / 2] (computed on the host, copied once). Backward rotates by the opposite angle.
Status RopeForward(float* qkv, const float* cos_table, const float* sin_table, int64_t B,
                   int64_t T, int64_t NH, int64_t KV, int64_t hd, void* stream);
Status RopeBackward(float* dqkv, const float* cos_table, const float* sin_table, int64_t B,
                    int64_t T, int64_t NH, int64_t KV, int64_t hd, void* stream);

Status GeluForward(float* out, const float* inp, int64_t n, void* stream);
Status GeluBackward(float* dinp, const float* inp, const float* dout, int64_t n, void* stream);
Status SwigluForward(float* out, const float* inp, int64_t N, int64_t F, void* stream);
Status SwigluBackward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F,
                      void* stream);
Status ResidualForward(float* out, const float* a, const float* b, int64_t n, void* stream);
Status ResidualBackward(float* da, float* db, const float* dout, int64_t n, void* stream);

/// The gradient norm's chunk sums of x[0, n) (offload/train/grad_norm.h, the host's bits): for
/// each chunk c of `chunk` elements (a multiple of 8; the last may be shorter) its sum of
/// squares in double into partial[c] and its largest |x| into maxabs[c] (device arrays of
/// ceil(n / chunk)).
Status GradNormChunks(const float* x, int64_t n, int64_t chunk, double* partial, float* maxabs,
                      void* stream);

/// The floats of scratch ClassifierForwardBackward needs for up to N rows (gpu_sizes.h): one
/// block's logits, and N doubles of per-row losses. `most_rows`: as ClassifierForwardBackward's.
int64_t ClassifierScratch(int64_t N, int64_t V, int64_t most_rows = 0);
/// The fused classifier: logits = x @ w[:V]^T, the summed cross-entropy of rows with a target
/// >= 0 (returned, summed on the host in row order in double), and — when dx is not null — the
/// gradient of grad_scale x that sum: dx += dlogits @ w, dw += dlogits^T @ x. A block of rows at
/// a time (gpu_sizes.h ClassifierBlockRows; `most_rows` > 0: blocks of at most that many, for
/// tests): each block's logits, cross-entropy and gradient GEMMs, so the logits never exceed one
/// block's. Synchronises the stream (the loss is needed on the host; with dx, also once before
/// the first block, after every target is checked, so a bad target adds no gradient). Errors: also
/// kInvalidArgument for a target >= V. With `w16` (the bf16 copy of w) the three GEMMs are the
/// mixed ones above (scratch16: MixedMatmulScratch(block rows, C, V) bf16 elements) and `w` is
/// not read (it may be null); the softmax and the loss stay fp32 / double.
Result<double> ClassifierForwardBackward(const Blas& blas, float* dx, float* dw, const float* x,
                                         const float* w, const int32_t* targets, float* scratch,
                                         int64_t N, int64_t C, int64_t V, float grad_scale,
                                         const uint16_t* w16 = nullptr,
                                         uint16_t* scratch16 = nullptr, int64_t most_rows = 0);

/// Tests only: the most blocks the element-wise and one-warp-per-row kernels are launched with
/// (each loops over the rest of its range with the grid's stride); 0 restores the default
/// (65535 x 16). One block makes every such kernel walk its whole range in that loop, which
/// offload_cuda_ops_test checks gives the default grid's bits. Not thread-safe.
void SetMaxGridBlocksForTest(int blocks);

}  // namespace ucp::offload::cuda
