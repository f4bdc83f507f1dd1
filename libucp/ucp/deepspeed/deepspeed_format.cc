// DeepSpeed formats (see deepspeed_format.h): the source over DeepSpeedTensorSource, the
// `--format deepspeed` sink (a plan into the target's view layout, run into a DeepSpeedWriter) and
// the `--format deepspeed-universal` sink.
#include "ucp/deepspeed/deepspeed_format.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/deepspeed/deepspeed_source.h"
#include "ucp/deepspeed/deepspeed_universal.h"
#include "ucp/deepspeed/deepspeed_universal_source.h"
#include "ucp/deepspeed/deepspeed_writer.h"
#include "ucp/io/universal/universal_checkpoint.h"
#include "ucp/json/strict_json.h"

namespace ucp::deepspeed {
namespace {

using api::CheckpointMeta;
using api::CheckpointSource;
using convert::TensorInfo;
using json = ::ucp::json::Json;

class DeepSpeedSource final : public CheckpointSource {
 public:
  DeepSpeedSource(std::unique_ptr<deepspeed::DeepSpeedTensorSource> tensors, CheckpointMeta meta)
      : tensors_(std::move(tensors)), meta_(std::move(meta)) {}
  const CheckpointMeta& meta() const override { return meta_; }
  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    return tensors_->ReadFlatRange(t, begin, end, out);
  }
  std::vector<TensorInfo> StoredTensors() const override { return tensors_->tensors(); }
  Status CheckUnchanged() const override { return tensors_->CheckUnchanged(); }
  Status VerifyChecksums() const override {
    return ForRecords(0, 1, [&](int64_t i) { return tensors_->VerifyRecord(i); });
  }
  bool BeginVerifiedReads() const override {
    tensors_->BeginVerifiedReads();
    return true;
  }
  Status FinishVerifiedReads(int part, int parts) const override {
    // A record found corrupt during the reads fails at once, without reading the rest.
    UCP_RETURN_IF_ERROR(tensors_->VerifiedReadsFailure());
    return ForRecords(part, parts, [&](int64_t i) { return tensors_->FinishVerifiedRecord(i); });
  }
  int64_t verify_bytes_reread() const override { return tensors_->verify_bytes_reread(); }

 private:
  // Runs fn on share `part` of `parts` of the records (dealt largest first to the least loaded
  // share, so every process computes the same deal). The records are independent, so they run
  // in parallel (the executor's thread limit applies); the first failure in record order is
  // reported.
  template <typename Fn>
  Status ForRecords(int part, int parts, Fn fn) const {
    const int64_t n = tensors_->num_records();
    std::vector<int64_t> mine;
    if (parts <= 1) {
      for (int64_t i = 0; i < n; ++i) mine.push_back(i);
    } else {
      std::vector<std::pair<int64_t, int64_t>> by_size;  // (-bytes, record)
      for (int64_t i = 0; i < n; ++i) by_size.emplace_back(-tensors_->record_bytes(i), i);
      std::sort(by_size.begin(), by_size.end());
      std::vector<int64_t> load(static_cast<size_t>(parts), 0);
      for (const auto& [neg, i] : by_size) {
        const auto p = std::min_element(load.begin(), load.end()) - load.begin();
        load[static_cast<size_t>(p)] -= neg;
        if (p == part) mine.push_back(i);
      }
      std::sort(mine.begin(), mine.end());
    }
    std::vector<Status> status(mine.size());
    std::atomic<bool> failed{false};
    tbb::parallel_for(
        size_t{0}, mine.size(),
        [&](size_t k) {
          if (failed.load(std::memory_order_relaxed)) return;
          status[k] = fn(mine[k]);
          if (!status[k].ok()) failed = true;
        },
        tbb::simple_partitioner());
    for (Status& s : status) UCP_RETURN_IF_ERROR(std::move(s));
    return Status::Ok();
  }

  std::unique_ptr<deepspeed::DeepSpeedTensorSource> tensors_;
  CheckpointMeta meta_;
};

// client_state.deepspeed of the source (a DeepSpeed folder's, or a universal checkpoint's
// record of one), or null.
Result<json> RecordedDeepSpeed(const CheckpointMeta& meta) {
  if (meta.client_state_json.empty()) return json();
  UCP_ASSIGN_OR_RETURN(json j,
                       ::ucp::json::ParseStrict(meta.client_state_json, "the source's client state",
                                                StatusCode::kDataLoss));
  if (!j.is_object() || !j.contains("deepspeed") || !j["deepspeed"].is_object()) return json();
  return j["deepspeed"];
}

}  // namespace

Result<std::unique_ptr<CheckpointSource>> OpenDeepSpeedSource(const std::filesystem::path& dir,
                                                              const std::filesystem::path& data_dir,
                                                              const std::string& model,
                                                              const std::string& qkv_layout,
                                                              const std::string& rotary_layout) {
  deepspeed::OpenOptions options;
  options.model = model;
  options.qkv_layout = qkv_layout;
  options.data_dir = data_dir;
  UCP_ASSIGN_OR_RETURN(deepspeed::DeepSpeedCheckpoint ck,
                       deepspeed::DeepSpeedCheckpoint::Open(dir, options));
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<deepspeed::DeepSpeedTensorSource> tensors,
                       deepspeed::DeepSpeedTensorSource::Open(ck));
  CheckpointMeta meta;
  meta.format = "deepspeed";
  meta.model_from_options = true;
  meta.rotary_layout_from_options = true;
  meta.dir = dir;
  meta.layout = ck.view();
  meta.spec = ck.spec();
  meta.model = ck.model();
  if (!rotary_layout.empty()) {
    // The rotary pairing of the q/k rows: the args' rotary_interleaved where they have it
    // (deepspeed_model.cc), else this option; it moves no bytes here (docs/hf.md).
    const std::string key(patterns::kRotaryInterleavedHyper);
    UCP_ASSIGN_OR_RETURN(int64_t interleaved,
                         patterns::ParseRotaryLayout(rotary_layout, "--rotary-layout"));
    auto recorded = meta.spec.hyper.find(key);
    if (recorded != meta.spec.hyper.end() && recorded->second != interleaved) {
      return InvalidArgumentError("--rotary-layout " + rotary_layout + " contradicts " +
                                  ck.dir().string() + ": args.rotary_interleaved = " +
                                  (recorded->second != 0 ? "True" : "False"));
    }
    meta.spec.hyper[key] = interleaved;
    meta.model.spec.hyper[key] = interleaved;
  }
  meta.step = ck.step();
  meta.optimizer_kind = ck.optimizer_kind();
  meta.optimizer_hyper = ck.optimizer_hyper();
  // The fp32 master, then the torch optimizer's own states under its names.
  meta.optimizer_states = {"fp32"};
  for (const std::string& s : ck.optimizer_states()) meta.optimizer_states.push_back(s);
  meta.framework = ck.naming() == deepspeed::Naming::kPlain ? "deepspeed" : "megatron-deepspeed";
  meta.source_layout = ck.LayoutString();
  // DeepSpeed's own layout (its dp and ZeRO stage), shown and kept by conversions.
  UCP_ASSIGN_OR_RETURN(meta.native_layout, layout::ParseLayout(meta.source_layout),
                       ck.dir().string());
  meta.source_notes = ck.dir().filename().string() + ", " + ck.optimizer() + ", " +
                      std::string(deepspeed::NamingName(ck.naming())) +
                      " names, hyper-parameters from " + ck.model_origin();
  if (deepspeed::HasFusedQkv(ck.model())) {
    meta.qkv_layout = std::string(deepspeed::QkvLayoutName(ck.qkv_layout()));
    meta.qkv_layout_origin = ck.qkv_layout_origin();
    meta.source_notes += ", QKV " + meta.qkv_layout + " (" + ck.qkv_layout_origin() + ")";
  }
  meta.client_state_json = "{\"deepspeed\":" + ck.client_state_json() + "}";
  if (!ck.ucp_client_state_json().empty()) {
    // Another framework's client state a ucp writer carried through (a ucp-train run's).
    const std::string where = ck.dir().string() + ": ucp_client_state";
    UCP_ASSIGN_OR_RETURN(json carried, ::ucp::json::ParseStrict(ck.ucp_client_state_json(), where,
                                                                StatusCode::kDataLoss));
    if (!carried.is_object()) return DataLossError(where + " is not a JSON object");
    UCP_ASSIGN_OR_RETURN(json all, ::ucp::json::ParseStrict(meta.client_state_json, where,
                                                            StatusCode::kInternal));
    for (auto& [k, v] : carried.items()) {
      if (k != "deepspeed" && k != "ucp_model") all[k] = std::move(v);
    }
    meta.client_state_json = all.dump();
  }
  meta.deepspeed_dir = ck.dir();
  return std::unique_ptr<CheckpointSource>(
      new DeepSpeedSource(std::move(tensors), std::move(meta)));
}

Result<deepspeed::Naming> ParseNamingOption(std::string_view text) {
  if (text == "megatron-pipe") return deepspeed::Naming::kMegatronPipe;
  if (text == "megatron-gpt") return deepspeed::Naming::kMegatronGpt;
  if (text == "plain") return deepspeed::Naming::kPlain;
  return InvalidArgumentError("--naming must be megatron-pipe, megatron-gpt or plain, not \"" +
                              std::string(text) + "\"");
}

Result<exec::ExecStats> ToDeepSpeed(const CheckpointSource& src, const layout::Layout& to,
                                    const std::filesystem::path& dst,
                                    const api::RunOptions& options,
                                    const DeepSpeedOutputOptions& ds) {
  const CheckpointMeta& meta = src.meta();
  const std::string where = "--format deepspeed --layout " + layout::ToString(to);
  if (to.universal) {
    return InvalidArgumentError(where + ": a DeepSpeed checkpoint has a layout, not universal");
  }
  if (to.zero_stage == 0) {
    return InvalidArgumentError(where +
                                ": DeepSpeed's ZeRO checkpoints are written at zero=1, 2 or 3; "
                                "zero=0 has no ZeRO optimizer files");
  }
  if (options.group != nullptr && options.group->size() > 1) {
    return UnimplementedError(
        "--format deepspeed runs in one process (every optimizer file takes "
        "slices of many parameters)");
  }
  UCP_ASSIGN_OR_RETURN(json recorded, RecordedDeepSpeed(meta));
  // The fp32 master, then the torch optimizer's states under their own names (carried from a
  // DeepSpeed source: SGD's momentum_buffer, Adagrad's sum, ...).
  std::string have;
  for (const std::string& s : meta.optimizer_states) have += (have.empty() ? "" : ", ") + s;
  if (meta.optimizer_states.empty() || meta.optimizer_states[0] != "fp32") {
    return UnimplementedError(where + ": the source's optimizer states are " + have +
                              ", without the fp32 master weights DeepSpeed's optimizer files "
                              "hold first");
  }
  if (meta.optimizer_states.size() == 1 && !recorded.is_object()) {
    return UnimplementedError(where + ": the source holds no optimizer state (" + have +
                              "; a weights-only checkpoint), and no DeepSpeed run recorded "
                              "which optimizer it is; DeepSpeed's files need the optimizer's");
  }
  const std::vector<std::string> torch_states(meta.optimizer_states.begin() + 1,
                                              meta.optimizer_states.end());
  auto recorded_string = [&](const char* key) -> std::string {
    return recorded.is_object() && recorded.contains(key) && recorded[key].is_string()
               ? recorded[key].get<std::string>()
               : std::string();
  };

  deepspeed::DeepSpeedWriteOptions wo;
  wo.layout.tp = to.tp;
  wo.layout.pp = to.pp;
  wo.layout.stages = to.stages;
  wo.layout.dp = to.dp;
  wo.layout.sp = to.sp;
  wo.layout.zero_stage = to.zero_stage;
  if (!ds.naming.empty()) {
    UCP_ASSIGN_OR_RETURN(wo.layout.naming, ParseNamingOption(ds.naming));
  } else if (const std::string n = recorded_string("naming"); !n.empty()) {
    UCP_ASSIGN_OR_RETURN(wo.layout.naming, deepspeed::NamingFromName(n),
                         "the source's recorded naming");
  } else {
    wo.layout.naming = deepspeed::Naming::kMegatronPipe;
  }
  // ZeRO-3 runs without DeepSpeed's pipeline engine: a GPTModelPipe source's names become
  // GPTModel's unless --naming asks otherwise (then DescribeDeepSpeedTarget refuses it).
  if (to.zero_stage == 3 && ds.naming.empty() &&
      wo.layout.naming == deepspeed::Naming::kMegatronPipe) {
    wo.layout.naming = deepspeed::Naming::kMegatronGpt;
  }
  // One param group when the source DeepSpeed run had one (besides DeepSpeed-MoE's expert
  // groups); Megatron's two otherwise.
  if (recorded.is_object() && recorded.contains("optimizer_state") &&
      recorded["optimizer_state"].is_object() &&
      recorded["optimizer_state"].contains("param_groups") &&
      recorded["optimizer_state"]["param_groups"].is_array()) {
    size_t dense = 0;
    for (const json& g : recorded["optimizer_state"]["param_groups"]) {
      if (!(g.is_object() && g.contains("moe") && g["moe"] == true)) ++dense;
    }
    if (dense == 1) wo.layout.grouping = deepspeed::ParamGrouping::kSingle;
  }
  // DeepSpeed-MoE files (expert files, expp_rank files, expert param groups over dp / ep) at
  // ep > 1, and at ep=1 when the source was DeepSpeed-MoE: an engine with MoE layers loads
  // nothing else. Otherwise experts are ordinary parameters under ucp's names.
  wo.layout.ep = to.ep;
  wo.layout.deepspeed_moe =
      to.ep > 1 || (recorded.is_object() && recorded.contains("deepspeed_moe") &&
                    recorded["deepspeed_moe"] == true);
  if (wo.layout.deepspeed_moe && meta.model.spec.dtype != DType::kFp32) {
    return UnimplementedError(
        where + ": DeepSpeed-MoE is written for fp32 training only, not " +
        std::string(DTypeName(meta.model.spec.dtype)) +
        " (the missing piece: DeepSpeed-MoE's model states hold no ds_config, so the training "
        "dtype is not in them for a reader, and no bf16 / fp16 MoE run has been checked "
        "against the engine)");
  }
  const bool bf16_allowed = meta.model.spec.dtype == DType::kBf16 && to.zero_stage == 1;
  if (ds.optimizer == "bf16") {
    if (!bf16_allowed) {
      return InvalidArgumentError(
          "--optimizer bf16: BF16_Optimizer checkpoints need bf16 training at zero=1; this is " +
          std::string(DTypeName(meta.model.spec.dtype)) +
          " at zero=" + std::to_string(to.zero_stage) + " (use --optimizer zero)");
    }
    wo.bf16_optimizer = true;
  } else if (ds.optimizer.empty()) {
    wo.bf16_optimizer = bf16_allowed && recorded_string("optimizer") == "bf16_optimizer";
  } else if (ds.optimizer != "zero") {
    return InvalidArgumentError("--optimizer must be zero or bf16, not \"" + ds.optimizer + "\"");
  }
  // The fused QKV's row order: --write-qkv-layout, else the source's (a DeepSpeed folder's, or
  // what a universal or ucp checkpoint recorded of one), else ucp's own per-group.
  if (!ds.qkv_layout.empty()) {
    UCP_ASSIGN_OR_RETURN(wo.qkv_layout,
                         deepspeed::ParseQkvLayout(ds.qkv_layout, "--write-qkv-layout"));
  } else if (!meta.qkv_layout.empty()) {
    UCP_ASSIGN_OR_RETURN(wo.qkv_layout,
                         deepspeed::ParseQkvLayout(meta.qkv_layout, "the source's QKV order"));
  } else if (const std::string q = recorded_string("qkv_layout"); !q.empty()) {
    UCP_ASSIGN_OR_RETURN(wo.qkv_layout, deepspeed::ParseQkvLayout(
                                            q, "the source's client_state.deepspeed.qkv_layout"));
  }
  wo.tag = !ds.tag.empty() ? ds.tag : recorded_string("tag");
  wo.step = meta.step;
  wo.hyper = meta.optimizer_hyper;
  wo.optimizer_states = torch_states;
  wo.model_states_from = !ds.model_states_from.empty() ? ds.model_states_from : meta.deepspeed_dir;
  if (recorded.is_object()) wo.client_state_json = recorded.dump();
  // The rest of the source's client state (a ucp-train run's) rides along as a string.
  if (!meta.client_state_json.empty()) {
    UCP_ASSIGN_OR_RETURN(json all, ::ucp::json::ParseStrict(meta.client_state_json,
                                                            "the source's client state",
                                                            StatusCode::kInvalidArgument));
    if (all.is_object()) {
      all.erase("deepspeed");
      all.erase("ucp_model");
      if (!all.empty()) wo.ucp_client_state_json = all.dump();
    }
  }

  const layout::Layout view{.tp = to.tp, .pp = to.pp, .stages = to.stages};
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, view, meta.plan_options()),
                       where);
  std::error_code ec;
  if (std::filesystem::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  // One read of the source (issue 14), as api::Extract: checksums from the conversion's reads
  // where the source can, else a pass before it; either way before the commit.
  const bool streamed = options.verify_source_checksums && src.BeginVerifiedReads();
  if (options.verify_source_checksums && !streamed) {
    progress::BeginPhase("verify", progress::TreeBytes(meta.dir));
    UCP_RETURN_IF_ERROR(src.VerifyChecksums());
  }
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<deepspeed::DeepSpeedWriter> writer,
                       deepspeed::DeepSpeedWriter::Create(dst, meta.model, plan, wo), where);
  exec::ExecOptions eo;
  eo.memory_limit_bytes = options.memory_limit_bytes;
  eo.progress = options.progress;
  eo.targets = writer->targets();
  Result<exec::ExecStats> run = exec::ExecutePlan(plan, src, *writer, eo);
  if (streamed) {
    UCP_RETURN_IF_ERROR(api::FinishVerifiedRun(src, run.status(), 0, 1));
    if (run.ok()) run->bytes_read += src.verify_bytes_reread();
  }
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, std::move(run));
  progress::BeginPhase("commit", 0);
  UCP_RETURN_IF_ERROR(writer->Commit(), "while writing DeepSpeed checkpoint " + dst.string());
  return stats;
}

namespace {

class DeepSpeedFormat final : public api::CheckpointFormat {
 public:
  std::string_view name() const override { return "deepspeed"; }
  std::string_view root_pointer_file() const override { return "latest"; }
  bool writes_root() const override { return true; }
  std::string_view summary() const override {
    return "DeepSpeed / Megatron-DeepSpeed ZeRO-1/2 and BF16_Optimizer checkpoint folders";
  }
  bool reads() const override { return true; }
  bool Detect(const std::filesystem::path& dir) const override {
    return LooksLikeDeepSpeedCheckpoint(dir);
  }
  std::string_view detect_hint() const override { return "DeepSpeed's mp_rank_*_model_states.pt"; }
  Result<std::unique_ptr<CheckpointSource>> Open(const std::filesystem::path& dir,
                                                 const std::filesystem::path& data_dir,
                                                 const api::SourceOptions& options) const override {
    return OpenDeepSpeedSource(dir, data_dir, options.model, options.qkv_layout,
                               options.rotary_layout);
  }
  bool writes() const override { return true; }
  std::vector<api::FormatOption> write_options() const override {
    return {{"optimizer",
             "--format deepspeed: zero (DeepSpeedZeroOptimizer files) or bf16 (BF16_Optimizer: "
             "bf16 at zero=1); default: the source's, else zero",
             ""},
            {"naming",
             "--format deepspeed: megatron-pipe (GPTModelPipe), megatron-gpt (GPTModel) or "
             "plain; default: the source's recorded naming, else megatron-pipe",
             ""},
            {"write-qkv-layout",
             "--format deepspeed: the fused QKV's row order, per-group (Megatron-DeepSpeed before "
             "PR #441) or per-rank-blocks (since PR #441); default: the source's, else per-group",
             ""},
            {"tag",
             "--format deepspeed: the tag folder (default: the source's, else "
             "global_step<iteration>)",
             ""},
            {"model-states-from",
             "--format deepspeed, deepspeed-universal: a DeepSpeed tag folder whose client state "
             "(args, scheduler, RNG, optimizer hyper-parameters) is carried over",
             ""}};
  }
  Result<exec::ExecStats> Write(const CheckpointSource& src, const std::filesystem::path& dst,
                                const api::WriteRequest& request) const override {
    DeepSpeedOutputOptions ds;
    ds.optimizer = request.Option("optimizer");
    ds.naming = request.Option("naming");
    ds.tag = request.Option("tag");
    ds.qkv_layout = request.Option("write-qkv-layout");
    ds.model_states_from = request.Option("model-states-from");
    return ToDeepSpeed(src, request.layout, dst, request.run, ds);
  }
  std::string_view written_noun() const override { return "DeepSpeed checkpoint"; }
};

// DeepSpeed's own universal layout, for `--universal-checkpoint` resumes; its loader cuts the
// new layout itself, so only tp and pp (the model-state files) come from the layout.
class DeepSpeedUniversalFormat final : public api::CheckpointFormat {
 public:
  std::string_view name() const override { return "deepspeed-universal"; }
  std::string_view root_pointer_file() const override { return "latest_universal"; }
  std::string_view summary() const override {
    return "DeepSpeed's universal layout (zero/<param>/fp32.pt ...), for DeepSpeed's "
           "--universal-checkpoint resume";
  }
  // Recognised before "deepspeed", whose model-state files it also has; read as a universal
  // source (deepspeed_universal_source.h).
  bool reads() const override { return true; }
  bool Detect(const std::filesystem::path& dir) const override {
    std::error_code ec;
    return std::filesystem::is_regular_file(dir / "zero" / "optimizer_state.pt", ec);
  }
  Result<std::unique_ptr<CheckpointSource>> Open(const std::filesystem::path& dir,
                                                 const std::filesystem::path& data_dir,
                                                 const api::SourceOptions& options) const override {
    return OpenDeepSpeedUniversalSource(dir, data_dir, options.model);
  }
  bool writes() const override { return true; }
  std::vector<api::FormatOption> write_options() const override {
    return {{"model-states-from",
             "--format deepspeed, deepspeed-universal: a DeepSpeed tag folder whose client state "
             "(args, scheduler, RNG, optimizer hyper-parameters) is carried over",
             ""}};
  }
  Result<exec::ExecStats> Write(const CheckpointSource& src, const std::filesystem::path& dst,
                                const api::WriteRequest& request) const override {
    UCP_ASSIGN_OR_RETURN(io::UniversalReader reader, io::UniversalReader::Open(src.meta().dir),
                         "SRC");
    DeepSpeedUniversalOptions ds;
    ds.tp = request.layout.universal ? 1 : request.layout.tp;
    ds.pp = request.layout.universal ? 1 : request.layout.pp;
    ds.ep = request.layout.universal ? 1 : request.layout.ep;
    ds.model_states_from = request.Option("model-states-from");
    Status written = WriteDeepSpeedUniversal(reader, dst, ds);
    if (written.code() == StatusCode::kUnimplemented) {
      // A rule DeepSpeed's universal loader cannot cut; its ZeRO checkpoints hold any model.
      written = Status(written.code(), written.message() +
                                           "; --format deepspeed writes this model (DeepSpeed "
                                           "ZeRO files at a layout)");
    }
    UCP_RETURN_IF_ERROR(written, "while writing DeepSpeed universal checkpoint " + dst.string());
    return exec::ExecStats{};
  }
  bool needs_universal_source() const override { return true; }
  std::string_view written_noun() const override { return "DeepSpeed universal checkpoint"; }
};

}  // namespace

std::unique_ptr<api::CheckpointFormat> MakeDeepSpeedFormat() {
  return std::make_unique<DeepSpeedFormat>();
}

std::unique_ptr<api::CheckpointFormat> MakeDeepSpeedUniversalFormat() {
  return std::make_unique<DeepSpeedUniversalFormat>();
}

}  // namespace ucp::deepspeed
