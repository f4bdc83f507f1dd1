// The distributed (per-rank) checkpoint: a folder with ucp_layout.json and one HDF5 file per
// rank holding the datasets the plan names for that rank (convert/plan.h). The writer builds it
// under a `.tmp-` sibling and renames it into place on Commit; the reader validates the
// manifest, finds every rank file and verifies checksums on full reads. Each rank file is
// created with all its datasets at once (in declaration order, so equal input gives equal
// bytes) and the contents stream in with pwrite at the datasets' offsets; reads are preads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/dist/dist_manifest.h"
#include "ucp/tensor/tensor.h"

namespace ucp::dist {

/// A tensor the writer will receive: its rank file, dataset name, dtype and shape.
struct DistTensorDecl {
  int64_t rank = 0;
  std::string name;
  DType dtype = DType::kFp32;
  Shape shape;
};

struct DistWriteOptions {
  /// Several processes writing one checkpoint (api::ProcessGroup): the temporary folder the
  /// committing process created. This writer then creates only the rank files it is given to
  /// write (`owned_ranks`), fsyncs each when complete, reports them with LocalPart(), and never
  /// removes the folder or commits.
  std::filesystem::path join_temp;
  /// The ranks whose files this writer creates; the others' come from other processes through
  /// AddPart. Unset: every rank (one process writes the whole checkpoint).
  std::optional<std::vector<int64_t>> owned_ranks;
};

class DistWriter {
 public:
  /// Starts a checkpoint at `dst` (must not exist; parents are created) for `world_size` ranks
  /// holding exactly `tensors`. A rank's file is created, with all its datasets in the order
  /// given, at its first write (or at Commit).
  /// Errors: kAlreadyExists (dst exists), kInvalidArgument (world_size < 1, a rank outside it, a
  /// name declared twice on a rank), kIoError.
  static Result<DistWriter> Create(const std::filesystem::path& dst, int64_t world_size,
                                   std::vector<DistTensorDecl> tensors,
                                   const DistWriteOptions& options = {});

  DistWriter(DistWriter&&) noexcept;
  DistWriter& operator=(DistWriter&&) noexcept;
  /// Without a successful Commit, removes the temporary folder: nothing appears at dst.
  ~DistWriter();

  /// Writes elements [begin_elem, begin_elem + n) of a declared tensor (n from data's size).
  /// The ranges of one tensor arrive in order, each where the last ended, from one thread at a
  /// time (the checksum is computed as they come); a rank's file is fsynced and closed once all
  /// its tensors are complete. Thread-safe across tensors.
  /// Errors: kOutOfRange (rank), kNotFound (not declared), kInvalidArgument (out of order, past
  /// the end), kAlreadyExists (already complete), kFailedPrecondition (after Commit), kIoError.
  Status WriteRange(int64_t rank, std::string_view name, int64_t begin_elem,
                    std::span<const std::byte> data);
  /// A whole declared tensor from a view of the caller's memory (dtype and shape must match the
  /// declaration).
  /// Errors: as WriteRange, kInvalidArgument (view differs from the declaration).
  Status WriteTensor(int64_t rank, std::string_view name, const ConstTensorView& data);

  /// What this writer wrote, for the process that commits: its owned ranks' files (created now
  /// if nothing was written to them) and each of their tensors' checksum, as text. Every
  /// declared tensor of an owned rank must be complete.
  /// Errors: kFailedPrecondition (a tensor incomplete, naming it), kIoError.
  Result<std::string> LocalPart();
  /// At the committing process: takes another process's LocalPart().
  /// Errors: kDataLoss (malformed text, a rank or tensor not declared, or reported twice).
  Status AddPart(std::string_view part);

  /// Checks that every declared tensor is complete (here or in an added part), writes
  /// ucp_layout.json from `header` (its `ranks` must be empty; they are filled from what was
  /// written), fsyncs, renames to dst. Errors: kInvalidArgument (header.ranks not empty),
  /// kAlreadyExists, kFailedPrecondition (called twice; a tensor incomplete, naming it), kIoError.
  Status Commit(const DistManifest& header);

  const std::filesystem::path& temp_dir() const;

 private:
  struct Impl;
  explicit DistWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class DistReader {
 public:
  /// Opens a checkpoint folder: ucp_layout.json parsed strictly, every rank file present.
  /// Errors: kNotFound (no folder / no ucp_layout.json: not a complete checkpoint),
  /// kFailedPrecondition (a `.tmp-` folder), kDataLoss (manifest invalid, rank file missing).
  static Result<DistReader> Open(const std::filesystem::path& dir);

  DistReader(DistReader&&) noexcept;
  DistReader& operator=(DistReader&&) noexcept;
  ~DistReader();

  const DistManifest& manifest() const;
  const std::filesystem::path& dir() const;

  /// The manifest entry of a tensor. Errors: kNotFound naming rank and tensor.
  Result<const DistTensor*> FindTensor(int64_t rank, std::string_view name) const;

  /// Reads one tensor in full and verifies its checksum.
  /// Errors: kNotFound (not in the manifest), kDataLoss (file unreadable or truncated, dataset
  /// missing, dtype/shape differs, checksum mismatch; naming file, tensor and field).
  Result<Tensor> ReadTensor(int64_t rank, std::string_view name) const;
  /// Reads elements [begin, end) of the row-major flattening (no checksum: a partial read).
  /// Errors: as ReadTensor without the checksum, kOutOfRange.
  Status ReadFlatRange(int64_t rank, std::string_view name, int64_t begin_elem, int64_t end_elem,
                       std::span<std::byte> out) const;

  /// Every rank file holds exactly the manifest's datasets with their dtype, shape, checksum.
  /// Errors: the first problem, kDataLoss naming file, tensor and field.
  /// Checks that every file this reader has read (data or metadata) is still the file it was
  /// at its first read: same device, inode, size and mtime (issue 16 #8). A conversion calls it
  /// after its last read and before committing its output, so that a source modified during the
  /// run fails it instead of yielding an output that differs from the checksummed source.
  /// Errors: kDataLoss naming the first changed or removed file; kIoError.
  Status CheckSourcesUnchanged() const;

  Status Verify() const { return Verify(0, 1); }
  /// Share `part` of `parts` of that work (rank files and tensors dealt round-robin), for
  /// processes that verify one checkpoint together.
  Status Verify(int part, int parts) const;
  /// One read of the source (issue 14): from this call on, each tensor's checksum is computed
  /// from the bytes ReadFlatRange returns, in element order (XXH3 is hashed in order: a range
  /// read ahead of where a tensor's hash stopped is left for FinishVerifiedReads), and a tensor
  /// is compared as soon as its last byte has been hashed (that read fails with kDataLoss
  /// naming the file and tensor). Call before the reads start.
  void VerifyReads() const;
  /// After the last read: Verify's checks for share `part` of `parts`, each tensor's checksum
  /// finished by reading only the bytes its hash has not covered. Without VerifyReads: Verify.
  Status FinishVerifiedReads(int part, int parts) const;
  /// Bytes FinishVerifiedReads read only for their checksums.
  int64_t verify_bytes_reread() const;

 private:
  struct Impl;
  explicit DistReader(std::unique_ptr<Impl> impl);
  Status VerifyShare(int part, int parts, bool finish_reads) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::dist
