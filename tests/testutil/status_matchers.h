// gMock matchers for Status and Result: assert the code and a message fragment, never just !ok.
#pragma once

#include <gmock/gmock.h>

#include <string>

#include "ucp/base/result.h"
#include "ucp/base/status.h"
#include "ucp/base/status_macros.h"

namespace ucp::testing {

inline const Status& GetStatus(const Status& s) { return s; }
template <typename T>
Status GetStatus(const Result<T>& r) { return r.status(); }

MATCHER(IsOk, "is ok") {
  Status s = ::ucp::testing::GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s.ToString();
  return s.ok();
}

MATCHER_P2(StatusIs, code, message_matcher, "") {
  Status s = ::ucp::testing::GetStatus(arg);
  *result_listener << "status is " << s.ToString();
  return s.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, s.message(), result_listener);
}

}  // namespace ucp::testing

#define UCP_ASSERT_OK(expr) ASSERT_THAT((expr), ::ucp::testing::IsOk())
#define UCP_EXPECT_OK(expr) EXPECT_THAT((expr), ::ucp::testing::IsOk())
#define UCP_ASSERT_OK_AND_ASSIGN(lhs, expr)           \
  UCP_ASSERT_OK_AND_ASSIGN_IMPL(UCP_STATUS_CONCAT(ucp_t_, __LINE__), lhs, expr)
#define UCP_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();   \
  lhs = std::move(tmp).value()
