// The zstd filter callback for HDF5's pipeline. HDF5 calls it under its own lock (one chunk at a
// time); ucp's writer and reader bypass it with direct chunk I/O to compress in parallel.
#include "ucp/io/hdf5/h5z_zstd.h"

#include <hdf5.h>

#include <cstdint>

#include "ucp/io/zstd/zstd_codec.h"

namespace ucp::io {
namespace {

// HDF5's limit on a chunk is < 4 GiB; a frame claiming more is corrupt.
constexpr uint64_t kMaxChunkBytes = (uint64_t{1} << 32) - 1;

size_t ZstdFilter(unsigned flags, size_t cd_nelmts, const unsigned cd_values[], size_t nbytes,
                  size_t* buf_size, void** buf) {
  const auto* in = static_cast<const std::byte*>(*buf);
  if (flags & H5Z_FLAG_REVERSE) {
    auto size = ZstdFrameContentSize({in, nbytes});
    if (!size.ok() || *size > kMaxChunkBytes) return 0;
    void* out = H5allocate_memory(static_cast<size_t>(*size), false);
    if (out == nullptr) return 0;
    if (!ZstdDecompress({in, nbytes}, {static_cast<std::byte*>(out), static_cast<size_t>(*size)})
             .ok()) {
      H5free_memory(out);
      return 0;
    }
    H5free_memory(*buf);
    *buf = out;
    *buf_size = static_cast<size_t>(*size);
    return static_cast<size_t>(*size);
  }
  // cd_values[0] is the level as unsigned (negative levels in two's complement); 0 or absent
  // means the default, and out-of-range levels are clamped as other zstd plugins do.
  int level = cd_nelmts > 0 ? static_cast<int>(cd_values[0]) : kZstdDefaultLevel;
  if (level == 0) level = kZstdDefaultLevel;
  if (level < ZstdMinLevel()) level = ZstdMinLevel();
  if (level > ZstdMaxLevel()) level = ZstdMaxLevel();
  const size_t bound = ZstdCompressBound(nbytes);
  void* out = H5allocate_memory(bound, false);
  if (out == nullptr) return 0;
  auto n = ZstdCompress({in, nbytes}, {static_cast<std::byte*>(out), bound}, level);
  if (!n.ok()) {
    H5free_memory(out);
    return 0;
  }
  H5free_memory(*buf);
  *buf = out;
  *buf_size = bound;
  return *n;
}

const H5Z_class2_t kZstdClass = {
    H5Z_CLASS_T_VERS,
    static_cast<H5Z_filter_t>(kZstdFilterId),
    1,  // encoder present
    1,  // decoder present
    "zstd (ucp; registered filter 32015, cd_values[0] = level)",
    nullptr,  // can_apply
    nullptr,  // set_local
    ZstdFilter,
};

}  // namespace

const void* ZstdFilterClass() { return &kZstdClass; }

Status RegisterZstdFilterLocked() {
  static bool registered = false;
  if (registered) return Status::Ok();
  if (H5Zregister(&kZstdClass) < 0) {
    H5Eclear2(H5E_DEFAULT);
    return InternalError("H5Zregister of the zstd filter (id 32015) failed");
  }
  registered = true;
  return Status::Ok();
}

}  // namespace ucp::io
