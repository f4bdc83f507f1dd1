#include "ucp/base/checked_math.h"

#include <gtest/gtest.h>

#include <vector>

namespace ucp {
namespace {

TEST(CheckedMath, MulAndAddDetectOverflow) {
  EXPECT_EQ(CheckedMul(1 << 20, 1 << 20), int64_t{1} << 40);
  EXPECT_FALSE(CheckedMul(int64_t{1} << 32, int64_t{1} << 32));
  EXPECT_FALSE(CheckedMul(-1, 2));
  EXPECT_FALSE(CheckedAdd(std::numeric_limits<int64_t>::max(), 1));
  EXPECT_EQ(CheckedAdd(2, 3), 5);
}

TEST(CheckedMath, ProductNamesTheTensor) {
  std::vector<int64_t> ok = {3, 4, 5};
  EXPECT_EQ(*CheckedProduct(ok, "w"), 60);
  EXPECT_EQ(*CheckedProduct({}, "w"), 1);
  std::vector<int64_t> neg = {3, -4};
  auto r = CheckedProduct(neg, "tensor \"w\"");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("tensor \"w\": dimension 1 is negative"), std::string::npos);
  std::vector<int64_t> big = {int64_t{1} << 40, int64_t{1} << 40};
  EXPECT_EQ(CheckedProduct(big, "w").status().code(), StatusCode::kDataLoss);
}

TEST(CheckedMath, RoundUp) {
  EXPECT_EQ(CeilDiv(10, 4), 3);
  EXPECT_EQ(RoundUp(10, 4), 12);
  EXPECT_EQ(RoundUp(0, 4), 0);
}

}  // namespace
}  // namespace ucp
