// The Zstandard HDF5 filter (registered id 32015, cd_values[0] = level), as one definition shared
// by the in-process registration and the plugin library that h5py and h5dump load.
#pragma once

#include "ucp/base/status.h"

namespace ucp::io {

/// The registered HDF5 filter id of Zstandard.
inline constexpr int kZstdFilterId = 32015;

/// The filter's H5Z_class2_t, as an opaque pointer (the plugin entry point returns it).
const void* ZstdFilterClass();

/// Registers the filter with this process's HDF5 (once; later calls are no-ops). The caller
/// holds the HDF5 lock.
/// Errors: kInternal when H5Zregister fails.
Status RegisterZstdFilterLocked();

}  // namespace ucp::io
