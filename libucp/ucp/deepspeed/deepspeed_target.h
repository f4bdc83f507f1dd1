// What a DeepSpeed ZeRO-1/2 (or BF16_Optimizer) checkpoint of a model holds at a layout, as pure
// arithmetic, for the writer (deepspeed_writer.h): per (pp, tp) rank, the engine's trainable
// parameters in its flattening order, split into the optimizer's param groups, each with its
// TP-local shape and offset in its group's flat buffer; the ZeRO partitioning of each group over
// the dp * sp data-parallel ranks (layout::PartitionFlat, DeepSpeed's 2 * dp * sp alignment);
// the fragments each partition's param_slice_mappings list; and where each module weight is saved.
//
// The engine's order is the order its module registers parameters (torch named_parameters):
//  * GPTModel and plain DeepSpeed: the model's canonical order (patterns' template order,
//    layer-major), which is Megatron's module order.
//  * GPTModelPipe: DeepSpeed's PipelineModule registers `tied_modules` before building its
//    layers, so on every stage that holds the tied embedding module its parameters come first;
//    then the layer modules by spec index (1 embedding when untied, 2..L+1 layers, L+2 final norm,
//    L+3 untied head). The tied module is built whole on each stage that uses it: the last stage
//    holds the position embedding too (deepspeed_ucp.md 5), a copy ucp's rule sets do not place
//    there. It is listed on the last stage with `source_stage` 0: its values are stage 0's.
// Megatron's param groups: weights of >= 2 dims that are not biases (weight decay), then the rest;
// a group with no parameter on a rank is left out, as Megatron's get_param_groups does.
// ZeRO-3 (stage3.py): each group is one sub-group (DeepSpeed's default sub_group_size), and every
// parameter is cut by itself into dp * sp pieces of ceil(numel / (dp * sp)) elements (the last
// zero-padded); partition d of a group is piece d of each of its parameters, back to back. No
// module weights are saved (the engine rounds its fp32 partitions on load).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/deepspeed/naming.h"
#include "ucp/layout/layout.h"
#include "ucp/patterns/model.h"
#include "ucp/tensor/shape.h"

namespace ucp::deepspeed {

/// How the engine grouped its parameters into optimizer param groups.
enum class ParamGrouping : uint8_t {
  kMegatron,  ///< group 0: >= 2-dim non-bias weights (weight decay); group 1: the rest
  kSingle,    ///< one group holding every parameter
};
/// "megatron", "single".
std::string_view ParamGroupingName(ParamGrouping g);

/// The DeepSpeed layout to write.
struct DeepSpeedLayout {
  int tp = 1;
  int pp = 1;
  int dp = 1;
  int sp = 1;  ///< Ulysses: the optimizer partitions are dp * sp per (pp, tp)
  int zero_stage = 1;
  Naming naming = Naming::kMegatronPipe;
  ParamGrouping grouping = ParamGrouping::kMegatron;
  /// Transformer layers per pipeline stage (layout::Layout::stages); empty: the even split.
  std::vector<int64_t> stages;
  /// DeepSpeed-MoE (deepspeed.moe.layer.MoE; engine.py _save_moe_checkpoint): routers and
  /// experts under DeepSpeed-MoE's names, every expert weight in its own
  /// layer_L_expert_E_mp_rank_TT file, and the experts of each of the `ep` expert-parallel ranks
  /// in their own param groups, partitioned over the dp * sp / ep ranks of its expert
  /// data-parallel group. Without it experts are ordinary parameters (ep must be 1).
  bool deepspeed_moe = false;
  int ep = 1;
};

/// One trainable parameter in one (pp, tp) rank's flat buffers.
struct TargetParam {
  std::string name;         ///< canonical (the model's)
  std::string engine_name;  ///< the name in param_shapes and param_slice_mappings
  size_t model_index = 0;   ///< into ResolvedModel::params
  Shape local_shape;        ///< the TP slice (patterns::SliceParam)
  int64_t numel = 0;
  int group = 0;
  int64_t offset = 0;  ///< element offset in its group's flat buffer (ZeRO-3: in a partition)
  int64_t piece = 0;   ///< ZeRO-3: ceil(numel / (dp * sp)), its elements in each partition
  /// The stage whose ucp view holds its values: its own, or 0 for the tied module's copy on the
  /// last stage of parameters ucp's rules keep on the first stage only.
  int source_stage = 0;
  /// DeepSpeed-MoE experts: the MoE layer (the engine's count of MoE modules) and the global
  /// expert index; -1 for other parameters.
  int moe_layer = -1;
  int64_t expert = -1;
};

/// One optimizer param group of a rank: its parameters in flattening order and their ZeRO
/// partitioning over dp * sp ranks.
struct TargetGroup {
  /// Which group of the grouping it is (Megatron: 0 weight decay, 1 none), whatever its index
  /// among the rank's non-empty groups.
  int kind = 0;
  /// DeepSpeed-MoE: the expert-parallel rank whose experts the group holds (a param group marked
  /// `moe`, partitioned over dp * sp / ep ranks: partition k is in file k * ep + ep_rank);
  /// -1 for the dense groups, partitioned over all dp * sp ranks.
  int ep_rank = -1;
  std::vector<int32_t> params;  ///< indices into TargetRank::params
  /// ZeRO-1/2: layout::PartitionFlat. ZeRO-3: fragment_size = the partition's length (the sum
  /// of its parameters' pieces), num_fragments = dp * sp, total = padded_total = their product.
  layout::ZeroPartition partition;
};

/// A module weight saved by this rank: `key` in `file` (relative to the tag folder); `file` is
/// the rank's mp_rank file (its `module` dict) or, for GPTModelPipe, a layer file.
struct ModelRecord {
  std::string file;
  std::string key;
  int32_t param = 0;  ///< index into TargetRank::params
};

/// A parameter's piece in one data-parallel partition, as param_slice_mappings records it.
struct TargetFragment {
  int32_t param = 0;  ///< index into TargetRank::params
  int64_t numel = 0;
  int64_t start = 0;  ///< in the partition
};

struct TargetRank {
  int pp = 0;
  int tp = 0;
  std::vector<TargetParam> params;  ///< group by group, each in flattening order
  std::vector<TargetGroup> groups;
  /// Module weights, grouped by file: files in spec order, keys in module order.
  std::vector<ModelRecord> model;
  /// The fragments of group `g` in partition `d` (0 <= d < dp * sp), in flattening order.
  std::vector<TargetFragment> Fragments(int g, int d) const;
  /// Trailing padding DeepSpeed records for group `g` on partition `d`: all of the group's
  /// alignment padding on the last partition, 0 on the others.
  int64_t GroupPadding(int g, int d) const;
  /// The groups in optimizer file `d` (0 <= d < dp * sp), in the file's order: the dense groups,
  /// then (DeepSpeed-MoE) the expert groups of ep rank d % ep.
  std::vector<int> FileGroups(int d, int ep) const;
};

struct DeepSpeedTarget {
  DeepSpeedLayout layout;
  std::vector<TargetRank> ranks;  ///< at pp * tp + tp_rank
  int64_t num_layers = 0;
  bool tied_embeddings = false;

  const TargetRank& rank(int pp, int tp) const {
    return ranks[static_cast<size_t>(pp) * layout.tp + tp];
  }
  /// The model-parallel rank XX of the file names: pp * tp + tp_rank for GPTModelPipe,
  /// tp_rank otherwise (pp is 1).
  int MpRank(int pp, int tp) const { return pp * layout.tp + tp; }
  /// dp * sp: the dp_world_size DeepSpeed records.
  int DpWorldSize() const { return layout.dp * layout.sp; }
  /// tp * pp: mp_world_size.
  int MpWorldSize() const { return layout.tp * layout.pp; }
  std::string ModelStatesFile(int pp, int tp) const;
  /// ZeRO-3: zero_pp_rank_D_mp_rank_XX_model_states.pt of partition d.
  std::string Zero3ModelStatesFile(int tp, int d) const;
  /// `prefix` is "bf16_" when bf16 is enabled, else "".
  std::string OptimStatesFile(int pp, int tp, int d, const std::string& prefix) const;
  /// DeepSpeed-MoE: experts per MoE layer (the model states' num_experts).
  std::vector<int64_t> num_experts;
  /// The partition of group `g` that optimizer file `d` holds (d, or d / ep for an expert group).
  int PartitionInFile(const TargetGroup& g, int d) const {
    return g.ep_rank < 0 ? d : d / layout.ep;
  }
  /// The optimizer file holding partition `k` of group `g`.
  int FileOfPartition(const TargetGroup& g, int k) const {
    return g.ep_rank < 0 ? k : k * layout.ep + g.ep_rank;
  }
  /// DeepSpeed-MoE: expp_rank_E_mp_rank_XX_optim_states.pt of expert-parallel rank e.
  std::string ExpertOptimFile(int e, int tp) const;
};

/// Describes the checkpoint DeepSpeed saves for `model` at `layout`.
/// Errors: kInvalidArgument (a layout size < 1, zero_stage not 1, 2 or 3, a naming that cannot
/// express the model: pp > 1 without GPTModelPipe, a parameter the naming has no name for;
/// ZeRO-3 with pp > 1 or GPTModelPipe, which DeepSpeed's pipeline engine does not run; ep > 1
/// without deepspeed_moe); kUnimplemented (DeepSpeed-MoE at pp > 1, sp > 1 or ZeRO-3, an expert
/// rule on axis ep); kFailedPrecondition (ep does not divide dp * sp or a layer's experts);
/// kFailedPrecondition (the model does not fit the layout: layers % pp, heads % tp, ...).
Result<DeepSpeedTarget> DescribeDeepSpeedTarget(const patterns::ResolvedModel& model,
                                                const DeepSpeedLayout& layout);

}  // namespace ucp::deepspeed
