// GPU check (label gpu): the CUDA model (the CPU model's graph over the CUDA ops) against the
// CPU model on the same weights and batch: loss and every gradient, GPT and LLaMA with GQA and
// an untied head. Skips where no CUDA device exists; tests/gpu/run_gpu_checks.sh runs it on one.
// Tolerance: loss within 1e-5 relative; max |gradient difference| <= 1e-4 x max(1, max |grad|)
// (different summation orders and the GPU's expf/tanhf over a few layers).
#include "offload/cuda/cuda_model.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "offload/cuda/cuda_cast.h"
#include "offload/model/model.h"
#include "tests/testutil/status_matchers.h"

namespace ucp::offload::cuda {
namespace {

ModelConfig Config(Family family) {
  ModelConfig c;
  c.family = family;
  c.vocab = 301;
  c.padded_vocab = 320;
  c.hidden = 96;
  c.layers = 2;
  c.heads = 6;
  c.kv_heads = family == Family::kGpt ? 6 : 2;
  c.head_dim = 16;
  c.ffn_hidden = family == Family::kGpt ? 384 : 160;
  c.max_positions = 64;
  c.tied_embeddings = family == Family::kGpt;
  return c;
}

class CudaModelTest : public ::testing::TestWithParam<Family> {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaModelTest, MatchesTheCpuModel) {
  const ModelConfig c = Config(GetParam());
  const int64_t B = 3, T = 37;
  UCP_ASSERT_OK_AND_ASSIGN(Model cpu, Model::Create(c, B, T, 2));
  UCP_ASSERT_OK_AND_ASSIGN(CudaModel gpu, CudaModel::Create(c, B, T));
  ASSERT_EQ(cpu.num_params(), gpu.num_params());
  const size_t n = static_cast<size_t>(cpu.num_params());
  std::vector<float> w(n), g_cpu(n, 0.0f), g_gpu(n);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (float& x : w) x = nd(rng);
  for (const ParamInfo& p : cpu.params()) {
    if (p.name.find("layernorm.weight") != std::string::npos) {
      std::fill(w.begin() + p.offset, w.begin() + p.offset + p.numel, 1.0f);
    }
  }
  std::vector<int32_t> in(B * T), tg(B * T);
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = static_cast<int32_t>(rng() % c.vocab);
    tg[i] = i % 13 == 5 ? -1 : static_cast<int32_t>(rng() % c.vocab);
  }
  const Batch batch{in, tg, B, T, 0};
  UCP_ASSERT_OK_AND_ASSIGN(double loss_cpu, cpu.ForwardBackward(w, g_cpu, batch, 1e-2f));

  float *d_w = nullptr, *d_g = nullptr;
  ASSERT_EQ(cudaMalloc(&d_w, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_g, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_w, w.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_g, 0, n * 4), cudaSuccess);
  UCP_ASSERT_OK_AND_ASSIGN(double loss_gpu, gpu.ForwardBackward(d_w, d_g, batch, 1e-2f));
  UCP_ASSERT_OK_AND_ASSIGN(double fwd_gpu, gpu.Forward(d_w, batch));
  ASSERT_EQ(cudaMemcpy(g_gpu.data(), d_g, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_w);
  cudaFree(d_g);

  EXPECT_NEAR(loss_gpu, loss_cpu, 1e-5 * std::abs(loss_cpu));
  EXPECT_EQ(loss_gpu, fwd_gpu);  // the forward alone computes the same loss
  for (const ParamInfo& p : cpu.params()) {
    double scale = 1.0, err = 0.0;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      scale = std::max(scale, static_cast<double>(std::abs(g_cpu[i])));
      err = std::max(err, static_cast<double>(std::abs(g_cpu[i] - g_gpu[i])));
    }
    EXPECT_LE(err, 1e-4 * scale) << p.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CudaModelTest, ::testing::Values(Family::kGpt, Family::kLlama));

TEST(CudaModelArgs, RefusedWithoutADeviceOrWithBadSizes) {
  if (DeviceCount() == 0) {
    EXPECT_EQ(CudaModel::Create(Config(Family::kGpt), 1, 8).status().code(),
              StatusCode::kDeviceError);
    return;
  }
  EXPECT_EQ(CudaModel::Create(Config(Family::kGpt), 1, 65).status().code(),
            StatusCode::kInvalidArgument);  // beyond GPT's position table
}

}  // namespace
}  // namespace ucp::offload::cuda
