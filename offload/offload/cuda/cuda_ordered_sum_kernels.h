// OrderedSum (offload/comm/ordered_sum.h) on the device: the adds of the NCCL communicator's
// deterministic collectives (nccl_communicator.h), so that the GPUs' gradient sums are the bits
// the MPI communicator's give on the host. A header so that kernels_emulated_test.cc also runs it
// on a CPU (cuda_platform.h) against OrderedSum itself.
//
// One thread per element, reading contribution i's element k at parts[i * n + k] (a warp reads
// 32 consecutive floats of each contribution: coalesced). The adds are fp32 adds alone (nothing a
// compiler may fuse into an FMA), in OrderedSum's order, so the bits are IEEE's and the host's.
#pragma once

#include <cstdint>

#include "offload/cuda/cuda_platform.h"

namespace ucp::offload::cuda::kernels {

constexpr int kOrderedSumThreads = 256;

// c[first * stride] + c[(first + 1) * stride] + ... over `count` contributions, left to right.
__host__ __device__ inline float FoldInRankOrder(const float* c, int64_t stride, int64_t first,
                                                 int64_t count) {
  float s = c[first * stride];
  for (int64_t i = 1; i < count; ++i) s += c[(first + i) * stride];
  return s;
}

// The sum of `count` contributions c[i * stride] in OrderedSum's order: kRankOrder, or
// kHalvingTree (halving_tree). The tree of count = 2^a m (m odd) halves a times down to 2^a
// leaves of m contributions each, folded in rank order; its pairs are added bottom-up here with a
// stack, as a binary counter: the leaves in order, and whenever the two on top are of one level,
// they become one of the next (left + right, as OrderedSum's dst += scratch).
__host__ __device__ inline float OrderedSumOf(const float* c, int64_t stride, int64_t count,
                                              bool halving_tree) {
  if (!halving_tree || count % 2 != 0) return FoldInRankOrder(c, stride, 0, count);
  int64_t m = count;
  while (m % 2 == 0) m /= 2;
  const int64_t leaves = count / m;
  float sum[64];  // a level per halving of an int64 count: 63 at most
  int level[64];
  int top = 0;
  for (int64_t j = 0; j < leaves; ++j) {
    float v = FoldInRankOrder(c, stride, j * m, m);
    int l = 0;
    while (top > 0 && level[top - 1] == l) {
      v = sum[top - 1] + v;
      --top;
      ++l;
    }
    sum[top] = v;
    level[top] = l;
    ++top;
  }
  return sum[0];
}

// out[k] <- OrderedSumOf(parts + k, n, count, halving_tree) for k in [0, n). Launch:
// OrderedSumBlocks(n) blocks of kOrderedSumThreads (grid-stride past the grid's limit).
static __global__ void __launch_bounds__(kOrderedSumThreads)
    OrderedSumKernel(float* out, const float* parts, int64_t count, int64_t n, bool halving_tree) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t k = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; k < n; k += stride) {
    out[k] = OrderedSumOf(parts + k, n, count, halving_tree);
  }
}

inline unsigned OrderedSumBlocks(int64_t n) {
  const int64_t blocks = (n + kOrderedSumThreads - 1) / kOrderedSumThreads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks < 1 ? 1 : blocks) : 65535);
}

}  // namespace ucp::offload::cuda::kernels
