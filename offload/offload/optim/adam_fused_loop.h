// Internal to offload/optim: the element loop of AdamStepFused (adam.h): the portable path
// (adam_fused.cc) and the vector paths' tails (adam_avx2.cc, adam_avx512.cc, whose vector bodies
// run the same expression in intrinsics; a loop left to GCC's vectoriser ran at 40% of AdamStep's
// rate). Internal linkage for the reason adam_element.h gives.
//
// Per element it is AdamElement's expression, with two changes: the pre-step state is read from
// `src_*` (the live state, or a speculative step's snapshot) and the gradient is multiplied by
// grad_scale once, in fp32, right after it is widened. Every file compiles it with
// -ffp-contract=off, fma as __builtin_fmaf and correctly rounded sqrt and division, so all paths
// agree bitwise with each other and with AdamStep (tested).
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
void FusedLoop(const AdamStepScalars& s, const AdamFusedArgs& f, size_t begin) {
  const AdamKernelArgs& a = f.args;
  float* p_out = a.p;
  float* m_out = a.m;
  float* v_out = a.v;
  const float* p_in = kSrc ? f.src_p : a.p;
  const float* m_in = kSrc ? f.src_m : a.m;
  const float* v_in = kSrc ? f.src_v : a.v;
  const float* vmax_in = kSrc ? f.src_vmax : a.vmax;
  const float scale = f.grad_scale;
  for (size_t i = begin; i < a.n; ++i) {
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

// Elements [begin, n) of f (a vector path's tail starts past its vector body).
inline void RunFused(const AdamStepScalars& s, const AdamFusedArgs& f, size_t begin = 0) {
  DispatchAdam(f.args, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    constexpr LowpDType kG = decltype(gc)::value, kO = decltype(oc)::value;
    constexpr bool kAms = decltype(ac)::value, kL2 = decltype(lc)::value;
    constexpr bool kSave = decltype(sc)::value;
    if constexpr (kSave) {
      FusedLoop<kG, kO, kAms, kL2, true, false>(s, f, begin);  // saves the live state
    } else if (f.src_p != nullptr) {
      FusedLoop<kG, kO, kAms, kL2, false, true>(s, f, begin);
    } else {
      FusedLoop<kG, kO, kAms, kL2, false, false>(s, f, begin);
    }
  });
}

}  // namespace
}  // namespace ucp::offload::internal
