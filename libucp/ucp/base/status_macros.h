// Error plumbing: propagate a failed Status or Result, adding the caller's context on the way.
#pragma once

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::internal_status {
inline Status AsStatus(const Status& s) { return s; }
inline Status AsStatus(Status&& s) { return std::move(s); }
template <typename T>
Status AsStatus(const Result<T>& r) { return r.status(); }
inline Status AddContext(Status s) { return s; }
template <typename C>
Status AddContext(Status s, C&& context) { return std::move(s).WithContext(context); }
}  // namespace ucp::internal_status

#define UCP_STATUS_CONCAT_INNER(a, b) a##b
#define UCP_STATUS_CONCAT(a, b) UCP_STATUS_CONCAT_INNER(a, b)

/// UCP_RETURN_IF_ERROR(expr[, context]): returns the Status of expr if it is not ok.
#define UCP_RETURN_IF_ERROR(expr, ...)                                                   \
  do {                                                                                    \
    ::ucp::Status ucp_status_ = ::ucp::internal_status::AsStatus(expr);                   \
    if (!ucp_status_.ok())                                                                \
      return ::ucp::internal_status::AddContext(std::move(ucp_status_) __VA_OPT__(, ) __VA_ARGS__); \
  } while (false)

/// UCP_ASSIGN_OR_RETURN(lhs, expr[, context]): `lhs = *expr` or return its error.
#define UCP_ASSIGN_OR_RETURN(lhs, expr, ...) \
  UCP_ASSIGN_OR_RETURN_IMPL(UCP_STATUS_CONCAT(ucp_result_, __LINE__), lhs, expr, __VA_ARGS__)
#define UCP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr, ...)                                        \
  auto tmp = (expr);                                                                          \
  if (!tmp.ok())                                                                              \
    return ::ucp::internal_status::AddContext(std::move(tmp).status() __VA_OPT__(, ) __VA_ARGS__); \
  lhs = std::move(tmp).value()
