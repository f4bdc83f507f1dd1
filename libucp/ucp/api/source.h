// What every checkpoint format plugs into (ADR 0008): a checkpoint on disk read as a
// CheckpointSource (its ucp layout's tensors, read by flat ranges), the description every source
// gives of itself (CheckpointMeta), and the options of the operations that run a plan from a
// source into a sink. Format plug-ins (api/format.h) implement and consume these; the facade
// (api/checkpoint.h) opens sources and runs operations through the format registry.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/api/process_group.h"
#include "ucp/base/result.h"
#include "ucp/convert/plan.h"
#include "ucp/exec/executor.h"
#include "ucp/layout/layout.h"
#include "ucp/patterns/model.h"

namespace ucp::api {

/// The checkpoint kinds of ucp's own format, as CheckpointMeta::format reports them (other
/// formats report their own registry name: "deepspeed", "hf").
struct Format {
  static constexpr std::string_view kUniversal = "ucp-universal";
  static constexpr std::string_view kDistributed = "ucp-distributed";
};

/// What every checkpoint says about itself.
struct CheckpointMeta {
  /// The kind of checkpoint: Format::kUniversal / kDistributed, or the name of the format that
  /// opened it ("deepspeed", "hf").
  std::string format = std::string(Format::kDistributed);
  layout::Layout layout;
  patterns::ModelSpec spec;  ///< templates from the family's rule set
  patterns::ResolvedModel model;
  int64_t step = 0;
  std::string optimizer_kind = "adam";
  std::map<std::string, double> optimizer_hyper;
  /// The fp32 states stored next to the model weights. A weights-only source (a Hugging Face
  /// folder) has {"fp32"}: the weights widened exactly, and no Adam moments.
  std::vector<std::string> optimizer_states = {"fp32", "exp_avg", "exp_avg_sq"};
  /// For checkpoints another framework wrote (a DeepSpeed folder, whose `layout` is the ucp view
  /// the planner reads it as): its name ("megatron-deepspeed"), its own layout string
  /// ("tp=2,pp=2,dp=2,sp=2,zero=1") and a line for `ucp inspect`. Extraction records the first
  /// two as the universal manifest's source.framework / source.layout. Empty for ucp's formats.
  std::string framework;
  std::string source_layout;
  std::string source_notes;
  /// The fused QKV's row order in the source's files where it is a property of the code that
  /// trained it (Megatron-DeepSpeed: "per-group" or "per-rank-blocks", deepspeed/qkv_layout.h);
  /// the tensors a source serves are always per-group. Extraction records it as the universal
  /// manifest's source.qkv_layout, and a universal source reports it back. Empty otherwise.
  std::string qkv_layout;
  /// Where qkv_layout came from when the source decided it at open (a DeepSpeed folder: the
  /// files' record, detected from the args, --qkv-layout, or the default and why), for the
  /// conversion summaries; empty otherwise.
  std::string qkv_layout_origin;
  /// The checkpoint's layout in its own terms where that differs from `layout` (a DeepSpeed
  /// folder: its real dp and ZeRO stage, tp=2,pp=2,dp=2,zero=1, where `layout` is the view
  /// dp=1,zero=0); unset for ucp's formats. What the CLI shows, and what a conversion keeps of
  /// the source for the keys its --layout omits.
  std::optional<layout::Layout> native_layout;
  /// native_layout when set, else layout.
  const layout::Layout& own_layout() const { return native_layout ? *native_layout : layout; }
  /// A JSON object whose members extraction adds to the universal manifest's client_state next
  /// to "ucp_model" ({"deepspeed": {"args": ..., ...}}, {"hf": {"config": ...}}): a foreign
  /// source's, or the client state a ucp checkpoint recorded; empty for none.
  std::string client_state_json;
  /// A DeepSpeed source's tag folder, whose files a DeepSpeed writer carries client state from.
  std::filesystem::path deepspeed_dir;
  /// The folder the checkpoint was opened from (empty for generated sources).
  std::filesystem::path dir;
  /// Whether SourceOptions::model bound this checkpoint's model (the format does not record
  /// one): `--model` is an error for the others.
  bool model_from_options = false;
  /// Whether the format took SourceOptions::rotary_layout (DeepSpeed, Hugging Face): the
  /// CLI refuses --rotary-layout for the others, which record their model's.
  bool rotary_layout_from_options = false;
  /// The plan options that describe what this checkpoint holds.
  convert::PlanOptions plan_options() const;
};

/// How to open a checkpoint whose files do not describe its ucp model.
struct SourceOptions {
  /// DeepSpeed folders: a preset, a model .json file or a family (deepspeed::OpenOptions::model);
  /// "" takes the model from the Megatron args and the shapes. Formats that record their model
  /// ignore it.
  std::string model;
  /// DeepSpeed folders: the fused QKV's row order (--qkv-layout: per-group, per-rank-blocks)
  /// where the files do not record it; "" takes the recorded one, else per-group.
  std::string qkv_layout;
  /// The rotary pairing of the model's q/k rows (--rotary-layout: interleaved, half-split),
  /// recorded as its rotary_interleaved hyper-parameter (docs/hf.md). DeepSpeed folders: the
  /// files' pairing where the args do not say. Hugging Face folders (half-split files): the
  /// pairing of the rows the source serves, i.e. of what a conversion writes. "" for the
  /// recorded one, else half-split. Formats that record their model refuse it (the CLI).
  std::string rotary_layout;
};

/// A checkpoint on disk, read tensor by tensor (the plan's tensor names of its layout). Each
/// format's source implements this interface (api/format.h).
class CheckpointSource : public exec::TensorSource {
 public:
  /// Opens the checkpoint folder `dir` with the format that recognises it (FormatRegistry::
  /// Detect over the built-in formats, api/format.h). Rule sets are read from `data_dir`
  /// (UcpDataDir()). Defined by the facade (ucp_api).
  /// Errors: kNotFound (no folder, or a folder no format recognises, saying what each needs),
  /// and the errors of the format's Open (kDataLoss for corrupt metadata, kFailedPrecondition
  /// for a model that does not fit, ...).
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
  /// One read of the source (issue 14): from this call on, the source checks its checksums from
  /// the bytes its reads return as they stream through the conversion, each record's (zip
  /// record, dataset) as soon as its last byte has been read (that read then fails with
  /// kDataLoss naming the file and record). Returns false for a source that cannot: its caller
  /// runs VerifyChecksums(Part) before converting instead. Not thread-safe: call it before the
  /// reads start; calling it again starts over.
  virtual bool BeginVerifiedReads() const { return false; }
  /// After the conversion's last read and before its output is committed (after
  /// BeginVerifiedReads returned true): reads only the bytes of share `part` of `parts` of the
  /// checksummed records that no read returned (padding, records the plan does not need) and
  /// compares every checksum of that share. Every process of a group calls it and the group
  /// agrees on the outcome before committing. The default verifies the share whole.
  /// Errors: kDataLoss naming file and record, read errors.
  virtual Status FinishVerifiedReads(int part, int parts) const {
    return VerifyChecksumsPart(part, parts);
  }
  /// Since BeginVerifiedReads: bytes read only for their checksums (by FinishVerifiedReads),
  /// which a run adds to its ExecStats::bytes_read.
  virtual int64_t verify_bytes_reread() const { return 0; }
};

/// The end of a conversion run after src.BeginVerifiedReads() returned true: `run` is the
/// status of the conversion's reads. Ok: FinishVerifiedReads(part, parts). kDataLoss (a
/// corrupt byte can surface as a failed replica check or a bad compressed chunk before its
/// record is complete): FinishVerifiedReads(0, 1), every record, and its checksum failure when
/// there is one, as it names the file and record, else `run`. Other errors: `run`, without
/// reading further.
Status FinishVerifiedRun(const CheckpointSource& src, Status run, int part, int parts);

/// The data folder: env UCP_DATA_DIR when set, else the compiled-in source root.
std::filesystem::path UcpDataDir();

/// Options shared by the operations.
struct RunOptions {
  int64_t memory_limit_bytes = int64_t{512} << 20;
  std::function<void(int64_t, int64_t)> progress;
  /// Verify every source checksum: from the bytes the conversion reads where the source can
  /// (CheckpointSource::BeginVerifiedReads), else in a pass before it; either way before the
  /// output is committed, so a corrupt shard fails the run and leaves no output.
  bool verify_source_checksums = true;
  /// The processes converting together, each writing a share of the output files (whole rank
  /// or parameter files, balanced by bytes) and verifying a share of the source; null: this
  /// process alone. Every process must call the operation with the same arguments.
  ProcessGroup* group = nullptr;
};

/// The executor options of a run.
exec::ExecOptions ExecOptionsOf(const RunOptions& options);

}  // namespace ucp::api
