// OrderedSum: the two orders written out by hand, and the layout invariance of the halving tree
// that the trainer's deterministic mode relies on.
#include "offload/comm/ordered_sum.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "tests/testutil/status_matchers.h"

namespace ucp::offload {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

// Values of mixed magnitude, so that a different order of adds gives different bits.
std::vector<float> Contributions(int64_t count, size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::vector<float> v(static_cast<size_t>(count) * n);
  for (float& x : v) x = std::ldexp(mantissa(gen), exponent(gen));
  return v;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(OrderedSumTest, RankOrderIsALeftFold) {
  const size_t n = 9000;  // more than one tile
  const auto c = Contributions(5, n, 1);
  std::vector<float> out(n);
  UCP_ASSERT_OK(OrderedSum(c, 5, out, SumOrder::kRankOrder));
  for (size_t k = 0; k < n; ++k) {
    float want = c[k];
    for (size_t i = 1; i < 5; ++i) want += c[i * n + k];
    ASSERT_EQ(std::memcmp(&want, &out[k], sizeof(float)), 0) << "element " << k;
  }
}

TEST(OrderedSumTest, HalvingTreeOfEightAndOfSix) {
  const size_t n = 5000;
  const auto c8 = Contributions(8, n, 2);
  std::vector<float> out(n);
  UCP_ASSERT_OK(OrderedSum(c8, 8, out, SumOrder::kHalvingTree));
  for (size_t k = 0; k < n; ++k) {
    auto at = [&](size_t i) { return c8[i * n + k]; };
    const float want = ((at(0) + at(1)) + (at(2) + at(3))) + ((at(4) + at(5)) + (at(6) + at(7)));
    ASSERT_EQ(std::memcmp(&want, &out[k], sizeof(float)), 0) << "element " << k;
  }
  const auto c6 = Contributions(6, n, 3);
  UCP_ASSERT_OK(OrderedSum(c6, 6, out, SumOrder::kHalvingTree));
  for (size_t k = 0; k < n; ++k) {
    auto at = [&](size_t i) { return c6[i * n + k]; };
    const float want = ((at(0) + at(1)) + at(2)) + ((at(3) + at(4)) + at(5));
    ASSERT_EQ(std::memcmp(&want, &out[k], sizeof(float)), 0) << "element " << k;
  }
}

// G leaves split over P = 1, 2, 4, 8 ranks: each rank's tree, then the tree over ranks, is the
// tree over all leaves, bit for bit. The rank-order fold does not have this property.
TEST(OrderedSumTest, HalvingTreeIsTheSameAtEveryPowerOfTwoSplit) {
  for (int64_t leaves_per_rank : {1, 3}) {
    const int64_t g = 8 * leaves_per_rank;
    const size_t n = 4097;
    const auto leaves = Contributions(g, n, 4 + static_cast<uint32_t>(g));
    std::vector<float> whole(n);
    UCP_ASSERT_OK(OrderedSum(leaves, g, whole, SumOrder::kHalvingTree));
    bool rank_order_differs = false;
    for (int64_t p : {1, 2, 4, 8}) {
      const int64_t per = g / p;
      std::vector<float> partials(static_cast<size_t>(p) * n);
      for (int64_t r = 0; r < p; ++r) {
        std::span<const float> mine(leaves.data() + r * per * n, static_cast<size_t>(per) * n);
        UCP_ASSERT_OK(OrderedSum(mine, per, std::span<float>(partials.data() + r * n, n),
                                 SumOrder::kHalvingTree));
      }
      std::vector<float> total(n);
      UCP_ASSERT_OK(OrderedSum(partials, p, total, SumOrder::kHalvingTree));
      EXPECT_TRUE(SameBits(total, whole)) << "G=" << g << " P=" << p;

      for (int64_t r = 0; r < p; ++r) {
        std::span<const float> mine(leaves.data() + r * per * n, static_cast<size_t>(per) * n);
        UCP_ASSERT_OK(OrderedSum(mine, per, std::span<float>(partials.data() + r * n, n),
                                 SumOrder::kRankOrder));
      }
      UCP_ASSERT_OK(OrderedSum(partials, p, total, SumOrder::kRankOrder));
      std::vector<float> folded(n);
      UCP_ASSERT_OK(OrderedSum(leaves, g, folded, SumOrder::kRankOrder));
      if (p > 1 && per > 1 && !SameBits(total, folded)) rank_order_differs = true;
    }
    if (leaves_per_rank == 3) {
      EXPECT_TRUE(rank_order_differs);
    }
  }
}

TEST(OrderedSumTest, OneContributionIsACopyAndEmptyIsFine) {
  const auto c = Contributions(1, 10, 5);
  std::vector<float> out(10);
  UCP_ASSERT_OK(OrderedSum(c, 1, out, SumOrder::kHalvingTree));
  EXPECT_TRUE(SameBits(out, c));
  UCP_EXPECT_OK(OrderedSum({}, 3, {}, SumOrder::kRankOrder));
}

TEST(OrderedSumTest, RejectsBadShapes) {
  std::vector<float> c(12), out(5);
  EXPECT_THAT(OrderedSum(c, 0, out, SumOrder::kRankOrder),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("0 contributions")));
  EXPECT_THAT(OrderedSum(c, 3, out, SumOrder::kRankOrder),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("12 floats are not 3 contributions of 5 floats")));
  EXPECT_THAT(OrderedSum(std::span<const float>(c.data(), 8), 2, std::span<float>(c.data() + 4, 4),
                         SumOrder::kRankOrder),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlaps")));
}

}  // namespace
}  // namespace ucp::offload
