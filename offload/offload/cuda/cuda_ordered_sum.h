// OrderedSum (offload/comm/ordered_sum.h) on the device: fixed-order fp32 sums of contributions
// in device memory, the bits the host's OrderedSum gives (cuda_ordered_sum_kernels.h). The NCCL
// communicator's deterministic collectives add with it. Plain C++ (no CUDA headers): streams are
// passed as void*.
#pragma once

#include <cstdint>

#include "ucp/base/status.h"

namespace ucp::offload::cuda {

/// d_out[k] <- the sum over i in [0, count) of d_parts[i * n + k], in rank order or, with
/// halving_tree, SumOrder::kHalvingTree's order, for k in [0, n), queued on `stream` (nullptr:
/// the default stream).
/// Errors: kInvalidArgument (count < 1, n < 0, null pointers with n > 0, d_out overlapping
/// d_parts), kDeviceError (launch).
Status OrderedSumOnDevice(float* d_out, const float* d_parts, int64_t count, int64_t n,
                          bool halving_tree, void* stream = nullptr);

}  // namespace ucp::offload::cuda
