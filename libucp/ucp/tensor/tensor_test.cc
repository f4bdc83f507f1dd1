#include "ucp/tensor/tensor.h"

#include <gtest/gtest.h>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

TEST(Tensor, ZerosAndCopyEveryDType) {
  ::ucp::testing::Gen gen(1);
  for (DType d : kAllDTypes) {
    Tensor t = gen.RandomTensor(d, {3, 5});
    EXPECT_EQ(t.num_bytes(), 15 * DTypeSizeBytes(d));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % HostBuffer::kAlignment, 0u);
    Result<Tensor> c = Tensor::CopyOf(t.view());
    ASSERT_TRUE(c.ok());
    EXPECT_TRUE(BitwiseEqual(c->view(), t.view())) << DTypeName(d);
    UCP_ASSERT_OK_AND_ASSIGN(Tensor z, Tensor::Zeros(d, {2, 0}));
    EXPECT_EQ(z.num_bytes(), 0);
  }
}

TEST(Tensor, ViewSizeIsChecked) {
  std::vector<std::byte> bytes(10);
  ConstTensorView v{DType::kFp32, {3}, bytes};
  EXPECT_THAT(ValidateView(v, "tensor \"w\""),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("holds 10 bytes but fp32 [3] needs 12")));
}

TEST(Tensor, ShapeOverflowIsDataLoss) {
  EXPECT_THAT(Tensor::Zeros(DType::kFp32, {int64_t{1} << 40, int64_t{1} << 40}),
              StatusIs(StatusCode::kDataLoss, HasSubstr("overflows")));
  EXPECT_THAT(Tensor::Zeros(DType::kFp32, {-1}), StatusIs(StatusCode::kDataLoss, HasSubstr("negative")));
}

TEST(Shape, StridesAndStrings) {
  Shape s = {2, 3, 4};
  EXPECT_EQ(ContiguousStrides(s), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(ShapeToString(s), "[2, 3, 4]");
  EXPECT_EQ(NumElementsOrDie(Shape{}), 1);
}

}  // namespace
}  // namespace ucp
