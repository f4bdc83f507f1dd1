// The NEON and SVE kernels against the shared scalar fp32 element (the portable path's body),
// bitwise, for every size of the list up to 1025, fp32/bf16/fp16 grads and outputs,
// amsgrad, L2 vs decoupled decay, and with the speculative snapshot. Cross-compiled with
// aarch64-linux-gnu-g++ and run under qemu-aarch64 (at two SVE vector lengths) on x86 hosts;
// see offload/CMakeLists.txt. It calls the kernels directly: adam.cc's checks and threading are
// covered by adam_test.cc on the host.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "offload/optim/adam_element.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {
namespace {

using Kernel = void (*)(const AdamStepScalars&, const AdamKernelArgs&);

struct State {
  std::vector<float> p, m, v, vmax, sp, sm, sv, svmax;
  std::vector<uint16_t> out;
};

State Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  State s;
  for (size_t i = 0; i < n; ++i) {
    s.p.push_back(0.02f * normal(rng));
    s.m.push_back(1e-3f * normal(rng));
    const float x = 1e-3f * normal(rng);
    s.v.push_back(x * x);
    s.vmax.push_back(x * x * (i % 2 ? 2.f : 0.5f));  // half the lanes take the new v
  }
  s.sp = s.sm = s.sv = s.svmax = std::vector<float>(n, -1.f);
  s.out = std::vector<uint16_t>(n, 0xffff);
  return s;
}

AdamKernelArgs Args(State& s, const void* g, LowpDType gd, LowpDType od, bool ams, bool l2,
                    bool snap) {
  AdamKernelArgs a;
  a.p = s.p.data();
  a.g = g;
  a.m = s.m.data();
  a.v = s.v.data();
  a.vmax = ams ? s.vmax.data() : nullptr;
  a.out = od == LowpDType::kFp32 ? nullptr : s.out.data();
  if (snap) {
    a.snap_p = s.sp.data();
    a.snap_m = s.sm.data();
    a.snap_v = s.sv.data();
    a.snap_vmax = ams ? s.svmax.data() : nullptr;
  }
  a.n = s.p.size();
  a.grad_dtype = gd;
  a.out_dtype = od;
  a.amsgrad = ams;
  a.l2 = l2;
  a.snapshot = snap;
  return a;
}

template <class T>
bool Same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void Scalar(const AdamStepScalars& s, const AdamKernelArgs& a) {
  DispatchAdam(a, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    AdamScalarLoop<decltype(gc)::value, decltype(oc)::value, decltype(ac)::value,
                   decltype(lc)::value, decltype(sc)::value>(s, a, 0, a.n);
  });
}

void CheckKernel(Kernel kernel) {
  // Step 10 of AdamW/Adam with lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
  AdamStepScalars base{};
  base.beta1 = 0.9f;
  base.one_minus_beta1 = static_cast<float>(1.0 - 0.9f);
  base.beta2 = 0.999f;
  base.one_minus_beta2 = static_cast<float>(1.0 - 0.999f);
  base.eps = 1e-8f;
  base.neg_step_size = static_cast<float>(-1e-3 / (1.0 - 0.34867844010946517));
  base.inv_sqrt_bias2 = static_cast<float>(1.0 / 0.09955128752003495);
  for (size_t n : {0, 1, 7, 15, 16, 17, 31, 33, 1023, 1025}) {
    for (LowpDType gd : {LowpDType::kFp32, LowpDType::kBf16, LowpDType::kFp16}) {
      for (LowpDType od : {LowpDType::kFp32, LowpDType::kBf16, LowpDType::kFp16}) {
        for (int flags = 0; flags < 8; ++flags) {
          const bool ams = flags & 1, l2 = flags & 2, snap = flags & 4;
          SCOPED_TRACE("n " + std::to_string(n) + " grad " + std::to_string(int(gd)) + " out " +
                       std::to_string(int(od)) + " flags " + std::to_string(flags));
          AdamStepScalars s = base;
          s.amsgrad = ams;
          s.l2_weight_decay = l2 ? 0.01f : 0.f;
          s.decay = l2 ? 1.f : static_cast<float>(1.0 - 1e-3 * 0.01);
          std::mt19937_64 rng(n * 131 + flags);
          std::normal_distribution<float> normal(0.f, 1e-2f);
          std::vector<float> g32(n);
          std::vector<uint16_t> g16(n);
          for (size_t i = 0; i < n; ++i) {
            g32[i] = normal(rng);
            g16[i] = gd == LowpDType::kBf16 ? Bf16BitsRne(g32[i]) : Fp16BitsRne(g32[i]);
          }
          const void* g = gd == LowpDType::kFp32 ? static_cast<const void*>(g32.data())
                                                 : static_cast<const void*>(g16.data());
          State want = Random(n, n + 7);
          State got = want;
          const State before = want;
          Scalar(s, Args(want, g, gd, od, ams, l2, snap));
          kernel(s, Args(got, g, gd, od, ams, l2, snap));
          EXPECT_TRUE(Same(got.p, want.p));
          EXPECT_TRUE(Same(got.m, want.m));
          EXPECT_TRUE(Same(got.v, want.v));
          EXPECT_TRUE(Same(got.vmax, want.vmax));
          EXPECT_TRUE(Same(got.out, want.out));
          EXPECT_TRUE(Same(got.sp, want.sp));
          EXPECT_TRUE(Same(got.sm, want.sm));
          EXPECT_TRUE(Same(got.sv, want.sv));
          EXPECT_TRUE(Same(got.svmax, want.svmax));
          if (n > 0) {
            EXPECT_FALSE(Same(got.p, before.p));  // the step did something
          }
          if (snap && n > 0) {
            EXPECT_TRUE(Same(got.sp, before.p));
          }
        }
      }
    }
  }
}

void CheckProbe(void (*probe)(float*, const float*, float*, float*, size_t, float)) {
  for (size_t n : {0, 1, 7, 17, 1025}) {
    State s = Random(n, n);
    const State before = s;
    std::vector<float> g(n, 3.f);
    probe(s.p.data(), g.data(), s.m.data(), s.v.data(), n, 0.f);
    EXPECT_TRUE(Same(s.p, before.p) && Same(s.m, before.m) && Same(s.v, before.v)) << n;
    probe(s.p.data(), g.data(), s.m.data(), s.v.data(), n, 1.f);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(s.p[i], before.p[i] + 3.f) << i;
      ASSERT_EQ(s.m[i], before.m[i] + before.v[i]) << i;
      ASSERT_EQ(s.v[i], before.v[i] + before.m[i]) << i;
    }
  }
}

TEST(AdamArm, NeonEqualsScalarElementBitwise) { CheckKernel(&AdamKernelNeon); }
TEST(AdamArm, SveEqualsScalarElementBitwise) { CheckKernel(&AdamKernelSve); }
TEST(AdamArm, NeonProbeMovesEveryStream) { CheckProbe(&ProbeKernelNeon); }
TEST(AdamArm, SveProbeMovesEveryStream) { CheckProbe(&ProbeKernelSve); }

}  // namespace
}  // namespace ucp::offload::internal
