// CUDA kernels for placement-aware casting; see cuda_cast.h.
#include <cuda_runtime.h>

#include <string>

#include "offload/cuda/cuda_cast.h"

namespace ucp::offload::cuda {
namespace {

// --- kernels

// The same bit recipe as ucp::Bf16FromFloat (libucp/ucp/tensor/float_bits.h), so host and
// device casts agree bitwise: quiet NaNs keep their top payload bits, everything else rounds to
// nearest even by adding 0x7fff plus the lowest kept bit.
__device__ inline uint16_t Bf16FromFloatDevice(float f) {
  uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

__global__ void CastFp32ToBf16Kernel(const float* __restrict__ src, uint16_t* __restrict__ dst,
                                     int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = Bf16FromFloatDevice(src[i]);
  }
}

__global__ void CastBf16ToFp32Kernel(const uint16_t* __restrict__ src, float* __restrict__ dst,
                                     int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
  }
}

__global__ void FlagNonFiniteKernel(const float* __restrict__ src, int64_t n, bool fp16_range,
                                    int* flag) {
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = src[i];
    bad = bad || !isfinite(v) || (fp16_range && fabsf(v) > 65504.0f);
  }
  if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) *flag = 1;  // a flag: no race on order
}

// --- launchers

constexpr int kThreads = 256;

int Blocks(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 * 16 ? blocks : 65535 * 16);  // grid-stride beyond
}

Status CheckArgs(const void* src, const void* dst, int64_t n, const char* what) {
  if (n < 0) return InvalidArgumentError(std::string(what) + ": negative count " + std::to_string(n));
  if (n > 0 && (src == nullptr || dst == nullptr)) {
    return InvalidArgumentError(std::string(what) + ": null device pointer for " +
                                std::to_string(n) + " elements");
  }
  return Status::Ok();
}

Status LaunchStatus(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return DeviceError(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                       cudaGetErrorString(err) + ")");
  }
  return Status::Ok();
}

}  // namespace

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

Status CastFp32ToBf16(const float* d_src, uint16_t* d_dst, int64_t n, void* stream) {
  Status s = CheckArgs(d_src, d_dst, n, "fp32 -> bf16 cast");
  if (!s.ok() || n == 0) return s;
  CastFp32ToBf16Kernel<<<Blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(d_src, d_dst, n);
  return LaunchStatus("fp32 -> bf16 cast kernel");
}

Status CastBf16ToFp32(const uint16_t* d_src, float* d_dst, int64_t n, void* stream) {
  Status s = CheckArgs(d_src, d_dst, n, "bf16 -> fp32 cast");
  if (!s.ok() || n == 0) return s;
  CastBf16ToFp32Kernel<<<Blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(d_src, d_dst, n);
  return LaunchStatus("bf16 -> fp32 cast kernel");
}

Status FlagNonFinite(const float* d_src, int64_t n, bool fp16_range, int* d_flag, void* stream) {
  Status s = CheckArgs(d_src, d_flag, n, "finite check");
  if (!s.ok() || n == 0) return s;
  FlagNonFiniteKernel<<<Blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      d_src, n, fp16_range, d_flag);
  return LaunchStatus("finite check");
}

}  // namespace ucp::offload::cuda
