// GPU check (label gpu): the device Adam (cuda_adam.h) against the CPU Adam, bitwise: params,
// exp_avg, exp_avg_sq and the bf16/fp16 copy, AdamW and L2, at step 1 from zero state and at step
// 1000, with a gradient multiplier (AdamStepFused) and without (AdamStep), sizes around the
// launch's block edges. Skips where no CUDA device exists; tests/gpu runs it on one.
#include "offload/cuda/cuda_adam.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "offload/cuda/cuda_cast.h"
#include "offload/optim/adam.h"
#include "tests/testutil/status_matchers.h"

namespace ucp::offload::cuda {
namespace {

template <typename T>
T* Upload(const std::vector<T>& h) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

struct Case {
  int64_t n;
  bool decoupled;
  int64_t step;
  LowpDType out;
  float scale;  // 1.0f: AdamStep; otherwise AdamStepFused with this multiplier
};

class CudaAdamTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaAdamTest, BitwiseTheCpuAdam) {
  const Case c = GetParam();
  const size_t n = static_cast<size_t>(c.n);
  std::mt19937_64 rng(static_cast<uint64_t>(c.n * 7 + c.step));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> p(n), g(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = nd(rng);
    g[i] = 1e-2f * nd(rng) * (i % 97 == 0 ? 1e4f : 1.0f);
    m[i] = c.step == 1 ? 0.0f : 1e-3f * nd(rng);
    v[i] = c.step == 1 ? 0.0f : 1e-6f * std::fabs(nd(rng));
  }
  AdamConfig cfg;
  cfg.lr = 3e-4f;
  cfg.beta1 = 0.9f;
  cfg.beta2 = 0.95f;
  cfg.eps = 1e-8f;
  cfg.weight_decay = 0.1f;
  cfg.decoupled = c.decoupled;

  float* dp = Upload(p);
  float* dg = Upload(g);
  float* dm = Upload(m);
  float* dv = Upload(v);
  std::vector<uint16_t> out(n, 0);
  uint16_t* dout = c.out == LowpDType::kFp32 ? nullptr : Upload(out);

  // The CPU: AdamStep on a scaled copy of the gradient (the sync trainer's path), or the fused
  // kernel with the multiplier (the pipeline's).
  AdamSpans a;
  a.param = p;
  a.exp_avg = m;
  a.exp_avg_sq = v;
  if (c.out == LowpDType::kBf16) a.out = LowpOutSpan::Bf16(out);
  if (c.out == LowpDType::kFp16) a.out = LowpOutSpan::Fp16(out);
  std::vector<float> gs = g;
  if (c.scale == 1.0f) {
    a.grad = GradSpan::Fp32(gs);
    UCP_ASSERT_OK(AdamStep(cfg, c.step, a));
  } else {
    a.grad = GradSpan::Fp32(g);
    AdamFusedOptions fo;
    fo.grad_scale = c.scale;
    UCP_ASSERT_OK(AdamStepFused(cfg, c.step, a, fo));
  }

  UCP_ASSERT_OK_AND_ASSIGN(AdamStepScalars s, MakeAdamStepScalars(cfg, c.step));
  DeviceAdamSpans d{dp, dg, dm, dv, dout, ToDevice(c.out), c.n};
  UCP_ASSERT_OK(AdamStepDevice(ToDevice(s, c.decoupled), c.scale, d));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  auto same = [&](const std::vector<float>& want, const float* dptr, const char* what) {
    const std::vector<float> got = Download(dptr, n);
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(&want[i], &got[i], 4) != 0) {
        if (first == n) first = i;
        ++bad;
      }
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << n << " differ, first at " << first
                       << " (cpu " << (first < n ? want[first] : 0.f) << ", gpu "
                       << (first < n ? got[first] : 0.f) << ")";
  };
  same(p, dp, "param");
  same(m, dm, "exp_avg");
  same(v, dv, "exp_avg_sq");
  if (dout != nullptr) {
    EXPECT_EQ(Download(dout, n), out) << "low-precision copy";
  }
  cudaFree(dp);
  cudaFree(dg);
  cudaFree(dm);
  cudaFree(dv);
  cudaFree(dout);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaAdamTest,
    ::testing::Values(Case{1, true, 1, LowpDType::kBf16, 1.0f},
                      Case{255, true, 1, LowpDType::kBf16, 1.0f},
                      Case{257, true, 1000, LowpDType::kBf16, 1.0f},
                      Case{1 << 20, true, 1000, LowpDType::kBf16, 0.37f},
                      Case{100003, false, 1000, LowpDType::kFp16, 1.0f},
                      Case{100003, true, 7, LowpDType::kFp16, 1.0f / 65536.0f},
                      Case{4099, true, 3, LowpDType::kFp32, 1.0f},
                      Case{(1 << 24) + 5, true, 2, LowpDType::kBf16, 0.5f}));

TEST(CudaAdamArgs, RefusesBadSpans) {
  DeviceAdamScalars s;
  DeviceAdamSpans d;
  d.n = -1;
  EXPECT_EQ(AdamStepDevice(s, 1.0f, d).code(), StatusCode::kInvalidArgument);
  d.n = 5;  // null pointers
  EXPECT_EQ(AdamStepDevice(s, 1.0f, d).code(), StatusCode::kInvalidArgument);
  s.amsgrad = true;
  d.n = 0;
  EXPECT_EQ(AdamStepDevice(s, 1.0f, d).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ucp::offload::cuda
