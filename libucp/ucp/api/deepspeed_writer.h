// Writing a DeepSpeed / Megatron-DeepSpeed ZeRO checkpoint at a layout from any checkpoint
// source (ucp distributed, universal, or a DeepSpeed folder): `ucp reshard|convert --format
// deepspeed`. The plan goes from the source into the target's ucp view layout
// (tp=T,pp=P,dp=1,zero=0) and deepspeed::DeepSpeedWriter places the view's slices into
// DeepSpeed's files (docs/deepspeed.md "Writing", ADR 0006).
#pragma once

#include <filesystem>
#include <string>

#include "ucp/api/checkpoint.h"
#include "ucp/base/result.h"
#include "ucp/deepspeed/naming.h"
#include "ucp/exec/executor.h"
#include "ucp/layout/layout.h"

namespace ucp::api {

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
  /// The tag folder; "" is global_step<iteration>, or the source's tag for a DeepSpeed source.
  std::string tag;
};

/// "megatron-pipe" | "megatron-gpt" | "plain" -> the naming. Errors: kInvalidArgument.
Result<deepspeed::Naming> ParseNamingOption(std::string_view text);

/// Writes `src` as a DeepSpeed checkpoint at `layout` (tp, pp, dp, sp, zero 1 or 2) in the new
/// folder `dst` (DST/latest, DST/<tag>/...), streaming: no universal copy, memory a few windows.
/// Errors: kInvalidArgument (zero=0, universal, a naming or optimizer the model or dtype cannot
/// take, BF16_Optimizer at ZeRO-2), kUnimplemented (zero=3, ep > 1, several processes),
/// kFailedPrecondition (the model does not fit the layout), kAlreadyExists (dst exists), and
/// the errors of the source, the plan, the executor and deepspeed::DeepSpeedWriter.
Result<exec::ExecStats> ToDeepSpeed(const CheckpointSource& src, const layout::Layout& layout,
                                    const std::filesystem::path& dst, const RunOptions& options,
                                    const DeepSpeedOutputOptions& ds = {});

}  // namespace ucp::api
