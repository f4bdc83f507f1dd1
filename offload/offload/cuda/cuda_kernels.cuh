// What the CUDA ops' translation units share (cuda_ops.cu, cuda_flash.cu): the fused QKV row's
// offsets and the launch check. Internal: included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ucp/base/status.h"

namespace ucp::offload::cuda::internal {

// Fused-QKV row offsets (ops_ref.cc's QkvLayout): group g holds [q of its hpg heads | k | v].
struct Qkv {
  int64_t hpg, hd, row;
  __host__ __device__ int64_t Q(int64_t h) const {
    return (h / hpg) * (hpg + 2) * hd + (h % hpg) * hd;
  }
  __host__ __device__ int64_t K(int64_t g) const { return g * (hpg + 2) * hd + hpg * hd; }
  __host__ __device__ int64_t V(int64_t g) const { return K(g) + hd; }
};

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
