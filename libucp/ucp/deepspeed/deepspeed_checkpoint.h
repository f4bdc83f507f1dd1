// Reading DeepSpeed / Megatron-DeepSpeed ZeRO-1/2 and BF16-optimizer checkpoints without Python
// (shared/reference/deepspeed_ucp.md sections 2-5): topology from file names and saved
// metadata, parameters under ucp's canonical names (naming.h), and the ucp model they are: the
// family's rule set (patterns/<family>.json) bound to hyper-parameters taken from a preset, the
// Megatron args or the shapes, and checked against every TP shard shape and pipeline stage.
//
// The checkpoint is then presented to the planner as a ucp layout *view*,
// tp=T,pp=P,dp=1,zero=0: per (pp, tp) rank a model slice (training dtype) and a ZeRO-0
// optimizer slice per state (fp32), exactly convert::DescribeLayout(model(), view()). The
// planner does all TP/PP arithmetic with ucp's own rules (never with the
// `universal_checkpoint_info` the source saved, which is wrong for TP=1 sources, section 9);
// DeepSpeedTensorSource (deepspeed_source.h) serves the view's tensors from the files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/deepspeed/naming.h"
#include "ucp/deepspeed/qkv_layout.h"
#include "ucp/layout/layout.h"
#include "ucp/patterns/model.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"

namespace ucp::torch {
class PyValue;
}  // namespace ucp::torch

namespace ucp::deepspeed {

/// ucp's hyper-parameters that Megatron's args carry, and each one's argument name
/// (megatron/arguments.py): read from rank 0's args by the DeepSpeed and universal sources.
struct MegatronArgName {
  const char* hyper;
  const char* arg;
};
inline constexpr MegatronArgName kMegatronArgNames[] = {
    {"hidden", "hidden_size"},
    {"layers", "num_layers"},
    {"heads", "num_attention_heads"},
    {"kv_heads", "num_key_value_heads"},
    {"head_dim", "kv_channels"},
    {"ffn_hidden", "ffn_hidden_size"},
    {"max_positions", "max_position_embeddings"},
    {"make_vocab_size_divisible_by", "make_vocab_size_divisible_by"},
};

/// One parameter as the checkpoint's param_shapes list it.
struct DeepSpeedParam {
  std::string name;         ///< ucp canonical name ("layers.0.self_attention.dense.weight")
  std::string engine_name;  ///< the name in the files
  int group = 0;            ///< optimizer param group on the first stage that lists it
  /// param_shapes per (stage, tp rank) at [stage * tp + tp_rank]; nullopt where not listed.
  std::vector<std::optional<Shape>> shapes;
  /// Stages whose param_shapes list it, ascending (a tied embedding: the first and the last).
  std::vector<int> stages;
  /// A DeepSpeed-MoE expert parameter: its MoE layer (the engine's count of MoE modules in
  /// named_modules order) and global expert index, so its weight is in
  /// layer_<moe_layer>_expert_<expert>_mp_rank_TT_model_states.pt; -1 for other parameters.
  int moe_layer = -1;
  int64_t expert = -1;
};

struct OpenOptions {
  /// A preset (`<data_dir>/models/<name>.json`), a model file (`*.json`) or a family ("gpt":
  /// `<data_dir>/gpt.json`). A preset or model file gives the hyper-parameters, checked against
  /// the checkpoint; a family or "" takes them from the Megatron args and the shapes. "" also
  /// recognises the family: the one rule set in data_dir whose parameter templates the
  /// checkpoint's canonical names are exactly. With "", a checkpoint that records its model
  /// (the client key `ucp_model` ucp's DeepSpeed writer saves) is bound to that, as a preset.
  std::string model;
  /// The folder holding the rule sets and models/; "" is env UCP_DATA_DIR + "/patterns" when
  /// set, else the source tree's patterns/ (as `ucp plan --data-dir`).
  std::filesystem::path data_dir;
  /// False: topology, names and metadata only (no rule set, no model, no checks against it).
  bool bind_model = true;
  /// The fused QKV's row order (`--qkv-layout`): "per-group", "per-rank-blocks" or "" (what the
  /// checkpoint records, else per-group). One that contradicts what the checkpoint records is
  /// kInvalidArgument (qkv_layout.h, docs/deepspeed.md "The fused QKV's row order").
  std::string qkv_layout;
};

class DeepSpeedCheckpoint {
 public:
  /// Opens the tag folder (holding mp_rank_*_model_states.pt, or ZeRO-3's
  /// zero_pp_rank_*_mp_rank_*_model_states.pt, and *zero_pp_rank_*_optim_states.pt) or its parent
  /// holding `latest`. Reads every (dp 0) model-states file's pickle and optimizer file 0's (not
  /// the tensors), then binds the model.
  /// Errors: kNotFound (no such folder, no `latest` tag folder, no mp_rank or optim files, a
  /// rank file missing from the grid, a key missing, no such model or rule set); kDataLoss
  /// (file counts that do not form a tp x pp x dp grid, param_shapes that differ between
  /// replicas, a bad pickle); kInvalidArgument (names that no rule set or two fit, a parameter
  /// matched by no rule or by two, a hyper-parameter the checkpoint does not determine and no
  /// preset gives, a bad rule set); kFailedPrecondition (a checkpoint that is not the model: a
  /// parameter missing on either side, a TP shard shape, pipeline stage or hyper-parameter that
  /// differs from the model's); kUnimplemented (DeepSpeed-MoE's legacy
  /// expert_E_mp_rank files or MoE with pipeline stages, ZeRO-3 or BF16_Optimizer, elastic
  /// checkpoints, ZeRO-3 with pipeline stages, optimizer state that is not per-element, frozen
  /// parameters); for the QKV order
  /// (DecideQkvLayout) kInvalidArgument (a --qkv-layout the checkpoint contradicts) and
  /// kFailedPrecondition (per-rank-blocks for a model it cannot hold).
  static Result<DeepSpeedCheckpoint> Open(const std::filesystem::path& path,
                                          const OpenOptions& options = {});

  const std::filesystem::path& dir() const { return dir_; }
  int tp() const { return tp_; }
  int pp() const { return pp_; }
  /// Number of optimizer partitions per (pp, tp): dp * sp.
  int dp_sp() const { return dp_ * sp_; }
  int dp() const { return dp_; }
  int sp() const { return sp_; }
  /// DeepSpeed-MoE: the expert-parallel size (expp_rank_* files), 1 without MoE layers.
  int ep() const { return ep_; }
  /// Whether the model has DeepSpeed-MoE layers (layer_*_expert_* files; engine.py
  /// _save_moe_checkpoint): the module of mp_rank_XX_model_states.pt lacks the experts and the
  /// file has no param_shapes; expert e's weights are in its own files and its optimizer state
  /// in the "moe" param groups, partitioned over the expert data-parallel group.
  bool moe() const { return moe_; }
  /// Experts per MoE layer (the model states' num_experts), in MoE-layer order.
  const std::vector<int64_t>& num_experts() const { return num_experts_; }
  int64_t iteration() const { return iteration_; }
  int64_t step() const { return step_; }
  /// The training dtype of the module weights.
  DType dtype() const { return dtype_; }
  Naming naming() const { return naming_; }
  /// "bf16_optimizer", "zero1", "zero2" or "zero3".
  const std::string& optimizer() const { return optimizer_; }
  /// ZeRO-3 (stage3.py): per (dp, tp) rank a zero_pp_rank_D_mp_rank_TT_model_states.pt whose
  /// param_shapes list each sub-group's parameters at their full (TP-local) shapes, and an optim
  /// file whose fp32_flat_groups[i] is sub-group i's parameters, each cut into dp * sp pieces of
  /// ceil(numel / (dp * sp)) elements (the last one padded), this rank's piece of each in order.
  /// No module weights are saved: the training-dtype weight is the fp32 master rounded, as the
  /// engine itself restores it (_rigid_load_state_dict).
  bool zero3() const { return optimizer_ == "zero3"; }
  /// universal_checkpoint_info.original_vocab_size; 0 when not saved.
  int64_t original_vocab_size() const { return original_vocab_; }
  /// The family whose rule set the model uses ("gpt"); empty unless bind_model.
  const std::string& family() const { return spec_.family; }
  /// Parameters in the order of the checkpoint's param_shapes (stage, tp rank 0, group).
  const std::vector<DeepSpeedParam>& params() const { return params_; }
  /// The bound model (bind_model only): templates, hyper-parameters, training dtype = dtype().
  const patterns::ModelSpec& spec() const { return spec_; }
  const patterns::ResolvedModel& model() const { return model_; }
  /// Where the hyper-parameters came from: "preset llama-tiny", "model file X", "Megatron args",
  /// "Megatron args and shapes", "shapes".
  const std::string& model_origin() const { return model_origin_; }
  /// params()[ds_index(i)] is model().params[i].
  int ds_index(size_t model_param) const { return ds_index_[model_param]; }
  /// tp=T,pp=P,dp=1,sp=1,ep=1,zero=0: the layout the planner sees.
  layout::Layout view() const;
  /// The checkpoint's own layout, "tp=2,pp=2,dp=2,sp=1,zero=1" (BF16_Optimizer: zero=1).
  std::string LayoutString() const;
  /// A JSON object: naming, tag, layout, optimizer, and rank 0's iteration, args
  /// (argparse.Namespace as an object), checkpoint_version, tokens, global_steps, ...,
  /// ds_version, ds_config, lr_scheduler and universal_checkpoint_info where JSON can hold them.
  const std::string& client_state_json() const { return client_state_json_; }
  /// The `ucp_client_state` string a ucp writer left in the model states (another framework's
  /// client state carried through DeepSpeed files, a JSON object); "" when absent.
  const std::string& ucp_client_state_json() const { return ucp_client_state_json_; }
  /// The fused QKV's row order in the files (bind_model only): the files' ucp_qkv_layout key (a
  /// ucp writer's), else per-rank-blocks when the Megatron args come from Megatron-DeepSpeed
  /// since PR #441 (they hold ds_sequence_parallel_fpdt) and the attention is multi-head, else
  /// OpenOptions::qkv_layout, else per-group.
  QkvLayout qkv_layout() const { return qkv_layout_; }
  /// Where qkv_layout() came from, for inspect and the summary: "recorded by ucp (...)",
  /// "detected: ...", "--qkv-layout", "default: ...".
  const std::string& qkv_layout_origin() const { return qkv_layout_origin_; }
  /// lr, beta1, beta2, eps, weight_decay of optimizer group 0.
  const std::vector<double>& hyper() const { return hyper_; }
  /// The torch optimizer's per-element states in its order, read from its per-group state (the
  /// tensors other than `step`): Adam {exp_avg, exp_avg_sq}, SGD with momentum
  /// {momentum_buffer}, Adagrad {sum}, Lion {exp_avg}, plain SGD {}.
  const std::vector<std::string>& optimizer_states() const { return optimizer_states_; }
  /// "adam" / "adamw" for Adam's states (by weight decay), else ds_config.optimizer.type
  /// lowercased, else "torch".
  const std::string& optimizer_kind() const { return optimizer_kind_; }
  /// Adam: lr, beta1, beta2, eps, weight_decay; another optimizer: every number (and bool, as
  /// 0/1) of param group 0, betas as beta1 / beta2.
  const std::map<std::string, double>& optimizer_hyper() const { return optimizer_hyper_; }

  /// File names relative to dir(). ZeRO-3: rank (dp 0, tp_rank)'s zero_pp_rank_0_mp_rank_TT file.
  std::string ModelStatesFile(int pp_rank, int tp_rank) const;
  /// ZeRO-3: zero_pp_rank_D_mp_rank_TT_model_states.pt of data-parallel rank `dp_rank`.
  std::string Zero3ModelStatesFile(int tp_rank, int dp_rank) const;
  std::string OptimStatesFile(int pp_rank, int tp_rank, int dp_rank) const;
  /// GPTModelPipe: the low-precision weights of spec `layer_index` on tp rank `tp_rank`.
  static std::string LayerFile(int64_t layer_index, int tp_rank);
  /// This folder's layer file: LayerFile, or layer_XX-model_states.pt when the engine's pipeline
  /// topology had no `model` axis (PipeDataParallelTopology: no tp rank in the names, tp=1).
  std::string LayerFileOf(int64_t layer_index, int tp_rank) const;
  /// DeepSpeed-MoE: expert `expert` (global index) of MoE layer `moe_layer` on model-parallel
  /// rank `mp_rank` (engine.py _get_expert_ckpt_name).
  static std::string ExpertFile(int moe_layer, int64_t expert, int mp_rank);

 private:
  Status BindModel(const OpenOptions& options, const torch::PyValue* args,
                   const torch::PyValue* ucp_model);
  Status DecideQkvLayout(const OpenOptions& options, const torch::PyValue* args,
                         const torch::PyValue* recorded, const std::string& file);

  std::filesystem::path dir_;
  int tp_ = 1, pp_ = 1, dp_ = 1, sp_ = 1, ep_ = 1;
  bool moe_ = false;
  bool layer_files_without_model_ = false;
  std::vector<int64_t> num_experts_;
  int64_t iteration_ = 0, step_ = 0;
  DType dtype_ = DType::kFp32;
  Naming naming_ = Naming::kPlain;
  std::string optimizer_;
  std::string optim_prefix_;
  bool zero3_files_ = false;  // zero_pp_rank_*_model_states.pt, not mp_rank_*
  int64_t original_vocab_ = 0;
  std::vector<DeepSpeedParam> params_;
  std::string client_state_json_;
  std::string ucp_client_state_json_;
  std::vector<double> hyper_;  // lr, beta1, beta2, eps, weight_decay
  std::vector<std::string> optimizer_states_;
  std::string optimizer_kind_;
  std::map<std::string, double> optimizer_hyper_;
  patterns::ModelSpec spec_;
  patterns::ResolvedModel model_;
  std::string model_origin_;
  std::vector<int> ds_index_;
  // Transformer layers per pipeline stage as the files hold them (stage_assignment.h); empty
  // for the even split. Part of view() and LayoutString().
  std::vector<int64_t> stages_;
  QkvLayout qkv_layout_ = QkvLayout::kPerGroup;
  std::string qkv_layout_origin_;
};

/// True for a folder DeepSpeed wrote: a tag folder with mp_rank_*_model_states.pt,
/// *zero_pp_rank_*_optim_states.pt or DeepSpeed-MoE files, or its parent holding `latest`.
/// Such a folder is opened (and its faults reported) by DeepSpeedCheckpoint::Open.
bool LooksLikeDeepSpeedCheckpoint(const std::filesystem::path& path);

}  // namespace ucp::deepspeed
