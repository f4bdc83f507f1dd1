// Checked size arithmetic: every size read from a file goes through these before it is trusted.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>

#include "ucp/base/result.h"

namespace ucp {

/// a * b, or nullopt when it does not fit in int64 or either is negative.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  if (a < 0 || b < 0) return std::nullopt;
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

/// a + b, or nullopt on overflow or a negative operand.
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  if (a < 0 || b < 0) return std::nullopt;
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

/// The product of dims (1 for none), or an error naming `what` when a dim is negative or the
/// product overflows int64.
/// Errors: kDataLoss (negative dim or overflow).
Result<int64_t> CheckedProduct(std::span<const int64_t> dims, const std::string& what);

/// Ceil(a / b) for a >= 0, b > 0.
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
/// The smallest multiple of b that is >= a, for a >= 0, b > 0.
constexpr int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

}  // namespace ucp
