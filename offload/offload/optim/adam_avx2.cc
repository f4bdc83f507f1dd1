// The AVX2 + FMA (+ F16C) path: 8 fp32 lanes per iteration over the vector body, then the shared
// scalar element for the tail. Compiled with -mavx2 -mfma -mf16c; called only when the CPU has
// all three (SimdPathAvailable).
#include <immintrin.h>

#include "offload/optim/adam_element.h"
#include "offload/optim/adam_fused_loop.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {
namespace {

constexpr size_t kLanes = 8;

template <LowpDType kG>
inline __m256 LoadGrad8(const void* g, size_t i) {
  if constexpr (kG == LowpDType::kFp32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (kG == LowpDType::kBf16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

template <LowpDType kO>
inline void StoreOut8(uint16_t* out, size_t i, __m256 p) {
  if constexpr (kO == LowpDType::kBf16) {
    // Round to nearest even on the bits (vcvtneps2bf16 would flush subnormals), NaNs kept quiet.
    const __m256i x = _mm256_castps_si256(p);
    const __m256i hi = _mm256_srli_epi32(x, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)));
    // packus works within 128-bit lanes: [0..3 0..3 | 4..7 4..7]; gather qwords 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  } else if constexpr (kO == LowpDType::kFp16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// AdamStep's loop, and with kFused AdamStepFused's (f: the pre-step state read from f->src_*
// when set, the gradient times f->grad_scale in fp32 right after it is widened; the tail is the
// portable fused loop): the same arithmetic as the scalar elements, so the same bits.
template <LowpDType kG, LowpDType kO, bool kAms, bool kL2, bool kSnap, bool kFused>
void Loop(const AdamStepScalars& s, const AdamKernelArgs& a, const AdamFusedArgs* f) {
  const PreStepState in = PreStepFrom(a, f);
  [[maybe_unused]] const __m256 scale = _mm256_set1_ps(kFused ? f->grad_scale : 1.0f);
  const __m256 beta1 = _mm256_set1_ps(s.beta1);
  const __m256 one_minus_beta1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(s.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(s.eps);
  const __m256 l2 = _mm256_set1_ps(s.l2_weight_decay);
  const __m256 decay = _mm256_set1_ps(s.decay);
  const __m256 neg_step_size = _mm256_set1_ps(s.neg_step_size);
  const __m256 inv_sqrt_bias2 = _mm256_set1_ps(s.inv_sqrt_bias2);
  const size_t rounded_size = a.n - a.n % kLanes;
  for (size_t i = 0; i < rounded_size; i += kLanes) {
    __m256 p = _mm256_loadu_ps(in.p + i);
    __m256 m = _mm256_loadu_ps(in.m + i);
    __m256 v = _mm256_loadu_ps(in.v + i);
    if constexpr (kSnap) {
      _mm256_storeu_ps(a.snap_p + i, p);
      _mm256_storeu_ps(a.snap_m + i, m);
      _mm256_storeu_ps(a.snap_v + i, v);
    }
    __m256 g = LoadGrad8<kG>(a.g, i);
    if constexpr (kFused) g = _mm256_mul_ps(g, scale);
    if constexpr (kL2) g = _mm256_fmadd_ps(l2, p, g);
    m = _mm256_fmadd_ps(beta1, m, _mm256_mul_ps(one_minus_beta1, g));
    v = _mm256_fmadd_ps(beta2, v, _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
    __m256 vu = v;
    if constexpr (kAms) {
      __m256 vm = _mm256_loadu_ps(in.vmax + i);
      if constexpr (kSnap) _mm256_storeu_ps(a.snap_vmax + i, vm);
      vm = _mm256_max_ps(vm, v);
      _mm256_storeu_ps(a.vmax + i, vm);
      vu = vm;
    }
    const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(vu), inv_sqrt_bias2, eps);
    p = _mm256_fmadd_ps(neg_step_size, _mm256_div_ps(m, d), _mm256_mul_ps(p, decay));
    _mm256_storeu_ps(a.p + i, p);
    _mm256_storeu_ps(a.m + i, m);
    _mm256_storeu_ps(a.v + i, v);
    StoreOut8<kO>(a.out, i, p);
  }
  if constexpr (kFused) {
    RunFused(s, *f, rounded_size);
  } else {
    AdamScalarLoop<kG, kO, kAms, kL2, kSnap>(s, a, rounded_size, a.n);
  }
}

}  // namespace

void AdamKernelAvx2(const AdamStepScalars& s, const AdamKernelArgs& a) {
  DispatchAdam(a, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    Loop<decltype(gc)::value, decltype(oc)::value, decltype(ac)::value, decltype(lc)::value,
         decltype(sc)::value, false>(s, a, nullptr);
  });
}

void AdamFusedKernelAvx2(const AdamStepScalars& s, const AdamFusedArgs& f) {
  DispatchAdam(f.args, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    Loop<decltype(gc)::value, decltype(oc)::value, decltype(ac)::value, decltype(lc)::value,
         decltype(sc)::value, true>(s, f.args, &f);
  });
}

void ProbeKernelAvx2(float* p, const float* g, float* m, float* v, size_t n, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  const size_t rounded_size = n - n % kLanes;
  for (size_t i = 0; i < rounded_size; i += kLanes) {
    const __m256 mi = _mm256_loadu_ps(m + i);
    const __m256 vi = _mm256_loadu_ps(v + i);
    _mm256_storeu_ps(p + i, _mm256_fmadd_ps(sv, _mm256_loadu_ps(g + i), _mm256_loadu_ps(p + i)));
    _mm256_storeu_ps(m + i, _mm256_fmadd_ps(sv, vi, mi));
    _mm256_storeu_ps(v + i, _mm256_fmadd_ps(sv, mi, vi));
  }
  ProbeScalarLoop(p, g, m, v, rounded_size, n, s);
}

}  // namespace ucp::offload::internal
