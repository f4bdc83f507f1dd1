// Tests of AdamStep: every path this machine runs against the fp64 reference (error bounds
// derived in docs/offload.md), all fp32 paths bitwise equal to each other, the fused bf16/fp16
// copy equal to ucp's RNE conversion of the path's own fp32 result, span and config validation,
// and the speculative step + rollback (bitwise).
#include "offload/optim/adam.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "offload/optim/adam_element.h"
#include "tests/testutil/status_matchers.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

constexpr double kU = 0x1p-24;  // fp32 unit roundoff

const size_t kSizes[] = {0, 1, 7, 15, 16, 17, 31, 33, 1023, 1025, (size_t{1} << 20) + 3};

std::vector<SimdPath> FastPaths() {
  std::vector<SimdPath> out;
  for (SimdPath p :
       {SimdPath::kPortable, SimdPath::kAvx2, SimdPath::kAvx512, SimdPath::kNeon, SimdPath::kSve}) {
    if (SimdPathAvailable(p)) out.push_back(p);
  }
  return out;
}

// Adam state plus gradients in all three dtypes, from one seed.
struct Problem {
  std::vector<float> p, m, v, vmax, g32;
  std::vector<uint16_t> g16;  // bf16 or fp16 bits of g32 (g32 holds their exact value)
  std::vector<uint16_t> out;

  Problem(size_t n, uint64_t seed, LowpDType grad_dtype, bool zero_state) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> log_mag(-6.f, 1.f);
    p.resize(n);
    m.resize(n);
    v.resize(n);
    vmax.resize(n);
    g32.resize(n);
    g16.resize(n);
    out.assign(n, 0xdead);
    for (size_t i = 0; i < n; ++i) {
      p[i] = normal(rng) * std::pow(10.f, log_mag(rng) / 2);
      float g = normal(rng) * std::pow(10.f, log_mag(rng));
      if (grad_dtype == LowpDType::kBf16) {
        g16[i] = Bf16FromFloat(g);
        g = FloatFromBf16(g16[i]);
      } else if (grad_dtype == LowpDType::kFp16) {
        g16[i] = HalfFromFloat(g);
        g = FloatFromHalf(g16[i]);
      }
      g32[i] = g;
      if (zero_state) {
        m[i] = v[i] = vmax[i] = 0.f;
      } else {
        m[i] = 0.1f * g + 0.01f * normal(rng);
        v[i] = std::abs(g * g * (1.f + normal(rng))) + 1e-12f;
        vmax[i] = v[i] * (i % 3 == 0 ? 2.f : 0.5f);
      }
    }
  }

  AdamSpans Spans(const AdamConfig& c, LowpDType grad_dtype, LowpDType out_dtype) {
    AdamSpans s;
    s.param = p;
    s.exp_avg = m;
    s.exp_avg_sq = v;
    if (c.amsgrad) s.max_exp_avg_sq = vmax;
    s.grad = grad_dtype == LowpDType::kFp32   ? GradSpan::Fp32(g32)
             : grad_dtype == LowpDType::kBf16 ? GradSpan::Bf16(g16)
                                              : GradSpan::Fp16(g16);
    if (out_dtype != LowpDType::kFp32) s.out = {out_dtype, out};
    return s;
  }
};

// Distance in units in the last place between two bf16/fp16 codes of the same format.
int64_t CodeDistance(uint16_t a, uint16_t b) {
  auto ordered = [](uint16_t c) -> int64_t {
    return (c & 0x8000) ? -static_cast<int64_t>(c & 0x7fff) : static_cast<int64_t>(c);
  };
  return std::abs(ordered(a) - ordered(b));
}

struct Case {
  std::string name;
  AdamConfig config;
  int64_t step;
  bool zero_state;
};

std::vector<Case> Cases() {
  AdamConfig adamw;
  adamw.lr = 1e-3f;
  adamw.weight_decay = 0.1f;
  AdamConfig l2 = adamw;
  l2.decoupled = false;
  l2.weight_decay = 0.01f;
  AdamConfig no_bias = adamw;
  no_bias.bias_correction = false;
  AdamConfig ams = adamw;
  ams.amsgrad = true;
  AdamConfig plain;  // Adam, no weight decay
  return {{"adamw_step1", adamw, 1, true},  {"adamw_step1000", adamw, 1000, false},
          {"l2_step7", l2, 7, false},       {"no_bias_correction", no_bias, 3, false},
          {"amsgrad_step5", ams, 5, false}, {"adam_step2", plain, 2, false}};
}

// Checks `got` (a fast path's result) against `ref` (the fp64 reference) element by element with
// the bounds of docs/offload.md, recomputing each element's scales in double from `before`.
void ExpectWithinBounds(const AdamConfig& c, int64_t step, const Problem& before,
                        const Problem& ref, const Problem& got, LowpDType out_dtype,
                        int64_t* codes_off_by_more) {
  const double b1 = c.beta1, b2 = c.beta2;
  const double bias1 = c.bias_correction ? 1 - std::pow(b1, double(step)) : 1;
  const double bias2 = c.bias_correction ? 1 - std::pow(b2, double(step)) : 1;
  const double step_size = c.lr / bias1;
  int reported = 0;
  for (size_t i = 0; i < before.p.size() && reported < 5; ++i) {
    double g = before.g32[i];
    if (!c.decoupled) g += double(c.weight_decay) * before.p[i];
    const double scale_m = std::abs(b1 * before.m[i]) + std::abs((1 - b1) * g);
    const double scale_v = std::abs(b2 * before.v[i]) + std::abs((1 - b2) * g * g);
    const double v_used = c.amsgrad ? std::max<double>(ref.vmax[i], ref.v[i]) : ref.v[i];
    const double d = std::sqrt(v_used) / std::sqrt(bias2) + c.eps;
    const double tol_m = 5 * kU * scale_m;
    const double tol_v = 5 * kU * scale_v;
    const double tol_p =
        3 * kU * (std::abs(before.p[i]) + std::abs(ref.p[i])) + 16 * kU * step_size * scale_m / d;
    bool bad = std::abs(double(got.m[i]) - ref.m[i]) > tol_m ||
               std::abs(double(got.v[i]) - ref.v[i]) > tol_v ||
               std::abs(double(got.p[i]) - ref.p[i]) > tol_p;
    if (c.amsgrad) bad = bad || std::abs(double(got.vmax[i]) - ref.vmax[i]) > tol_v;
    if (out_dtype != LowpDType::kFp32) {
      const uint16_t own =
          out_dtype == LowpDType::kBf16 ? Bf16FromFloat(got.p[i]) : HalfFromFloat(got.p[i]);
      // Exact: the copy is RNE of the path's own fp32 result. Bounded: that result is within
      // tol_p of the reference, so the copy is within tol_p + one low-precision ulp of it (the
      // codes differ by at most 1 unless the fp32 update cancelled, |p_new| << |p|).
      const bool bf16 = out_dtype == LowpDType::kBf16;
      const double out_value = bf16 ? FloatFromBf16(got.out[i]) : FloatFromHalf(got.out[i]);
      int e = 0;
      std::frexp(ref.p[i], &e);
      const double lowp_ulp =
          bf16 ? std::ldexp(1.0, e - 8) : std::max(std::ldexp(1.0, e - 11), 0x1p-24);
      bad = bad || got.out[i] != own || std::abs(out_value - ref.p[i]) > tol_p + lowp_ulp;
      if (CodeDistance(got.out[i], ref.out[i]) > 1) ++*codes_off_by_more;
    }
    if (bad) {
      ++reported;
      ADD_FAILURE() << "element " << i << ": p " << got.p[i] << " vs ref " << ref.p[i] << " (tol "
                    << tol_p << "), m " << got.m[i] << " vs " << ref.m[i] << " (tol " << tol_m
                    << "), v " << got.v[i] << " vs " << ref.v[i] << " (tol " << tol_v << "), out "
                    << got.out[i] << " vs ref " << ref.out[i];
    }
  }
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST(AdamStep, AllPathsAgainstReferenceAndEachOther) {
  std::vector<SimdPath> paths = FastPaths();
  std::string ran;
  for (SimdPath p : paths) ran += std::string(SimdPathName(p)) + " ";
  RecordProperty("paths", ran);
  std::cout << "[ paths    ] " << ran << "\n";
  ASSERT_FALSE(paths.empty());
  const auto cases = Cases();
  int64_t codes_off_by_more = 0;  // low-precision copies more than 1 code from the reference's
  int64_t outs_checked = 0;
  for (size_t n : kSizes) {
    const bool big = n > 100000;
    for (const Case& cs : cases) {
      if (big && cs.name != "adamw_step1000" && cs.name != "amsgrad_step5") continue;
      for (LowpDType gd : {LowpDType::kFp32, LowpDType::kBf16, LowpDType::kFp16}) {
        for (LowpDType od : {LowpDType::kFp32, LowpDType::kBf16, LowpDType::kFp16}) {
          SCOPED_TRACE(cs.name + " n=" + std::to_string(n) + " grad=" +
                       std::string(LowpDTypeName(gd)) + " out=" + std::string(LowpDTypeName(od)));
          const uint64_t seed = n * 131 + static_cast<uint64_t>(gd) * 7 + static_cast<uint64_t>(od);
          const Problem before(n, seed, gd, cs.zero_state);
          Problem ref = before;
          UCP_ASSERT_OK(
              AdamStep(cs.config, cs.step, ref.Spans(cs.config, gd, od), SimdPath::kScalarRef));
          Problem first = before;
          for (size_t k = 0; k < paths.size(); ++k) {
            SCOPED_TRACE(std::string(SimdPathName(paths[k])));
            Problem got = before;
            UCP_ASSERT_OK(AdamStep(cs.config, cs.step, got.Spans(cs.config, gd, od), paths[k]));
            ExpectWithinBounds(cs.config, cs.step, before, ref, got, od, &codes_off_by_more);
            outs_checked += od == LowpDType::kFp32 ? 0 : static_cast<int64_t>(n);
            if (k == 0) {
              first = got;
            } else {
              EXPECT_TRUE(SameBits(got.p, first.p) && SameBits(got.m, first.m) &&
                          SameBits(got.v, first.v) && SameBits(got.vmax, first.vmax) &&
                          got.out == first.out)
                  << SimdPathName(paths[k]) << " differs bitwise from " << SimdPathName(paths[0]);
            }
          }
        }
      }
    }
  }
  std::cout << "[ lowp     ] " << codes_off_by_more << " of " << outs_checked
            << " bf16/fp16 copies are more than 1 code from the reference's (cancellation)\n";
  // Cancellation is rare with these data; a systematic rounding bug would hit most elements.
  EXPECT_LT(codes_off_by_more * 10000, outs_checked);
}

TEST(AdamStep, WeightDecayModesDiffer) {
  // Decoupled and L2 decay must give different params once wd != 0, and equal ones when wd = 0.
  for (float wd : {0.0f, 0.1f}) {
    AdamConfig w;
    w.weight_decay = wd;
    AdamConfig l2 = w;
    l2.decoupled = false;
    Problem a(257, 5, LowpDType::kFp32, false);
    Problem b = a;
    UCP_ASSERT_OK(AdamStep(w, 3, a.Spans(w, LowpDType::kFp32, LowpDType::kFp32)));
    UCP_ASSERT_OK(AdamStep(l2, 3, b.Spans(l2, LowpDType::kFp32, LowpDType::kFp32)));
    EXPECT_EQ(SameBits(a.p, b.p), wd == 0.0f) << "wd " << wd;
  }
}

TEST(AdamStep, BiasCorrectionOffEqualsLargeStep) {
  // With beta^t -> 0 the bias corrections are 1 in fp32 and both configurations agree bitwise.
  AdamConfig on;
  AdamConfig off = on;
  off.bias_correction = false;
  Problem a(100, 9, LowpDType::kFp32, false);
  Problem b = a;
  UCP_ASSERT_OK(AdamStep(on, 100000, a.Spans(on, LowpDType::kFp32, LowpDType::kFp32)));
  UCP_ASSERT_OK(AdamStep(off, 1, b.Spans(off, LowpDType::kFp32, LowpDType::kFp32)));
  EXPECT_TRUE(SameBits(a.p, b.p));
  Problem c = b;
  UCP_ASSERT_OK(AdamStep(on, 1, c.Spans(on, LowpDType::kFp32, LowpDType::kFp32)));
  EXPECT_FALSE(SameBits(b.p, c.p));
}

TEST(AdamStep, FirstStepMovesEachWeightByAboutLr) {
  // Step 1 from zero state: m_hat / sqrt(v_hat) = sign(g), so |dp| = lr up to eps.
  AdamConfig c;
  c.lr = 0.01f;
  c.eps = 0.0f;
  Problem a(64, 3, LowpDType::kFp32, true);
  Problem before = a;
  UCP_ASSERT_OK(AdamStep(c, 1, a.Spans(c, LowpDType::kFp32, LowpDType::kFp32)));
  for (size_t i = 0; i < a.p.size(); ++i) {
    EXPECT_NEAR(before.p[i] - a.p[i], before.g32[i] > 0 ? 0.01 : -0.01, 1e-6) << i;
  }
}

TEST(AdamStep, RejectsBadConfig) {
  Problem a(4, 1, LowpDType::kFp32, false);
  AdamConfig c;
  c.beta1 = 1.0f;
  EXPECT_THAT(AdamStep(c, 1, a.Spans(c, LowpDType::kFp32, LowpDType::kFp32)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("beta1 is 1.0")));
  c = {};
  c.beta2 = -0.5f;
  EXPECT_THAT(ValidateAdamConfig(c),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("beta2 is -0.5")));
  c = {};
  c.lr = NAN;
  EXPECT_THAT(ValidateAdamConfig(c), StatusIs(StatusCode::kInvalidArgument, HasSubstr("lr is")));
  c = {};
  c.weight_decay = -1.0f;
  EXPECT_THAT(ValidateAdamConfig(c),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("weight_decay is -1")));
  c = {};
  c.eps = INFINITY;
  EXPECT_THAT(ValidateAdamConfig(c), StatusIs(StatusCode::kInvalidArgument, HasSubstr("eps is")));
  c = {};
  EXPECT_THAT(AdamStep(c, 0, a.Spans(c, LowpDType::kFp32, LowpDType::kFp32)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("adam step is 0")));
}

TEST(AdamStep, RejectsBadSpans) {
  AdamConfig c;
  Problem a(8, 1, LowpDType::kFp32, false);
  AdamSpans s = a.Spans(c, LowpDType::kFp32, LowpDType::kFp32);
  AdamSpans bad = s;
  bad.exp_avg = bad.exp_avg.first(7);
  EXPECT_THAT(AdamStep(c, 1, bad), StatusIs(StatusCode::kInvalidArgument,
                                            HasSubstr("exp_avg has 7 elements, param has 8")));
  bad = s;
  bad.grad = GradSpan::Fp32(std::span<const float>(a.g32).first(3));
  EXPECT_THAT(AdamStep(c, 1, bad),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("grad has 3 elements")));
  bad = s;
  bad.exp_avg_sq = std::span<float>(a.m);  // the same memory as exp_avg
  EXPECT_THAT(AdamStep(c, 1, bad),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("exp_avg and exp_avg_sq overlap")));
  bad = s;
  bad.out = LowpOutSpan{LowpDType::kFp32, a.out};
  EXPECT_THAT(AdamStep(c, 1, bad),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("out dtype is fp32")));
  bad = s;
  bad.max_exp_avg_sq = a.vmax;
  EXPECT_THAT(AdamStep(c, 1, bad), StatusIs(StatusCode::kInvalidArgument,
                                            HasSubstr("max_exp_avg_sq given but amsgrad is off")));
  AdamConfig ams;
  ams.amsgrad = true;
  EXPECT_THAT(AdamStep(ams, 1, s),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("amsgrad is on but max_exp_avg_sq is empty")));
  // Nothing was written by the rejected calls.
  const Problem fresh(8, 1, LowpDType::kFp32, false);
  EXPECT_TRUE(SameBits(a.p, fresh.p) && SameBits(a.m, fresh.m) && SameBits(a.v, fresh.v));
}

TEST(AdamStep, UnavailablePathIsFailedPrecondition) {
  Problem a(8, 1, LowpDType::kFp32, false);
  AdamConfig c;
  int tried = 0;
  for (SimdPath p : {SimdPath::kAvx2, SimdPath::kAvx512, SimdPath::kNeon, SimdPath::kSve}) {
    if (SimdPathAvailable(p)) continue;
    ++tried;
    EXPECT_THAT(AdamStep(c, 1, a.Spans(c, LowpDType::kFp32, LowpDType::kFp32), p),
                StatusIs(StatusCode::kFailedPrecondition,
                         HasSubstr("simd path " + std::string(SimdPathName(p)))));
  }
  EXPECT_GE(tried, 1);  // no CPU has both the x86 and the Arm paths
}

TEST(SimdPath, NamesRoundTripAndBestIsAvailable) {
  for (SimdPath p : {SimdPath::kScalarRef, SimdPath::kPortable, SimdPath::kAvx2, SimdPath::kAvx512,
                     SimdPath::kNeon, SimdPath::kSve}) {
    UCP_ASSERT_OK_AND_ASSIGN(SimdPath q, ParseSimdPath(SimdPathName(p)));
    EXPECT_EQ(p, q);
  }
  EXPECT_THAT(ParseSimdPath("avx3"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("'avx3' is not one of")));
  EXPECT_TRUE(SimdPathAvailable(BestSimdPath()));
  EXPECT_NE(BestSimdPath(), SimdPath::kScalarRef);
}

TEST(AdamRollback, SpeculativeStepThenRollbackIsBitwiseIdentity) {
  for (SimdPath path : FastPaths()) {
    for (bool amsgrad : {false, true}) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{33}, size_t{1025}}) {
        SCOPED_TRACE(std::string(SimdPathName(path)) + " n=" + std::to_string(n) +
                     (amsgrad ? " amsgrad" : ""));
        AdamConfig c;
        c.amsgrad = amsgrad;
        c.weight_decay = 0.05f;
        Problem nan_grad(n, 77 + n, LowpDType::kBf16, false);
        if (n > 0) nan_grad.g16[0] = 0x7fc0;  // a NaN gradient: rollback must still be exact
        const Problem before = nan_grad;
        Problem spec = before;
        Problem plain = before;
        std::vector<float> sp(n), sm(n), sv(n), svmax(n);
        AdamSnapshot snap{sp, sm, sv, amsgrad ? std::span<float>(svmax) : std::span<float>()};
        UCP_ASSERT_OK(AdamStepSpeculative(c, 4, spec.Spans(c, LowpDType::kBf16, LowpDType::kBf16),
                                          snap, path));
        UCP_ASSERT_OK(AdamStep(c, 4, plain.Spans(c, LowpDType::kBf16, LowpDType::kBf16), path));
        // The speculative step is the plain step, plus a copy of the old values.
        EXPECT_TRUE(SameBits(spec.p, plain.p) && SameBits(spec.m, plain.m) &&
                    SameBits(spec.v, plain.v) && SameBits(spec.vmax, plain.vmax));
        EXPECT_TRUE(SameBits(sp, before.p) && SameBits(sm, before.m) && SameBits(sv, before.v));
        if (n > 0) {
          EXPECT_FALSE(SameBits(spec.p, before.p));
        }
        UCP_ASSERT_OK(AdamRollback(spec.Spans(c, LowpDType::kBf16, LowpDType::kBf16), snap));
        EXPECT_TRUE(SameBits(spec.p, before.p));
        EXPECT_TRUE(SameBits(spec.m, before.m));
        EXPECT_TRUE(SameBits(spec.v, before.v));
        EXPECT_TRUE(SameBits(spec.vmax, before.vmax));
      }
    }
  }
}

TEST(AdamRollback, RollbackThenClippedStepEqualsClippedStep) {
  // The STV replay: speculate with raw grads, roll back, step with clipped grads; the result is
  // the direct clipped step, bitwise.
  AdamConfig c;
  const size_t n = 1000;
  const Problem before(n, 4, LowpDType::kFp32, false);
  Problem clipped_grads = before;
  for (float& g : clipped_grads.g32) g *= 0.25f;
  Problem direct = clipped_grads;
  UCP_ASSERT_OK(AdamStep(c, 9, direct.Spans(c, LowpDType::kFp32, LowpDType::kBf16)));
  Problem replay = before;
  std::vector<float> sp(n), sm(n), sv(n);
  AdamSnapshot snap{sp, sm, sv, {}};
  UCP_ASSERT_OK(
      AdamStepSpeculative(c, 9, replay.Spans(c, LowpDType::kFp32, LowpDType::kBf16), snap));
  UCP_ASSERT_OK(AdamRollback(replay.Spans(c, LowpDType::kFp32, LowpDType::kBf16), snap));
  replay.g32 = clipped_grads.g32;
  UCP_ASSERT_OK(AdamStep(c, 9, replay.Spans(c, LowpDType::kFp32, LowpDType::kBf16)));
  EXPECT_TRUE(SameBits(replay.p, direct.p) && SameBits(replay.m, direct.m) &&
              SameBits(replay.v, direct.v) && replay.out == direct.out);
}

TEST(AdamRollback, RejectsMismatchedSnapshot) {
  AdamConfig c;
  Problem a(8, 1, LowpDType::kFp32, false);
  std::vector<float> sp(8), sm(7), sv(8);
  AdamSnapshot snap{sp, sm, sv, {}};
  EXPECT_THAT(
      AdamRollback(a.Spans(c, LowpDType::kFp32, LowpDType::kFp32), snap),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("exp_avg has 8 elements, its snapshot 7")));
  EXPECT_THAT(AdamStepSpeculative(c, 1, a.Spans(c, LowpDType::kFp32, LowpDType::kFp32), snap),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("snapshot.exp_avg has 7 elements, param has 8")));
  std::vector<float> sm8(8);
  AdamSnapshot aliased{sp, sm8, std::span<float>(a.m), {}};
  EXPECT_THAT(
      AdamStepSpeculative(c, 1, a.Spans(c, LowpDType::kFp32, LowpDType::kFp32), aliased),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("exp_avg and snapshot.exp_avg_sq overlap")));
}

// The scalar conversions every path's tail uses, against ucp's float_bits.h.
TEST(AdamConversions, Fp16AndBf16MatchFloatBits) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float a = internal::FloatFromFp16Bits(static_cast<uint16_t>(h));
    const float b = FloatFromHalf(static_cast<uint16_t>(h));
    if (std::isnan(b)) {
      ASSERT_TRUE(std::isnan(a)) << h;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(a), std::bit_cast<uint32_t>(b)) << h;
    }
  }
  std::mt19937_64 rng(1);
  std::vector<uint32_t> bits = {0u,          0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                                0x477fe000u, 0x477ff000u, 0x477fefffu, 0x38800000u, 0x387fffffu,
                                0x33000000u, 0x33000001u, 0x33800000u, 0x387fe000u, 0x7f7fffffu};
  for (int i = 0; i < 1 << 20; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  // Dense around the fp16 subnormal and overflow boundaries.
  for (uint32_t x = 0x33000000u; x < 0x39000000u; x += 0x1f3u) bits.push_back(x);
  for (uint32_t x = 0x477f0000u; x < 0x47800100u; x += 7u) bits.push_back(x);
  for (uint32_t x : bits) {
    const float f = std::bit_cast<float>(x);
    ASSERT_EQ(internal::Fp16BitsRne(f), HalfFromFloat(f)) << std::hex << x;
    ASSERT_EQ(internal::Bf16BitsRne(f), Bf16FromFloat(f)) << std::hex << x;
  }
}

}  // namespace
}  // namespace ucp::offload
