// Checksums of stored bytes: XXH3-64, written as "xxh3-64:<16 lowercase hex>".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "ucp/base/result.h"

namespace ucp::io {

/// The prefix of every checksum string.
inline constexpr std::string_view kXxh3Prefix = "xxh3-64:";

/// XXH3-64 (seed 0) of `bytes`.
uint64_t Xxh3_64(std::span<const std::byte> bytes);

/// "xxh3-64:0123456789abcdef".
std::string FormatXxh3(uint64_t digest);

/// Parses FormatXxh3's output; `what` names the field in errors.
/// Errors: kDataLoss naming `what` for any other text.
Result<uint64_t> ParseXxh3(std::string_view text, const std::string& what);

/// Incremental XXH3-64 for data that arrives in pieces (chunks of a dataset).
class Xxh3Hasher {
 public:
  Xxh3Hasher();
  ~Xxh3Hasher();
  Xxh3Hasher(Xxh3Hasher&&) noexcept;
  Xxh3Hasher& operator=(Xxh3Hasher&&) noexcept;
  void Update(std::span<const std::byte> bytes);
  uint64_t Digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ucp::io
