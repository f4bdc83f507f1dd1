// Internal to offload/optim: the scalar fp32 Adam element and the bit conversions, shared by the
// portable path and by each vector path's tail, so that the tail computes exactly what the
// vector body does.
//
// Everything here has internal linkage on purpose: each path's file is compiled with its own
// -m flags, and an inline function with external linkage could be emitted once with AVX-512
// instructions and then picked by the linker for the portable path. For the same reason this
// header calls compiler builtins only (no std:: inline functions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "offload/optim/adam.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {
namespace {

inline uint32_t BitsOf(float f) {
  uint32_t x;
  __builtin_memcpy(&x, &f, sizeof x);
  return x;
}
inline float FloatOf(uint32_t x) {
  float f;
  __builtin_memcpy(&f, &x, sizeof f);
  return f;
}

// bf16, round to nearest even; a NaN stays a quiet NaN with its top payload bits (as
// ucp::Bf16FromFloat, and as the vector stores).
inline uint16_t Bf16BitsRne(float f) {
  const uint32_t x = BitsOf(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// fp16, round to nearest even, subnormals produced, overflow to inf; a NaN becomes a quiet NaN
// with the top 10 payload bits (what F16C's vcvtps2ph and ucp::HalfFromFloat give).
inline uint16_t Fp16BitsRne(float f) {
  const uint32_t x = BitsOf(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (ax < 0x38800000u) {                // below 2^-14: the subnormal grid of 2^-24
    if (ax <= 0x33000000u) return sign;  // at most half of 2^-24: rounds to (even) zero
    const uint32_t e = ax >> 23;
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // value / 2^-24 == mant >> shift
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;  // may carry into the smallest normal
    return static_cast<uint16_t>(sign | h);
  }
  const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);  // a carry moves into the exponent
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}

// fp16 to fp32, exact; a NaN is quieted (as vcvtph2ps).
inline float FloatFromFp16Bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) {
    return FloatOf(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  }
  if (exp == 0) {
    // mant * 2^-24 is exact in fp32 (at most 10 significant bits times a power of two).
    return FloatOf(sign | BitsOf(static_cast<float>(mant) * 5.9604644775390625e-8f));
  }
  return FloatOf(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline float FloatFromBf16Bits(uint16_t h) { return FloatOf(static_cast<uint32_t>(h) << 16); }

// The larger of a and b, or b when either is NaN: the semantics of maxps(a, b) on x86 and of
// the NEON/SVE paths' compare-and-select, so that amsgrad agrees bitwise across paths.
inline float MaxLikeMaxps(float a, float b) { return a > b ? a : b; }

template <LowpDType kG>
inline float LoadGrad(const void* g, size_t i) {
  if constexpr (kG == LowpDType::kFp32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (kG == LowpDType::kBf16) {
    return FloatFromBf16Bits(static_cast<const uint16_t*>(g)[i]);
  } else {
    return FloatFromFp16Bits(static_cast<const uint16_t*>(g)[i]);
  }
}

template <LowpDType kO>
inline void StoreOut(uint16_t* out, size_t i, float p) {
  if constexpr (kO == LowpDType::kBf16) {
    out[i] = Bf16BitsRne(p);
  } else if constexpr (kO == LowpDType::kFp16) {
    out[i] = Fp16BitsRne(p);
  }
}

// One element of the canonical fp32 step (adam.h gives the formula). The vector bodies evaluate
// this expression lane-wise in the same order.
template <LowpDType kG, LowpDType kO, bool kAms, bool kL2, bool kSnap>
inline void AdamElement(const AdamStepScalars& s, const AdamKernelArgs& a, size_t i) {
  float p = a.p[i];
  float m = a.m[i];
  float v = a.v[i];
  if constexpr (kSnap) {
    a.snap_p[i] = p;
    a.snap_m[i] = m;
    a.snap_v[i] = v;
  }
  float g = LoadGrad<kG>(a.g, i);
  if constexpr (kL2) g = __builtin_fmaf(s.l2_weight_decay, p, g);
  m = __builtin_fmaf(s.beta1, m, s.one_minus_beta1 * g);
  v = __builtin_fmaf(s.beta2, v, (s.one_minus_beta2 * g) * g);
  float vu = v;
  if constexpr (kAms) {
    float vm = a.vmax[i];
    if constexpr (kSnap) a.snap_vmax[i] = vm;
    vm = MaxLikeMaxps(vm, v);
    a.vmax[i] = vm;
    vu = vm;
  }
  const float d = __builtin_fmaf(__builtin_sqrtf(vu), s.inv_sqrt_bias2, s.eps);
  p = __builtin_fmaf(s.neg_step_size, m / d, p * s.decay);
  a.p[i] = p;
  a.m[i] = m;
  a.v[i] = v;
  StoreOut<kO>(a.out, i, p);
}

// Calls f(grad_c, out_c, ams_c, l2_c, snap_c) with std::integral_constant arguments matching the
// run-time flags of `a`, so each path instantiates one tight loop per combination.
template <class F>
inline void DispatchAdam(const AdamKernelArgs& a, F&& f) {
  auto with_bool = [](bool b, auto&& k) {
    if (b) {
      k(std::true_type{});
    } else {
      k(std::false_type{});
    }
  };
  auto with_dtype = [](LowpDType d, auto&& k) {
    switch (d) {
      case LowpDType::kFp32:
        k(std::integral_constant<LowpDType, LowpDType::kFp32>{});
        break;
      case LowpDType::kBf16:
        k(std::integral_constant<LowpDType, LowpDType::kBf16>{});
        break;
      case LowpDType::kFp16:
        k(std::integral_constant<LowpDType, LowpDType::kFp16>{});
        break;
    }
  };
  with_dtype(a.grad_dtype, [&](auto gc) {
    with_dtype(a.out_dtype, [&](auto oc) {
      with_bool(a.amsgrad, [&](auto ac) {
        with_bool(a.l2,
                  [&](auto lc) { with_bool(a.snapshot, [&](auto sc) { f(gc, oc, ac, lc, sc); }); });
      });
    });
  });
}

// The scalar loop over [begin, end): the portable path's body and every vector path's tail.
template <LowpDType kG, LowpDType kO, bool kAms, bool kL2, bool kSnap>
inline void AdamScalarLoop(const AdamStepScalars& s, const AdamKernelArgs& a, size_t begin,
                           size_t end) {
  for (size_t i = begin; i < end; ++i) AdamElement<kG, kO, kAms, kL2, kSnap>(s, a, i);
}

inline void ProbeScalarLoop(float* p, const float* g, float* m, float* v, size_t begin, size_t end,
                            float s) {
  for (size_t i = begin; i < end; ++i) {
    const float mi = m[i];
    p[i] = p[i] + s * g[i];
    m[i] = mi + s * v[i];
    v[i] = v[i] + s * mi;
  }
}

}  // namespace
}  // namespace ucp::offload::internal
