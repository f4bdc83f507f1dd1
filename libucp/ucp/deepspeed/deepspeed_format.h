// DeepSpeed / Megatron-DeepSpeed checkpoints as formats (api/format.h, ADR 0008):
// "deepspeed" reads a ZeRO checkpoint folder as its ucp layout view (ADR 0005) and writes one at a
// layout from any source (ADR 0006); "deepspeed-universal" writes DeepSpeed's own universal
// layout from a ucp universal checkpoint (deepspeed_universal.h). docs/deepspeed.md.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "ucp/api/format.h"
#include "ucp/api/source.h"
#include "ucp/base/result.h"
#include "ucp/deepspeed/naming.h"
#include "ucp/exec/executor.h"
#include "ucp/layout/layout.h"

namespace ucp::deepspeed {

/// Opens the DeepSpeed checkpoint at `dir` (a tag folder or its parent with `latest`); `model`
/// is deepspeed::OpenOptions::model (preset, model file, family or ""), `qkv_layout` its
/// qkv_layout (--qkv-layout, "" for the recorded one or per-group), rule sets and presets
/// come from `data_dir`. meta(): format kDeepSpeed, layout the view tp=T,pp=P,dp=1,zero=0,
/// framework "deepspeed" or "megatron-deepspeed", source_layout DeepSpeed's own layout, and a
/// client state {"deepspeed": {...}} for the universal manifest. `rotary_layout`
/// (--rotary-layout: interleaved, half-split; "" for the args' rotary_interleaved, else
/// half-split) is recorded as the model's rotary_interleaved hyper-parameter (docs/hf.md).
/// Errors: those of deepspeed::DeepSpeedCheckpoint::Open and DeepSpeedTensorSource::Open;
/// kInvalidArgument for a --rotary-layout the args contradict or that is not a layout name.
Result<std::unique_ptr<api::CheckpointSource>> OpenDeepSpeedSource(
    const std::filesystem::path& dir, const std::filesystem::path& data_dir,
    const std::string& model, const std::string& qkv_layout = "",
    const std::string& rotary_layout = "");

struct DeepSpeedOutputOptions {
  /// "zero" (DeepSpeedZeroOptimizer), "bf16" (BF16_Optimizer: bf16 training, ZeRO-1) or "" for
  /// the source's when it is a DeepSpeed checkpoint whose kind the layout allows, else "zero".
  std::string optimizer;
  /// "megatron-pipe" (GPTModelPipe), "megatron-gpt" (GPTModel), "plain", or "" for the naming
  /// the source recorded (a DeepSpeed source, or a universal checkpoint extracted from one),
  /// else megatron-pipe.
  std::string naming;
  /// A DeepSpeed tag folder to carry client state from (args, scheduler, RNG, optimizer
  /// hyper-parameters); "" is the source itself when it is a DeepSpeed folder, else the client
  /// state the source recorded (deepspeed::DeepSpeedWriteOptions).
  std::filesystem::path model_states_from;
  /// The fused QKV's row order written (deepspeed/qkv_layout.h): "per-group", "per-rank-blocks"
  /// or "" for the source's (CheckpointMeta::qkv_layout, else client_state.deepspeed.qkv_layout),
  /// else per-group.
  std::string qkv_layout;
  /// The tag folder; "" is global_step<iteration>, or the source's tag for a DeepSpeed source.
  std::string tag;
};

/// "megatron-pipe" | "megatron-gpt" | "plain" -> the naming. Errors: kInvalidArgument.
Result<Naming> ParseNamingOption(std::string_view text);

/// Writes `src` as a DeepSpeed checkpoint at `layout` (tp, pp, dp, sp, zero 1 or 2) in the new
/// folder `dst` (DST/latest, DST/<tag>/...), streaming: no universal copy, memory a few windows.
/// ep > 1, or a DeepSpeed-MoE source at ep=1, writes DeepSpeed-MoE's files (expert files,
/// expp_rank files, expert param groups partitioned over dp / ep; docs/deepspeed.md).
/// Errors: kInvalidArgument (zero=0, universal, a naming or optimizer the model or dtype cannot
/// take, BF16_Optimizer at ZeRO-2), kUnimplemented (DeepSpeed-MoE at pp > 1, sp > 1, ZeRO-3 or
/// a dtype other than fp32; several processes),
/// kFailedPrecondition (the model does not fit the layout), kAlreadyExists (dst exists), and
/// the errors of the source, the plan, the executor and deepspeed::DeepSpeedWriter.
Result<exec::ExecStats> ToDeepSpeed(const api::CheckpointSource& src, const layout::Layout& layout,
                                    const std::filesystem::path& dst,
                                    const api::RunOptions& options,
                                    const DeepSpeedOutputOptions& ds = {});

/// The "deepspeed" format (source and sink; options optimizer, naming, tag, model-states-from).
std::unique_ptr<api::CheckpointFormat> MakeDeepSpeedFormat();
/// The "deepspeed-universal" format (sink only, from a ucp universal source; tp and pp of the
/// layout; option model-states-from).
std::unique_ptr<api::CheckpointFormat> MakeDeepSpeedUniversalFormat();

}  // namespace ucp::deepspeed
