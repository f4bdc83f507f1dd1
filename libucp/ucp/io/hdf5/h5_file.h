// H5File: the one HDF5 wrapper in ucp. RAII handles, every C call checked and turned into a
// Status carrying HDF5's own message, HDF5's stderr printing silenced, and every HDF5 call made
// under one process-wide lock (so a non-thread-safe libhdf5 is safe too). Datasets hold any ucp
// DType, little-endian, with a `dtype` attribute naming it; zstd-compressed datasets (filter
// 32015 after byte shuffle) are compressed and decompressed in parallel outside the lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"
#include "ucp/tensor/tensor.h"

namespace ucp::io {

/// How WriteDataset stores a dataset.
struct DatasetOptions {
  /// 0: uncompressed, contiguous. Otherwise the zstd level (ZstdMinLevel()..ZstdMaxLevel(), e.g.
  /// 3), chunked, byte shuffle then zstd. Scalars and empty tensors are always stored contiguous.
  int compression_level = 0;
  /// Target uncompressed bytes per chunk when compressed, in [4 KiB, 1 GiB].
  int64_t chunk_bytes = int64_t{4} << 20;
};

/// What DatasetInfo reports.
struct DatasetMeta {
  DType dtype = DType::kFp32;
  Shape shape;
  bool compressed = false;  ///< zstd filter in the pipeline
  Shape chunk_shape;        ///< empty when contiguous
};

/// The canonical ucp name for a dataset's `dtype` attribute.
inline constexpr std::string_view kDTypeAttribute = "dtype";

class H5File {
 public:
  /// Creates a new file (never truncates an existing one), with pinned creation properties (no
  /// timestamps, fixed library version bounds) so equal input gives equal bytes.
  /// Errors: kAlreadyExists, kIoError (with HDF5's message).
  static Result<H5File> Create(const std::filesystem::path& path);
  /// Opens an existing file read-only.
  /// Errors: kNotFound (no such file), kDataLoss (not HDF5, truncated, unreadable superblock).
  static Result<H5File> Open(const std::filesystem::path& path);

  H5File(H5File&&) noexcept;
  H5File& operator=(H5File&&) noexcept;
  ~H5File();

  const std::filesystem::path& path() const;

  /// Flushes and closes, reporting errors a destructor would lose. Later calls fail.
  /// Errors: kIoError.
  Status Close();

  /// Writes a new dataset `name` ("a/b" creates group "a"), with attribute dtype = DTypeName.
  /// bf16 and fp8 are stored as raw uint16/uint8 bits; bool as h5py's int8 enum FALSE/TRUE.
  /// Errors: kInvalidArgument (bad name, view size, options), kAlreadyExists (name taken),
  /// kIoError (HDF5 failure, message included).
  Status WriteDataset(std::string_view name, const ConstTensorView& data,
                      const DatasetOptions& options = {});

  /// Creates dataset `name` (as WriteDataset, uncompressed and contiguous) with its storage
  /// allocated now and never filled, for its bytes to be written later straight into the file
  /// (io/raw_file.h) once this H5File is closed. Returns the byte offset of the dataset's first
  /// element in the file, or -1 for an empty dataset (nothing to write).
  /// Errors: kInvalidArgument (bad name or rank), kAlreadyExists, kIoError.
  Result<int64_t> CreateDirectDataset(std::string_view name, DType dtype, const Shape& shape);

  /// Where a dataset's bytes are when they can be read straight from the file: the byte offset
  /// of a contiguous, unfiltered dataset whose storage is allocated and holds exactly
  /// elements * dtype size bytes; -1 for any other (chunked or compressed, external, empty or
  /// not yet allocated), which ReadFlatRange reads instead.
  /// Errors: as DatasetInfo; kDataLoss when the bytes reach past the end of the file.
  Result<int64_t> DirectOffset(std::string_view name) const;

  /// The dtype, shape and storage of dataset `name`.
  /// Errors: kNotFound (no such dataset), kDataLoss (dtype attribute inconsistent with the stored
  /// type, unreadable metadata), kUnimplemented (a type ucp cannot map, e.g. uint16 without a
  /// dtype attribute, compound).
  Result<DatasetMeta> DatasetInfo(std::string_view name) const;

  /// True when `name` exists and is a dataset.
  bool HasDataset(std::string_view name) const;

  /// Every dataset in the file by full path without the leading '/' ("a/b"), sorted.
  /// Errors: kDataLoss.
  Result<std::vector<std::string>> ListDatasets() const;

  /// Reads a whole dataset.
  /// Errors: as DatasetInfo, and kDataLoss (missing or corrupt chunk, HDF5 read failure),
  /// kResourceExhausted.
  Result<Tensor> ReadDataset(std::string_view name) const;
  /// Reads a whole dataset into `out`, whose dtype and shape must match it.
  /// Errors: as ReadDataset, and kInvalidArgument (dtype, shape or size of `out` differs).
  Status ReadDatasetInto(std::string_view name, TensorView out) const;
  /// Reads elements [begin_elem, end_elem) of the row-major flattening of dataset `name` (any
  /// rank) into `out`, which must hold exactly (end - begin) elements.
  /// Errors: as DatasetInfo, kOutOfRange (range outside the dataset), kInvalidArgument (size of
  /// `out`), kDataLoss (read failure).
  Status ReadFlatRange(std::string_view name, int64_t begin_elem, int64_t end_elem,
                       std::span<std::byte> out) const;

  // Attributes on `object`: "" for the file's root group, otherwise a dataset or group path.
  // Strings are variable-length UTF-8 scalars (h5py gives `str`), integers int64 little-endian.
  // JSON is stored as a string attribute holding the text.

  /// Errors: kNotFound (no object), kAlreadyExists (attribute exists), kIoError.
  Status WriteStringAttribute(std::string_view object, std::string_view name,
                              std::string_view value);
  Status WriteInt64Attribute(std::string_view object, std::string_view name, int64_t value);
  Status WriteInt64ArrayAttribute(std::string_view object, std::string_view name,
                                  std::span<const int64_t> values);
  /// Errors: kNotFound (no object or attribute), kDataLoss (wrong type or shape).
  Result<std::string> ReadStringAttribute(std::string_view object, std::string_view name) const;
  Result<int64_t> ReadInt64Attribute(std::string_view object, std::string_view name) const;
  Result<std::vector<int64_t>> ReadInt64ArrayAttribute(std::string_view object,
                                                       std::string_view name) const;
  bool HasAttribute(std::string_view object, std::string_view name) const;

 private:
  struct Impl;
  explicit H5File(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// True when this process's libhdf5 was built thread-safe (informational; ucp serializes HDF5
/// calls either way).
bool Hdf5IsThreadSafe();

}  // namespace ucp::io
