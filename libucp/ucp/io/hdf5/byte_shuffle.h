// HDF5's byte shuffle (filter 2) done outside HDF5, so chunks can be prepared in parallel and
// written with H5Dwrite_chunk: byte j of element i moves to position j * n + i.
#pragma once

#include <cstddef>
#include <span>

namespace ucp::io {

/// Shuffles `src` (elements of `element_bytes`) into `dst`, exactly as HDF5's shuffle filter
/// does, trailing bytes that do not fill an element included. Sizes must be equal.
void ByteShuffle(std::span<const std::byte> src, std::span<std::byte> dst, size_t element_bytes);
/// The inverse of ByteShuffle.
void ByteUnshuffle(std::span<const std::byte> src, std::span<std::byte> dst, size_t element_bytes);

}  // namespace ucp::io
