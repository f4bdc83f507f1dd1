#include "ucp/tensor/cast.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "ucp/tensor/float_bits.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

// A format under test: how many codes a sign half has, how to decode, how to encode.
struct Format {
  const char* name;
  uint32_t num_positive_codes;  // codes 0 .. n-1 without the sign bit
  std::function<double(uint32_t)> decode;
  std::function<uint32_t(double)> encode;
  uint32_t overflow_code;  // what a magnitude past the largest finite rounds to (inf or NaN)
};

std::vector<Format> Formats() {
  return {
      {"fp16", 0x8000, [](uint32_t c) { return Fp16Format::ToDouble(c); },
       [](double v) { return Fp16Format::FromDouble(v); }, 0x7c00},
      {"bf16", 0x8000, [](uint32_t c) { return Bf16Format::ToDouble(c); },
       [](double v) { return Bf16Format::FromDouble(v); }, 0x7f80},
      {"fp8_e4m3", 0x80, [](uint32_t c) { return Fp8E4m3Format::ToDouble(c); },
       [](double v) { return Fp8E4m3Format::FromDouble(v); }, 0x7f},
      {"fp8_e5m2", 0x80, [](uint32_t c) { return Fp8E5m2Format::ToDouble(c); },
       [](double v) { return Fp8E5m2Format::FromDouble(v); }, 0x7c},
  };
}

// The finite positive codes in value order (positive codes are monotone in value).
std::vector<uint32_t> FinitePositive(const Format& f) {
  std::vector<uint32_t> codes;
  for (uint32_t c = 0; c < f.num_positive_codes; ++c) {
    if (std::isfinite(f.decode(c))) codes.push_back(c);
  }
  return codes;
}

// Round-to-nearest-even by search, independent of the encoder's bit tricks.
uint32_t ReferenceRound(const Format& f, const std::vector<uint32_t>& codes, double mag) {
  double max_val = f.decode(codes.back());
  double ulp_max = max_val - f.decode(codes[codes.size() - 2]);
  double beyond = max_val + ulp_max;  // where the overflow code would sit, unbounded
  if (mag >= beyond) return f.overflow_code;
  size_t lo = 0, hi = codes.size() - 1;
  if (mag >= max_val) {
    double dl = mag - max_val, dh = beyond - mag;
    if (dl < dh) return codes.back();
    if (dh < dl) return f.overflow_code;
    return (codes.back() & 1) ? f.overflow_code : codes.back();
  }
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    (f.decode(codes[mid]) <= mag ? lo : hi) = mid;
  }
  double dl = mag - f.decode(codes[lo]), dh = f.decode(codes[hi]) - mag;
  if (dl < dh) return codes[lo];
  if (dh < dl) return codes[hi];
  return (codes[lo] & 1) ? codes[hi] : codes[lo];
}

TEST(NarrowFloat, EveryCodeRoundTrips) {
  for (const Format& f : Formats()) {
    for (uint32_t sign : {0u, f.num_positive_codes}) {
      for (uint32_t c = 0; c < f.num_positive_codes; ++c) {
        double v = f.decode(c | sign);
        if (std::isnan(v)) {
          EXPECT_TRUE(std::isnan(f.decode(f.encode(v)))) << f.name << " code " << c;
          continue;
        }
        ASSERT_EQ(f.encode(v), c | sign) << f.name << " code " << c << " value " << v;
      }
    }
  }
}

TEST(NarrowFloat, MidpointsAndRandomValuesRoundToNearestEven) {
  std::mt19937_64 rng(42);
  for (const Format& f : Formats()) {
    std::vector<uint32_t> codes = FinitePositive(f);
    // Every midpoint between neighbours is a tie; a hair either side is not.
    for (size_t i = 0; i + 1 < codes.size(); ++i) {
      double a = f.decode(codes[i]), b = f.decode(codes[i + 1]);
      double mid = a + (b - a) / 2;
      for (double v : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, INFINITY)}) {
        ASSERT_EQ(f.encode(v), ReferenceRound(f, codes, v)) << f.name << " v=" << v;
        ASSERT_EQ(f.encode(-v), ReferenceRound(f, codes, v) | f.num_positive_codes) << f.name;
      }
    }
    double max_val = f.decode(codes.back());
    std::uniform_real_distribution<double> mant(1.0, 2.0);
    std::uniform_int_distribution<int> ex(-30, static_cast<int>(std::log2(max_val)) + 2);
    for (int i = 0; i < 20000; ++i) {
      double v = std::ldexp(mant(rng), ex(rng));
      ASSERT_EQ(f.encode(v), ReferenceRound(f, codes, v)) << f.name << " v=" << v;
    }
  }
}

TEST(NarrowFloat, SpecialValues) {
  EXPECT_EQ(HalfFromFloat(1.0f), 0x3c00);
  EXPECT_EQ(HalfFromFloat(65504.0f), 0x7bff);
  EXPECT_EQ(HalfFromFloat(65520.0f), 0x7c00);  // the tie past the largest finite goes to inf
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(HalfFromFloat(-0.0f), 0x8000);
  EXPECT_EQ(HalfFromFloat(INFINITY), 0x7c00);
  EXPECT_TRUE(std::isnan(FloatFromHalf(HalfFromFloat(NAN))));
  EXPECT_EQ(Fp8E4m3Format::FromDouble(448.0), 0x7eu);
  EXPECT_EQ(Fp8E4m3Format::FromDouble(464.0), 0x7eu);  // tie between 448 and the NaN slot
  EXPECT_EQ(Fp8E4m3Format::FromDouble(465.0), 0x7fu);  // past it: NaN, as torch does
  EXPECT_EQ(Fp8E4m3Format::FromDouble(INFINITY), 0x7fu);
  EXPECT_EQ(Fp8E5m2Format::FromDouble(57344.0), 0x7bu);
  EXPECT_EQ(Fp8E5m2Format::FromDouble(INFINITY), 0x7cu);
  EXPECT_EQ(Fp8E4m3Format::ToDouble(0x01), std::ldexp(1.0, -9));
}

TEST(Bf16, FastPathMatchesGenericOnEveryFloatClass) {
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &bits, 4);
    uint16_t fast = Bf16FromFloat(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(FloatFromBf16(fast)));
      continue;
    }
    ASSERT_EQ(fast, Bf16Format::FromDouble(f)) << std::hex << bits;
  }
  for (uint32_t c = 0; c < 0x10000; ++c) {
    double a = FloatFromBf16(static_cast<uint16_t>(c)), b = Bf16Format::ToDouble(c);
    ASSERT_TRUE((std::isnan(a) && std::isnan(b)) || a == b) << c;
  }
}

std::vector<std::byte> Encode(DType d, const std::vector<double>& values) {
  // Build the source through fp64 -> d, which the tests above pin down.
  std::vector<std::byte> f64(values.size() * 8), out(values.size() * static_cast<size_t>(DTypeSizeBytes(d)));
  std::memcpy(f64.data(), values.data(), f64.size());
  if (IsFloating(d)) {
    EXPECT_TRUE(CastElements(DType::kFp64, f64, d, out, static_cast<int64_t>(values.size())).ok());
  } else {
    std::vector<int64_t> ints(values.begin(), values.end());
    std::memcpy(f64.data(), ints.data(), f64.size());
    EXPECT_TRUE(CastElements(DType::kInt64, f64, d, out, static_cast<int64_t>(values.size())).ok());
  }
  return out;
}

TEST(CastElements, EveryPairPreservesSmallExactValues) {
  const std::vector<double> values = {0, 1, 0, 1, 1};  // representable in every dtype, bool too
  for (DType src : kAllDTypes) {
    for (DType dst : kAllDTypes) {
      std::vector<std::byte> in = Encode(src, values);
      std::vector<std::byte> out(values.size() * static_cast<size_t>(DTypeSizeBytes(dst)));
      Status s = CastElements(src, in, dst, out, static_cast<int64_t>(values.size()));
      if (IsFloating(src) && !IsFloating(dst)) {
        EXPECT_THAT(s, StatusIs(StatusCode::kUnimplemented, HasSubstr("not exact")));
        continue;
      }
      ASSERT_TRUE(s.ok()) << DTypeName(src) << "->" << DTypeName(dst) << ": " << s;
      EXPECT_EQ(out, Encode(dst, values)) << DTypeName(src) << "->" << DTypeName(dst);
    }
  }
}

TEST(CastElements, SameDTypeMovesBytes) {
  ::ucp::testing::Gen gen(3);
  for (DType d : kAllDTypes) {
    Tensor t = gen.RandomTensor(d, {257});
    std::vector<std::byte> out(static_cast<size_t>(t.num_bytes()));
    UCP_ASSERT_OK(CastElements(d, t.view().bytes, d, out, 257));
    EXPECT_EQ(std::memcmp(out.data(), t.data(), out.size()), 0) << DTypeName(d);
  }
}

TEST(CastElements, Errors) {
  std::vector<std::byte> in(8), out(2);
  EXPECT_THAT(CastElements(DType::kFp32, in, DType::kBf16, out, 2),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("buffers too small")));
  int32_t big = 300;
  std::vector<std::byte> b(4);
  std::memcpy(b.data(), &big, 4);
  std::vector<std::byte> o(1);
  EXPECT_THAT(CastElements(DType::kInt32, b, DType::kInt8, o, 1),
              StatusIs(StatusCode::kOutOfRange, HasSubstr("element 0 (300) does not fit")));
}

}  // namespace
}  // namespace ucp
