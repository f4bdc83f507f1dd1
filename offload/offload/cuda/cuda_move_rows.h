// Strided row moves in device memory (cuda_move_rows_kernels.h): the CUDA model's backend for the
// rearrangements of Ulysses sequence parallelism (offload/model/ulysses.h). Plain C++ (no CUDA
// headers): streams are passed as void*.
#pragma once

#include <cstdint>

#include "offload/model/strided.h"
#include "ucp/base/status.h"

namespace ucp::offload::cuda {

/// Queues moves[0, count) of `rows` rows each on `stream`: copies (moves whose destinations are
/// disjoint, several to a launch), or with `add` each added into its destination in list order
/// (one launch a move, so moves that add into one value do so in that order).
/// Errors: kInvalidArgument (count, rows or a width < 0, a pitch below its width, null pointers
/// of a move with values), kDeviceError (launch).
Status MoveRowsOnDevice(const graph::Strided<float>* moves, int64_t count, int64_t rows, bool add,
                        void* stream);

}  // namespace ucp::offload::cuda
