// The facade the CLI and trainers call: open any checkpoint as a CheckpointSource, and the
// whole-checkpoint operations (generate, extract, reshard, convert, verify, diff) built from a
// plan (convert/) run by the executor (exec/) between readers and writers (io/, dist/).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ucp/api/process_group.h"
#include "ucp/base/result.h"
#include "ucp/convert/plan.h"
#include "ucp/exec/executor.h"
#include "ucp/layout/layout.h"
#include "ucp/patterns/model.h"

namespace ucp::api {

enum class Format : uint8_t { kUniversal, kDistributed, kDeepSpeed };
/// "ucp-universal", "ucp-distributed", "deepspeed".
std::string_view FormatName(Format f);

/// What every checkpoint says about itself.
struct CheckpointMeta {
  Format format = Format::kDistributed;
  layout::Layout layout;
  patterns::ModelSpec spec;  ///< templates from the family's rule set
  patterns::ResolvedModel model;
  int64_t step = 0;
  std::string optimizer_kind = "adam";
  std::map<std::string, double> optimizer_hyper;
  std::vector<std::string> optimizer_states = {"fp32", "exp_avg", "exp_avg_sq"};
  /// For checkpoints another framework wrote (a DeepSpeed folder, whose `layout` is the ucp view
  /// the planner reads it as): its name ("megatron-deepspeed"), its own layout string
  /// ("tp=2,pp=2,dp=2,sp=2,zero=1") and a line for `ucp inspect`. Extraction records the first
  /// two as the universal manifest's source.framework / source.layout. Empty for ucp's formats.
  std::string framework;
  std::string source_layout;
  std::string source_notes;
  /// A JSON object whose members extraction adds to the universal manifest's client_state next
  /// to "ucp_model" ({"deepspeed": {"args": ..., ...}}): a DeepSpeed source's, or the client
  /// state a universal checkpoint recorded; empty for none.
  std::string client_state_json;
  /// A DeepSpeed source's tag folder, whose files a DeepSpeed writer carries client state from.
  std::filesystem::path deepspeed_dir;
  /// The plan options that describe what this checkpoint holds.
  convert::PlanOptions plan_options() const;
};

/// How to open a checkpoint whose files do not describe its ucp model.
struct SourceOptions {
  /// DeepSpeed folders: a preset, a model .json file or a family (deepspeed::OpenOptions::model);
  /// "" takes the model from the Megatron args and the shapes. ucp's own formats record their
  /// model and ignore it.
  std::string model;
};

/// A checkpoint on disk, read tensor by tensor (the plan's tensor names of its layout). The
/// DeepSpeed reader (api/deepspeed_source.h) plugs in by implementing this interface.
class CheckpointSource : public exec::TensorSource {
 public:
  /// Opens a universal (manifest.json) or distributed (ucp_layout.json) folder, or a DeepSpeed /
  /// Megatron-DeepSpeed one (OpenDeepSpeedSource in api/deepspeed_source.h). Rule sets are read
  /// from `data_dir` (UcpDataDir()).
  /// Errors: kNotFound (no folder, or a folder that is no complete checkpoint), kDataLoss
  /// (corrupt metadata, missing rank file), kFailedPrecondition (a universal checkpoint without
  /// the ucp model description), errors of the model's rule set, errors of OpenDeepSpeedSource.
  static Result<std::unique_ptr<CheckpointSource>> Open(const std::filesystem::path& dir,
                                                        const std::filesystem::path& data_dir,
                                                        const SourceOptions& options = {});
  virtual const CheckpointMeta& meta() const = 0;
  /// The tensors on disk as (dtype, shape, name, rank); for checks against the plan.
  virtual std::vector<convert::TensorInfo> StoredTensors() const = 0;
  /// Checksums of every stored tensor. Errors: kDataLoss naming file, tensor and field.
  virtual Status VerifyChecksums() const = 0;
  /// Share `part` of `parts` of VerifyChecksums, for processes that convert one checkpoint
  /// together (RunOptions::group). The default has part 0 verify everything.
  virtual Status VerifyChecksumsPart(int part, int /*parts*/) const {
    return part == 0 ? VerifyChecksums() : Status::Ok();
  }
};

/// The data folder: env UCP_DATA_DIR when set, else the compiled-in source root.
std::filesystem::path UcpDataDir();

/// Options shared by the operations.
struct RunOptions {
  int64_t memory_limit_bytes = int64_t{512} << 20;
  std::function<void(int64_t, int64_t)> progress;
  /// Verify every source checksum before converting (the executor's range reads cannot), so a
  /// corrupt shard fails the run before any output is written.
  bool verify_source_checksums = true;
  /// The processes converting together, each writing a share of the output files (whole rank
  /// or parameter files, balanced by bytes) and verifying a share of the source; null: this
  /// process alone. Every process must call the operation with the same arguments.
  ProcessGroup* group = nullptr;
};

/// Loads a preset / model file and resolves it against its family's rules; `dtype` (when not
/// empty) replaces the training dtype.
/// Errors: those of patterns::LoadModel / LoadRuleSet / Resolve; kInvalidArgument (dtype name).
Result<std::pair<patterns::ModelSpec, patterns::ResolvedModel>> LoadResolvedModel(
    const std::filesystem::path& data_dir, const std::string& model, const std::string& dtype);

/// A deterministic random checkpoint: full tensors drawn from `seed` (a pure function of seed,
/// parameter, state and element index), then sharded to `layout` (distributed) or written
/// universal when layout.universal.
/// Errors: kAlreadyExists (dst exists), kFailedPrecondition (layout cannot hold the model), I/O.
Result<exec::ExecStats> Generate(const patterns::ModelSpec& spec,
                                 const patterns::ResolvedModel& model, const layout::Layout& layout,
                                 uint64_t seed, const std::filesystem::path& dst,
                                 const RunOptions& options);

/// Any source -> universal at dst. Errors: as Open, the plan, the executor and the writer.
Result<exec::ExecStats> Extract(const CheckpointSource& src, const std::filesystem::path& dst,
                                const RunOptions& options);

/// Any source -> distributed at `layout`, without a universal copy on disk (reshard from a
/// universal source, convert from a distributed one).
/// Errors: kFailedPrecondition (the model does not fit the layout), as Extract.
Result<exec::ExecStats> ToLayout(const CheckpointSource& src, const layout::Layout& layout,
                                 const std::filesystem::path& dst, const RunOptions& options);

/// Checksums, the stored tensor set against the layout's (names, dtypes, shapes), and coverage
/// (every element of every parameter state written exactly once by the plan to universal), and
/// replicated copies equal.
/// Errors: kDataLoss naming the problem; kInternal for a coverage failure.
Status Verify(const CheckpointSource& src);

/// The first difference between two checkpoints' logical content, if any.
struct DiffResult {
  bool equal = true;
  std::string first_difference;  ///< "parameter \"X\" state \"fp32\": element 17: 0.5 vs 0.25"
  int64_t tensors_compared = 0;
};
/// Compares logical (universal) content, whatever the layouts or formats: the same parameters,
/// states, dtypes and shapes, and elements equal bitwise (atol 0) or within atol.
/// Errors: as Extract (reading either side).
Result<DiffResult> Diff(const CheckpointSource& a, const CheckpointSource& b, double atol,
                        const RunOptions& options);

}  // namespace ucp::api
