// Column sums of the parameter gradients of norms and matrix products (cuda_ops.cu launches
// them): dweight[c] += sum_n norm[n, c] dout[n, c] and dbias[c] += sum_n dout[n, c]. A header so
// that kernels_emulated_test.cc also runs it on a CPU (cuda_platform.h).
//
// A block per 32 columns, 32 x 32 threads: thread (j, i) walks rows j, j + 32, ... of column
// c0 + i (a warp reads 32 consecutive floats of a row: coalesced), then thread (0, i) adds the
// column's 32 partial sums in lane order. The sums' order is fixed whatever the launch, so the
// bits are the same run after run; with C / 32 blocks of 32 warps the rows are read in
// parallel (one thread per column walking every row kept C / 256 blocks busy on a GPU of 132
// SMs: milliseconds per norm at 16K rows).
#pragma once

#include <cstdint>

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

}  // namespace ucp::offload::cuda::kernels
