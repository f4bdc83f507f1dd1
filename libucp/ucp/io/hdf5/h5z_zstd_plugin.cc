// HDF5 plugin entry points for the zstd filter, so h5py and h5dump read compressed ucp files
// when HDF5_PLUGIN_PATH names the folder holding this library.
#include <H5PLextern.h>

#include "ucp/io/hdf5/h5z_zstd.h"

extern "C" __attribute__((visibility("default"))) H5PL_type_t H5PLget_plugin_type(void) {
  return H5PL_TYPE_FILTER;
}

extern "C" __attribute__((visibility("default"))) const void* H5PLget_plugin_info(void) {
  return ucp::io::ZstdFilterClass();
}
