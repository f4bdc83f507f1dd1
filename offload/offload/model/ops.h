// The engine's CPU ops, fp32, one flat function per op in the manner of llm.c's train_gpt2.c:
// forward writes its output, backward ADDS into every gradient it is given (dinp +=, dweight +=,
// dbias +=), so residual branches and micro-batches accumulate without copies.
//
// Two twins of every op:
//   * ops::X (ops.cc): the fast path, all on a Parallel (a oneTBB arena): projections as one
//     single-threaded cblas_sgemm per arena thread on disjoint blocks of the output, everything
//     else over static row partitions.
//   * ops::ref::X<T> (ops_ref.cc): plain scalar loops, instantiated for float and double. The
//     tests check the fast ops against them in fp32 and the backward passes against central
//     finite differences in fp64; model.cc composes them in double as the model's oracle.
//
// Determinism: a Parallel cuts every range into num_threads contiguous chunks fixed by the range
// size alone, and reductions across rows (dweight, dbias, the loss) are per-chunk partials summed
// in chunk order, so the same inputs and thread count give the same bits whichever worker runs
// which chunk. A GEMM block's values depend only on its shape, and the blocks are fixed by the
// thread count, so the projections are deterministic for a fixed thread count too.
//
// Threads: one pool. The GEMMs are split over the arena by the ops themselves and OpenBLAS is
// set to one thread (process-global: openblas_set_num_threads(1), done by Parallel's constructor
// and by Model on every call), so no OpenBLAS thread ever exists to busy-wait beside the arena's
// workers (docs/adr/0007-cpu-blas.md has the measurements).
//
// Shapes are in comments beside the pointers; the ops validate nothing (the model does), take
// contiguous row-major tensors only, and cannot fail (Errors: none, for every op below).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

namespace ucp::offload {

/// A oneTBB task_arena of `num_threads` with a static partitioner and a reusable scratch buffer.
/// Not thread-safe: one caller at a time. Constructing one sets OpenBLAS to one thread.
class Parallel {
 public:
  /// num_threads >= 1 (UCP_CHECK).
  explicit Parallel(int num_threads);
  Parallel(Parallel&&) noexcept;
  Parallel& operator=(Parallel&&) noexcept;
  ~Parallel();

  int num_threads() const { return num_threads_; }
  /// Number of chunks every For() cuts its range into (== num_threads).
  int num_chunks() const { return num_threads_; }

  /// Runs body(chunk, begin, end) for each of the num_chunks() contiguous pieces of [0, n):
  /// chunk c covers [n*c/k, n*(c+1)/k). Pieces may be empty. Returns when all are done.
  template <typename F>
  void For(int64_t n, F&& body) {
    using Fn = std::remove_reference_t<F>;
    Run(
        n,
        [](void* ctx, int chunk, int64_t begin, int64_t end) {
          (*static_cast<Fn*>(ctx))(chunk, begin, end);
        },
        static_cast<void*>(&body));
  }

  /// A scratch buffer of at least `count` floats, valid until the next Scratch() call. Grows
  /// (allocates) only when a larger size is asked for; Reserve() it up front to avoid that.
  float* Scratch(size_t count);
  void Reserve(size_t count) { Scratch(count); }
  /// The floats the scratch holds now (the memory plan's check of its figures).
  size_t scratch_floats() const { return scratch_.size(); }

 private:
  void Run(int64_t n, void (*fn)(void*, int, int64_t, int64_t), void* ctx);
  struct Impl;
  int num_threads_ = 1;
  std::unique_ptr<Impl> impl_;
  std::vector<float> scratch_;
};

namespace ops {

// ---------------------------------------------------------------------------------------------
// Fast path (ops.cc). B: batch, T: sequence, C: channels, N = B*T rows.

/// out[B,T,C] = wte[tokens[b,t]] + (wpe ? wpe[t] : 0). tokens must be < rows of wte.
void EncoderForward(Parallel& par, float* out, const int32_t* tokens, const float* wte,
                    const float* wpe, int64_t B, int64_t T, int64_t C);
/// dwte[tokens[b,t]] += dout[b,t]; dwpe[t] += sum_b dout[b,t] (when dwpe). Partitioned over
/// channels (dwte) and positions (dwpe), so no two chunks touch the same element.
void EncoderBackward(Parallel& par, float* dwte, float* dwpe, const float* dout,
                     const int32_t* tokens, int64_t B, int64_t T, int64_t C);

/// out[N,C] = (inp - mean) * rstd * weight + bias; mean[N], rstd[N] saved for backward.
/// Biased variance; rstd = 1 / sqrt(var + eps).
void LayerNormForward(Parallel& par, float* out, float* mean, float* rstd, const float* inp,
                      const float* weight, const float* bias, int64_t N, int64_t C, float eps);
void LayerNormBackward(Parallel& par, float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, const float* mean, const float* rstd,
                       int64_t N, int64_t C);

/// out[N,C] = inp * rstd * weight, rstd = 1 / sqrt(mean(inp^2) + eps) saved in rstd[N].
void RmsNormForward(Parallel& par, float* out, float* rstd, const float* inp, const float* weight,
                    int64_t N, int64_t C, float eps);
void RmsNormBackward(Parallel& par, float* dinp, float* dweight, const float* dout,
                     const float* inp, const float* weight, const float* rstd, int64_t N,
                     int64_t C);

/// out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC] (bias may be null). cblas_sgemm per thread.
void MatmulForward(Parallel& par, float* out, const float* inp, const float* weight,
                   const float* bias, int64_t N, int64_t C, int64_t OC);
/// dinp[N,C] += dout @ weight; dweight[OC,C] += dout^T @ inp; dbias[OC] += colsum(dout).
/// dinp, dbias may be null.
void MatmulBackward(Parallel& par, float* dinp, float* dweight, float* dbias, const float* dout,
                    const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC);

/// Causal self-attention over the fused QKV rows (Megatron interleaved groups: KV groups of
/// [q of NH/KV heads | k | v], hd rows each). qkv[B,T,(NH+2KV)*hd] -> out[B,T,NH*hd], with the
/// per-row log-sum-exp of the scaled scores lse[B,NH,T] saved for backward (the probabilities
/// are recomputed there, so memory is O(T) per head, not O(T^2)).
void AttentionForward(Parallel& par, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                      int64_t NH, int64_t KV, int64_t hd);
/// dqkv[B,T,(NH+2KV)*hd] += d/dqkv of <dout, out>. Parallel over (b, kv group), so each chunk
/// owns its k/v gradient rows.
void AttentionBackward(Parallel& par, float* dqkv, const float* dout, const float* qkv,
                       const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd);

/// The RoPE tables for positions [0, T): cos/sin[T, hd/2] of p * theta^(-2i/hd), the angle and
/// both functions evaluated in double and rounded to float once (see model.cc).
void RopeTables(float* cos_table, float* sin_table, int64_t T, int64_t hd, double theta);
/// In place on the q and k rows of qkv[B,T,(NH+2KV)*hd]: rotate_half rotary,
/// (x_i, x_{i+hd/2}) -> (x_i c - x_{i+hd/2} s, x_{i+hd/2} c + x_i s). v rows untouched.
void RopeForward(Parallel& par, float* qkv, const float* cos_table, const float* sin_table,
                 int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd);
/// In place on dqkv: the transpose (rotation by -angle). The op is linear, so this turns the
/// gradient w.r.t. the rotated q/k into the gradient w.r.t. the unrotated ones.
void RopeBackward(Parallel& par, float* dqkv, const float* cos_table, const float* sin_table,
                  int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd);

/// out[n] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GPT-2's gelu_new).
void GeluForward(Parallel& par, float* out, const float* inp, int64_t n);
void GeluBackward(Parallel& par, float* dinp, const float* inp, const float* dout, int64_t n);

/// inp[N, 2F] = [gate | up] per row; out[N,F] = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
void SwigluForward(Parallel& par, float* out, const float* inp, int64_t N, int64_t F);
void SwigluBackward(Parallel& par, float* dinp, const float* inp, const float* dout, int64_t N,
                    int64_t F);

/// out[n] = a + b; backward: da += dout, db += dout.
void ResidualForward(Parallel& par, float* out, const float* a, const float* b, int64_t n);
void ResidualBackward(Parallel& par, float* da, float* db, const float* dout, int64_t n);

/// Fused classifier: logits = x[N,C] @ w[:V]^T (only the first V rows of w[Vp,C]; the padded
/// rows never enter), softmax cross-entropy (natural log) against targets[N] (< 0: no loss, no
/// gradient). Returns the sum of the per-row losses (in double, summed in row order). When dx
/// is non-null, backpropagates grad_scale * sum: dx[N,C] += dlogits @ w[:V], dw[:V] +=
/// dlogits^T @ x (dw rows >= V untouched). Works on row blocks of ClassifierBlockRows(N, V)
/// rows, so at most one block of logits exists at a time. targets must be < V.
double ClassifierForwardBackward(Parallel& par, float* dx, float* dw, const float* x,
                                 const float* w, const int32_t* targets, int64_t N, int64_t C,
                                 int64_t V, float grad_scale);
/// Rows per block of the classifier: about 16 Mi logits (64 MiB), which keeps the dw GEMM's
/// K dimension large enough to amortise streaming dw through memory.
int64_t ClassifierBlockRows(int64_t N, int64_t V);
/// The floats of Parallel::Scratch the classifier needs for any N' <= N (for Reserve).
size_t ClassifierScratch(int64_t N, int64_t V, int num_chunks);
/// The floats of Parallel::Scratch the other ops need at most, for Reserve.
size_t OpsScratch(int64_t N, int64_t C, int64_t T, int64_t hd, int num_chunks);

// ---------------------------------------------------------------------------------------------
// Scalar reference twins (ops_ref.cc), T in {float, double}; sequential, no BLAS, the obvious
// loop order. Same contracts as above (backward adds). The attention reference keeps a full
// probability row per query; the classifier reference materialises all N x V logits.
namespace ref {

template <typename T>
void EncoderForward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int64_t B,
                    int64_t Tn, int64_t C);
template <typename T>
void EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B, int64_t Tn,
                     int64_t C);
template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                      int64_t N, int64_t C, T eps);
template <typename T>
void LayerNormBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                       const T* mean, const T* rstd, int64_t N, int64_t C);
template <typename T>
void RmsNormForward(T* out, T* rstd, const T* inp, const T* weight, int64_t N, int64_t C, T eps);
template <typename T>
void RmsNormBackward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                     const T* rstd, int64_t N, int64_t C);
template <typename T>
void MatmulForward(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int64_t C,
                   int64_t OC);
template <typename T>
void MatmulBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                    int64_t N, int64_t C, int64_t OC);
template <typename T>
void AttentionForward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t NH, int64_t KV,
                      int64_t hd);
template <typename T>
void AttentionBackward(T* dqkv, const T* dout, const T* qkv, const T* lse, int64_t B, int64_t Tn,
                       int64_t NH, int64_t KV, int64_t hd);
template <typename T>
void RopeForward(T* qkv, const T* cos_table, const T* sin_table, int64_t B, int64_t Tn, int64_t NH,
                 int64_t KV, int64_t hd);
template <typename T>
void RopeBackward(T* dqkv, const T* cos_table, const T* sin_table, int64_t B, int64_t Tn,
                  int64_t NH, int64_t KV, int64_t hd);
/// The tables in T (double: no rounding to float; float: the same values as ops::RopeTables).
template <typename T>
void RopeTables(T* cos_table, T* sin_table, int64_t Tn, int64_t hd, double theta);
template <typename T>
void GeluForward(T* out, const T* inp, int64_t n);
template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n);
template <typename T>
void SwigluForward(T* out, const T* inp, int64_t N, int64_t F);
template <typename T>
void SwigluBackward(T* dinp, const T* inp, const T* dout, int64_t N, int64_t F);
template <typename T>
void ResidualForward(T* out, const T* a, const T* b, int64_t n);
template <typename T>
void ResidualBackward(T* da, T* db, const T* dout, int64_t n);
/// `logits` is caller scratch of N*V.
template <typename T>
double ClassifierForwardBackward(T* dx, T* dw, T* logits, const T* x, const T* w,
                                 const int32_t* targets, int64_t N, int64_t C, int64_t V,
                                 T grad_scale);

}  // namespace ref
}  // namespace ops

/// For benchmarks (ucp-bench train): the best GFLOP/s over `repeats` runs of the GEMM the model's
/// ops use (C[M,N] = A[M,K] B[N,K]^T, split over `num_threads` exactly as the model splits it),
/// on random operands. Not a hot path: it allocates.
double MeasureSgemmGflops(int64_t M, int64_t N, int64_t K, int num_threads, int repeats);

}  // namespace ucp::offload
