// libzstd adapter: single-shot compression with per-thread contexts.
#include "ucp/io/zstd/zstd_codec.h"

#include <zstd.h>

#include <memory>
#include <string>

namespace ucp::io {
namespace {

struct CCtxDeleter {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};
struct DCtxDeleter {
  void operator()(ZSTD_DCtx* c) const { ZSTD_freeDCtx(c); }
};

ZSTD_CCtx* ThreadCCtx() {
  thread_local std::unique_ptr<ZSTD_CCtx, CCtxDeleter> ctx(ZSTD_createCCtx());
  return ctx.get();
}
ZSTD_DCtx* ThreadDCtx() {
  thread_local std::unique_ptr<ZSTD_DCtx, DCtxDeleter> ctx(ZSTD_createDCtx());
  return ctx.get();
}

}  // namespace

int ZstdMinLevel() { return ZSTD_minCLevel(); }
int ZstdMaxLevel() { return ZSTD_maxCLevel(); }
size_t ZstdCompressBound(size_t src_bytes) { return ZSTD_compressBound(src_bytes); }

Result<size_t> ZstdCompress(std::span<const std::byte> src, std::span<std::byte> dst, int level) {
  if (level < ZSTD_minCLevel() || level > ZSTD_maxCLevel() || level == 0) {
    return InvalidArgumentError("zstd compression level " + std::to_string(level) +
                                " is outside [" + std::to_string(ZSTD_minCLevel()) + ", " +
                                std::to_string(ZSTD_maxCLevel()) + "] or zero");
  }
  ZSTD_CCtx* ctx = ThreadCCtx();
  if (ctx == nullptr) return ResourceExhaustedError("cannot allocate a zstd compression context");
  // compressCCtx writes the content size into the frame header, which older HDF5 zstd plugins
  // need to size their output buffer.
  size_t n = ZSTD_compressCCtx(ctx, dst.data(), dst.size(), src.data(), src.size(), level);
  if (ZSTD_isError(n)) {
    return InternalError(std::string("zstd compression of ") + std::to_string(src.size()) +
                         " bytes failed: " + ZSTD_getErrorName(n));
  }
  return n;
}

Result<uint64_t> ZstdFrameContentSize(std::span<const std::byte> frame) {
  unsigned long long size = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (size == ZSTD_CONTENTSIZE_ERROR) {
    return DataLossError("not a zstd frame (" + std::to_string(frame.size()) + " bytes)");
  }
  if (size == ZSTD_CONTENTSIZE_UNKNOWN) {
    return DataLossError("zstd frame does not record its content size");
  }
  return static_cast<uint64_t>(size);
}

Status ZstdDecompress(std::span<const std::byte> frame, std::span<std::byte> dst) {
  ZSTD_DCtx* ctx = ThreadDCtx();
  if (ctx == nullptr) return ResourceExhaustedError("cannot allocate a zstd decompression context");
  size_t n = ZSTD_decompressDCtx(ctx, dst.data(), dst.size(), frame.data(), frame.size());
  if (ZSTD_isError(n)) {
    return DataLossError(std::string("corrupt zstd frame of ") + std::to_string(frame.size()) +
                         " bytes: " + ZSTD_getErrorName(n));
  }
  if (n != dst.size()) {
    return DataLossError("zstd frame decodes to " + std::to_string(n) + " bytes, expected " +
                         std::to_string(dst.size()));
  }
  return Status::Ok();
}

}  // namespace ucp::io
