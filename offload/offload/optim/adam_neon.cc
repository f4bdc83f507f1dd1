// The NEON (Advanced SIMD) path for AArch64, e.g. Grace's Neoverse V2: 4 fp32 lanes per
// iteration over the vector body, then the shared scalar element for the tail. NEON is part of
// the AArch64 baseline, so no extra flags; built when targeting aarch64, and compile-checked with
// aarch64-linux-gnu-g++ on x86 hosts that have it (target ucp_offload_arm_check).
#include <arm_neon.h>

#include "offload/optim/adam_element.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {
namespace {

constexpr size_t kLanes = 4;

// fma(a, b, c) in the argument order the scalar element uses.
inline float32x4_t Fma(float32x4_t a, float32x4_t b, float32x4_t c) { return vfmaq_f32(c, a, b); }

template <LowpDType kG>
inline float32x4_t LoadGrad4(const void* g, size_t i) {
  if constexpr (kG == LowpDType::kFp32) {
    return vld1q_f32(static_cast<const float*>(g) + i);
  } else {
    const uint16x4_t h = vld1_u16(static_cast<const uint16_t*>(g) + i);
    if constexpr (kG == LowpDType::kBf16) {
      return vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(h), 16));
    } else {
      return vcvt_f32_f16(vreinterpret_f16_u16(h));
    }
  }
}

template <LowpDType kO>
inline void StoreOut4(uint16_t* out, size_t i, float32x4_t p) {
  if constexpr (kO == LowpDType::kBf16) {
    // Round to nearest even on the bits, NaNs kept quiet with their top payload bits.
    const uint32x4_t x = vreinterpretq_u32_f32(p);
    const uint32x4_t hi = vshrq_n_u32(x, 16);
    const uint32x4_t lsb = vandq_u32(hi, vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(x, vdupq_n_u32(0x7fff)), lsb), 16);
    const uint32x4_t is_num = vceqq_f32(p, p);
    vst1_u16(out + i, vmovn_u32(vbslq_u32(is_num, r, vorrq_u32(hi, vdupq_n_u32(0x40)))));
  } else if constexpr (kO == LowpDType::kFp16) {
    // FPCR's default rounding mode is round to nearest even.
    vst1_u16(out + i, vreinterpret_u16_f16(vcvt_f16_f32(p)));
  }
}

template <LowpDType kG, LowpDType kO, bool kAms, bool kL2, bool kSnap>
void Loop(const AdamStepScalars& s, const AdamKernelArgs& a) {
  const float32x4_t beta1 = vdupq_n_f32(s.beta1);
  const float32x4_t one_minus_beta1 = vdupq_n_f32(s.one_minus_beta1);
  const float32x4_t beta2 = vdupq_n_f32(s.beta2);
  const float32x4_t one_minus_beta2 = vdupq_n_f32(s.one_minus_beta2);
  const float32x4_t eps = vdupq_n_f32(s.eps);
  const float32x4_t l2 = vdupq_n_f32(s.l2_weight_decay);
  const float32x4_t decay = vdupq_n_f32(s.decay);
  const float32x4_t neg_step_size = vdupq_n_f32(s.neg_step_size);
  const float32x4_t inv_sqrt_bias2 = vdupq_n_f32(s.inv_sqrt_bias2);
  const size_t rounded_size = a.n - a.n % kLanes;
  for (size_t i = 0; i < rounded_size; i += kLanes) {
    float32x4_t p = vld1q_f32(a.p + i);
    float32x4_t m = vld1q_f32(a.m + i);
    float32x4_t v = vld1q_f32(a.v + i);
    if constexpr (kSnap) {
      vst1q_f32(a.snap_p + i, p);
      vst1q_f32(a.snap_m + i, m);
      vst1q_f32(a.snap_v + i, v);
    }
    float32x4_t g = LoadGrad4<kG>(a.g, i);
    if constexpr (kL2) g = Fma(l2, p, g);
    m = Fma(beta1, m, vmulq_f32(one_minus_beta1, g));
    v = Fma(beta2, v, vmulq_f32(vmulq_f32(one_minus_beta2, g), g));
    float32x4_t vu = v;
    if constexpr (kAms) {
      float32x4_t vm = vld1q_f32(a.vmax + i);
      if constexpr (kSnap) vst1q_f32(a.snap_vmax + i, vm);
      vm = vbslq_f32(vcgtq_f32(vm, v), vm, v);  // MaxLikeMaxps: v when either is NaN
      vst1q_f32(a.vmax + i, vm);
      vu = vm;
    }
    const float32x4_t d = Fma(vsqrtq_f32(vu), inv_sqrt_bias2, eps);
    p = Fma(neg_step_size, vdivq_f32(m, d), vmulq_f32(p, decay));
    vst1q_f32(a.p + i, p);
    vst1q_f32(a.m + i, m);
    vst1q_f32(a.v + i, v);
    StoreOut4<kO>(a.out, i, p);
  }
  AdamScalarLoop<kG, kO, kAms, kL2, kSnap>(s, a, rounded_size, a.n);
}

}  // namespace

void AdamKernelNeon(const AdamStepScalars& s, const AdamKernelArgs& a) {
  DispatchAdam(a, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    Loop<decltype(gc)::value, decltype(oc)::value, decltype(ac)::value, decltype(lc)::value,
         decltype(sc)::value>(s, a);
  });
}

void ProbeKernelNeon(float* p, const float* g, float* m, float* v, size_t n, float s) {
  const float32x4_t sv = vdupq_n_f32(s);
  const size_t rounded_size = n - n % kLanes;
  for (size_t i = 0; i < rounded_size; i += kLanes) {
    const float32x4_t mi = vld1q_f32(m + i);
    const float32x4_t vi = vld1q_f32(v + i);
    vst1q_f32(p + i, Fma(sv, vld1q_f32(g + i), vld1q_f32(p + i)));
    vst1q_f32(m + i, Fma(sv, vi, mi));
    vst1q_f32(v + i, Fma(sv, mi, vi));
  }
  ProbeScalarLoop(p, g, m, v, rounded_size, n, s);
}

}  // namespace ucp::offload::internal
