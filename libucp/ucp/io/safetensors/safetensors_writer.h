// SafetensorsWriter: writes a safetensors file atomically and deterministically, laid out as the
// reference `safetensors.torch.save_file` lays it out, so that the same tensors and metadata give
// the same bytes (docs/safetensors_format.md). The layout is fixed up front from names, dtypes and
// shapes; tensor bytes then stream in by pwrite, in any order and from many threads, into a
// temporary file beside the destination, which Commit fsyncs and renames into place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"
#include "ucp/io/safetensors/safetensors_header.h"
#include "ucp/tensor/tensor.h"

namespace ucp::safetensors {

/// The metadata transformers 4.x requires in every shard it loads.
inline std::map<std::string, std::string> DefaultMetadata() { return {{"format", "pt"}}; }

struct SafetensorsWriteOptions {
  /// Written as `__metadata__` (keys sorted); nullopt writes no `__metadata__` at all, as
  /// save_file(metadata=None) does.
  std::optional<std::map<std::string, std::string>> metadata = DefaultMetadata();
  /// Replace an existing file at the destination. Off: Commit fails with kAlreadyExists.
  bool overwrite = false;
};

class SafetensorsWriter {
 public:
  /// Lays out `tensors` (LayOut), creates `<path>.tmp-XXXXXX` in path's folder sized to the whole
  /// file, and writes the header into it. Zero-sized tensors need no writes.
  /// Errors: kInvalidArgument (LayOut's rules); kResourceExhausted (header too large);
  /// kAlreadyExists (path exists and overwrite is off); kNotFound (no such folder); kIoError.
  static Result<SafetensorsWriter> Create(const std::filesystem::path& path,
                                          std::span<const SafetensorsTensorSpec> tensors,
                                          SafetensorsWriteOptions options = {});

  SafetensorsWriter(SafetensorsWriter&&) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept;
  /// Removes the temporary file unless Commit succeeded.
  ~SafetensorsWriter();

  /// The layout, in file order.
  const std::vector<SafetensorsEntry>& entries() const;
  /// The position of `name` in entries().
  /// Errors: kNotFound naming the tensor.
  Result<size_t> IndexOf(std::string_view name) const;

  /// Writes `bytes` at byte `byte_begin` of tensor entries()[index]. Thread-safe; ranges may come
  /// in any order but must not overlap.
  /// Errors: kOutOfRange (bad index, or the range is not within the tensor); kInvalidArgument
  /// (the range overlaps one already written); kFailedPrecondition (committed); kIoError.
  Status WriteRange(size_t index, int64_t byte_begin, std::span<const std::byte> bytes);
  /// Writes a whole tensor, checking its dtype and shape against the layout.
  /// Errors: kNotFound (no such tensor); kInvalidArgument (dtype, shape or byte count differ);
  /// as WriteRange.
  Status WriteTensor(std::string_view name, const ConstTensorView& view);

  /// Checks that every byte of every tensor was written, fsyncs, renames the file into place
  /// (never over an existing file unless overwrite is set) and fsyncs the folder.
  /// Errors: kFailedPrecondition (bytes never written, naming the tensor and range, or already
  /// committed); kAlreadyExists; kIoError.
  Status Commit();

 private:
  struct Impl;
  explicit SafetensorsWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// A tensor to write under a name.
struct NamedTensorView {
  std::string name;
  ConstTensorView view;
};

/// Create, WriteTensor for each tensor, Commit: the one-call form.
/// Errors: as SafetensorsWriter, plus kInvalidArgument for a view whose bytes do not match its
/// dtype and shape.
Status WriteSafetensorsFile(const std::filesystem::path& path,
                            std::span<const NamedTensorView> tensors,
                            SafetensorsWriteOptions options = {});

}  // namespace ucp::safetensors
