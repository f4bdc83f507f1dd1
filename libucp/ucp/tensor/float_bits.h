// Bit-exact conversions between fp32/fp64 and the narrow float formats, round-to-nearest-even.
// Header-only so hot loops (the CPU Adam's fused bf16 write, casts) inline them.
//
// NaN rules: a NaN stays a NaN (quiet); fp16/bf16/e5m2 keep the top payload bits. fp8 e4m3fn
// (torch.float8_e4m3fn) has no infinity: values that round past 448 become NaN, as in torch.
// Overflow in the formats with infinity gives infinity. Subnormals are produced and read.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace ucp {

// --- bf16: the top half of an fp32.

inline uint16_t Bf16FromFloat(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  // Adding 0x7fff plus the lowest kept bit rounds half to even; a carry moves into the exponent,
  // which is exactly right (and gives inf past the largest finite bf16).
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float FloatFromBf16(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

// --- Generic IEEE-like narrow floats with kExp exponent bits and kMant mantissa bits.

enum class NarrowKind { kIeee, kFn };  // kFn: no inf, only S.1111.111 is NaN (e4m3fn)

template <int kExp, int kMant, NarrowKind kKind>
struct NarrowFloat {
  static constexpr int kBias = (1 << (kExp - 1)) - 1;
  static constexpr uint32_t kExpMask = (1u << kExp) - 1;
  static constexpr uint32_t kSignBit = 1u << (kExp + kMant);
  static constexpr uint32_t kInfCode = kExpMask << kMant;  // kIeee only
  static constexpr uint32_t kNanCode = kKind == NarrowKind::kFn ? (kInfCode | ((1u << kMant) - 1))
                                                                : (kInfCode | (1u << (kMant - 1)));
  // The largest finite magnitude code: below inf for kIeee, one below the NaN code for kFn.
  static constexpr uint32_t kMaxFinite = kKind == NarrowKind::kFn ? kNanCode - 1 : kInfCode - 1;

  // Encodes a double (exactly representing any fp32 input), round-to-nearest-even.
  static uint32_t FromDouble(double v) {
    uint64_t x = std::bit_cast<uint64_t>(v);
    uint32_t sign = (x >> 63) ? kSignBit : 0u;
    uint64_t ax = x & 0x7fffffffffffffffull;
    if (ax > 0x7ff0000000000000ull) {
      if constexpr (kKind == NarrowKind::kFn) return sign | kNanCode;
      return sign | kNanCode | static_cast<uint32_t>((ax >> (52 - kMant)) & ((1u << kMant) - 1));
    }
    if (ax == 0x7ff0000000000000ull) {
      return sign | (kKind == NarrowKind::kFn ? kNanCode : kInfCode);
    }
    int exp = static_cast<int>(ax >> 52) - 1023;
    if (exp > kBias + 2) return sign | Overflow();  // far beyond range; avoids shifting below
    uint64_t mant = (ax & 0xfffffffffffffull) | (1ull << 52);  // 53 significant bits
    // Number of low bits of `mant` to drop: normal results keep kMant fraction bits; results
    // below the smallest normal (exp < 1 - kBias) drop more, to land on the subnormal grid.
    int drop = 52 - kMant;
    uint64_t code_hi;  // the exponent field contribution
    if (exp >= 1 - kBias) {
      code_hi = static_cast<uint64_t>(exp + kBias) << kMant;
      mant &= (1ull << 52) - 1;  // the implicit bit is carried by the exponent field
    } else {
      drop += (1 - kBias) - exp;
      code_hi = 0;
      if (drop > 60) return sign;  // far below half the smallest subnormal
    }
    uint64_t kept = mant >> drop;
    uint64_t rem = mant & ((1ull << drop) - 1);
    uint64_t halfway = 1ull << (drop - 1);
    uint64_t code = code_hi + kept;
    if (rem > halfway || (rem == halfway && (kept & 1))) code += 1;  // a carry bumps the exponent
    if (code > kMaxFinite) return sign | Overflow();
    return sign | static_cast<uint32_t>(code);
  }

  static double ToDouble(uint32_t code) {
    bool neg = (code & kSignBit) != 0;
    uint32_t exp = (code >> kMant) & kExpMask;
    uint32_t mant = code & ((1u << kMant) - 1);
    double mag;
    if (kKind == NarrowKind::kIeee && exp == kExpMask) {
      mag = mant ? std::nan("") : INFINITY;
    } else if (kKind == NarrowKind::kFn && (code & ~kSignBit) == kNanCode) {
      mag = std::nan("");
    } else if (exp == 0) {
      mag = std::ldexp(static_cast<double>(mant), 1 - kBias - kMant);
    } else {
      mag = std::ldexp(static_cast<double>(mant | (1u << kMant)), static_cast<int>(exp) - kBias - kMant);
    }
    return neg ? -mag : mag;
  }

 private:
  static constexpr uint32_t Overflow() { return kKind == NarrowKind::kFn ? kNanCode : kInfCode; }
};

using Fp16Format = NarrowFloat<5, 10, NarrowKind::kIeee>;
using Fp8E4m3Format = NarrowFloat<4, 3, NarrowKind::kFn>;
using Fp8E5m2Format = NarrowFloat<5, 2, NarrowKind::kIeee>;
using Bf16Format = NarrowFloat<8, 7, NarrowKind::kIeee>;  // for fp64 sources (no double rounding)

inline uint16_t HalfFromFloat(float f) { return static_cast<uint16_t>(Fp16Format::FromDouble(f)); }
inline float FloatFromHalf(uint16_t h) { return static_cast<float>(Fp16Format::ToDouble(h)); }

}  // namespace ucp
