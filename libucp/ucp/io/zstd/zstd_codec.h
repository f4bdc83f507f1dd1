// Zstandard compression of whole buffers (one frame each, content size recorded), the only
// interface to libzstd in ucp. Contexts are per thread, so calls from TBB tasks run in parallel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ucp/base/result.h"

namespace ucp::io {

/// The compression levels libzstd accepts (negative levels are the fast modes).
int ZstdMinLevel();
int ZstdMaxLevel();
/// The level used when none is given (3).
inline constexpr int kZstdDefaultLevel = 3;

/// The largest frame that compressing `src_bytes` bytes can produce.
size_t ZstdCompressBound(size_t src_bytes);

/// Compresses `src` into `dst` as one frame that records its content size; returns the frame's
/// size. `dst` should hold ZstdCompressBound(src.size()) bytes.
/// Errors: kInvalidArgument (level outside [min, max]), kInternal (libzstd error, named).
Result<size_t> ZstdCompress(std::span<const std::byte> src, std::span<std::byte> dst, int level);

/// The content size recorded in the frame header of `frame`.
/// Errors: kDataLoss when `frame` is not a zstd frame or records no size.
Result<uint64_t> ZstdFrameContentSize(std::span<const std::byte> frame);

/// Decompresses one frame into exactly `dst.size()` bytes.
/// Errors: kDataLoss when the frame is corrupt or decodes to another size (both sizes given).
Status ZstdDecompress(std::span<const std::byte> frame, std::span<std::byte> dst);

}  // namespace ucp::io
