// Strided row moves on the device: the rearrangements of Ulysses sequence parallelism
// (offload/model/ulysses.h) as the CUDA model runs them (cuda_move_rows.h). A header so that
// kernels_emulated_test.cc also runs it on a CPU (cuda_platform.h) against the CPU model's moves.
//
// One launch moves up to kMaxMovesPerLaunch moves of the same row count, move m on gridDim.y
// index m, a thread per value (a warp reads 32 consecutive values of a row: coalesced). Copies
// only write; adds are one fp32 add per value (dst + src, nothing to fuse), so a launch of moves
// whose destinations are disjoint gives the CPU's bits, and the launcher keeps the list's order
// for adds that may meet (one move per launch).
#pragma once

#include <cstdint>

#include "offload/cuda/cuda_platform.h"
#include "offload/model/strided.h"

namespace ucp::offload::cuda::kernels {

constexpr int kMoveRowsThreads = 256;
constexpr int kMaxMovesPerLaunch = 32;

// Passed by value (a kernel parameter: 32 moves are 1.3 KB of the 4 KB allowed).
struct RowMoves {
  graph::Strided<float> m[kMaxMovesPerLaunch];
};

// Launch: (MoveRowsBlocks(largest move), count) blocks of kMoveRowsThreads; grid-stride in x.
static __global__ void __launch_bounds__(kMoveRowsThreads)
    MoveRowsKernel(RowMoves moves, int64_t rows, bool add) {
  const graph::Strided<float> mv = moves.m[blockIdx.y];
  const int64_t n = rows * mv.width;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / mv.width, c = i - r * mv.width;
    float* d = mv.dst + r * mv.dpitch + c;
    const float v = mv.src[r * mv.spitch + c];
    if (add) {
      *d = *d + v;
    } else {
      *d = v;
    }
  }
}

// x blocks for a move of n values: enough for one value a thread, at most 4096 (grid-stride).
inline unsigned MoveRowsBlocks(int64_t n) {
  const int64_t b = (n + kMoveRowsThreads - 1) / kMoveRowsThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

// The launches that run moves[0, count) of `rows` rows (MoveRowsOnDevice's, and the emulated
// test's): launch(batch, moves in it, x blocks) for each, in order. Copies go up to
// kMaxMovesPerLaunch to a launch (their destinations are disjoint); adds one to a launch, so that
// moves adding into one value do so in list order. Moves of no values are skipped.
template <typename Launch>
inline void ForEachMoveLaunch(const graph::Strided<float>* moves, int64_t count, int64_t rows,
                              bool add, Launch&& launch) {
  const int64_t per_launch = add ? 1 : kMaxMovesPerLaunch;
  for (int64_t first = 0; first < count; first += per_launch) {
    RowMoves batch{};
    int k = 0;
    int64_t largest = 0;
    for (int64_t i = first; i < count && i < first + per_launch; ++i) {
      const graph::Strided<float>& m = moves[i];
      if (rows * m.width == 0) continue;
      batch.m[k++] = m;
      if (rows * m.width > largest) largest = rows * m.width;
    }
    if (k > 0) launch(batch, k, MoveRowsBlocks(largest));
  }
}

}  // namespace ucp::offload::cuda::kernels
