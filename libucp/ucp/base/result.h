// Result<T>: a value or a non-ok Status. Shaped like std::expected<T, Status> (C++23) so that
// moving to it later is mechanical: has_value(), value(), operator*, operator->, status().
#pragma once

#include <type_traits>
#include <utility>
#include <variant>

#include "ucp/base/check.h"
#include "ucp/base/status.h"

namespace ucp {

template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "use Status, not Result<Status>");

 public:
  // Implicit from a value or an error, so `return value;` and `return SomeError(...)` both work.
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    UCP_CHECK(!std::get<Status>(v_).ok()) << "Result constructed from an ok Status";
  }
  template <typename U, typename = std::enable_if_t<std::is_constructible_v<T, U&&> &&
                                                    !std::is_same_v<std::decay_t<U>, Status> &&
                                                    !std::is_same_v<std::decay_t<U>, T>>>
  Result(U&& value) : v_(T(std::forward<U>(value))) {}  // NOLINT

  bool ok() const { return v_.index() == 0; }
  bool has_value() const { return ok(); }
  explicit operator bool() const { return ok(); }

  /// The error, or an ok Status when there is a value.
  Status status() const& { return ok() ? Status() : std::get<Status>(v_); }
  Status status() && { return ok() ? Status() : std::get<Status>(std::move(v_)); }

  T& value() & { CheckOk(); return std::get<0>(v_); }
  const T& value() const& { CheckOk(); return std::get<0>(v_); }
  T&& value() && { CheckOk(); return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return ok() ? std::get<0>(v_) : T(std::forward<U>(fallback));
  }

 private:
  void CheckOk() const {
    UCP_CHECK(ok()) << "value() on an error Result: " << std::get<Status>(v_).ToString();
  }
  std::variant<T, Status> v_;
};

}  // namespace ucp
