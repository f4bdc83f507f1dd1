// HostBuffer: owning, 64-byte-aligned host memory (cache-line and AVX-512 aligned).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ucp/base/result.h"

namespace ucp {

class HostBuffer {
 public:
  static constexpr size_t kAlignment = 64;

  HostBuffer() = default;
  /// Allocates num_bytes (zero-filled when zero_fill).
  /// Errors: kResourceExhausted when the allocation fails; kInvalidArgument when negative.
  static Result<HostBuffer> Allocate(int64_t num_bytes, bool zero_fill = false);

  HostBuffer(HostBuffer&& o) noexcept : data_(o.data_), num_bytes_(o.num_bytes_) {
    o.data_ = nullptr;
    o.num_bytes_ = 0;
  }
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  int64_t num_bytes() const { return num_bytes_; }
  std::span<std::byte> bytes() { return {data_, static_cast<size_t>(num_bytes_)}; }
  std::span<const std::byte> bytes() const { return {data_, static_cast<size_t>(num_bytes_)}; }
  template <typename T>
  std::span<T> as() {
    return {reinterpret_cast<T*>(data_), static_cast<size_t>(num_bytes_) / sizeof(T)};
  }
  template <typename T>
  std::span<const T> as() const {
    return {reinterpret_cast<const T*>(data_), static_cast<size_t>(num_bytes_) / sizeof(T)};
  }

 private:
  std::byte* data_ = nullptr;
  int64_t num_bytes_ = 0;
};

}  // namespace ucp
