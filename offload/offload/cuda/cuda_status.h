// A CUDA runtime call's error as a Status, for the host-side code of the CUDA engine.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ucp/base/status.h"

namespace ucp::offload::cuda {

/// Ok for cudaSuccess; otherwise a DeviceError naming `what`, the error's name and text. A
/// failed call also sets the runtime's last error: reported here, it is cleared, so that it does
/// not resurface as the next kernel launch's failure (launchers read cudaGetLastError).
inline Status CudaStatus(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  return DeviceError(what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace ucp::offload::cuda
