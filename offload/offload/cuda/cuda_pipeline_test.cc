// GPU check (label gpu): the pipeline over the CUDA backend steps the same bits as over the CPU
// twin — gradients on the device (fp32 and bf16 link), the overflow check on the device, the
// weights back on the device. Skips where no CUDA device exists; tests/gpu/run_gpu_checks.sh
// runs it on one.
#include "offload/cuda/cuda_pipeline.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "offload/cuda/cuda_cast.h"
#include "tests/testutil/status_matchers.h"

namespace ucp::offload::cuda {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

constexpr int64_t kN = 50001;

struct Host {
  std::vector<float> grad, master, m, v;
  std::vector<uint16_t> weights;
  explicit Host(uint64_t seed) : grad(kN), master(kN), m(kN), v(kN), weights(kN) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < kN; ++i) {
      grad[i] = 1e2f * nd(rng);
      master[i] = nd(rng);
      m[i] = 1e-1f * nd(rng);
      v[i] = 1e-2f * std::fabs(nd(rng));
    }
  }
};

std::vector<Bucket> Buckets() {
  return {{"layers.1", {{0, 25001, 20000}, {20000, 5000, 5000}}},
          {"layers.0", {{25000, 10001, 15000}}},
          {"embedding", {{40000, 0, 5000}, {45000, 45001, 5000}, {50000, 10000, 1}}}};
}

PipelineOptions Options(bool bf16_link) {
  PipelineOptions o;
  o.adam.beta2 = 0.95f;
  o.adam.weight_decay = 0.1f;
  o.adam_threads = 2;
  o.bf16_link = bf16_link;
  return o;
}

void Step(Pipeline& p, int64_t step, const Validation& v) {
  UCP_ASSERT_OK(p.Begin(step, 1e-3f, 1.0f / 512));
  for (int k = 0; k < 3; ++k) p.BucketReady(k);
  UCP_ASSERT_OK(p.Finish(v));
}

TEST(CudaPipeline, SameBitsAsTheCpuTwin) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (bool bf16_link : {false, true}) {
    SCOPED_TRACE(bf16_link ? "bf16 link" : "fp32 link");
    Host cpu(3), gpu(3);
    float* d_grad = nullptr;
    uint16_t* d_weights = nullptr;
    ASSERT_EQ(cudaMalloc(&d_grad, kN * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_weights, kN * 2), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_grad, gpu.grad.data(), kN * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // (see the inf's copy below)
    UCP_ASSERT_OK_AND_ASSIGN(auto backend, CudaPipelineBackend());
    PipelineMemory dm{{d_grad, static_cast<size_t>(kN)}, {d_weights, static_cast<size_t>(kN)},
                      gpu.master, gpu.m, gpu.v};
    UCP_ASSERT_OK_AND_ASSIGN(auto pg, Pipeline::Create(Options(bf16_link), Buckets(), dm,
                                                       std::move(backend)));
    UCP_ASSERT_OK_AND_ASSIGN(auto pc, Pipeline::Create(Options(bf16_link), Buckets(),
                                                       {cpu.grad, cpu.weights, cpu.master, cpu.m,
                                                        cpu.v},
                                                       CpuPipelineBackend()));
    // A committed step, a clip-corrected one, then an overflow (inf on the device) undone.
    Step(*pg, 1, {false, 1.0f / 512});
    Step(*pc, 1, {false, 1.0f / 512});
    Step(*pg, 2, {false, 0.3f / 512});
    Step(*pc, 2, {false, 0.3f / 512});
    const float inf = INFINITY;
    cpu.grad[30000] = inf;
    ASSERT_EQ(cudaMemcpy(d_grad + 30000, &inf, 4, cudaMemcpyHostToDevice), cudaSuccess);
    // (A pageable copy may return before its DMA lands, and the backend's non-blocking copy
    // stream does not wait for the legacy stream.)
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    Step(*pg, 3, {true, 1.0f / 512});
    Step(*pc, 3, {true, 1.0f / 512});
    EXPECT_EQ(pg->last_stats().deferred, pc->last_stats().deferred);
    EXPECT_EQ(pg->last_stats().deferred, 1);
    ASSERT_EQ(cudaMemcpy(gpu.weights.data(), d_weights, kN * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(0, std::memcmp(gpu.master.data(), cpu.master.data(), kN * 4));
    EXPECT_EQ(0, std::memcmp(gpu.m.data(), cpu.m.data(), kN * 4));
    EXPECT_EQ(0, std::memcmp(gpu.v.data(), cpu.v.data(), kN * 4));
    EXPECT_EQ(0, std::memcmp(gpu.weights.data(), cpu.weights.data(), kN * 2));
    cudaFree(d_grad);
    cudaFree(d_weights);
  }
}

TEST(CudaPipeline, RefusesTailBucketsOnTheDevice) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Host h(5);
  UCP_ASSERT_OK_AND_ASSIGN(auto backend, CudaPipelineBackend());
  PipelineOptions o = Options(false);
  o.gpu_tail_buckets = 1;
  EXPECT_THAT(Pipeline::Create(o, Buckets(), {h.grad, h.weights, h.master, h.m, h.v},
                               std::move(backend))
                  .status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("GPU Adam")));
}

}  // namespace
}  // namespace ucp::offload::cuda
