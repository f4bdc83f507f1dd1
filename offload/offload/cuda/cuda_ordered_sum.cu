// The launcher of OrderedSumKernel (cuda_ordered_sum.h).
#include <cuda_runtime.h>

#include <string>

#include "offload/cuda/cuda_ordered_sum.h"
#include "offload/cuda/cuda_ordered_sum_kernels.h"

namespace ucp::offload::cuda {

Status OrderedSumOnDevice(float* d_out, const float* d_parts, int64_t count, int64_t n,
                          bool halving_tree, void* stream) {
  if (count < 1 || n < 0) {
    return InvalidArgumentError("ordered sum on the device: " + std::to_string(count) +
                                " contributions of " + std::to_string(n) +
                                " floats (need at least 1, and n >= 0)");
  }
  if (n == 0) return Status::Ok();
  if (d_out == nullptr || d_parts == nullptr) {
    return InvalidArgumentError("ordered sum on the device: null device pointer for " +
                                std::to_string(n) + " floats");
  }
  const char* out = reinterpret_cast<const char*>(d_out);
  const char* parts = reinterpret_cast<const char*>(d_parts);
  if (out < parts + count * n * 4 && parts < out + n * 4) {
    return InvalidArgumentError("ordered sum on the device: the output overlaps the contributions");
  }
  kernels::OrderedSumKernel<<<kernels::OrderedSumBlocks(n), kernels::kOrderedSumThreads, 0,
                              static_cast<cudaStream_t>(stream)>>>(d_out, d_parts, count, n,
                                                                   halving_tree);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return DeviceError(std::string("ordered sum kernel: ") + cudaGetErrorName(err) + " (" +
                       cudaGetErrorString(err) + ")");
  }
  return Status::Ok();
}

}  // namespace ucp::offload::cuda
