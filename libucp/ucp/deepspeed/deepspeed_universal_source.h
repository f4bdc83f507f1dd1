// Reading DeepSpeed's universal checkpoint layout (shared/reference/deepspeed_ucp.md 6): what
// ucp's `--format deepspeed-universal` writes and what DeepSpeed's ds_to_universal.py writes,
// opened as a ucp universal source (full fp32 tensors per parameter), so that every format ucp
// writes is read back (issue 15 #5). docs/deepspeed.md "Reading DeepSpeed's universal layout".
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "ucp/api/source.h"
#include "ucp/base/result.h"

namespace ucp::deepspeed {

/// Opens the universal folder `dir` (zero/<engine name>/{fp32,exp_avg,exp_avg_sq}.pt [step.pt],
/// zero/optimizer_state.pt, and the model-state files: mp_rank_*_model_states.pt, or those of
/// ds_to_universal's ZeRO-3 path, zero_pp_rank_*_mp_rank_*_model_states.pt, a full dp x tp grid).
/// Every .pt is parsed strictly at open (TorchFile: zip, pickle, storage records), each state
/// file must be {'param': fp32 tensor, ['cat_dim': int], ['vocab_tensor': bool], ...} or a bare
/// fp32 tensor (in a ZeRO-3 folder of tp=1: flat, shaped by rank 0's param_shapes), the three
/// states of a parameter of one shape. The step: step.pt, else the Adam step of
/// optimizer_state.pt (ZeRO-3), else rank 0's iteration, else its global_steps. The model:
/// `model` (a preset or model file; a family takes the hyper-parameters from the Megatron args),
/// else the `ucp_model` rank 0's model states record (ucp's writers save it), else the Megatron
/// `args` there with the sizes they lack read off the tensors' shapes. Tensors are read by
/// ranges of their storages (memory: the windows).
/// meta(): format "deepspeed-universal", the universal layout, framework "deepspeed" or
/// "megatron-deepspeed", client state {"deepspeed": {"naming": ...}}.
/// Errors: kNotFound (no zero/ folder, optimizer_state.pt, rank 0's model-state file or one of
/// the ZeRO-3 grid, a parameter's folder or state file, a param_shapes entry a flat state needs,
/// naming it), kDataLoss (a corrupt or truncated .pt, a value of the wrong kind, states of
/// different shapes, a flat state whose element count is not its param_shapes', sub-group steps
/// that differ, model-state files of both kinds, naming file, parameter and field),
/// kInvalidArgument (names of two namings, names no rule set fits, no model recorded and none
/// given), kFailedPrecondition (a shape that differs from the model's), kUnimplemented (a state
/// that is not fp32, a bare state in a ZeRO-3 folder of tp > 1, whose full shape is not
/// recorded).
Result<std::unique_ptr<api::CheckpointSource>> OpenDeepSpeedUniversalSource(
    const std::filesystem::path& dir, const std::filesystem::path& data_dir,
    const std::string& model);

}  // namespace ucp::deepspeed
