// The fast CPU path of the ops in ops.h. Projections (and the classifier's three products) are
// single-threaded cblas_sgemm calls on disjoint blocks of the output, one per arena thread (Gemm
// below); the rest is memory-light loops over static row partitions on the same arena, written so
// that GCC vectorises their inner loops (contiguous unit-stride bodies, no reductions the compiler
// would have to reorder: sums that should be vectorised keep kLanes explicit partial
// accumulators, combined in a fixed order).
#include "offload/model/ops.h"

#include <cblas.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "offload/model/qkv_layout.h"
#include "ucp/base/check.h"

namespace ucp::offload {

struct Parallel::Impl {
  explicit Impl(int n) : arena(n) {}
  tbb::task_arena arena;
};

Parallel::Parallel(int num_threads) : num_threads_(num_threads) {
  UCP_CHECK(num_threads >= 1) << "num_threads " << num_threads;
  openblas_set_num_threads(1);  // the ops thread their GEMMs themselves (Gemm)
  if (num_threads > 1) impl_ = std::make_unique<Impl>(num_threads);
}
Parallel::Parallel(Parallel&&) noexcept = default;
Parallel& Parallel::operator=(Parallel&&) noexcept = default;
Parallel::~Parallel() = default;

float* Parallel::Scratch(size_t count) {
  if (scratch_.size() < count) scratch_.resize(count);
  return scratch_.data();
}

void Parallel::Run(int64_t n, void (*fn)(void*, int, int64_t, int64_t), void* ctx) {
  const int k = num_threads_;
  auto piece = [&](int c) { fn(ctx, c, n * c / k, n * (c + 1) / k); };
  if (k == 1 || n <= 1) {
    for (int c = 0; c < k; ++c) piece(c);
    return;
  }
  // One task per chunk: the chunk boundaries depend on n and k only, so which worker runs a
  // chunk cannot change a result.
  impl_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<int>(0, k, 1),
        [&](const tbb::blocked_range<int>& r) {
          for (int c = r.begin(); c != r.end(); ++c) piece(c);
        },
        tbb::simple_partitioner());
  });
}

namespace ops {

namespace {
// C[M,N] = op(A) op(B) + beta C (alpha 1, row-major), as num_chunks single-threaded sgemm calls
// on the arena, each on a contiguous block of C's rows (M >= N) or columns (in units of 16, the
// kernels' register block), each with the whole K sum. So the GEMMs run on the same threads as
// every other op, and OpenBLAS keeps no threads of its own to busy-wait between calls
// (docs/adr/0007-cpu-blas.md); a block's values depend only on its shape, so the result is
// deterministic for a fixed thread count. Needs openblas_set_num_threads(1) (Model does it).
void Gemm(Parallel& par, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t M, int64_t N, int64_t K,
          const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
          int64_t ldc) {
  if (par.num_threads() == 1) {
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  constexpr int64_t kUnit = 16;
  if (M >= N) {
    par.For((M + kUnit - 1) / kUnit, [&](int, int64_t u0, int64_t u1) {
      const int64_t r0 = u0 * kUnit, r1 = std::min(M, u1 * kUnit);
      if (r1 <= r0) return;
      cblas_sgemm(CblasRowMajor, ta, tb, r1 - r0, N, K, 1.0f,
                  A + (ta == CblasNoTrans ? r0 * lda : r0), lda, B, ldb, beta, C + r0 * ldc, ldc);
    });
  } else {
    par.For((N + kUnit - 1) / kUnit, [&](int, int64_t u0, int64_t u1) {
      const int64_t c0 = u0 * kUnit, c1 = std::min(N, u1 * kUnit);
      if (c1 <= c0) return;
      cblas_sgemm(CblasRowMajor, ta, tb, M, c1 - c0, K, 1.0f, A, lda,
                  B + (tb == CblasNoTrans ? c0 : c0 * ldb), ldb, beta, C + c0, ldc);
    });
  }
}
}  // namespace

namespace {

constexpr int kLanes = 16;

// exp(x) for x in about [-87, 88] (clamped), within 2 ulp: Cephes' expf with the power of two
// built in the exponent bits. Branch-free so loops over it vectorise (glibc's expf does not).
inline float FastExp(float x) {
  // Ternaries, not std::min/max: with -fno-trapping-math GCC if-converts them into vector blends.
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // Round to nearest by the 1.5 * 2^23 trick (no roundps on baseline x86-64).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * std::bit_cast<float>(bits);
}

// tanh(u) = 1 - 2 / (exp(2u) + 1): saturates to +-1 cleanly; absolute error ~1e-7, which is
// what GeLU's 0.5 x (1 + tanh) can use.
inline float FastTanh(float u) { return 1.0f - 2.0f / (FastExp(2.0f * u) + 1.0f); }

// out[C] += sum over rows of in[N,C], by per-chunk partials summed in chunk order.
void ColumnSum(Parallel& par, float* out, const float* in, int64_t N, int64_t C) {
  const int k = par.num_chunks();
  float* partial = par.Scratch(static_cast<size_t>(k) * C);  // [k, C]
  par.For(N, [&](int chunk, int64_t r0, int64_t r1) {
    float* acc = partial + chunk * C;
    std::fill(acc, acc + C, 0.0f);
    for (int64_t n = r0; n < r1; ++n) {
      const float* row = in + n * C;
      for (int64_t c = 0; c < C; ++c) acc[c] += row[c];
    }
  });
  par.For(C, [&](int, int64_t c0, int64_t c1) {
    for (int chunk = 0; chunk < k; ++chunk) {
      const float* acc = partial + chunk * C;
      for (int64_t c = c0; c < c1; ++c) out[c] += acc[c];
    }
  });
}

// Sum of x[0, n) with kLanes partial sums (vectorisable, fixed order).
inline float LaneSum(const float* x, int64_t n) {
  float acc[kLanes] = {};
  const int64_t rounded = n / kLanes * kLanes;
  for (int64_t i = 0; i < rounded; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l];
  }
  float s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (int64_t i = rounded; i < n; ++i) s += x[i];
  return s;
}

// Max of x[0, n) with kLanes partial maxima (max is exact, so any order gives the same value).
inline float LaneMax(const float* x, int64_t n) {
  float acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = -std::numeric_limits<float>::infinity();
  const int64_t rounded = n / kLanes * kLanes;
  for (int64_t i = 0; i < rounded; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  }
  float m = acc[0];
  for (int l = 1; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  for (int64_t i = rounded; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// s[j] += a * x[j] for j in [0, n).
inline void Axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

}  // namespace

void EncoderForward(Parallel& par, float* out, const int32_t* tokens, const float* wte,
                    const float* wpe, int64_t B, int64_t T, int64_t C) {
  par.For(B * T, [&](int, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* e = wte + static_cast<int64_t>(tokens[n]) * C;
      float* o = out + n * C;
      if (wpe) {
        const float* p = wpe + (n % T) * C;
        for (int64_t c = 0; c < C; ++c) o[c] = e[c] + p[c];
      } else {
        std::memcpy(o, e, sizeof(float) * C);
      }
    }
  });
}

void EncoderBackward(Parallel& par, float* dwte, float* dwpe, const float* dout,
                     const int32_t* tokens, int64_t B, int64_t T, int64_t C) {
  // Channels partitioned: a token repeated in the batch is accumulated by one chunk, in row order.
  par.For(C, [&](int, int64_t c0, int64_t c1) {
    for (int64_t n = 0; n < B * T; ++n) {
      float* dw = dwte + static_cast<int64_t>(tokens[n]) * C;
      const float* d = dout + n * C;
      for (int64_t c = c0; c < c1; ++c) dw[c] += d[c];
    }
  });
  if (dwpe) {
    par.For(T, [&](int, int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t b = 0; b < B; ++b) {
          const float* d = dout + (b * T + t) * C;
          for (int64_t c = 0; c < C; ++c) dwpe[t * C + c] += d[c];
        }
      }
    });
  }
}

void LayerNormForward(Parallel& par, float* out, float* mean, float* rstd, const float* inp,
                      const float* weight, const float* bias, int64_t N, int64_t C, float eps) {
  par.For(N, [&](int, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* x = inp + n * C;
      float* o = out + n * C;
      const float m = LaneSum(x, C) / C;
      // Centred values go through `o` so the variance sum vectorises.
      for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * (x[c] - m);
      const float v = LaneSum(o, C) / C;
      const float s = 1.0f / std::sqrt(v + eps);
      for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * s * weight[c] + bias[c];
      mean[n] = m;
      rstd[n] = s;
    }
  });
}

void LayerNormBackward(Parallel& par, float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, const float* mean, const float* rstd,
                       int64_t N, int64_t C) {
  const int k = par.num_chunks();
  // [k, 2C] dweight | dbias partials, then [k, 2C] row scratch.
  float* scratch = par.Scratch(static_cast<size_t>(k) * 4 * C);
  par.For(N, [&](int chunk, int64_t r0, int64_t r1) {
    float* dw = scratch + chunk * 2 * C;
    float* db = dw + C;
    float* norm = scratch + (k + chunk) * 2 * C;
    float* dnorm = norm + C;
    std::fill(dw, dw + 2 * C, 0.0f);
    for (int64_t n = r0; n < r1; ++n) {
      const float* x = inp + n * C;
      const float* d = dout + n * C;
      const float m = mean[n], s = rstd[n];
      for (int64_t c = 0; c < C; ++c) {
        norm[c] = (x[c] - m) * s;
        dnorm[c] = weight[c] * d[c];
      }
      const float dnorm_mean = LaneSum(dnorm, C) / C;
      float* di = dinp + n * C;
      float acc[kLanes] = {};
      const int64_t rounded = C / kLanes * kLanes;
      for (int64_t c = 0; c < rounded; c += kLanes) {
        for (int l = 0; l < kLanes; ++l) acc[l] += dnorm[c + l] * norm[c + l];
      }
      float dnn = 0;
      for (int l = 0; l < kLanes; ++l) dnn += acc[l];
      for (int64_t c = rounded; c < C; ++c) dnn += dnorm[c] * norm[c];
      const float dnorm_norm_mean = dnn / C;
      for (int64_t c = 0; c < C; ++c) {
        db[c] += d[c];
        dw[c] += norm[c] * d[c];
        di[c] += (dnorm[c] - dnorm_mean - norm[c] * dnorm_norm_mean) * s;
      }
    }
  });
  par.For(C, [&](int, int64_t c0, int64_t c1) {
    for (int chunk = 0; chunk < k; ++chunk) {
      const float* dw = scratch + chunk * 2 * C;
      for (int64_t c = c0; c < c1; ++c) {
        dweight[c] += dw[c];
        dbias[c] += dw[C + c];
      }
    }
  });
}

void RmsNormForward(Parallel& par, float* out, float* rstd, const float* inp, const float* weight,
                    int64_t N, int64_t C, float eps) {
  par.For(N, [&](int, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* x = inp + n * C;
      float* o = out + n * C;
      for (int64_t c = 0; c < C; ++c) o[c] = x[c] * x[c];
      const float s = 1.0f / std::sqrt(LaneSum(o, C) / C + eps);
      for (int64_t c = 0; c < C; ++c) o[c] = x[c] * s * weight[c];
      rstd[n] = s;
    }
  });
}

void RmsNormBackward(Parallel& par, float* dinp, float* dweight, const float* dout,
                     const float* inp, const float* weight, const float* rstd, int64_t N,
                     int64_t C) {
  const int k = par.num_chunks();
  float* scratch = par.Scratch(static_cast<size_t>(k) * 3 * C);  // [k, C] dw, [k, 2C] rows
  par.For(N, [&](int chunk, int64_t r0, int64_t r1) {
    float* dw = scratch + chunk * C;
    float* norm = scratch + k * C + chunk * 2 * C;
    float* prod = norm + C;
    std::fill(dw, dw + C, 0.0f);
    for (int64_t n = r0; n < r1; ++n) {
      const float* x = inp + n * C;
      const float* d = dout + n * C;
      const float s = rstd[n];
      for (int64_t c = 0; c < C; ++c) {
        norm[c] = x[c] * s;
        prod[c] = weight[c] * d[c] * norm[c];
      }
      const float dnorm_norm_mean = LaneSum(prod, C) / C;
      float* di = dinp + n * C;
      for (int64_t c = 0; c < C; ++c) {
        dw[c] += norm[c] * d[c];
        di[c] += (weight[c] * d[c] - norm[c] * dnorm_norm_mean) * s;
      }
    }
  });
  par.For(C, [&](int, int64_t c0, int64_t c1) {
    for (int chunk = 0; chunk < k; ++chunk) {
      const float* dw = scratch + chunk * C;
      for (int64_t c = c0; c < c1; ++c) dweight[c] += dw[c];
    }
  });
}

void MatmulForward(Parallel& par, float* out, const float* inp, const float* weight,
                   const float* bias, int64_t N, int64_t C, int64_t OC) {
  Gemm(par, CblasNoTrans, CblasTrans, N, OC, C, inp, C, weight, C, 0.0f, out, OC);
  if (bias) {
    par.For(N, [&](int, int64_t r0, int64_t r1) {
      for (int64_t n = r0; n < r1; ++n) {
        float* o = out + n * OC;
        for (int64_t j = 0; j < OC; ++j) o[j] += bias[j];
      }
    });
  }
}

void MatmulBackward(Parallel& par, float* dinp, float* dweight, float* dbias, const float* dout,
                    const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
  if (dinp) {
    // dinp[N,C] += dout[N,OC] @ weight[OC,C]
    Gemm(par, CblasNoTrans, CblasNoTrans, N, C, OC, dout, OC, weight, C, 1.0f, dinp, C);
  }
  // dweight[OC,C] += dout^T @ inp
  Gemm(par, CblasTrans, CblasNoTrans, OC, C, N, dout, OC, inp, C, 1.0f, dweight, C);
  if (dbias) ColumnSum(par, dbias, dout, N, OC);
}

size_t OpsScratch(int64_t N, int64_t C, int64_t T, int64_t hd, int num_chunks) {
  const size_t k = static_cast<size_t>(num_chunks);
  const size_t attention = k * static_cast<size_t>(4 * hd * T + 8 * T);  // AttentionScratch
  (void)N;
  return std::max({k * 4 * static_cast<size_t>(C), attention});
}

// The attention kernels work on one unit = (sequence b, kv group g) at a time. On x86-64 they
// are compiled three times (AVX-512, AVX2, baseline SSE2) and the loader picks one by CPU
// (GCC target_clones, an ifunc). The clones compute the same expression in the same order:
// -ffp-contract=off forbids FMA and every reduction is written with a fixed order, so they give
// the same bits; only the vector width differs.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define UCP_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define UCP_MULTIVERSION
#endif

namespace {

// Queries per block: the scores of kQ queries are accumulated together so each key row loaded
// from kt feeds kQ multiply-adds (one alone makes the loop load-bound).
constexpr int64_t kQ = 4;

// Attention scratch per chunk: kt, vt [hd, T], dk, dv [T, hd], p, dp [kQ, T].
int64_t AttentionScratch(int64_t T, int64_t hd) { return 4 * hd * T + 2 * kQ * T; }

// s[r][0, len) = q_r . K_j for the kQ queries q[r] (rows of `stride`), with K transposed in
// kt[hd, T]: unit-stride axpys over j, each s[r][j] summed over i in order, as the reference's
// per-key dot product.
inline void Scores4(float* __restrict s, const float* const* q, const float* __restrict kt,
                    int64_t T, int64_t len, int64_t hd) {
  float* __restrict s0 = s;
  float* __restrict s1 = s + T;
  float* __restrict s2 = s + 2 * T;
  float* __restrict s3 = s + 3 * T;
  std::fill(s0, s0 + len, 0.0f);
  std::fill(s1, s1 + len, 0.0f);
  std::fill(s2, s2 + len, 0.0f);
  std::fill(s3, s3 + len, 0.0f);
  for (int64_t i = 0; i < hd; ++i) {
    const float a0 = q[0][i], a1 = q[1][i], a2 = q[2][i], a3 = q[3][i];
    const float* __restrict kr = kt + i * T;
    for (int64_t j = 0; j < len; ++j) {
      const float k = kr[j];
      s0[j] += a0 * k;
      s1[j] += a1 * k;
      s2[j] += a2 * k;
      s3[j] += a3 * k;
    }
  }
}

UCP_MULTIVERSION void AttentionForwardUnit(float* out, float* lse, const float* qkv, float* scratch,
                                           const QkvLayout& L, int64_t b, int64_t g, int64_t T,
                                           int64_t NH, float scale) {
  const int64_t hd = L.hd;
  float* kt = scratch;         // [hd, T]
  float* s = kt + 4 * hd * T;  // [kQ, T]
  const float* base = qkv + b * T * L.row;
  for (int64_t j = 0; j < T; ++j) {
    for (int64_t i = 0; i < hd; ++i) kt[i * T + j] = base[j * L.row + L.K(g) + i];
  }
  for (int64_t h = g * L.hpg; h < (g + 1) * L.hpg; ++h) {
    for (int64_t t0 = 0; t0 < T; t0 += kQ) {
      const int64_t nq = std::min(kQ, T - t0), len = t0 + nq;
      // A short last block repeats its last query in the spare rows (computed, never used).
      const float* q[kQ];
      for (int64_t r = 0; r < kQ; ++r) q[r] = base + (t0 + std::min(r, nq - 1)) * L.row + L.Q(h);
      Scores4(s, q, kt, T, len, hd);
      float* o[kQ];
      float inv[kQ];
      for (int64_t r = 0; r < kQ; ++r) {
        float* sr = s + r * T;
        const int64_t n = t0 + std::min(r, nq - 1) + 1;  // causal: keys [0, t]
        for (int64_t j = 0; j < n; ++j) sr[j] = sr[j] * scale;
        const float m = LaneMax(sr, n);
        for (int64_t j = 0; j < n; ++j) sr[j] = FastExp(sr[j] - m);
        float sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += sr[j];
        inv[r] = 1.0f / sum;
        for (int64_t j = n; j < len; ++j) sr[j] = 0.0f;  // masked keys add exactly zero
        if (r < nq) lse[(b * NH + h) * T + t0 + r] = m + std::log(sum);
        o[r] = out + (b * T + t0 + std::min(r, nq - 1)) * NH * hd + h * hd;
      }
      // Spare rows write into the last real row first, which is then overwritten.
      for (int64_t r = kQ - 1; r >= 0; --r) {
        float* __restrict orow = o[r];
        std::fill(orow, orow + hd, 0.0f);
        const float* sr = s + r * T;
        for (int64_t j = 0; j < len; ++j) Axpy(orow, sr[j] * inv[r], base + j * L.row + L.V(g), hd);
      }
    }
  }
}

UCP_MULTIVERSION void AttentionBackwardUnit(float* dqkv, const float* dout, const float* qkv,
                                            const float* lse, float* scratch, const QkvLayout& L,
                                            int64_t b, int64_t g, int64_t T, int64_t NH,
                                            float scale) {
  const int64_t hd = L.hd;
  float* kt = scratch;      // [hd, T]
  float* vt = kt + hd * T;  // [hd, T]
  float* dk = vt + hd * T;  // [T, hd]
  float* dv = dk + hd * T;  // [T, hd]
  float* p = dv + hd * T;   // [kQ, T] probabilities, then ds
  float* dp = p + kQ * T;   // [kQ, T]
  const float* base = qkv + b * T * L.row;
  float* dbase = dqkv + b * T * L.row;
  for (int64_t j = 0; j < T; ++j) {
    for (int64_t i = 0; i < hd; ++i) {
      kt[i * T + j] = base[j * L.row + L.K(g) + i];
      vt[i * T + j] = base[j * L.row + L.V(g) + i];
    }
  }
  // The group's k / v gradients are summed here over its heads and queries, then added once.
  std::fill(dk, dk + 2 * hd * T, 0.0f);
  for (int64_t h = g * L.hpg; h < (g + 1) * L.hpg; ++h) {
    for (int64_t t0 = 0; t0 < T; t0 += kQ) {
      const int64_t nq = std::min(kQ, T - t0), len = t0 + nq;
      const float* q[kQ];
      const float* d[kQ];
      for (int64_t r = 0; r < kQ; ++r) {
        const int64_t t = t0 + std::min(r, nq - 1);
        q[r] = base + t * L.row + L.Q(h);
        d[r] = dout + (b * T + t) * NH * hd + h * hd;
      }
      Scores4(p, q, kt, T, len, hd);
      Scores4(dp, d, vt, T, len, hd);
      for (int64_t r = 0; r < kQ; ++r) {
        float* pr = p + r * T;
        const float* dpr = dp + r * T;
        if (r >= nq) {  // spare row: contributes nothing
          std::fill(pr, pr + len, 0.0f);
          continue;
        }
        const int64_t n = t0 + r + 1;
        const float l = lse[(b * NH + h) * T + t0 + r];
        for (int64_t j = 0; j < n; ++j) pr[j] = FastExp(pr[j] * scale - l);
        float dsum = 0;
        for (int64_t j = 0; j < n; ++j) dsum += pr[j] * dpr[j];
        // pr becomes ds; dp's row is kept for nothing else, p's values go to dv first.
        float* dvr = dp + r * T;  // reuse: dp row now holds p (for dv), pr holds ds
        for (int64_t j = 0; j < n; ++j) {
          const float pj = pr[j];
          pr[j] = pj * (dpr[j] - dsum) * scale;
          dvr[j] = pj;
        }
        for (int64_t j = n; j < len; ++j) pr[j] = dvr[j] = 0.0f;
      }
      // dq_r += sum_j ds_rj k_j, in j order.
      for (int64_t r = 0; r < nq; ++r) {
        float* dq = dbase + (t0 + r) * L.row + L.Q(h);
        const float* ds = p + r * T;
        for (int64_t j = 0; j < len; ++j) Axpy(dq, ds[j], base + j * L.row + L.K(g), hd);
      }
      // dk_j += ds_rj q_r, dv_j += p_rj d_r, in (query) order.
      for (int64_t j = 0; j < len; ++j) {
        for (int64_t r = 0; r < nq; ++r) {
          Axpy(dk + j * hd, p[r * T + j], q[r], hd);
          Axpy(dv + j * hd, dp[r * T + j], d[r], hd);
        }
      }
    }
  }
  for (int64_t j = 0; j < T; ++j) {
    Axpy(dbase + j * L.row + L.K(g), 1.0f, dk + j * hd, hd);
    Axpy(dbase + j * L.row + L.V(g), 1.0f, dv + j * hd, hd);
  }
}

}  // namespace

void AttentionForward(Parallel& par, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                      int64_t NH, int64_t KV, int64_t hd) {
  const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t per_chunk = AttentionScratch(T, hd);
  float* scratch = par.Scratch(static_cast<size_t>(par.num_chunks()) * per_chunk);
  par.For(B * KV, [&](int chunk, int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      AttentionForwardUnit(out, lse, qkv, scratch + chunk * per_chunk, L, u / KV, u % KV, T, NH,
                           scale);
    }
  });
}

void AttentionBackward(Parallel& par, float* dqkv, const float* dout, const float* qkv,
                       const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t per_chunk = AttentionScratch(T, hd);
  float* scratch = par.Scratch(static_cast<size_t>(par.num_chunks()) * per_chunk);
  par.For(B * KV, [&](int chunk, int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      AttentionBackwardUnit(dqkv, dout, qkv, lse, scratch + chunk * per_chunk, L, u / KV, u % KV, T,
                            NH, scale);
    }
  });
}

void RopeTables(float* cos_table, float* sin_table, int64_t T, int64_t hd, double theta) {
  ref::RopeTables<float>(cos_table, sin_table, T, hd, theta);
}

namespace {
void Rotate(Parallel& par, float* qkv, const float* cos_table, const float* sin_table, int64_t B,
            int64_t T, int64_t NH, int64_t KV, int64_t hd, float sign) {
  const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
  const int64_t half = hd / 2;
  par.For(B * T, [&](int, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const int64_t t = n % T;
      const float* ct = cos_table + t * half;
      const float* st = sin_table + t * half;
      for (int64_t g = 0; g < KV; ++g) {
        for (int64_t h = 0; h < L.hpg + 1; ++h) {
          float* x = qkv + n * L.row + g * (L.hpg + 2) * hd + h * hd;
          for (int64_t i = 0; i < half; ++i) {
            const float c = ct[i], s = sign * st[i];
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c - x2 * s;
            x[i + half] = x2 * c + x1 * s;
          }
        }
      }
    }
  });
}
}  // namespace

void RopeForward(Parallel& par, float* qkv, const float* cos_table, const float* sin_table,
                 int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  Rotate(par, qkv, cos_table, sin_table, B, T, NH, KV, hd, 1.0f);
}

void RopeBackward(Parallel& par, float* dqkv, const float* cos_table, const float* sin_table,
                  int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  Rotate(par, dqkv, cos_table, sin_table, B, T, NH, KV, hd, -1.0f);
}

namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
}

void GeluForward(Parallel& par, float* out, const float* inp, int64_t n) {
  par.For(n, [&](int, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float x = inp[i];
      out[i] = 0.5f * x * (1.0f + FastTanh(kGeluK * (x + 0.044715f * x * x * x)));
    }
  });
}

void GeluBackward(Parallel& par, float* dinp, const float* inp, const float* dout, int64_t n) {
  par.For(n, [&](int, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float x = inp[i];
      const float th = FastTanh(kGeluK * (x + 0.044715f * x * x * x));
      const float grad = 0.5f * (1.0f + th) +
                         0.5f * x * (1.0f - th * th) * kGeluK * (1.0f + 3.0f * 0.044715f * x * x);
      dinp[i] += grad * dout[i];
    }
  });
}

void SwigluForward(Parallel& par, float* out, const float* inp, int64_t N, int64_t F) {
  par.For(N, [&](int, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* g = inp + n * 2 * F;
      const float* u = g + F;
      float* o = out + n * F;
      for (int64_t f = 0; f < F; ++f) o[f] = g[f] / (1.0f + FastExp(-g[f])) * u[f];
    }
  });
}

void SwigluBackward(Parallel& par, float* dinp, const float* inp, const float* dout, int64_t N,
                    int64_t F) {
  par.For(N, [&](int, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* g = inp + n * 2 * F;
      const float* u = g + F;
      const float* d = dout + n * F;
      float* dg = dinp + n * 2 * F;
      float* du = dg + F;
      for (int64_t f = 0; f < F; ++f) {
        const float sig = 1.0f / (1.0f + FastExp(-g[f]));
        dg[f] += d[f] * u[f] * sig * (1.0f + g[f] * (1.0f - sig));
        du[f] += d[f] * g[f] * sig;
      }
    }
  });
}

void ResidualForward(Parallel& par, float* out, const float* a, const float* b, int64_t n) {
  par.For(n, [&](int, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
  });
}

void ResidualBackward(Parallel& par, float* da, float* db, const float* dout, int64_t n) {
  par.For(n, [&](int, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      da[i] += dout[i];
      db[i] += dout[i];
    }
  });
}

int64_t ClassifierBlockRows(int64_t N, int64_t V) {
  const int64_t most = std::max<int64_t>(1, (int64_t{1} << 24) / V);
  // Equal blocks (1024 rows at V = 50257: 4 x 256, not 3 x 320 + 64, whose last GEMMs are thin).
  const int64_t blocks = (N + most - 1) / most;
  return (N + blocks - 1) / blocks;
}

size_t ClassifierScratch(int64_t N, int64_t V, int /*num_chunks*/) {
  // An upper bound over every N' <= N (a shorter batch may get taller, fewer blocks).
  const int64_t rows = std::min(N, std::max<int64_t>(1, (int64_t{1} << 24) / V));
  return static_cast<size_t>(rows * V + 2 * rows + 2);  // logits + per-row losses (double)
}

double ClassifierForwardBackward(Parallel& par, float* dx, float* dw, const float* x,
                                 const float* w, const int32_t* targets, int64_t N, int64_t C,
                                 int64_t V, float grad_scale) {
  const int64_t R = ClassifierBlockRows(N, V);
  float* logits = par.Scratch(ClassifierScratch(N, V, par.num_chunks()));  // [R, V]
  // Per-row losses as doubles after the logits (8-byte aligned: R * V + 2 rounded to even).
  double* row_loss = reinterpret_cast<double*>(logits + ((R * V + 1) / 2) * 2);
  double loss = 0;
  for (int64_t r0 = 0; r0 < N; r0 += R) {
    const int64_t rows = std::min(R, N - r0);
    Gemm(par, CblasNoTrans, CblasTrans, rows, V, C, x + r0 * C, C, w, C, 0.0f, logits, V);
    par.For(rows, [&](int, int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float* l = logits + i * V;
        const int32_t target = targets[r0 + i];
        if (target < 0) {
          std::fill(l, l + V, 0.0f);
          row_loss[i] = 0;
          continue;
        }
        float mx[kLanes];
        std::fill(mx, mx + kLanes, -std::numeric_limits<float>::infinity());
        const int64_t rounded = V / kLanes * kLanes;
        for (int64_t v = 0; v < rounded; v += kLanes) {
          for (int k = 0; k < kLanes; ++k) mx[k] = std::max(mx[k], l[v + k]);
        }
        float m = mx[0];
        for (int k = 1; k < kLanes; ++k) m = std::max(m, mx[k]);
        for (int64_t v = rounded; v < V; ++v) m = std::max(m, l[v]);
        const float l_target = l[target];
        for (int64_t v = 0; v < V; ++v) l[v] = FastExp(l[v] - m);
        double acc[kLanes] = {};
        for (int64_t v = 0; v < rounded; v += kLanes) {
          for (int k = 0; k < kLanes; ++k) acc[k] += static_cast<double>(l[v + k]);
        }
        double sum = 0;
        for (int k = 0; k < kLanes; ++k) sum += acc[k];
        for (int64_t v = rounded; v < V; ++v) sum += static_cast<double>(l[v]);
        row_loss[i] = std::log(sum) + static_cast<double>(m) - static_cast<double>(l_target);
        const float scaled_inv = static_cast<float>(grad_scale / sum);
        for (int64_t v = 0; v < V; ++v) l[v] = l[v] * scaled_inv;
        l[target] -= grad_scale;
      }
    });
    for (int64_t i = 0; i < rows; ++i) loss += row_loss[i];
    if (dx != nullptr) {
      // dx[rows,C] += dlogits[rows,V] @ w[:V]; dw[:V] += dlogits^T @ x.
      Gemm(par, CblasNoTrans, CblasNoTrans, rows, C, V, logits, V, w, C, 1.0f, dx + r0 * C, C);
      Gemm(par, CblasTrans, CblasNoTrans, V, C, rows, logits, V, x + r0 * C, C, 1.0f, dw, C);
    }
  }
  return loss;
}

}  // namespace ops

double MeasureSgemmGflops(int64_t M, int64_t N, int64_t K, int num_threads, int repeats) {
  Parallel par(num_threads);
  std::vector<float> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(N * K)),
      c(static_cast<size_t>(M * N));
  uint32_t x = 12345;
  for (auto* v : {&a, &b}) {
    for (float& f : *v) {
      x = x * 1664525u + 1013904223u;
      f = static_cast<float>(x >> 8) * 0x1p-24f - 0.5f;
    }
  }
  double best = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    ops::MatmulForward(par, c.data(), a.data(), b.data(), nullptr, M, K, N);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * M * N * K / s / 1e9);  // the first run warms up
  }
  return best;
}

}  // namespace ucp::offload
