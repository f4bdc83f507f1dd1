// GPU check (label gpu): the device casts agree bitwise with the host's Bf16FromFloat over every
// float class. Skips where no CUDA device exists; tests/gpu/run_gpu_checks.sh runs it on one.
#include "offload/cuda/cuda_cast.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload::cuda {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

TEST(CudaCast, ArgumentsAreCheckedWithoutADevice) {
  EXPECT_THAT(CastFp32ToBf16(nullptr, nullptr, -1), StatusIs(StatusCode::kInvalidArgument, HasSubstr("negative count")));
  EXPECT_THAT(CastFp32ToBf16(nullptr, nullptr, 4), StatusIs(StatusCode::kInvalidArgument, HasSubstr("null device pointer")));
  UCP_EXPECT_OK(CastBf16ToFp32(nullptr, nullptr, 0));
}

TEST(CudaCast, MatchesHostBitwise) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t n = (1 << 22) + 3;
  std::vector<float> h_src(n);
  std::mt19937 rng(11);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    std::memcpy(&h_src[i], &bits, 4);
  }
  h_src[0] = NAN; h_src[1] = INFINITY; h_src[2] = -0.0f; h_src[3] = 1.00390625f;  // a tie
  float* d_src = nullptr;
  uint16_t* d_bf16 = nullptr;
  float* d_back = nullptr;
  ASSERT_EQ(cudaMalloc(&d_src, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_bf16, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_back, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_src, h_src.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  UCP_ASSERT_OK(CastFp32ToBf16(d_src, d_bf16, n));
  UCP_ASSERT_OK(CastBf16ToFp32(d_bf16, d_back, n));
  std::vector<uint16_t> h_bf16(n);
  std::vector<float> h_back(n);
  ASSERT_EQ(cudaMemcpy(h_bf16.data(), d_bf16, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h_back.data(), d_back, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(h_bf16[i], Bf16FromFloat(h_src[i])) << "element " << i;
    uint32_t back;
    std::memcpy(&back, &h_back[i], 4);
    ASSERT_EQ(back, uint32_t{h_bf16[i]} << 16) << "element " << i;
  }
  cudaFree(d_src);
  cudaFree(d_bf16);
  cudaFree(d_back);
}

}  // namespace
}  // namespace ucp::offload::cuda
