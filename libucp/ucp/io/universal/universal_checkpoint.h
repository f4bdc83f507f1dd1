// The universal checkpoint: a folder with manifest.json and one HDF5 file per parameter holding
// its fp32 master weight and optimizer states at the logical shape (docs/format.md). The writer
// builds it under a `.tmp-` sibling and renames it into place; the reader validates everything
// and verifies checksums on every full read. Uncompressed states move between memory and the
// files with pread/pwrite at the datasets' offsets (io/raw_file.h), streamed in pieces.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/io/manifest/universal_manifest.h"
#include "ucp/tensor/tensor.h"

namespace ucp::io {

struct UniversalWriteOptions {
  /// The training step; written into every parameter file, and Commit's header must agree.
  int64_t step = 0;
  /// 0: uncompressed (the default; see docs/PERFORMANCE.md). Otherwise the zstd level.
  int compression_level = 0;
  /// Target uncompressed bytes per chunk when compressed.
  int64_t chunk_bytes = int64_t{4} << 20;
  /// Several processes writing one checkpoint (api::ProcessGroup): the temporary folder the
  /// committing process created. This writer then fsyncs each file it completes, reports its
  /// parameters with LocalPart(), and never removes the folder or commits.
  std::filesystem::path join_temp;
};

/// One named state of a parameter, viewing the caller's memory (no copy).
using NamedState = std::pair<std::string, ConstTensorView>;

/// A state of a parameter file to be streamed in: its name (the dataset) and dtype; its shape is
/// the parameter's.
struct StateDecl {
  std::string name;
  DType dtype = DType::kFp32;
};

class UniversalWriter {
 public:
  /// Starts a checkpoint at `dst`, which must not exist; its parent folders are created.
  /// Errors: kAlreadyExists (dst exists), kInvalidArgument (options), kIoError.
  static Result<UniversalWriter> Create(const std::filesystem::path& dst,
                                        const UniversalWriteOptions& options = {});

  UniversalWriter(UniversalWriter&&) noexcept;
  UniversalWriter& operator=(UniversalWriter&&) noexcept;
  /// Without a successful Commit, removes the temporary folder: nothing appears at dst.
  ~UniversalWriter();

  /// Writes one parameter file, fsynced. `meta` gives name, shape, dtype and pattern_json; its
  /// states and file are ignored (filled from `states`). Every state must have shape meta.shape.
  /// Thread-safe: call it from many tasks at once for different parameters.
  /// Errors: kInvalidArgument (bad name, no states, duplicate state, shape differs, view size),
  /// kAlreadyExists (parameter written before), kFailedPrecondition (after Commit), kIoError.
  Status WriteParameter(const UniversalParamInfo& meta, std::span<const NamedState> states);

  /// Starts parameter `meta`'s file with `states` (datasets created in this order), to be filled
  /// by WriteStateRange. The file is fsynced and closed when the last element of its last state
  /// has arrived. Thread-safe.
  /// Errors: as WriteParameter.
  Status BeginParameter(const UniversalParamInfo& meta, std::span<const StateDecl> states);

  /// Elements [begin_elem, begin_elem + n) of a state of a begun parameter (n from data's size).
  /// The ranges of one state must arrive in order, each starting where the last one ended, from
  /// one thread at a time (the checksum is computed as they come). Thread-safe across states.
  /// With compression the state is buffered until complete.
  /// Errors: kNotFound (parameter not begun, unknown state), kInvalidArgument (out of order,
  /// past the end, size not a whole number of elements), kAlreadyExists (state complete),
  /// kIoError.
  Status WriteStateRange(std::string_view param, std::string_view state, int64_t begin_elem,
                         std::span<const std::byte> data);

  /// The parameters this writer completed, as text for the committing process.
  /// Errors: kFailedPrecondition (a begun parameter is incomplete, naming it).
  Result<std::string> LocalPart() const;
  /// At the committing process: takes another process's LocalPart().
  /// Errors: kDataLoss (malformed text), kAlreadyExists (a parameter written twice).
  Status AddPart(std::string_view part);

  /// Writes manifest.json (params sorted by name, from what was written; header.params must be
  /// empty), fsyncs the folder, renames it to dst and fsyncs dst's parent.
  /// Errors: kInvalidArgument (header.params not empty, header.step differs from the options'
  /// step, bad header fields), kAlreadyExists (dst appeared meanwhile), kFailedPrecondition
  /// (called twice, or a begun parameter is incomplete, naming it), kIoError.
  Status Commit(const UniversalManifest& header);

  /// The temporary folder being written (for tests and progress messages).
  const std::filesystem::path& temp_dir() const;

 private:
  struct Impl;
  explicit UniversalWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class UniversalReader {
 public:
  /// Opens and validates a checkpoint folder: manifest.json parsed strictly, every param `file`
  /// inside the folder and present. Files are opened lazily.
  /// Errors: kNotFound (no folder, no manifest.json: not a complete checkpoint),
  /// kFailedPrecondition (a `.tmp-` folder: an unfinished write), kDataLoss (manifest invalid,
  /// a param file missing or outside the folder), kUnimplemented (other format version).
  static Result<UniversalReader> Open(const std::filesystem::path& dir);

  UniversalReader(UniversalReader&&) noexcept;
  UniversalReader& operator=(UniversalReader&&) noexcept;
  ~UniversalReader();

  const UniversalManifest& manifest() const;
  const std::filesystem::path& dir() const;
  /// Errors: kNotFound naming the parameter.
  Result<const UniversalParamInfo*> FindParam(std::string_view param) const;

  /// Reads one state in full and verifies its checksum.
  /// Errors: kNotFound (parameter or state not in the manifest), kDataLoss (file unreadable,
  /// dataset missing, dtype or shape differs from the manifest, checksum mismatch; the message
  /// names file, parameter, state and field).
  Result<Tensor> ReadState(std::string_view param, std::string_view state) const;
  /// As ReadState, into the caller's memory (dtype and shape must match the manifest).
  /// Errors: as ReadState, and kInvalidArgument (out differs from the manifest).
  Status ReadStateInto(std::string_view param, std::string_view state, TensorView out) const;
  /// Reads elements [begin, end) of a state's row-major flattening (no checksum: partial read).
  /// Errors: as ReadState without the checksum, and kOutOfRange, kInvalidArgument.
  Status ReadStateFlatRange(std::string_view param, std::string_view state, int64_t begin_elem,
                            int64_t end_elem, std::span<std::byte> out) const;

  /// Checks every parameter file: attributes name, shape and step equal the manifest, exactly
  /// the manifest's states as datasets, each with the manifest's dtype and shape, and checksum.
  /// Errors: the first problem found, as ReadState, naming file, parameter, state and field.
  /// Checks that every file this reader has read (data or metadata) is still the file it was
  /// at its first read: same device, inode, size and mtime (issue 16 #8). A conversion calls it
  /// after its last read and before committing its output, so that a source modified during the
  /// run fails it instead of yielding an output that differs from the checksummed source.
  /// Errors: kDataLoss naming the first changed or removed file; kIoError.
  Status CheckSourcesUnchanged() const;

  Status Verify() const { return Verify(0, 1); }
  /// Share `part` of `parts` of that work (parameters dealt round-robin), for processes that
  /// verify one checkpoint together.
  Status Verify(int part, int parts) const;

  /// One read of the source (issue 14): from this call on, each state's checksum is computed
  /// from the bytes ReadStateFlatRange returns, in element order (XXH3 is hashed in order: a
  /// range read ahead of where a state's hash stopped is left for FinishVerifiedReads), and a
  /// state is compared as soon as its last byte has been hashed (that read fails with
  /// kDataLoss naming file, parameter and state). Call before the reads start.
  void VerifyReads() const;
  /// After the last read: Verify's checks for share `part` of `parts` (parameters dealt
  /// round-robin), each state's checksum finished by reading only the bytes its hash has not
  /// covered. Without VerifyReads: Verify(part, parts). Errors: as Verify.
  Status FinishVerifiedReads(int part, int parts) const;
  /// Bytes FinishVerifiedReads read only for their checksums.
  int64_t verify_bytes_reread() const;

 private:
  struct Impl;
  explicit UniversalReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::io
