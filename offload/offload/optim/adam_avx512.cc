// The AVX-512 path: 16 fp32 lanes per iteration over the vector body, then the shared scalar
// element for the tail. Compiled with -mavx512f -mavx512bw -mavx512vl (-mfma -mf16c for the tail);
// called only when the CPU has avx512f, avx512bw and avx512vl (SimdPathAvailable).
#include <immintrin.h>

#include "offload/optim/adam_element.h"
#include "offload/optim/adam_fused_loop.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {
namespace {

constexpr size_t kLanes = 16;

template <LowpDType kG>
inline __m512 LoadGrad16(const void* g, size_t i) {
  if constexpr (kG == LowpDType::kFp32) {
    return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (kG == LowpDType::kBf16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <LowpDType kO>
inline void StoreOut16(uint16_t* out, size_t i, __m512 p) {
  if constexpr (kO == LowpDType::kBf16) {
    // Round to nearest even on the bits (vcvtneps2bf16 would flush subnormals), NaNs kept quiet.
    const __m512i x = _mm512_castps_si512(p);
    const __m512i hi = _mm512_srli_epi32(x, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, is_nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  } else if constexpr (kO == LowpDType::kFp16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// AdamStep's loop, and with kFused AdamStepFused's (f: the pre-step state read from f->src_*
// when set, the gradient times f->grad_scale in fp32 right after it is widened; the tail is the
// portable fused loop): the same arithmetic as the scalar elements, so the same bits.
template <LowpDType kG, LowpDType kO, bool kAms, bool kL2, bool kSnap, bool kFused>
void Loop(const AdamStepScalars& s, const AdamKernelArgs& a, const AdamFusedArgs* f) {
  const PreStepState in = PreStepFrom(a, f);
  [[maybe_unused]] const __m512 scale = _mm512_set1_ps(kFused ? f->grad_scale : 1.0f);
  const __m512 beta1 = _mm512_set1_ps(s.beta1);
  const __m512 one_minus_beta1 = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(s.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(s.eps);
  const __m512 l2 = _mm512_set1_ps(s.l2_weight_decay);
  const __m512 decay = _mm512_set1_ps(s.decay);
  const __m512 neg_step_size = _mm512_set1_ps(s.neg_step_size);
  const __m512 inv_sqrt_bias2 = _mm512_set1_ps(s.inv_sqrt_bias2);
  const size_t rounded_size = a.n - a.n % kLanes;
  for (size_t i = 0; i < rounded_size; i += kLanes) {
    __m512 p = _mm512_loadu_ps(in.p + i);
    __m512 m = _mm512_loadu_ps(in.m + i);
    __m512 v = _mm512_loadu_ps(in.v + i);
    if constexpr (kSnap) {
      _mm512_storeu_ps(a.snap_p + i, p);
      _mm512_storeu_ps(a.snap_m + i, m);
      _mm512_storeu_ps(a.snap_v + i, v);
    }
    __m512 g = LoadGrad16<kG>(a.g, i);
    if constexpr (kFused) g = _mm512_mul_ps(g, scale);
    if constexpr (kL2) g = _mm512_fmadd_ps(l2, p, g);
    m = _mm512_fmadd_ps(beta1, m, _mm512_mul_ps(one_minus_beta1, g));
    v = _mm512_fmadd_ps(beta2, v, _mm512_mul_ps(_mm512_mul_ps(one_minus_beta2, g), g));
    __m512 vu = v;
    if constexpr (kAms) {
      __m512 vm = _mm512_loadu_ps(in.vmax + i);
      if constexpr (kSnap) _mm512_storeu_ps(a.snap_vmax + i, vm);
      vm = _mm512_max_ps(vm, v);
      _mm512_storeu_ps(a.vmax + i, vm);
      vu = vm;
    }
    const __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(vu), inv_sqrt_bias2, eps);
    p = _mm512_fmadd_ps(neg_step_size, _mm512_div_ps(m, d), _mm512_mul_ps(p, decay));
    _mm512_storeu_ps(a.p + i, p);
    _mm512_storeu_ps(a.m + i, m);
    _mm512_storeu_ps(a.v + i, v);
    StoreOut16<kO>(a.out, i, p);
  }
  if constexpr (kFused) {
    RunFused(s, *f, rounded_size);
  } else {
    AdamScalarLoop<kG, kO, kAms, kL2, kSnap>(s, a, rounded_size, a.n);
  }
}

}  // namespace

void AdamKernelAvx512(const AdamStepScalars& s, const AdamKernelArgs& a) {
  DispatchAdam(a, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    Loop<decltype(gc)::value, decltype(oc)::value, decltype(ac)::value, decltype(lc)::value,
         decltype(sc)::value, false>(s, a, nullptr);
  });
}

void AdamFusedKernelAvx512(const AdamStepScalars& s, const AdamFusedArgs& f) {
  DispatchAdam(f.args, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    Loop<decltype(gc)::value, decltype(oc)::value, decltype(ac)::value, decltype(lc)::value,
         decltype(sc)::value, true>(s, f.args, &f);
  });
}

void ProbeKernelAvx512(float* p, const float* g, float* m, float* v, size_t n, float s) {
  const __m512 sv = _mm512_set1_ps(s);
  const size_t rounded_size = n - n % kLanes;
  for (size_t i = 0; i < rounded_size; i += kLanes) {
    const __m512 mi = _mm512_loadu_ps(m + i);
    const __m512 vi = _mm512_loadu_ps(v + i);
    _mm512_storeu_ps(p + i, _mm512_fmadd_ps(sv, _mm512_loadu_ps(g + i), _mm512_loadu_ps(p + i)));
    _mm512_storeu_ps(m + i, _mm512_fmadd_ps(sv, vi, mi));
    _mm512_storeu_ps(v + i, _mm512_fmadd_ps(sv, mi, vi));
  }
  ProbeScalarLoop(p, g, m, v, rounded_size, n, s);
}

}  // namespace ucp::offload::internal
