// Internal to offload/optim: the element loop of AdamStepFused (adam.h), included by
// adam_fused.cc (portable) and adam_fused_avx2.cc (compiled with -mavx2 -mfma, where GCC
// vectorises it). Internal linkage for the reason adam_element.h gives.
//
// Per element it is AdamElement's expression, with two changes: the pre-step state is read from
// `src_*` (the live state, or a speculative step's snapshot) and the gradient is multiplied by
// grad_scale once, in fp32, right after it is widened. Both files compile the same source with
// -ffp-contract=off, fma as __builtin_fmaf and correctly rounded sqrt and division, so they agree
// bitwise with each other and with the vector paths of AdamStep (tested).
#pragma once

#include <cstddef>
#include <cstdint>

#include "offload/optim/adam_element.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {
namespace {

// kSrc: the pre-step state comes from f.src_* (else from the live spans, read and written in
// place through the same pointers, so the compiler sees a dependence distance of 0).
template <LowpDType kG, LowpDType kO, bool kAms, bool kL2, bool kSave, bool kSrc>
void FusedLoop(const AdamStepScalars& s, const AdamFusedArgs& f) {
  const AdamKernelArgs& a = f.args;
  float* p_out = a.p;
  float* m_out = a.m;
  float* v_out = a.v;
  const float* p_in = kSrc ? f.src_p : a.p;
  const float* m_in = kSrc ? f.src_m : a.m;
  const float* v_in = kSrc ? f.src_v : a.v;
  const float* vmax_in = kSrc ? f.src_vmax : a.vmax;
  const float scale = f.grad_scale;
  for (size_t i = 0; i < a.n; ++i) {
    float p = p_in[i];
    float m = m_in[i];
    float v = v_in[i];
    if constexpr (kSave) {
      a.snap_p[i] = p;
      a.snap_m[i] = m;
      a.snap_v[i] = v;
    }
    float g = LoadGrad<kG>(a.g, i) * scale;
    if constexpr (kL2) g = __builtin_fmaf(s.l2_weight_decay, p, g);
    m = __builtin_fmaf(s.beta1, m, s.one_minus_beta1 * g);
    v = __builtin_fmaf(s.beta2, v, (s.one_minus_beta2 * g) * g);
    float vu = v;
    if constexpr (kAms) {
      float vm = vmax_in[i];
      if constexpr (kSave) a.snap_vmax[i] = vm;
      vm = MaxLikeMaxps(vm, v);
      a.vmax[i] = vm;
      vu = vm;
    }
    const float d = __builtin_fmaf(__builtin_sqrtf(vu), s.inv_sqrt_bias2, s.eps);
    p = __builtin_fmaf(s.neg_step_size, m / d, p * s.decay);
    p_out[i] = p;
    m_out[i] = m;
    v_out[i] = v;
    StoreOut<kO>(a.out, i, p);
  }
}

inline void RunFused(const AdamStepScalars& s, const AdamFusedArgs& f) {
  DispatchAdam(f.args, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    constexpr LowpDType kG = decltype(gc)::value, kO = decltype(oc)::value;
    constexpr bool kAms = decltype(ac)::value, kL2 = decltype(lc)::value;
    constexpr bool kSave = decltype(sc)::value;
    if constexpr (kSave) {
      FusedLoop<kG, kO, kAms, kL2, true, false>(s, f);  // a speculative step saves the live state
    } else if (f.src_p != nullptr) {
      FusedLoop<kG, kO, kAms, kL2, false, true>(s, f);
    } else {
      FusedLoop<kG, kO, kAms, kL2, false, false>(s, f);
    }
  });
}

}  // namespace
}  // namespace ucp::offload::internal
