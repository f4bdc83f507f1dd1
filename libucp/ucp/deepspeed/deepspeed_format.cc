// DeepSpeed formats (see deepspeed_format.h): the source over DeepSpeedTensorSource, the
// `--format deepspeed` sink (a plan into the target's view layout, run into a DeepSpeedWriter) and
// the `--format deepspeed-universal` sink.
#include "ucp/deepspeed/deepspeed_format.h"

#include <tbb/parallel_for.h>

#include <atomic>
#include <mutex>

#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/deepspeed/deepspeed_source.h"
#include "ucp/deepspeed/deepspeed_universal.h"
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
  // The records are independent, so they are streamed in parallel (the executor's thread limit
  // applies); the first failure in record order is reported.
  Status VerifyChecksums() const override {
    const int64_t n = tensors_->num_records();
    std::vector<Status> status(static_cast<size_t>(n));
    std::atomic<bool> failed{false};
    tbb::parallel_for(
        int64_t{0}, n,
        [&](int64_t i) {
          if (failed.load(std::memory_order_relaxed)) return;
          status[static_cast<size_t>(i)] = tensors_->VerifyRecord(i);
          if (!status[static_cast<size_t>(i)].ok()) failed = true;
        },
        tbb::simple_partitioner());
    for (Status& s : status) UCP_RETURN_IF_ERROR(std::move(s));
    return Status::Ok();
  }

 private:
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
                                                              const std::string& model) {
  deepspeed::OpenOptions options;
  options.model = model;
  options.data_dir = data_dir;
  UCP_ASSIGN_OR_RETURN(deepspeed::DeepSpeedCheckpoint ck,
                       deepspeed::DeepSpeedCheckpoint::Open(dir, options));
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<deepspeed::DeepSpeedTensorSource> tensors,
                       deepspeed::DeepSpeedTensorSource::Open(ck));
  CheckpointMeta meta;
  meta.format = "deepspeed";
  meta.model_from_options = true;
  meta.dir = dir;
  meta.layout = ck.view();
  meta.spec = ck.spec();
  meta.model = ck.model();
  meta.step = ck.step();
  const std::vector<double>& h = ck.hyper();
  meta.optimizer_kind = h[4] != 0 ? "adamw" : "adam";
  meta.optimizer_hyper = {
      {"lr", h[0]}, {"beta1", h[1]}, {"beta2", h[2]}, {"eps", h[3]}, {"weight_decay", h[4]}};
  meta.optimizer_states = {"fp32", "exp_avg", "exp_avg_sq"};
  meta.framework = ck.naming() == deepspeed::Naming::kPlain ? "deepspeed" : "megatron-deepspeed";
  meta.source_layout = ck.LayoutString();
  // DeepSpeed's own layout (its dp and ZeRO stage), shown and kept by conversions.
  UCP_ASSIGN_OR_RETURN(meta.native_layout, layout::ParseLayout(meta.source_layout),
                       ck.dir().string());
  meta.source_notes = ck.dir().filename().string() + ", " + ck.optimizer() + ", " +
                      std::string(deepspeed::NamingName(ck.naming())) +
                      " names, hyper-parameters from " + ck.model_origin();
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
  if (to.ep != 1) {
    return UnimplementedError(where +
                              ": DeepSpeed-MoE expert parallelism (ep > 1) is not "
                              "written; experts are ordinary parameters at ep=1");
  }
  if (options.group != nullptr && options.group->size() > 1) {
    return UnimplementedError(
        "--format deepspeed runs in one process (every optimizer file takes "
        "slices of many parameters)");
  }
  const std::vector<std::string> adam = {"fp32", "exp_avg", "exp_avg_sq"};
  if (meta.optimizer_states != adam) {
    std::string have;
    for (const std::string& s : meta.optimizer_states) have += (have.empty() ? "" : ", ") + s;
    return UnimplementedError(where + ": the source's optimizer states are " + have +
                              "; DeepSpeed files are written for Adam (fp32, exp_avg, exp_avg_sq)");
  }
  UCP_ASSIGN_OR_RETURN(json recorded, RecordedDeepSpeed(meta));
  auto recorded_string = [&](const char* key) -> std::string {
    return recorded.is_object() && recorded.contains(key) && recorded[key].is_string()
               ? recorded[key].get<std::string>()
               : std::string();
  };

  deepspeed::DeepSpeedWriteOptions wo;
  wo.layout.tp = to.tp;
  wo.layout.pp = to.pp;
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
  // One param group when the source DeepSpeed run had one; Megatron's two otherwise.
  if (recorded.is_object() && recorded.contains("optimizer_state") &&
      recorded["optimizer_state"].is_object() &&
      recorded["optimizer_state"].contains("param_groups") &&
      recorded["optimizer_state"]["param_groups"].is_array() &&
      recorded["optimizer_state"]["param_groups"].size() == 1) {
    wo.layout.grouping = deepspeed::ParamGrouping::kSingle;
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
  wo.tag = !ds.tag.empty() ? ds.tag : recorded_string("tag");
  wo.step = meta.step;
  wo.hyper = meta.optimizer_hyper;
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

  const layout::Layout view{.tp = to.tp, .pp = to.pp};
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, view, meta.plan_options()),
                       where);
  std::error_code ec;
  if (std::filesystem::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  if (options.verify_source_checksums) {
    progress::BeginPhase("verify", progress::TreeBytes(meta.dir));
    UCP_RETURN_IF_ERROR(src.VerifyChecksums());
  }
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<deepspeed::DeepSpeedWriter> writer,
                       deepspeed::DeepSpeedWriter::Create(dst, meta.model, plan, wo), where);
  exec::ExecOptions eo;
  eo.memory_limit_bytes = options.memory_limit_bytes;
  eo.progress = options.progress;
  eo.targets = writer->targets();
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, exec::ExecutePlan(plan, src, *writer, eo));
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
    return OpenDeepSpeedSource(dir, data_dir, options.model);
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
  // Recognised (before "deepspeed", whose model-state files it also has) so that reading one
  // says what it is instead of "no optimizer files"; reading it is not implemented yet.
  bool reads() const override { return true; }
  bool Detect(const std::filesystem::path& dir) const override {
    std::error_code ec;
    return std::filesystem::is_regular_file(dir / "zero" / "optimizer_state.pt", ec);
  }
  Result<std::unique_ptr<CheckpointSource>> Open(const std::filesystem::path& dir,
                                                 const std::filesystem::path&,
                                                 const api::SourceOptions&) const override {
    return UnimplementedError(dir.string() +
                              " is DeepSpeed's universal layout (zero/<param>/*.pt), which ucp "
                              "writes for DeepSpeed but does not read yet; convert the "
                              "checkpoint it was written from");
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
