// The sampler: permutations per epoch, independence from dp, Megatron's slice, golden values.
#include "offload/data/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "tests/testutil/status_matchers.h"

namespace ucp::offload {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

std::vector<int64_t> Epoch(const Sampler& s, int64_t epoch) {
  std::vector<int64_t> out;
  for (int64_t p = 0; p < s.num_samples(); ++p)
    out.push_back(s.SampleAt(epoch * s.num_samples() + p));
  return out;
}

TEST(SamplerTest, CreateCountsSamples) {
  UCP_ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(/*num_tokens=*/101, /*seq_len=*/10, 1));
  EXPECT_EQ(s.num_samples(), 10);  // the last sample's target is token 100
  EXPECT_EQ(s.seq_len(), 10);
  UCP_ASSERT_OK_AND_ASSIGN(Sampler t, Sampler::Create(100, 10, 1));
  EXPECT_EQ(t.num_samples(), 9);
  UCP_ASSERT_OK_AND_ASSIGN(Sampler one, Sampler::Create(2, 1, 1));
  EXPECT_EQ(one.num_samples(), 1);
  EXPECT_EQ(one.SampleAt(5), 0);
}

TEST(SamplerTest, CreateErrors) {
  EXPECT_THAT(Sampler::Create(100, 0, 1),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("seq_len is 0")));
  EXPECT_THAT(
      Sampler::Create(8, 8, 1),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("8 tokens hold no sample of seq_len + 1")));
  EXPECT_THAT(Sampler::Create(0, 8, 1),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("0 tokens hold no sample")));
}

TEST(SamplerTest, EveryEpochIsAPermutationAndEpochsDiffer) {
  for (int64_t n : {1, 2, 3, 7, 100, 1000}) {
    for (uint64_t seed : {0ULL, 1ULL, 1234ULL, ~0ULL}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " seed=" << seed);
      UCP_ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(n * 4 + 1, 4, seed));
      ASSERT_EQ(s.num_samples(), n);
      std::vector<int64_t> identity(static_cast<size_t>(n));
      std::iota(identity.begin(), identity.end(), 0);
      std::vector<std::vector<int64_t>> epochs;
      for (int64_t e = 0; e < 4; ++e) {
        std::vector<int64_t> perm = Epoch(s, e);
        std::vector<int64_t> sorted = perm;
        std::sort(sorted.begin(), sorted.end());
        EXPECT_EQ(sorted, identity) << "epoch " << e << " visits each sample exactly once";
        epochs.push_back(std::move(perm));
      }
      if (n >= 7) {
        EXPECT_NE(epochs[0], epochs[1]);
        EXPECT_NE(epochs[1], epochs[2]);
        EXPECT_NE(epochs[0], identity);
      }
      // Going back to an earlier epoch (the cache is rebuilt) gives the same order.
      EXPECT_EQ(Epoch(s, 0), epochs[0]);
    }
  }
}

TEST(SamplerTest, SeedsDiffer) {
  UCP_ASSERT_OK_AND_ASSIGN(Sampler a, Sampler::Create(1001, 1, 1));
  UCP_ASSERT_OK_AND_ASSIGN(Sampler b, Sampler::Create(1001, 1, 2));
  EXPECT_NE(Epoch(a, 0), Epoch(b, 0));
}

// Pins the permutation of sampler.h's comment: a change of generator, of the range map or of the
// keying shows here, on every platform. The values come from this independent transcription of
// that comment into Python:
//   M = 2**64
//   def mix(z):
//     z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M
//     z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M
//     return z ^ (z >> 31)
//   def perm(n, seed, e):
//     p, key = list(range(n)), mix(mix(seed) ^ e)
//     for i in range(n - 1, 0, -1):
//       j = (mix((key + (i + 1) * 0x9E3779B97F4A7C15) % M) * (i + 1)) >> 64
//       p[i], p[j] = p[j], p[i]
//     return p
TEST(SamplerTest, GoldenValues) {
  UCP_ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(10 * 16 + 1, 16, 1234));
  ASSERT_EQ(s.num_samples(), 10);
  EXPECT_THAT(Epoch(s, 0), ElementsAreArray(std::vector<int64_t>{1, 3, 4, 7, 9, 2, 8, 5, 0, 6}));
  EXPECT_THAT(Epoch(s, 1), ElementsAreArray(std::vector<int64_t>{9, 8, 2, 1, 5, 0, 7, 6, 4, 3}));
  UCP_ASSERT_OK_AND_ASSIGN(Sampler big, Sampler::Create(1000001, 1, 42));
  EXPECT_EQ(big.SampleAt(0), 235140);
  EXPECT_EQ(big.SampleAt(999999), 712109);
  EXPECT_EQ(big.SampleAt(1000000 * 3 + 17), 659144);
}

TEST(SamplerTest, RankRangeIsMegatronsSlice) {
  UCP_ASSERT_OK_AND_ASSIGN(auto r, Sampler::RankRange(/*step=*/5, /*global_batch=*/12, /*dp=*/4,
                                                      /*dp_rank=*/2));
  EXPECT_EQ(r, std::make_pair(int64_t{66}, int64_t{69}));
}

TEST(SamplerTest, SameSamplesAtAnyDp) {
  const int64_t global_batch = 12;
  UCP_ASSERT_OK_AND_ASSIGN(Sampler s, Sampler::Create(50 * 8 + 1, 8, 7));
  for (int64_t step : {0, 1, 4, 9}) {  // step 4 crosses the epoch boundary (48..60 over N=50)
    UCP_ASSERT_OK_AND_ASSIGN(auto whole, Sampler::RankRange(step, global_batch, 1, 0));
    std::vector<int64_t> expected;
    for (int64_t g = whole.first; g < whole.second; ++g) expected.push_back(s.SampleAt(g));
    for (int64_t dp : {1, 2, 3, 4, 6}) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " dp " << dp);
      std::vector<int64_t> globals, samples;
      for (int64_t rank = 0; rank < dp; ++rank) {
        UCP_ASSERT_OK_AND_ASSIGN(auto r, Sampler::RankRange(step, global_batch, dp, rank));
        EXPECT_EQ(r.second - r.first, global_batch / dp);
        for (int64_t g = r.first; g < r.second; ++g) {
          globals.push_back(g);
          samples.push_back(s.SampleAt(g));
        }
      }
      std::vector<int64_t> in_order(static_cast<size_t>(global_batch));
      std::iota(in_order.begin(), in_order.end(), whole.first);
      EXPECT_EQ(globals, in_order);  // the ranks' slices tile the step, in rank order
      EXPECT_EQ(samples, expected);
    }
  }
}

TEST(SamplerTest, RankRangeErrors) {
  EXPECT_THAT(Sampler::RankRange(0, 6, 4, 0),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("global batch 6 does not divide by dp=4: 6 = 4 * 1 + 2")));
  EXPECT_THAT(Sampler::RankRange(0, 6, 3, 3),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("dp rank 3 is outside [0, 3)")));
  EXPECT_THAT(Sampler::RankRange(0, 6, 0, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("dp is 0")));
  EXPECT_THAT(Sampler::RankRange(-1, 6, 1, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("step is -1")));
  EXPECT_THAT(Sampler::RankRange(0, 0, 1, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("global batch is 0")));
  EXPECT_THAT(Sampler::RankRange(int64_t{1} << 62, 8, 1, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("passes INT64_MAX")));
}

TEST(SamplerTest, FillShiftsTargetsByOne) {
  const int64_t seq_len = 5;
  std::vector<uint16_t> tokens(6 * seq_len + 1 + 3);  // 3 tokens past the last whole sample
  std::iota(tokens.begin(), tokens.end(), uint16_t{100});
  UCP_ASSERT_OK_AND_ASSIGN(Sampler s,
                           Sampler::Create(static_cast<int64_t>(tokens.size()), seq_len, 3));
  ASSERT_EQ(s.num_samples(), 6);
  const int64_t first = 4, n = 4;  // crosses into epoch 1
  std::vector<int32_t> inputs(n * seq_len), targets(n * seq_len);
  s.Fill(tokens, first, n, inputs, targets);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t start = s.SampleAt(first + k) * seq_len;
    for (int64_t t = 0; t < seq_len; ++t) {
      EXPECT_EQ(inputs[k * seq_len + t], 100 + start + t);
      EXPECT_EQ(targets[k * seq_len + t], 100 + start + t + 1);
      if (t + 1 < seq_len) {
        EXPECT_EQ(targets[k * seq_len + t], inputs[k * seq_len + t + 1]);
      }
    }
  }
}

}  // namespace
}  // namespace ucp::offload
