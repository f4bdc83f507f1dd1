// The SVE path (vector-length agnostic): svcntw() fp32 lanes per iteration, the last partial
// vector under a whilelt predicate with the same operations, so there is no scalar tail to keep
// in step with the body. Built with -march=armv8.2-a+sve when targeting aarch64 and called only on
// CPUs with SVE; compile-checked with aarch64-linux-gnu-g++ on x86 hosts (ucp_offload_arm_check).
#include <arm_sve.h>

#include "offload/optim/adam_element.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {
namespace {

// fma(a, b, c) in the argument order the scalar element uses.
inline svfloat32_t Fma(svbool_t pg, svfloat32_t a, svfloat32_t b, svfloat32_t c) {
  return svmla_f32_x(pg, c, a, b);
}

template <LowpDType kG>
inline svfloat32_t LoadGradN(svbool_t pg, const void* g, size_t i) {
  if constexpr (kG == LowpDType::kFp32) {
    return svld1_f32(pg, static_cast<const float*>(g) + i);
  } else {
    const svuint32_t h = svld1uh_u32(pg, static_cast<const uint16_t*>(g) + i);
    if constexpr (kG == LowpDType::kBf16) {
      return svreinterpret_f32_u32(svlsl_n_u32_x(pg, h, 16));
    } else {
      // The half sits in the low 16 bits of each 32-bit container, which is what cvt reads.
      return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(h));
    }
  }
}

template <LowpDType kO>
inline void StoreOutN(svbool_t pg, uint16_t* out, size_t i, svfloat32_t p) {
  if constexpr (kO == LowpDType::kBf16) {
    const svuint32_t x = svreinterpret_u32_f32(p);
    const svuint32_t hi = svlsr_n_u32_x(pg, x, 16);
    const svuint32_t lsb = svand_n_u32_x(pg, hi, 1);
    const svuint32_t r = svlsr_n_u32_x(pg, svadd_u32_x(pg, svadd_n_u32_x(pg, x, 0x7fff), lsb), 16);
    const svbool_t is_nan = svcmpuo_f32(pg, p, p);
    svst1h_u32(pg, out + i, svsel_u32(is_nan, svorr_n_u32_x(pg, hi, 0x40), r));
  } else if constexpr (kO == LowpDType::kFp16) {
    svst1h_u32(pg, out + i, svreinterpret_u32_f16(svcvt_f16_f32_x(pg, p)));
  }
}

template <LowpDType kG, LowpDType kO, bool kAms, bool kL2, bool kSnap>
void Loop(const AdamStepScalars& s, const AdamKernelArgs& a) {
  const svfloat32_t beta1 = svdup_n_f32(s.beta1);
  const svfloat32_t one_minus_beta1 = svdup_n_f32(s.one_minus_beta1);
  const svfloat32_t beta2 = svdup_n_f32(s.beta2);
  const svfloat32_t one_minus_beta2 = svdup_n_f32(s.one_minus_beta2);
  const svfloat32_t eps = svdup_n_f32(s.eps);
  const svfloat32_t l2 = svdup_n_f32(s.l2_weight_decay);
  const svfloat32_t decay = svdup_n_f32(s.decay);
  const svfloat32_t neg_step_size = svdup_n_f32(s.neg_step_size);
  const svfloat32_t inv_sqrt_bias2 = svdup_n_f32(s.inv_sqrt_bias2);
  const size_t lanes = svcntw();
  for (size_t i = 0; i < a.n; i += lanes) {
    const svbool_t pg = svwhilelt_b32_u64(i, a.n);
    svfloat32_t p = svld1_f32(pg, a.p + i);
    svfloat32_t m = svld1_f32(pg, a.m + i);
    svfloat32_t v = svld1_f32(pg, a.v + i);
    if constexpr (kSnap) {
      svst1_f32(pg, a.snap_p + i, p);
      svst1_f32(pg, a.snap_m + i, m);
      svst1_f32(pg, a.snap_v + i, v);
    }
    svfloat32_t g = LoadGradN<kG>(pg, a.g, i);
    if constexpr (kL2) g = Fma(pg, l2, p, g);
    m = Fma(pg, beta1, m, svmul_f32_x(pg, one_minus_beta1, g));
    v = Fma(pg, beta2, v, svmul_f32_x(pg, svmul_f32_x(pg, one_minus_beta2, g), g));
    svfloat32_t vu = v;
    if constexpr (kAms) {
      svfloat32_t vm = svld1_f32(pg, a.vmax + i);
      if constexpr (kSnap) svst1_f32(pg, a.snap_vmax + i, vm);
      vm = svsel_f32(svcmpgt_f32(pg, vm, v), vm, v);  // MaxLikeMaxps: v when either is NaN
      svst1_f32(pg, a.vmax + i, vm);
      vu = vm;
    }
    const svfloat32_t d = Fma(pg, svsqrt_f32_x(pg, vu), inv_sqrt_bias2, eps);
    p = Fma(pg, neg_step_size, svdiv_f32_x(pg, m, d), svmul_f32_x(pg, p, decay));
    svst1_f32(pg, a.p + i, p);
    svst1_f32(pg, a.m + i, m);
    svst1_f32(pg, a.v + i, v);
    StoreOutN<kO>(pg, a.out, i, p);
  }
}

}  // namespace

void AdamKernelSve(const AdamStepScalars& s, const AdamKernelArgs& a) {
  DispatchAdam(a, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    Loop<decltype(gc)::value, decltype(oc)::value, decltype(ac)::value, decltype(lc)::value,
         decltype(sc)::value>(s, a);
  });
}

void ProbeKernelSve(float* p, const float* g, float* m, float* v, size_t n, float s) {
  const svfloat32_t sv = svdup_n_f32(s);
  const size_t lanes = svcntw();
  for (size_t i = 0; i < n; i += lanes) {
    const svbool_t pg = svwhilelt_b32_u64(i, n);
    const svfloat32_t mi = svld1_f32(pg, m + i);
    const svfloat32_t vi = svld1_f32(pg, v + i);
    svst1_f32(pg, p + i, Fma(pg, sv, svld1_f32(pg, g + i), svld1_f32(pg, p + i)));
    svst1_f32(pg, m + i, Fma(pg, sv, vi, mi));
    svst1_f32(pg, v + i, Fma(pg, sv, mi, vi));
  }
}

}  // namespace ucp::offload::internal
