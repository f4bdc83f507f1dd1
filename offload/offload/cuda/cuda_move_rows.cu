// The launcher of MoveRowsKernel (cuda_move_rows.h).
#include <cuda_runtime.h>

#include <string>

#include "offload/cuda/cuda_move_rows.h"
#include "offload/cuda/cuda_move_rows_kernels.h"

namespace ucp::offload::cuda {

Status MoveRowsOnDevice(const graph::Strided<float>* moves, int64_t count, int64_t rows, bool add,
                        void* stream) {
  if (count < 0 || rows < 0 || (count > 0 && moves == nullptr)) {
    return InvalidArgumentError("row moves on the device: " + std::to_string(count) +
                                " moves of " + std::to_string(rows) + " rows");
  }
  for (int64_t i = 0; i < count; ++i) {
    const graph::Strided<float>& m = moves[i];
    if (m.width < 0 || (rows > 1 && (m.dpitch < m.width || m.spitch < m.width)) ||
        (m.width > 0 && rows > 0 && (m.dst == nullptr || m.src == nullptr))) {
      return InvalidArgumentError("row move " + std::to_string(i) + " on the device: width " +
                                  std::to_string(m.width) + ", pitches " +
                                  std::to_string(m.dpitch) + "/" + std::to_string(m.spitch));
    }
  }
  // (A message, not a Status, in the lambda: nvcc flags assigning a [[nodiscard]] type.)
  std::string error;
  kernels::ForEachMoveLaunch(
      moves, count, rows, add, [&](const kernels::RowMoves& batch, int k, unsigned blocks) {
        if (!error.empty()) return;
        kernels::MoveRowsKernel<<<dim3(blocks, static_cast<unsigned>(k)),
                                  kernels::kMoveRowsThreads, 0,
                                  static_cast<cudaStream_t>(stream)>>>(batch, rows, add);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) {
          error = std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
        }
      });
  if (!error.empty()) return DeviceError("row move kernel: " + error);
  return Status::Ok();
}

}  // namespace ucp::offload::cuda
