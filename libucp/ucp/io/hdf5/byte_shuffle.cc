// Byte shuffle and its inverse (a byte-matrix transpose).
#include "ucp/io/hdf5/byte_shuffle.h"

#include <cstring>

#include "ucp/base/check.h"

namespace ucp::io {

void ByteShuffle(std::span<const std::byte> src, std::span<std::byte> dst, size_t element_bytes) {
  UCP_CHECK(src.size() == dst.size()) << src.size() << " vs " << dst.size();
  const size_t n = src.size() / element_bytes;
  if (element_bytes <= 1 || n <= 1) {
    std::memcpy(dst.data(), src.data(), src.size());
    return;
  }
  for (size_t j = 0; j < element_bytes; ++j) {
    std::byte* out = dst.data() + j * n;
    const std::byte* in = src.data() + j;
    for (size_t i = 0; i < n; ++i) out[i] = in[i * element_bytes];
  }
  const size_t tail = n * element_bytes;
  std::memcpy(dst.data() + tail, src.data() + tail, src.size() - tail);
}

void ByteUnshuffle(std::span<const std::byte> src, std::span<std::byte> dst, size_t element_bytes) {
  UCP_CHECK(src.size() == dst.size()) << src.size() << " vs " << dst.size();
  const size_t n = src.size() / element_bytes;
  if (element_bytes <= 1 || n <= 1) {
    std::memcpy(dst.data(), src.data(), src.size());
    return;
  }
  for (size_t j = 0; j < element_bytes; ++j) {
    const std::byte* in = src.data() + j * n;
    std::byte* out = dst.data() + j;
    for (size_t i = 0; i < n; ++i) out[i * element_bytes] = in[i];
  }
  const size_t tail = n * element_bytes;
  std::memcpy(dst.data() + tail, src.data() + tail, src.size() - tail);
}

}  // namespace ucp::io
