// Writing DeepSpeed's own universal checkpoint layout (shared/reference/deepspeed_ucp.md 6) from a
// ucp universal checkpoint, for DeepSpeed's `--universal-checkpoint` resume: one folder per
// parameter under the engine's name, holding the full fp32 state tensors.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"
#include "ucp/io/universal/universal_checkpoint.h"
#include "ucp/patterns/model.h"

namespace ucp::deepspeed {

struct DeepSpeedUniversalOptions {
  /// The DeepSpeed tag folder the universal checkpoint came from: its mp_rank_*_model_states.pt
  /// are copied byte for byte (client state: args, RNG, scheduler), as DeepSpeed's converter
  /// does. Empty: minimal mp_rank_00_model_states.pt files are written from the manifest.
  std::filesystem::path model_states_from;
  int tp = 1;  ///< the layout the model-state files describe when written from scratch
  int pp = 1;
  /// The expert-parallel size asked for: per-expert parameters at ep > 1 are refused
  /// (kUnimplemented), since DeepSpeed's universal loader cannot place expert-parallel slices.
  int ep = 1;
  /// The family or preset whose rule set gives cat_dim; "" is the manifest's source_model
  /// (recognised from the names when that is empty too).
  std::string model;
  std::filesystem::path data_dir;  ///< as OpenOptions::data_dir
};

/// Writes DeepSpeed's universal layout at `dst` (a new folder): zero/<engine name>/{fp32,
/// exp_avg,exp_avg_sq}.pt as dicts {'param': full tensor, ...} whose keys make DeepSpeed's
/// load_hp_checkpoint_state cut each tp rank's slice as ucp's rule places it: none (replicate,
/// average), 'cat_dim' (shard, interleaved_groups fuse), 'cat_dim' 0 + 'vocab_tensor' (pad_strip),
/// 'cat_dim' + 'param_n_sub_params' (concat fuse of equal parts: SwiGLU) or 'sub_param_shape'
/// (concat fuse of unequal parts),
/// zero/<engine name>/step.pt, zero/optimizer_state.pt and mp_rank_XX_model_states.pt (those
/// written from scratch record the model as `ucp_model` {name, family, dtype, hyper}, so that
/// ucp reads the folder back: deepspeed_universal_source.h), built in
/// a `dst.tmp-XXXXXX` sibling and renamed into place. Nothing is written outside dst: DeepSpeed's
/// dirname(dst)/latest_universal pointer is the caller's to write (`ucp ... --into-root`).
/// Engine names follow the naming the
/// client state's "deepspeed" object records (an extraction from DeepSpeed), else GPTModelPipe's.
/// Errors: kAlreadyExists (dst exists); kInvalidArgument (a parameter matched by no rule or
/// two, names no rule set fits, concat parts of unknown or inconsistent sizes);
/// kUnimplemented (what DeepSpeed's loader cannot cut: interleaved_groups off dim 0, pad_strip
/// off dim 0, axis ep, per-expert parameters at ep > 1); errors of
/// UniversalReader, DeepSpeedCheckpoint::Open (model_states_from) and TorchWriter.
/// The rule set for `model` (a family or a preset) in `rules_dir`, or, when it is empty, the one
/// rule set there that gives every canonical name in `names` exactly one rule.
/// Errors: kInvalidArgument (a name matched by no rule or two, names two rule sets fit),
/// kNotFound (no rule set), the errors of patterns::LoadRuleSet / LoadModel.
Result<patterns::RuleSet> SelectUniversalRuleSet(const std::filesystem::path& rules_dir,
                                                 const std::string& model,
                                                 const std::vector<std::string>& names);

Status WriteDeepSpeedUniversal(const io::UniversalReader& reader, const std::filesystem::path& dst,
                               const DeepSpeedUniversalOptions& options = {});

}  // namespace ucp::deepspeed
