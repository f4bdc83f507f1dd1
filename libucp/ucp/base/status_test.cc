#include "ucp/base/status.h"

#include <gtest/gtest.h>

#include <memory>

#include "ucp/base/result.h"
#include "ucp/base/status_macros.h"

namespace ucp {
namespace {

TEST(Status, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "ok");
}

TEST(Status, ContextIsAppended) {
  Status s = DataLossError("checksum mismatch").WithContext("while reading a.h5");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.ToString(), "data_loss: checksum mismatch; while reading a.h5");
  EXPECT_TRUE(Status().WithContext("x").ok());
}

// Issue 16 #10: an error is one line, always (a path with a newline, HDF5's multi-line text).
TEST(Status, MessagesAndContextAreOneLine) {
  Status s = IoError("cannot open a\nb.h5\x01").WithContext("while\r\treading\x7f");
  EXPECT_EQ(s.message(), "cannot open a\\nb.h5\\x01; while\\r\\treading\\x7f");
  EXPECT_EQ(s.message().find('\n'), std::string::npos);
  EXPECT_EQ(EscapeControlCharacters("plain: ok/\xc3\xa9"), "plain: ok/\xc3\xa9");  // UTF-8 kept
}

TEST(Status, EveryCodeHasANameAndExitCode) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    auto code = static_cast<StatusCode>(c);
    EXPECT_NE(StatusCodeName(code), "unknown");
    if (code == StatusCode::kOk) {
      EXPECT_EQ(ExitCodeFor(code), 0);
    } else {
      EXPECT_GT(ExitCodeFor(code), 2) << StatusCodeName(code);  // 1 and 2 are for usage errors
    }
  }
}

Result<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x) {
  UCP_ASSIGN_OR_RETURN(int h, Half(x), "while halving once");
  UCP_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckEven(int x) {
  UCP_RETURN_IF_ERROR(Half(x), "checking " + std::to_string(x));
  return Status::Ok();
}

TEST(Result, PropagatesWithContext) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "odd: 3");
  Result<int> r2 = Quarter(5);
  EXPECT_EQ(r2.status().message(), "odd: 5; while halving once");
  EXPECT_EQ(CheckEven(3).message(), "odd: 3; checking 3");
  EXPECT_TRUE(CheckEven(4).ok());
}

TEST(Result, HoldsMoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(7);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
  EXPECT_EQ(Result<int>(NotFoundError("x")).value_or(3), 3);
}

TEST(ResultDeathTest, ValueOnErrorAborts) {
  Result<int> r = NotFoundError("missing thing");
  EXPECT_DEATH((void)r.value(), "missing thing");
}

}  // namespace
}  // namespace ucp
