// Writing DeepSpeed ZeRO-1/2 and BF16_Optimizer checkpoints that DeepSpeed's own load_checkpoint
// loads at their layout (docs/deepspeed.md, "Writing"; shared/reference/deepspeed_ucp.md 2):
//
//   DST/latest                                   the tag
//   DST/<tag>/mp_rank_XX_model_states.pt         module (or None + layer files), param_shapes,
//                                                dp/mp world sizes, scheduler, client state
//   DST/<tag>/layer_IDX-model_TT-model_states.pt GPTModelPipe: each layer's weights
//   DST/<tag>/[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt
//                                                the flat fp32 and optimizer-state partitions,
//                                                param_slice_mappings, optimizer metadata
//   DeepSpeed-MoE (DeepSpeedLayout::deepspeed_moe): mp_rank files without the experts and with
//   num_experts, DST/<tag>/layer_L_expert_E_mp_rank_XX_model_states.pt per expert,
//   DST/<tag>/expp_rank_E_mp_rank_XX_optim_states.pt per ep rank, and in each zero_pp_rank_D
//   file the expert groups of ep rank D % ep (partition D / ep of dp / ep)
//
// The writer is the executor's sink for a plan into the target's ucp view layout
// (tp=T,pp=P,dp=1,zero=0, as the DeepSpeed reader presents a checkpoint): each model slice and
// each ZeRO-0 optimizer slice of a (pp, tp) rank is placed, window by window, into the flat
// partitions of that rank's dp * sp optimizer files (deepspeed_target.h says where) or into its
// module record. Every file is laid out when the writer is created (pickles, headers, room for
// every tensor) and the slices are written into it with pwrite as they stream in, so memory is a
// few windows whatever the size of a partition (ADR 0006). Everything is written under
// DST.tmp-XXXXXX, fsynced and renamed to DST on Commit.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/convert/plan.h"
#include "ucp/deepspeed/deepspeed_target.h"
#include "ucp/deepspeed/qkv_layout.h"
#include "ucp/exec/executor.h"
#include "ucp/patterns/model.h"

namespace ucp::deepspeed {

struct DeepSpeedWriteOptions {
  DeepSpeedLayout layout;
  /// BF16_Optimizer files (bf16 training, ZeRO-1; `bf16_` prefix, no zero_stage, padding kept in
  /// the fp32 partitions) instead of DeepSpeedZeroOptimizer's.
  bool bf16_optimizer = false;
  /// The tag folder's name; "" is global_step<iteration>.
  std::string tag;
  /// Adam's step count, written into every param group's state.
  int64_t step = 0;
  /// lr, beta1, beta2, eps, weight_decay: the param groups' hyper-parameters when no source
  /// DeepSpeed checkpoint gives them.
  std::map<std::string, double> hyper;
  /// A DeepSpeed tag folder whose client state is carried over: the Megatron args (with the
  /// parallel sizes set to the new layout), iteration, tokens, the learning-rate scheduler,
  /// RNG states, the optimizer's param-group hyper-parameters, loss scaler and clip_grad.
  std::filesystem::path model_states_from;
  /// Else the client state an extraction from DeepSpeed recorded (the JSON object
  /// client_state.deepspeed of a universal checkpoint), carried where JSON kept it; "" for none.
  std::string client_state_json;
  /// The torch optimizer's per-element states after the fp32 master, in the order its
  /// per-group state keeps them (Adam: exp_avg, exp_avg_sq; SGD: momentum_buffer; ...). Param
  /// groups of an optimizer other than Adam come from the carried client state only.
  std::vector<std::string> optimizer_states = {"exp_avg", "exp_avg_sq"};
  /// The fused QKV's row order in the files: per-group (ucp's, Megatron-DeepSpeed before PR
  /// #441) or per-rank-blocks (since PR #441); recorded as the model states' ucp_qkv_layout.
  QkvLayout qkv_layout = QkvLayout::kPerGroup;
  /// Client state of other frameworks to carry through DeepSpeed files (a JSON object, e.g. a
  /// ucp-train run's {"ucp_train": ...}): written as the string `ucp_client_state` of every
  /// model-states file, which DeepSpeed's loader hands back as client state untouched and ucp's
  /// reader turns back into client state. "" for none.
  std::string ucp_client_state_json;
};

class DeepSpeedWriter final : public exec::TensorSink {
 public:
  /// Creates DST.tmp-XXXXXX/<tag>/ with every file of the checkpoint laid out, and binds each
  /// target of `plan` (a plan from any source into `model`'s view layout
  /// tp=T,pp=P,dp=1,zero=0 of options.layout) to the places it is written.
  /// Errors: kAlreadyExists (dst exists); kInvalidArgument (BF16_Optimizer for a dtype other
  /// than bf16 or ZeRO-2, errors of DescribeDeepSpeedTarget, client state that cannot be read);
  /// errors of DescribeDeepSpeedTarget, of opening model_states_from, of the torch writer;
  /// kInternal when the plan's targets do not cover the checkpoint exactly (a bug).
  static Result<std::unique_ptr<DeepSpeedWriter>> Create(const std::filesystem::path& dst,
                                                         const patterns::ResolvedModel& model,
                                                         const convert::Plan& plan,
                                                         const DeepSpeedWriteOptions& options);
  ~DeepSpeedWriter() override;
  DeepSpeedWriter(const DeepSpeedWriter&) = delete;
  DeepSpeedWriter& operator=(const DeepSpeedWriter&) = delete;

  /// The plan targets that are written somewhere, for exec::ExecOptions::targets: every one but
  /// the model slices of tied copies, which DeepSpeed saves once (GPTModelPipe's last stage has
  /// no file for its copy of the tied embedding).
  const std::vector<int32_t>& targets() const;

  /// Places elements [begin, end) of a view tensor. Thread-safe.
  /// Errors: kInternal (a tensor the writer was not created for); kIoError.
  Status WriteRange(const convert::TensorInfo& tensor, int64_t begin, int64_t end,
                    std::span<const std::byte> data) override;

  /// Completes every file (zip directories and CRC-32s), writes `latest` (and Megatron's
  /// latest_checkpointed_iteration.txt for Megatron namings), fsyncs the folder and renames it
  /// to dst. Errors: kInternal (a tensor not written exactly once), kAlreadyExists, kIoError.
  Status Commit();

  /// The described checkpoint (tests, inspect).
  const DeepSpeedTarget& target() const;
  /// The temporary folder everything is written in until Commit.
  const std::filesystem::path& temp_dir() const;

 private:
  struct Impl;
  explicit DeepSpeedWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::deepspeed
