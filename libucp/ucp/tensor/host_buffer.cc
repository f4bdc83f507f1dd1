#include "ucp/tensor/host_buffer.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "ucp/base/checked_math.h"

namespace ucp {

Result<HostBuffer> HostBuffer::Allocate(int64_t num_bytes, bool zero_fill) {
  if (num_bytes < 0) return InvalidArgumentError("negative buffer size " + std::to_string(num_bytes));
  HostBuffer b;
  if (num_bytes == 0) return b;
  // aligned_alloc wants a size that is a multiple of the alignment.
  size_t padded = static_cast<size_t>(RoundUp(num_bytes, static_cast<int64_t>(kAlignment)));
  void* p = std::aligned_alloc(kAlignment, padded);
  if (p == nullptr) {
    return ResourceExhaustedError("cannot allocate " + std::to_string(num_bytes) +
                                  " bytes of host memory");
  }
  if (zero_fill) std::memset(p, 0, padded);
  b.data_ = static_cast<std::byte*>(p);
  b.num_bytes_ = num_bytes;
  return b;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = o.data_;
    num_bytes_ = o.num_bytes_;
    o.data_ = nullptr;
    o.num_bytes_ = 0;
  }
  return *this;
}

HostBuffer::~HostBuffer() { std::free(data_); }

}  // namespace ucp
