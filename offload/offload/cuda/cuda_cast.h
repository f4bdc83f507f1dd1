// Placement-aware casting on the GPU (SuperOffload §3.6): gradients leave the GPU in the
// precision the host optimizer wants, and updated fp32 weights come back as bf16 cast on the
// device, so the PCIe/NVLink transfer moves the narrower type only where it pays. This header is
// plain C++ (no CUDA headers), so host code can call it; streams are passed as void*.
#pragma once

#include <cstdint>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload::cuda {

/// Number of CUDA devices visible; 0 when there is no driver or device (not an error).
int DeviceCount();

/// d_dst[i] = RNE bf16 of d_src[i] for i < n, on `stream` (a cudaStream_t, nullptr = default).
/// Bitwise the same as ucp::Bf16FromFloat on the host, NaNs included.
/// Errors: kInvalidArgument (n < 0, null pointers with n > 0), kDeviceError (launch failure,
/// with the CUDA error name).
Status CastFp32ToBf16(const float* d_src, uint16_t* d_dst, int64_t n, void* stream = nullptr);

/// d_dst[i] = fp32 value of bf16 d_src[i] (exact).
/// Errors: as CastFp32ToBf16.
Status CastBf16ToFp32(const uint16_t* d_src, float* d_dst, int64_t n, void* stream = nullptr);

/// Sets *d_flag to 1 (leaves it otherwise) when some d_src[i], i < n, is not finite, or, with
/// fp16_range, exceeds 65504 in magnitude: the pipeline's overflow check, on the device, before
/// any cast (the CPU twin checks the same fp32 values).
/// Errors: as CastFp32ToBf16.
Status FlagNonFinite(const float* d_src, int64_t n, bool fp16_range, int* d_flag,
                     void* stream = nullptr);

}  // namespace ucp::offload::cuda
