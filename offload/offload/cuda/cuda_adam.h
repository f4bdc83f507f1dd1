// The device Adam (issue 12): the tail buckets of the offloaded optimizer (the grad groups
// backward finishes last) are stepped on the GPU from the device gradients, with their fp32
// master and Adam states in device memory. Plain C++ header (no CUDA headers); streams are void*.
//
// Numerics: the CPU fused kernel's element (offload/optim/adam_fused_loop.h, docs/offload.md
// "Numerics") with the same fp32 constants (MakeAdamStepScalars), each operation written as its
// IEEE round-to-nearest intrinsic (__fmul_rn, __fmaf_rn, __fsqrt_rn, __fdiv_rn), so nvcc's
// contraction and fast-math flags cannot change it: bitwise the CPU Adam's result (tested by
// cuda_adam_test against AdamStepFused and AdamStep).
#pragma once

#include <cstdint>

#include "ucp/base/status.h"
#if __cplusplus >= 202002L  // adam.h is C++20 (std::span); the .cu (C++17) does not need it
#include "offload/optim/adam.h"
#endif

namespace ucp::offload::cuda {

/// offload::AdamStepScalars, field for field (that header is C++20; nvcc compiles C++17 here).
struct DeviceAdamScalars {
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, eps = 0;
  float l2_weight_decay = 0, decay = 1, neg_step_size = 0, inv_sqrt_bias2 = 1;
  bool l2 = false;  ///< Adam with L2 (not decoupled): g = fma(l2_weight_decay, p, g)
  bool amsgrad = false;
};

enum class DeviceOut { kNone, kBf16, kFp16 };

/// Device pointers of n elements each; `out` (bf16 or fp16 bits) is written unless kNone.
struct DeviceAdamSpans {
  float* param = nullptr;
  const float* grad = nullptr;  ///< fp32
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  uint16_t* out = nullptr;
  DeviceOut out_dtype = DeviceOut::kNone;
  int64_t n = 0;
};

/// One AdamW/Adam step of `s` on `stream` with g = fl(grad * grad_scale) (AdamStepFused's
/// multiplier; pass 1.0f for none). amsgrad is not supported on the device.
/// Errors: kInvalidArgument (n < 0, a null pointer with n > 0, amsgrad, out missing for
/// bf16/fp16), kDeviceError (the launch).
Status AdamStepDevice(const DeviceAdamScalars& s, float grad_scale, const DeviceAdamSpans& spans,
                      void* stream = nullptr);

#if __cplusplus >= 202002L
/// The CPU's per-step constants (MakeAdamStepScalars) for the device; `decoupled` from the
/// config (L2 when false).
inline DeviceAdamScalars ToDevice(const AdamStepScalars& s, bool decoupled) {
  DeviceAdamScalars d;
  d.beta1 = s.beta1;
  d.one_minus_beta1 = s.one_minus_beta1;
  d.beta2 = s.beta2;
  d.one_minus_beta2 = s.one_minus_beta2;
  d.eps = s.eps;
  d.l2_weight_decay = s.l2_weight_decay;
  d.decay = s.decay;
  d.neg_step_size = s.neg_step_size;
  d.inv_sqrt_bias2 = s.inv_sqrt_bias2;
  d.l2 = !decoupled && s.l2_weight_decay != 0.0f;  // the CPU kernels' condition (adam.cc)
  d.amsgrad = s.amsgrad;
  return d;
}
inline DeviceOut ToDevice(LowpDType t) {
  return t == LowpDType::kBf16 ? DeviceOut::kBf16
         : t == LowpDType::kFp16 ? DeviceOut::kFp16 : DeviceOut::kNone;
}
#endif

}  // namespace ucp::offload::cuda
