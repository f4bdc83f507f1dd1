// A strided row move: the unit of Ulysses' rearrangements (offload/model/ulysses.h), shared with
// the CUDA kernels that run them (offload/cuda/cuda_move_rows.h). Plain C++17 with no other
// header of the engine, so nvcc compiles it too.
#pragma once

#include <cstdint>

namespace ucp::offload::graph {

/// For each of a move's `rows` rows i (the row count is the caller's), the `width` values at
/// src + i spitch go to dst + i dpitch (copied, or added into dst).
template <typename T>
struct Strided {
  T* dst = nullptr;
  int64_t dpitch = 0;
  const T* src = nullptr;
  int64_t spitch = 0;
  int64_t width = 0;
};

}  // namespace ucp::offload::graph
