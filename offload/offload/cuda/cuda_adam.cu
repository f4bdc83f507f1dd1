// The device Adam; see cuda_adam.h. One thread per element, grid-stride.
#include "offload/cuda/cuda_adam.h"

#include <cuda_runtime.h>

#include <string>

namespace ucp::offload::cuda {
namespace {

// The same bit recipes as the CPU's (offload/optim/adam_element.h Bf16BitsRne, Fp16BitsRne):
// round to nearest even on the integer bits, NaN kept quiet.
__device__ inline uint16_t Bf16Rne(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__device__ inline uint16_t Fp16Rne(float f) {
  const uint32_t x = __float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax < 0x38800000u) {
    if (ax <= 0x33000000u) return sign;
    const uint32_t e = ax >> 23;
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}

// The element of adam_fused_loop.h, operation for operation.
template <int kOut, bool kL2>
__global__ void AdamKernel(DeviceAdamScalars s, float scale, float* __restrict__ p_,
                           const float* __restrict__ g_, float* __restrict__ m_,
                           float* __restrict__ v_, uint16_t* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float p = p_[i];
    float m = m_[i];
    float v = v_[i];
    float g = __fmul_rn(g_[i], scale);
    if constexpr (kL2) g = __fmaf_rn(s.l2_weight_decay, p, g);
    m = __fmaf_rn(s.beta1, m, __fmul_rn(s.one_minus_beta1, g));
    v = __fmaf_rn(s.beta2, v, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
    const float d = __fmaf_rn(__fsqrt_rn(v), s.inv_sqrt_bias2, s.eps);
    p = __fmaf_rn(s.neg_step_size, __fdiv_rn(m, d), __fmul_rn(p, s.decay));
    p_[i] = p;
    m_[i] = m;
    v_[i] = v;
    if constexpr (kOut == 1) out[i] = Bf16Rne(p);
    if constexpr (kOut == 2) out[i] = Fp16Rne(p);
  }
}

template <int kOut>
void Launch(const DeviceAdamScalars& s, float scale, const DeviceAdamSpans& a, cudaStream_t st) {
  const int threads = 256;
  const int64_t want = (a.n + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 65536 ? want : 65536);
  if (s.l2) {
    AdamKernel<kOut, true><<<blocks, threads, 0, st>>>(s, scale, a.param, a.grad, a.exp_avg,
                                                       a.exp_avg_sq, a.out, a.n);
  } else {
    AdamKernel<kOut, false><<<blocks, threads, 0, st>>>(s, scale, a.param, a.grad, a.exp_avg,
                                                        a.exp_avg_sq, a.out, a.n);
  }
}

}  // namespace

Status AdamStepDevice(const DeviceAdamScalars& s, float grad_scale, const DeviceAdamSpans& a,
                      void* stream) {
  if (a.n < 0) return InvalidArgumentError("device Adam: n=" + std::to_string(a.n) + " < 0");
  if (s.amsgrad) return InvalidArgumentError("device Adam: amsgrad is not supported");
  if (a.n == 0) return Status::Ok();
  if (a.param == nullptr || a.grad == nullptr || a.exp_avg == nullptr ||
      a.exp_avg_sq == nullptr) {
    return InvalidArgumentError("device Adam: a null span with n=" + std::to_string(a.n));
  }
  if (a.out == nullptr && a.out_dtype != DeviceOut::kNone) {
    return InvalidArgumentError("device Adam: a bf16/fp16 copy without an out span");
  }
  const auto st = static_cast<cudaStream_t>(stream);
  if (a.out_dtype == DeviceOut::kNone) {
    Launch<0>(s, grad_scale, a, st);
  } else if (a.out_dtype == DeviceOut::kBf16) {
    Launch<1>(s, grad_scale, a, st);
  } else {
    Launch<2>(s, grad_scale, a, st);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return DeviceError(std::string("device Adam launch: ") + cudaGetErrorName(err));
  }
  return Status::Ok();
}

}  // namespace ucp::offload::cuda
