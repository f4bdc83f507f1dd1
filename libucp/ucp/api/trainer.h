// The trainer API: a trainer hands libucp views over its own memory for its rank (model slices
// in the training dtype, ZeRO fragments or optimizer slices in fp32), named by the plan's
// per-rank tensor names (convert/plan.h); libucp saves them as a distributed checkpoint, and
// restores a rank from any checkpoint (universal, or distributed at any layout), reading only
// what that rank needs. See examples/save_restore.cc.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ucp/api/checkpoint.h"
#include "ucp/tensor/tensor.h"

namespace ucp::api {

/// The tensors rank `rank` of `layout` holds (dp replicas of model slices included, with the
/// names of the copy dp rank 0 writes), in plan order: what a trainer allocates and hands over.
/// Errors: as convert::DescribeLayout; kOutOfRange for a rank outside the layout.
Result<std::vector<convert::TensorInfo>> RankTensors(const patterns::ResolvedModel& model,
                                                     const layout::Layout& layout, int64_t rank,
                                                     const convert::PlanOptions& options = {});

struct SaveOptions {
  /// The processes saving together (e.g. ucp::mpi::WorldGroup(), one per GPU); null: this
  /// process saves every rank. Create and Commit are collective: every process calls them.
  ProcessGroup* group = nullptr;
  /// The global ranks this process saves (with a group); every rank of the layout must be
  /// saved by exactly one process. Ignored without a group.
  std::vector<int64_t> ranks;
};

/// Saves the ranks of one layout into a distributed checkpoint, then commits it atomically. A
/// dp replica's copy of a tensor that another rank writes is checked for shape and dtype and not
/// written again. With several processes (SaveOptions::group) each saves its own ranks into one
/// temporary folder, and the root commits once all have finished.
class RankSaver {
 public:
  /// Errors: kAlreadyExists (dst exists), kFailedPrecondition (the layout cannot hold the
  /// model), kInvalidArgument (invalid layout, a rank outside it); with a group, the first
  /// error of any process.
  static Result<RankSaver> Create(const std::filesystem::path& dst, const CheckpointMeta& meta,
                                  const SaveOptions& options = {});

  RankSaver(RankSaver&&) noexcept;
  RankSaver& operator=(RankSaver&&) noexcept;
  ~RankSaver();

  /// Writes the rank's tensors from the trainer's memory (no copy). Thread-safe.
  /// Errors: kNotFound (a name that is not a tensor of this rank), kInvalidArgument (dtype or
  /// shape differs from the layout's, naming the tensor), kAlreadyExists, kFailedPrecondition
  /// (a rank this process did not say it saves), kIoError.
  Status SaveRank(int64_t rank, std::span<const std::pair<std::string, ConstTensorView>> tensors);

  /// Checks that every tensor of the layout was saved (by some process) and commits.
  /// Errors: kFailedPrecondition naming the first tensor never saved; as DistWriter::Commit;
  /// with a group, the first error of any process.
  Status Commit();

 private:
  struct Impl;
  explicit RankSaver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Fills the trainer's views for rank `rank` of `layout` from `src` (any layout or format),
/// running only the plan's part for the named tensors.
/// Errors: kNotFound (a name that is not a tensor of this rank), kInvalidArgument (dtype or
/// shape of a view differs), kFailedPrecondition (the model does not fit the layout), and the
/// source's read errors.
Status RestoreRank(const CheckpointSource& src, const layout::Layout& layout, int64_t rank,
                   std::span<const std::pair<std::string, TensorView>> tensors,
                   const RunOptions& options = {});

}  // namespace ucp::api
