#include "ucp/tensor/dtype.h"

#include <gtest/gtest.h>

#include <set>

#include "tests/testutil/status_matchers.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

TEST(DType, NamesRoundTripForEveryDType) {
  std::set<std::string_view> names;
  for (DType d : kAllDTypes) {
    EXPECT_TRUE(names.insert(DTypeName(d)).second) << "duplicate name " << DTypeName(d);
    EXPECT_EQ(*DTypeFromName(DTypeName(d)), d);
    EXPECT_EQ(*DTypeFromName(DTypeTorchName(d)), d);
    EXPECT_EQ(DTypeSizeBits(d) % 8, 0);
    EXPECT_EQ(DTypeSizeBytes(d) * 8, DTypeSizeBits(d));
  }
  EXPECT_EQ(kAllDTypes.size(), 12u);
}

TEST(DType, KnownSizes) {
  EXPECT_EQ(DTypeSizeBytes(DType::kBf16), 2);
  EXPECT_EQ(DTypeSizeBytes(DType::kFp8E4m3), 1);
  EXPECT_EQ(DTypeSizeBytes(DType::kInt64), 8);
  EXPECT_EQ(DTypeSizeBytes(DType::kBool), 1);
  EXPECT_TRUE(IsFloating(DType::kFp8E5m2));
  EXPECT_FALSE(IsFloating(DType::kUint8));
}

TEST(DType, UnknownNameIsAnError) {
  EXPECT_THAT(DTypeFromName("fp12"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("unknown dtype \"fp12\"")));
  EXPECT_THAT(DTypeFromName(""), StatusIs(StatusCode::kInvalidArgument, HasSubstr("unknown")));
}

}  // namespace
}  // namespace ucp
