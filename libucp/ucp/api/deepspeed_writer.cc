// `--format deepspeed`: a plan into the target's view layout, run into a DeepSpeedWriter (see
// deepspeed_writer.h).
#include "ucp/api/deepspeed_writer.h"

#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_writer.h"
#include "ucp/json/strict_json.h"

namespace ucp::api {
namespace {

using json = ::ucp::json::Json;

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

Result<deepspeed::Naming> ParseNamingOption(std::string_view text) {
  if (text == "megatron-pipe") return deepspeed::Naming::kMegatronPipe;
  if (text == "megatron-gpt") return deepspeed::Naming::kMegatronGpt;
  if (text == "plain") return deepspeed::Naming::kPlain;
  return InvalidArgumentError("--naming must be megatron-pipe, megatron-gpt or plain, not \"" +
                              std::string(text) + "\"");
}

Result<exec::ExecStats> ToDeepSpeed(const CheckpointSource& src, const layout::Layout& to,
                                    const std::filesystem::path& dst, const RunOptions& options,
                                    const DeepSpeedOutputOptions& ds) {
  const CheckpointMeta& meta = src.meta();
  const std::string where = "--format deepspeed --layout " + layout::ToString(to);
  if (to.universal) {
    return InvalidArgumentError(where + ": a DeepSpeed checkpoint has a layout, not universal");
  }
  if (to.zero_stage == 0) {
    return InvalidArgumentError(where +
                                ": DeepSpeed's ZeRO checkpoints are written at zero=1 or zero=2; "
                                "zero=0 has no ZeRO optimizer files");
  }
  if (to.zero_stage == 3) {
    return UnimplementedError(where +
                              ": writing ZeRO-3 checkpoints is not implemented (zero=1 "
                              "and zero=2 are)");
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

  const layout::Layout view{.tp = to.tp, .pp = to.pp};
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, view, meta.plan_options()),
                       where);
  std::error_code ec;
  if (std::filesystem::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  if (options.verify_source_checksums) UCP_RETURN_IF_ERROR(src.VerifyChecksums());
  UCP_ASSIGN_OR_RETURN(std::unique_ptr<deepspeed::DeepSpeedWriter> writer,
                       deepspeed::DeepSpeedWriter::Create(dst, meta.model, plan, wo), where);
  exec::ExecOptions eo;
  eo.memory_limit_bytes = options.memory_limit_bytes;
  eo.progress = options.progress;
  eo.targets = writer->targets();
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats, exec::ExecutePlan(plan, src, *writer, eo));
  UCP_RETURN_IF_ERROR(writer->Commit(), "while writing DeepSpeed checkpoint " + dst.string());
  return stats;
}

}  // namespace ucp::api
