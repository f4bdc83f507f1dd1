// What the CUDA ops' translation units share (cuda_ops.cu, cuda_flash.cu): the launch check.
// Internal: included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ucp/base/status.h"

namespace ucp::offload::cuda::internal {

// The last launch's error as a Status naming `what`.
inline Status Launched(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return DeviceError(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                       cudaGetErrorString(err) + ")");
  }
  return Status::Ok();
}

}  // namespace ucp::offload::cuda::internal
