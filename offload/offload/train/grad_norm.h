// The gradient norm's arithmetic, shared by the trainer (over its host copy of the gradients)
// and the devices that sum where the gradients are (TrainDevice::GradNormChunks): the CPU twin
// runs this code, the CUDA device a kernel with the same operations in the same order
// (offload/cuda/cuda_ops.h GradNormChunks; offload_cuda_ops_test compares the bits).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

namespace ucp::offload {

/// Fixed chunks, so the norm is the same bits for any thread count, and on a device.
inline constexpr int64_t kGradNormChunk = int64_t{1} << 16;

/// The chunks of n elements (the last may be shorter).
inline int64_t NumGradNormChunks(int64_t n) { return (n + kGradNormChunk - 1) / kGradNormChunk; }

/// The sum of squares of x in double, and the largest |x|, in a fixed order: element i into lane
/// i % 8 (each lane summed in order, each square rounded before its add: no fused multiply-add),
/// then the lanes in a fixed tree. Eight independent chains: one serial double sum is bound by
/// the adder's latency (at 1B parameters it was a quarter of a GPU step's host time); the bits
/// depend on x alone, never on threads or the machine. A NaN makes the sum NaN; the max skips it.
inline void SumSquaresAndMax(std::span<const float> x, double* sum, float* max) {
  constexpr size_t kLanes = 8;
  double acc[kLanes] = {};
  float mx[kLanes] = {};
  const size_t n = x.size(), whole = n - n % kLanes;
  for (size_t i = 0; i < whole; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) {
      const float v = x[i + j];
      acc[j] += static_cast<double>(v) * v;
      mx[j] = std::max(mx[j], std::fabs(v));
    }
  }
  for (size_t i = whole; i < n; ++i) {  // the tail: lane i % 8 as well
    acc[i - whole] += static_cast<double>(x[i]) * x[i];
    mx[i - whole] = std::max(mx[i - whole], std::fabs(x[i]));
  }
  *sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  *max = std::max({mx[0], mx[1], mx[2], mx[3], mx[4], mx[5], mx[6], mx[7]});
}

/// Chunk c of x (kGradNormChunk elements from c kGradNormChunk; the last may be shorter).
inline void SumChunk(std::span<const float> x, int64_t c, double* sum, float* max) {
  const size_t b = static_cast<size_t>(c * kGradNormChunk);
  SumSquaresAndMax(x.subspan(b, std::min(x.size() - b, static_cast<size_t>(kGradNormChunk))), sum,
                   max);
}

}  // namespace ucp::offload
