// The flash attention kernels (cuda_flash.cu launches them; see there and cuda_ops.h). A header
// so that kernels_emulated_test.cc can also compile them for the host, over simt_emulation.h's
// threads (cuda_platform.h): the kernels' indexing, masking, synchronisation and sums are then
// checked on a CPU, where CI runs; the GPU's own run checks the rest.
#pragma once

#include <cmath>
#include <cstdint>

#include "offload/cuda/cuda_platform.h"
#include "offload/model/qkv_layout.h"

namespace ucp::offload::cuda::flash {

using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kRows = 16 * kWarps;  // a block's own rows; also the tile of the other side
constexpr int kThreadsPerBlock = 32 * kWarps;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Shared-memory strides, padded against bank conflicts; WMMA wants 32-byte aligned fragment
// pointers and strides of a multiple of 8 (bf16) or 4 (float) elements.
template <int HD>
struct Smem {
  static constexpr int kLdh = HD + 8;     // a bf16 row of a q, k, v or dout tile
  static constexpr int kLds = kRows + 4;  // an fp32 row of scores
  static constexpr int kLdp = kRows + 8;  // a bf16 row of probabilities or dS
  static constexpr int kTile = kRows * kLdh;  // bf16 elements of a tile
  static constexpr int kScores = kRows * kLds;
  static constexpr int kProbs = kRows * kLdp;
};

// A kernel's shared memory, carved in one order: TILES bf16 tiles, the fp32 scores, PROBS bf16
// probability (or dS) blocks, then per row of the other side's tile its lse and D, and the 256
// element places. kBytes is what the launch asks for.
template <int HD, int TILES, int PROBS>
struct Carved {
  using M = Smem<HD>;
  static constexpr int kBytes =
      TILES * M::kTile * 2 + M::kScores * 4 + PROBS * M::kProbs * 2 + (2 * kRows + 256) * 4;
  unsigned char* base;
  __device__ explicit Carved(unsigned char* smem) : base(smem) {}
  __device__ bf16* tile(int i) const { return reinterpret_cast<bf16*>(base) + i * M::kTile; }
  __device__ float* scores() const { return reinterpret_cast<float*>(tile(TILES)); }
  __device__ bf16* probs(int i) const {
    return reinterpret_cast<bf16*>(scores() + M::kScores) + i * M::kProbs;
  }
  __device__ float* lse() const { return reinterpret_cast<float*>(probs(PROBS)); }
  __device__ float* d() const { return lse() + kRows; }
  __device__ float* pos() const { return d() + kRows; }
};

// The element places: the numbers 16 r + c at (r, c) of a 16 x 16 matrix, which each warp loads
// (after a __syncthreads) into a FragC `pos`: pos.x[i] is then element i's place in any FragC.
__device__ inline void FillPlaces(float* scratch256) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) scratch256[i] = static_cast<float>(i);
}

// The end of a kernel's prologue: every thread's copies (one committed group) have landed and
// the block has passed a barrier, so the tiles and FillPlaces' numbers are whole; then each
// warp loads its element places.
__device__ inline void PrologueLanded(FragC& pos, const float* places) {
  __pipeline_wait_prior(0);
  __syncthreads();
  wmma::load_matrix_sync(pos, places, 16, wmma::mem_row_major);
}
__device__ inline int PlaceRow(float p) { return static_cast<int>(p) >> 4; }
__device__ inline int PlaceCol(float p) { return static_cast<int>(p) & 15; }

// Queues the copy of rows [r0, r0 + kRows) of the head at `off` in each bf16 row of `src` (row
// stride `stride` elements) into dst (kLdh stride), in 16-byte pieces (cp.async: the caller
// commits them as a group and waits for it before a __syncthreads); rows at or past T are zeroed
// at once. 16-byte aligned: the head sizes the kernels take are multiples of 8 elements, so are
// the strides and offsets, and the scratch copies start aligned.
template <int HD>
__device__ inline void TileAsync(bf16* dst, const bf16* src, int64_t stride, int64_t off,
                                 int64_t r0, int64_t T) {
  constexpr int kPieces = HD / 8;  // per row
  for (int i = threadIdx.x; i < kRows * kPieces; i += blockDim.x) {
    const int r = i / kPieces, c = (i % kPieces) * 8;
    bf16* d = dst + r * Smem<HD>::kLdh + c;
    const int64_t t = r0 + r;
    if (t < T) {
      __pipeline_memcpy_async(d, src + t * stride + off + c, 16);
    } else {
      *reinterpret_cast<uint4*>(d) = uint4{0, 0, 0, 0};
    }
  }
}

// acc (16 x 16) = the 16 rows at a times the 16 rows at b, transposed (each row HD bf16 of a
// tile, stride kLdh): the dot products of two row blocks.
template <int HD>
__device__ inline void RowsDotRows(FragC& acc, const bf16* a, const bf16* b) {
  constexpr int L = Smem<HD>::kLdh;
  wmma::fill_fragment(acc, 0.0f);
  for (int k = 0; k < HD / 16; ++k) {
    FragA fa;
    FragBCol fb;
    wmma::load_matrix_sync(fa, a + k * 16, L);
    wmma::load_matrix_sync(fb, b + k * 16, L);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// The scores of 16 rows (at a) against a tile's kRows rows (at bt), into s (stride kLds) for
// the softmax.
template <int HD>
__device__ inline void ScoresToSmem(float* s, const bf16* a, const bf16* bt) {
  for (int n = 0; n < kRows / 16; ++n) {
    FragC acc;
    RowsDotRows<HD>(acc, a, bt + n * 16 * Smem<HD>::kLdh);
    wmma::store_matrix_sync(s + n * 16, acc, Smem<HD>::kLds, wmma::mem_row_major);
  }
}

// acc[f] += P (16 x kRows, bf16 at p, stride kLdp) times the rows of m (kRows x HD at m).
template <int HD>
__device__ inline void AccumulateProduct(FragC (&acc)[HD / 16], const bf16* p, const bf16* m) {
  for (int k = 0; k < kRows / 16; ++k) {
    FragA fa;
    wmma::load_matrix_sync(fa, p + k * 16, Smem<HD>::kLdp);
    for (int f = 0; f < HD / 16; ++f) {
      FragBRow fb;
      wmma::load_matrix_sync(fb, m + k * 16 * Smem<HD>::kLdh + f * 16, Smem<HD>::kLdh);
      wmma::mma_sync(acc[f], fa, fb, acc[f]);
    }
  }
}

// ---- forward: a block per (64 queries, sequence, head); keys tile by tile with the online
// softmax. Heavier blocks (later queries: more keys) start first. One K and one V buffer, their
// loads staggered: the next K lands while this tile's softmax and P V run, the next V while the
// next scores do.
template <int HD>
__global__ void __launch_bounds__(kThreadsPerBlock)
    FlashForwardKernel(float* out, float* lse, const bf16* qkv16, int64_t T, int64_t NH,
                       int64_t KV, float scale) {
  using M = Smem<HD>;
  UCP_DYNAMIC_SMEM(smem);
  const Carved<HD, 3, 1> sm(smem);
  bf16 *sQ = sm.tile(0), *sK = sm.tile(1), *sV = sm.tile(2), *sP = sm.probs(0);
  float *sS = sm.scores(), *sRow = sm.lse(), *sPos = sm.pos();  // sRow: each row's factor

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = (gridDim.x - 1 - blockIdx.x) * int64_t{kRows};
  const int64_t b = blockIdx.y / NH, h = blockIdx.y % NH;
  const QkvLayout L{NH / KV, HD, (NH + 2 * KV) * HD};
  const int64_t g = h / L.hpg;
  const bf16* base = qkv16 + b * T * L.row;

  FillPlaces(sPos);
  TileAsync<HD>(sQ, base, L.row, L.Q(h), q0, T);
  TileAsync<HD>(sK, base, L.row, L.K(g), 0, T);
  TileAsync<HD>(sV, base, L.row, L.V(g), 0, T);
  __pipeline_commit();
  FragC pos;
  PrologueLanded(pos, sPos);

  const int wr = warp * 16;                  // the warp's rows in the block
  const int r = lane / 2, half = lane % 2;   // this lane's row and half of the key tile
  const int64_t query = q0 + wr + r;
  float* sw = sS + wr * M::kLds;
  bf16* pw = sP + wr * M::kLdp;
  FragC o[HD / 16];
  for (auto& f : o) wmma::fill_fragment(f, 0.0f);
  float m = -INFINITY, l = 0.0f;

  const int64_t kend = T < q0 + kRows ? T : q0 + kRows;
  for (int64_t k0 = 0; k0 < kend; k0 += kRows) {
    const bool more = k0 + kRows < kend;
    // A warp whose queries all precede the tile has nothing to add (warp-uniform). Otherwise
    // k0 <= its first query (both multiples of 16), so each of its rows has an unmasked key.
    const bool active = k0 <= q0 + wr + 15;
    if (active) ScoresToSmem<HD>(sw, sQ + wr * M::kLdh, sK);
    __syncthreads();  // every warp is done with this K
    if (more) TileAsync<HD>(sK, base, L.row, L.K(g), k0 + kRows, T);
    __pipeline_commit();
    __pipeline_wait_prior(1);  // this tile's V (the group before the next K)
    __syncthreads();
    if (active) {
      const float* srow = sw + r * M::kLds + half * 32;
      float mx = -INFINITY;
      for (int c = 0; c < 32; ++c) {
        const int64_t key = k0 + half * 32 + c;
        if (key <= query && key < T) mx = fmaxf(mx, srow[c] * scale);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_new = fmaxf(m, mx);
      const float corr = expf(m - m_new);  // 0 on the first tile (m = -inf, m_new finite)
      float sum = 0.0f;
      bf16* prow = pw + r * M::kLdp + half * 32;
      for (int c = 0; c < 32; ++c) {
        const int64_t key = k0 + half * 32 + c;
        const float p = key <= query && key < T ? expf(srow[c] * scale - m_new) : 0.0f;
        sum += p;
        prow[c] = __float2bfloat16_rn(p);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      l = l * corr + sum;
      m = m_new;
      if (half == 0) sRow[wr + r] = corr;
      __syncwarp();
      for (auto& f : o) {
        for (int i = 0; i < f.num_elements; ++i) f.x[i] *= sRow[wr + PlaceRow(pos.x[i])];
      }
      AccumulateProduct<HD>(o, pw, sV);
      __syncwarp();  // the next tile's scores overwrite sw, its factors sRow
    }
    __syncthreads();  // every warp is done with this V
    if (more) TileAsync<HD>(sV, base, L.row, L.V(g), k0 + kRows, T);
    __pipeline_commit();
    __pipeline_wait_prior(1);  // the next K
    __syncthreads();
  }
  // Rows past T (a last partial block) computed on zeros; only real rows are written.
  if (half == 0) sRow[wr + r] = 1.0f / l;
  __syncwarp();
  for (int f = 0; f < HD / 16; ++f) {
    for (int i = 0; i < o[f].num_elements; ++i) {
      const int rr = PlaceRow(pos.x[i]);
      const int64_t t = q0 + wr + rr;
      if (t < T) {
        out[(b * T + t) * NH * HD + h * HD + f * 16 + PlaceCol(pos.x[i])] =
            o[f].x[i] * sRow[wr + rr];
      }
    }
  }
  if (half == 0 && query < T) lse[(b * NH + h) * T + query] = m + logf(l);
}

// ---- backward, D from the forward's output: dsum[b, h, t] = dout_t . out_t (a warp per row,
// lanes over the head dimension, a fixed tree: deterministic).
// (static, as every non-template kernel of these headers: each including file its own.)
static __global__ void FlashRowDotKernel(float* dsum, const float* dout, const float* out,
                                         int64_t B, int64_t T, int64_t NH, int64_t hd) {
  const int64_t row = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const bool live = row < B * NH * T;  // (every lane takes part in the shuffles)
  const int64_t t = live ? row % T : 0, h = live ? (row / T) % NH : 0, b = live ? row / (T * NH) : 0;
  float s = 0.0f;
  if (live) {
    const int64_t at = (b * T + t) * NH * hd + h * hd;
    for (int64_t i = lane; i < hd; i += 32) s += dout[at + i] * out[at + i];
  }
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (live && lane == 0) dsum[row] = s;
}

// ---- backward, queries: a block per (64 queries, sequence, head). Without `d_given`, a first
// walk over the keys: D = rowsum(P o dP) into `dsum`; with it, dsum already holds D
// (FlashRowDotKernel). Then dS = P (dP - D) scale, dq += dS k. The next V lands while dq's
// product runs (K is read by the scores and by dq, so the next K waits for both).
template <int HD>
__global__ void __launch_bounds__(kThreadsPerBlock)
    FlashBackwardQueryKernel(float* dqkv, float* dsum, const bf16* dout16, const bf16* qkv16,
                             const float* lse, int64_t T, int64_t NH, int64_t KV, float scale,
                             bool d_given) {
  using M = Smem<HD>;
  UCP_DYNAMIC_SMEM(smem);
  const Carved<HD, 4, 1> sm(smem);
  bf16 *sQ = sm.tile(0), *sDO = sm.tile(1), *sK = sm.tile(2), *sV = sm.tile(3), *sP = sm.probs(0);
  float *sS = sm.scores(), *sLse = sm.lse(), *sD = sm.d(), *sPos = sm.pos();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = (gridDim.x - 1 - blockIdx.x) * int64_t{kRows};
  const int64_t b = blockIdx.y / NH, h = blockIdx.y % NH;
  const QkvLayout L{NH / KV, HD, (NH + 2 * KV) * HD};
  const int64_t g = h / L.hpg, ah = NH * HD;
  const bf16* base = qkv16 + b * T * L.row;
  const int64_t row0 = (b * NH + h) * T;

  FillPlaces(sPos);
  TileAsync<HD>(sQ, base, L.row, L.Q(h), q0, T);
  TileAsync<HD>(sDO, dout16 + b * T * ah, ah, h * HD, q0, T);
  TileAsync<HD>(sK, base, L.row, L.K(g), 0, T);
  TileAsync<HD>(sV, base, L.row, L.V(g), 0, T);
  __pipeline_commit();
  for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
    sLse[i] = q0 + i < T ? lse[row0 + q0 + i] : 0.0f;
    if (d_given) sD[i] = q0 + i < T ? dsum[row0 + q0 + i] : 0.0f;
  }
  FragC pos;
  PrologueLanded(pos, sPos);

  const int wr = warp * 16;
  const int r = lane / 2, half = lane % 2;
  const int64_t query = q0 + wr + r;
  float* sw = sS + wr * M::kLds;
  bf16* pw = sP + wr * M::kLdp;
  const bf16* qw = sQ + wr * M::kLdh;
  const bf16* dow = sDO + wr * M::kLdh;
  const int64_t kend = T < q0 + kRows ? T : q0 + kRows;
  const int tiles = static_cast<int>((kend + kRows - 1) / kRows);
  const int first_pass = d_given ? 1 : 0;
  FragC dq[HD / 16];
  for (auto& f : dq) wmma::fill_fragment(f, 0.0f);
  float d_acc = 0.0f;

  // Step s: tile s % tiles of pass first_pass + s / tiles.
  for (int s = 0; s < (2 - first_pass) * tiles; ++s) {
    const int pass = first_pass + s / tiles;
    const int64_t k0 = int64_t{s % tiles} * kRows;
    const int64_t next_k0 = int64_t{(s + 1) % tiles} * kRows;
    const bool more = s + 1 < (2 - first_pass) * tiles;
    if (pass == 1 && !d_given && s == tiles) {  // the first walk's sums are D
      d_acc += __shfl_xor_sync(0xffffffffu, d_acc, 1);
      if (half == 0) sD[wr + r] = d_acc;
      if (half == 0 && query < T) dsum[row0 + query] = d_acc;
      __syncwarp();
    }
    const bool active = k0 <= q0 + wr + 15;  // as in the forward
    float* srow = sw + r * M::kLds + half * 32;
    if (active) {
      // P in place of the scores.
      ScoresToSmem<HD>(sw, qw, sK);
      __syncwarp();
      const float l = sLse[wr + r];
      for (int c = 0; c < 32; ++c) {
        const int64_t key = k0 + half * 32 + c;
        srow[c] = key <= query && key < T ? expf(srow[c] * scale - l) : 0.0f;
      }
      __syncwarp();
      // dP = dout v^T, 16 x 16 at a time, met with P element by element in registers.
      for (int n = 0; n < kRows / 16; ++n) {
        FragC dp;
        RowsDotRows<HD>(dp, dow, sV + n * 16 * M::kLdh);
        for (int i = 0; i < dp.num_elements; ++i) {
          const int rr = PlaceRow(pos.x[i]), cc = n * 16 + PlaceCol(pos.x[i]);
          const float p = sw[rr * M::kLds + cc];
          if (pass == 0) {
            sw[rr * M::kLds + cc] = p * dp.x[i];  // summed by row below, in a fixed order
          } else {
            pw[rr * M::kLdp + cc] = __float2bfloat16_rn(p * (dp.x[i] - sD[wr + rr]) * scale);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this V (and has written its P o dP or dS)
    if (more) TileAsync<HD>(sV, base, L.row, L.V(g), next_k0, T);
    __pipeline_commit();
    if (active) {
      if (pass == 0) {
        for (int c = 0; c < 32; ++c) d_acc += srow[c];
      } else {
        AccumulateProduct<HD>(dq, pw, sK);
      }
    }
    __syncthreads();  // every warp is done with this K
    if (more) TileAsync<HD>(sK, base, L.row, L.K(g), next_k0, T);
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
  }
  for (int f = 0; f < HD / 16; ++f) {
    for (int i = 0; i < dq[f].num_elements; ++i) {
      const int64_t t = q0 + wr + PlaceRow(pos.x[i]);
      if (t < T) dqkv[(b * T + t) * L.row + L.Q(h) + f * 16 + PlaceCol(pos.x[i])] += dq[f].x[i];
    }
  }
}

// ---- backward, keys: a block per (64 keys, sequence, KV group); the group's heads in order,
// each over the query tiles from the block's own: dv += P^T dout, dk += dS^T q. Reads the D the
// query kernel left in `dsum`. The next q lands while dv's product runs, the next dout while the
// next scores do.
template <int HD>
__global__ void __launch_bounds__(kThreadsPerBlock)
    FlashBackwardKeyKernel(float* dqkv, const float* dsum, const bf16* dout16, const bf16* qkv16,
                           const float* lse, int64_t T, int64_t NH, int64_t KV, float scale) {
  using M = Smem<HD>;
  UCP_DYNAMIC_SMEM(smem);
  const Carved<HD, 4, 2> sm(smem);
  bf16 *sK = sm.tile(0), *sV = sm.tile(1), *sQ = sm.tile(2), *sDO = sm.tile(3);
  bf16 *sP = sm.probs(0), *sDS = sm.probs(1);
  float *sS = sm.scores(), *sLse = sm.lse(), *sD = sm.d(), *sPos = sm.pos();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k0 = blockIdx.x * int64_t{kRows};
  const int64_t b = blockIdx.y / KV, g = blockIdx.y % KV;
  const QkvLayout L{NH / KV, HD, (NH + 2 * KV) * HD};
  const int64_t ah = NH * HD;
  const bf16* base = qkv16 + b * T * L.row;
  const bf16* dbase = dout16 + b * T * ah;
  // Step s: head g hpg + s / nq, query tile k0 + (s % nq) kRows.
  const int nq = static_cast<int>((T - k0 + kRows - 1) / kRows);
  const int steps = static_cast<int>(L.hpg) * nq;
  auto head = [&](int step) { return g * L.hpg + step / nq; };
  auto tile = [&](int step) { return k0 + int64_t{step % nq} * kRows; };
  // The step's log-sum-exps and D into shared memory (plain loads).
  auto rows = [&](int step) {
    const int64_t row0 = (b * NH + head(step)) * T, q0 = tile(step);
    for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
      sLse[i] = q0 + i < T ? lse[row0 + q0 + i] : 0.0f;
      sD[i] = q0 + i < T ? dsum[row0 + q0 + i] : 0.0f;
    }
  };

  FillPlaces(sPos);
  TileAsync<HD>(sK, base, L.row, L.K(g), k0, T);
  TileAsync<HD>(sV, base, L.row, L.V(g), k0, T);
  TileAsync<HD>(sQ, base, L.row, L.Q(head(0)), tile(0), T);
  TileAsync<HD>(sDO, dbase, ah, head(0) * HD, tile(0), T);
  __pipeline_commit();
  rows(0);
  FragC pos;
  PrologueLanded(pos, sPos);

  const int wr = warp * 16;
  const int r = lane / 2, half = lane % 2;
  const int64_t key = k0 + wr + r;
  float* sw = sS + wr * M::kLds;
  bf16* pw = sP + wr * M::kLdp;
  bf16* dsw = sDS + wr * M::kLdp;
  const bf16* kw = sK + wr * M::kLdh;
  const bf16* vw = sV + wr * M::kLdh;
  FragC dk[HD / 16], dv[HD / 16];
  for (auto& f : dk) wmma::fill_fragment(f, 0.0f);
  for (auto& f : dv) wmma::fill_fragment(f, 0.0f);

  for (int s = 0; s < steps; ++s) {
    const int64_t q0 = tile(s);
    const bool more = s + 1 < steps;
    // S^T (this warp's 16 keys against the tile's queries), then P^T: fp32 in place for dS,
    // bf16 for dv's product.
    ScoresToSmem<HD>(sw, kw, sQ);
    __syncwarp();
    float* srow = sw + r * M::kLds + half * 32;
    bf16* prow = pw + r * M::kLdp + half * 32;
    for (int c = 0; c < 32; ++c) {
      const int q = half * 32 + c;
      const int64_t query = q0 + q;
      const float p = key <= query && query < T ? expf(srow[c] * scale - sLse[q]) : 0.0f;
      srow[c] = p;
      prow[c] = __float2bfloat16_rn(p);
    }
    __pipeline_wait_prior(0);  // this step's dout
    __syncthreads();
    // dP^T = v dout^T, met with P^T element by element: dS^T.
    for (int n = 0; n < kRows / 16; ++n) {
      FragC dp;
      RowsDotRows<HD>(dp, vw, sDO + n * 16 * M::kLdh);
      for (int i = 0; i < dp.num_elements; ++i) {
        const int rr = PlaceRow(pos.x[i]), cc = n * 16 + PlaceCol(pos.x[i]);
        dsw[rr * M::kLdp + cc] =
            __float2bfloat16_rn(sw[rr * M::kLds + cc] * (dp.x[i] - sD[cc]) * scale);
      }
    }
    __syncwarp();
    AccumulateProduct<HD>(dk, dsw, sQ);
    __syncthreads();  // every warp is done with this q, lse and D
    if (more) {
      TileAsync<HD>(sQ, base, L.row, L.Q(head(s + 1)), tile(s + 1), T);
      rows(s + 1);
    }
    __pipeline_commit();
    AccumulateProduct<HD>(dv, pw, sDO);
    __syncthreads();  // every warp is done with this dout
    if (more) TileAsync<HD>(sDO, dbase, ah, head(s + 1) * HD, tile(s + 1), T);
    __pipeline_commit();
    __pipeline_wait_prior(1);  // the next q (its dout may still be on its way)
    __syncthreads();
  }
  const int64_t kslot = L.K(g), vslot = L.V(g);
  for (int f = 0; f < HD / 16; ++f) {
    for (int i = 0; i < dk[f].num_elements; ++i) {
      const int64_t j = k0 + wr + PlaceRow(pos.x[i]);
      if (j < T) {
        float* at = dqkv + (b * T + j) * L.row + f * 16 + PlaceCol(pos.x[i]);
        at[kslot] += dk[f].x[i];
        at[vslot] += dv[f].x[i];
      }
    }
  }
}

inline unsigned Tiles(int64_t T) { return static_cast<unsigned>((T + kRows - 1) / kRows); }

}  // namespace ucp::offload::cuda::flash
