// Column sums of the parameter gradients (cuda_ops.cu launches them): the norms' and matrix
// products' dweight[c] += sum_n norm[n, c] dout[n, c] and dbias[c] += sum_n dout[n, c], and the
// embedding gradients (rows summed by token, by position). A header so that
// kernels_emulated_test.cc also runs them on a CPU (cuda_platform.h).
//
// A block per 32 columns, 32 x 32 threads: thread (j, i) walks rows j, j + 32, ... of column
// c0 + i (a warp reads 32 consecutive floats of a row: coalesced), then thread (0, i) adds the
// column's 32 partial sums in lane order. The sums' order is fixed whatever the launch, so the
// bits are the same run after run; with C / 32 blocks of 32 warps the rows are read in
// parallel (one thread per column walking every row kept C / 256 blocks busy on a GPU of 132
// SMs: milliseconds per norm at 16K rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "offload/cuda/cuda_platform.h"

namespace ucp::offload::cuda::kernels {

constexpr int kColumnTile = 32;                          // columns per block
constexpr int kColumnThreads = kColumnTile * kColumnTile;  // 32 row lanes of each column
constexpr int kColumnSmemBytes = 2 * kColumnTile * (kColumnTile + 1) * 4;

// dweight (when not null) += sum_n norm dout, with norm = (inp - mean[n]) rstd[n] (mean null:
// RMSNorm, inp rstd[n]); dbias (when not null) += sum_n dout. Launch: ColumnBlocks(C) blocks of
// kColumnThreads threads, kColumnSmemBytes of dynamic shared memory.
static __global__ void __launch_bounds__(kColumnThreads)
    ColumnGradKernel(float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* mean, const float* rstd, int64_t N, int64_t C) {
  UCP_DYNAMIC_SMEM(smem);
  float* pw = reinterpret_cast<float*>(smem);              // [row lane][column], padded
  float* pb = pw + kColumnTile * (kColumnTile + 1);
  const int i = static_cast<int>(threadIdx.x) % kColumnTile;
  const int j = static_cast<int>(threadIdx.x) / kColumnTile;
  const int64_t c = int64_t{blockIdx.x} * kColumnTile + i;
  float dw = 0.0f, db = 0.0f;
  if (c < C) {
    for (int64_t n = j; n < N; n += kColumnTile) {
      const float d = dout[n * C + c];
      db += d;
      if (dweight) {
        const float norm = (inp[n * C + c] - (mean ? mean[n] : 0.0f)) * rstd[n];
        dw += norm * d;
      }
    }
  }
  pw[j * (kColumnTile + 1) + i] = dw;
  pb[j * (kColumnTile + 1) + i] = db;
  __syncthreads();
  if (j == 0 && c < C) {
    float sw = 0.0f, sb = 0.0f;
    for (int k = 0; k < kColumnTile; ++k) {
      sw += pw[k * (kColumnTile + 1) + i];
      sb += pb[k * (kColumnTile + 1) + i];
    }
    if (dweight) dweight[c] += sw;
    if (dbias) dbias[c] += sb;
  }
}

inline unsigned ColumnBlocks(int64_t C) {
  return static_cast<unsigned>((C + kColumnTile - 1) / kColumnTile);
}

// ---- the embedding gradient: rows summed by token (cuda_ops.h EncoderBackward)

// The batch's positions grouped by token (host): order = 0..n-1 sorted by token, positions
// ascending within a token (stable); run r is order[starts[r], starts[r + 1]), starts ending
// with n.
inline void GroupTokenRuns(const int32_t* tokens, int64_t count, std::vector<int32_t>& order,
                           std::vector<int32_t>& starts) {
  const auto n = static_cast<int32_t>(count);
  order.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return tokens[a] < tokens[b]; });
  starts.clear();
  for (int32_t i = 0; i < n; ++i) {
    if (i == 0 || tokens[order[i]] != tokens[order[i - 1]]) starts.push_back(i);
  }
  starts.push_back(n);
}

// Block (run r, channel chunk): the run's rows onto its token's row, in position order.
static __global__ void TokenRunGradKernel(float* dwte, const float* dout, const int32_t* tokens,
                                   const int32_t* order, const int32_t* starts, int64_t C) {
  const int64_t r = blockIdx.x;
  const int64_t c = blockIdx.y * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const int32_t first = starts[r], end = starts[r + 1];
  float* row = dwte + int64_t{tokens[order[first]]} * C;
  float acc = row[c];
  for (int32_t i = first; i < end; ++i) acc += dout[int64_t{order[i]} * C + c];
  row[c] = acc;
}

// dwpe[t, c] += sum_b dout[b, t, c], a thread per (t, c).
static __global__ void PositionGradKernel(float* dwpe, const float* dout, int64_t B, int64_t T,
                                   int64_t C) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < T * C;
       i += int64_t{gridDim.x} * blockDim.x) {
    float s = 0.0f;
    for (int64_t b = 0; b < B; ++b) s += dout[b * T * C + i];
    dwpe[i] += s;
  }
}


}  // namespace ucp::offload::cuda::kernels
