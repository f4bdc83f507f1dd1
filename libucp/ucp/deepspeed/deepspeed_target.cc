// The layout of a DeepSpeed checkpoint to write (see deepspeed_target.h).
#include "ucp/deepspeed/deepspeed_target.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <tuple>

#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"

namespace ucp::deepspeed {
namespace {

// The position of a canonical parameter's module in GPTModelPipe's named_parameters: the tied
// module first (registered before the layers), then the layer specs by index.
int64_t PipeModuleOrder(const std::string& canonical, bool tied, int64_t layers) {
  if (canonical.starts_with("embedding.")) return tied ? -1 : 1;
  if (canonical.starts_with("final_layernorm.")) return layers + 2;
  if (canonical.starts_with("output_layer.")) return layers + 3;
  return 2;  // a layer: its index is added by the caller
}

}  // namespace

std::string_view ParamGroupingName(ParamGrouping g) {
  return g == ParamGrouping::kMegatron ? "megatron" : "single";
}

std::string DeepSpeedTarget::ModelStatesFile(int pp, int tp) const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "mp_rank_%02d_model_states.pt", MpRank(pp, tp));
  return buf;
}

std::string DeepSpeedTarget::Zero3ModelStatesFile(int tp, int d) const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "zero_pp_rank_%d_mp_rank_%02d_model_states.pt", d, MpRank(0, tp));
  return buf;
}

std::string DeepSpeedTarget::ExpertOptimFile(int e, int tp) const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "expp_rank_%d_mp_rank_%02d_optim_states.pt", e, MpRank(0, tp));
  return buf;
}

std::string DeepSpeedTarget::OptimStatesFile(int pp, int tp, int d,
                                             const std::string& prefix) const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%szero_pp_rank_%d_mp_rank_%02d_optim_states.pt", prefix.c_str(),
                d, MpRank(pp, tp));
  return buf;
}

std::vector<TargetFragment> TargetRank::Fragments(int g, int d) const {
  const TargetGroup& group = groups[static_cast<size_t>(g)];
  const layout::IndexRange part = group.partition.Fragment(d);
  std::vector<TargetFragment> out;
  for (int32_t i : group.params) {
    const TargetParam& p = params[static_cast<size_t>(i)];
    const layout::IndexRange overlap = layout::Intersect({p.offset, p.offset + p.numel}, part);
    // DeepSpeed links a parameter to a partition only when they share an element.
    if (overlap.empty()) continue;
    out.push_back({i, overlap.size(), overlap.inclusive_min - part.inclusive_min});
  }
  return out;
}

std::vector<int> TargetRank::FileGroups(int d, int ep) const {
  std::vector<int> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].ep_rank < 0 || groups[g].ep_rank == d % ep) out.push_back(static_cast<int>(g));
  }
  return out;
}

int64_t TargetRank::GroupPadding(int g, int d) const {
  const layout::ZeroPartition& p = groups[static_cast<size_t>(g)].partition;
  return d == p.num_fragments - 1 ? p.padded_total - p.total : 0;
}

Result<DeepSpeedTarget> DescribeDeepSpeedTarget(const patterns::ResolvedModel& model,
                                                const DeepSpeedLayout& l) {
  if (l.tp < 1 || l.pp < 1 || l.dp < 1 || l.sp < 1) {
    return InvalidArgumentError("DeepSpeed layout tp=" + std::to_string(l.tp) +
                                ",pp=" + std::to_string(l.pp) + ",dp=" + std::to_string(l.dp) +
                                ",sp=" + std::to_string(l.sp) + " has a size below 1");
  }
  if (l.zero_stage < 1 || l.zero_stage > 3) {
    return InvalidArgumentError("DeepSpeed checkpoints are written for ZeRO stage 1, 2 or 3, not " +
                                std::to_string(l.zero_stage));
  }
  const bool zero3 = l.zero_stage == 3;
  if (zero3 && (l.pp > 1 || l.naming == Naming::kMegatronPipe)) {
    return InvalidArgumentError(
        "ZeRO-3 is written without pipeline stages (pp=1, naming megatron-gpt or plain): "
        "DeepSpeed's pipeline engine does not run ZeRO-3 (asked: pp=" +
        std::to_string(l.pp) + ", naming " + std::string(NamingName(l.naming)) + ")");
  }
  if (l.pp > 1 && l.naming != Naming::kMegatronPipe) {
    return InvalidArgumentError("naming " + std::string(NamingName(l.naming)) +
                                " cannot express pp=" + std::to_string(l.pp) +
                                ": only a GPTModelPipe (naming megatron-pipe) has pipeline stages");
  }
  // Megatron-DeepSpeed divides num_key_value_heads by tp (megatron/model/transformer.py), so
  // the split inside a query group that Megatron-Core takes for tp above them
  // (split_groups_up_to, docs/patterns.md) is not something its engine can load.
  if (l.naming != Naming::kPlain) {
    for (const patterns::ResolvedParam& p : model.params) {
      const patterns::ResolvedRule& r = p.rule;
      if (r.kind == patterns::RuleKind::kFuse &&
          r.order == patterns::FuseOrder::kInterleavedGroups && r.groups % l.tp != 0) {
        return FailedPreconditionError(
            "parameter \"" + p.name + "\": " + std::to_string(r.groups) + " " + r.group_name +
            " not divisible by tp=" + std::to_string(l.tp) + ": naming " +
            std::string(NamingName(l.naming)) +
            " needs whole query groups per tp rank (only Megatron-Core splits a group over tp "
            "ranks; --format ucp takes this tp)");
      }
    }
  }
  if (!l.deepspeed_moe && l.ep != 1) {
    return InvalidArgumentError("DeepSpeed layout ep=" + std::to_string(l.ep) +
                                ": expert parallelism is written as DeepSpeed-MoE only");
  }
  // DeepSpeed-MoE: the MoE layers (layers with per-expert parameters, in layer order: the
  // engine counts its MoE modules in named_modules order) and their expert counts.
  std::map<int64_t, int64_t> experts_of_layer;
  if (l.deepspeed_moe) {
    const std::string what = "DeepSpeed-MoE at tp=" + std::to_string(l.tp) +
                             ",pp=" + std::to_string(l.pp) + ",dp=" + std::to_string(l.dp) +
                             ",sp=" + std::to_string(l.sp) + ",ep=" + std::to_string(l.ep) +
                             ",zero=" + std::to_string(l.zero_stage);
    if (l.ep < 1) return InvalidArgumentError(what + ": ep is below 1");
    if (l.pp > 1 || l.sp > 1 || zero3) {
      return UnimplementedError(
          what +
          ": DeepSpeed-MoE is written at ZeRO-1/2 without pipeline stages or sequence "
          "parallelism (the missing piece is the expert files' MoE-layer numbering per "
          "stage, the expert groups over dp * sp, and ZeRO-3's expert sub-groups)");
    }
    if ((l.dp * l.sp) % l.ep != 0) {
      return FailedPreconditionError(
          what + ": ep does not divide dp * sp = " + std::to_string(l.dp * l.sp) +
          " (every expert data-parallel group has dp * sp / ep ranks)");
    }
    for (const patterns::ResolvedParam& p : model.params) {
      if (p.rule.axis == patterns::Axis::kEp && p.expert < 0) {
        return UnimplementedError(what + ": parameter \"" + p.name +
                                  "\" is sharded on axis ep, not one expert's; DeepSpeed-MoE "
                                  "saves whole experts (the missing piece is its layout of an "
                                  "ep-sharded tensor)");
      }
      if (p.expert < 0) continue;
      if (p.stage != patterns::StagePlacement::kLayer) {
        return UnimplementedError(what + ": expert parameter \"" + p.name +
                                  "\" is in no transformer layer");
      }
      int64_t& n = experts_of_layer[p.layer];
      n = std::max(n, p.expert + 1);
    }
    if (experts_of_layer.empty()) {
      return FailedPreconditionError(what + ": model \"" + model.spec.name +
                                     "\" has no per-expert parameters");
    }
    for (const auto& [layer, n] : experts_of_layer) {
      if (n % l.ep != 0) {
        return FailedPreconditionError(what + ": layer " + std::to_string(layer) + " has " +
                                       std::to_string(n) + " experts, not a multiple of ep");
      }
    }
  }
  DeepSpeedTarget target;
  target.layout = l;
  std::map<int64_t, int> moe_layer_of;
  for (const auto& [layer, n] : experts_of_layer) {
    moe_layer_of[layer] = static_cast<int>(target.num_experts.size());
    target.num_experts.push_back(n);
  }
  target.num_layers = model.num_layers;
  auto tied = model.spec.hyper.find("tied_embeddings");
  target.tied_embeddings = tied != model.spec.hyper.end() && tied->second != 0;
  UCP_ASSIGN_OR_RETURN(layout::StageAssignment stages,
                       layout::AssignStages(model.num_layers, l.pp, l.stages),
                       "model \"" + model.spec.name + "\" at pp=" + std::to_string(l.pp));
  const EngineNameContext names{model.num_layers, target.tied_embeddings, l.deepspeed_moe};
  std::vector<std::string> engine_names(model.params.size());
  for (size_t i = 0; i < model.params.size(); ++i) {
    UCP_ASSIGN_OR_RETURN(engine_names[i], EngineName(model.params[i].name, l.naming, names),
                         "model \"" + model.spec.name + "\"");
  }
  const bool pipe = l.naming == Naming::kMegatronPipe;
  const int last = l.pp - 1;
  // Which stages hold each parameter, and where its values come from.
  struct Placed {
    size_t model_index;
    int source_stage;
  };
  std::vector<std::vector<Placed>> on_stage(static_cast<size_t>(l.pp));
  for (size_t i = 0; i < model.params.size(); ++i) {
    const patterns::ResolvedParam& p = model.params[i];
    switch (p.stage) {
      case patterns::StagePlacement::kLayer: {
        const int s = stages.StageOfLayer(p.layer);
        on_stage[static_cast<size_t>(s)].push_back({i, s});
        break;
      }
      case patterns::StagePlacement::kFirst:
        on_stage[0].push_back({i, 0});
        break;
      case patterns::StagePlacement::kLast:
        on_stage[static_cast<size_t>(last)].push_back({i, last});
        break;
      case patterns::StagePlacement::kFirstAndLast:
        on_stage[0].push_back({i, 0});
        if (last != 0) on_stage[static_cast<size_t>(last)].push_back({i, last});
        break;
    }
  }
  if (pipe && target.tied_embeddings && last != 0) {
    // The whole tied EmbeddingPipe lives on the last stage too.
    std::vector<Placed>& ls = on_stage[static_cast<size_t>(last)];
    for (size_t i = 0; i < model.params.size(); ++i) {
      if (!model.params[i].name.starts_with("embedding.")) continue;
      const bool there =
          std::any_of(ls.begin(), ls.end(), [&](const Placed& x) { return x.model_index == i; });
      if (!there) ls.push_back({i, 0});
    }
  }
  for (int s = 0; s < l.pp; ++s) {
    std::vector<Placed> order = on_stage[static_cast<size_t>(s)];
    if (pipe) {
      auto key = [&](const Placed& x) {
        const patterns::ResolvedParam& p = model.params[x.model_index];
        int64_t module = PipeModuleOrder(p.name, target.tied_embeddings, model.num_layers);
        if (p.stage == patterns::StagePlacement::kLayer) module += p.layer;
        return std::make_pair(module, x.model_index);
      };
      std::stable_sort(order.begin(), order.end(),
                       [&](const Placed& a, const Placed& b) { return key(a) < key(b); });
    } else {
      std::stable_sort(order.begin(), order.end(), [](const Placed& a, const Placed& b) {
        return a.model_index < b.model_index;
      });
    }
    for (int r = 0; r < l.tp; ++r) {
      TargetRank rank;
      rank.pp = s;
      rank.tp = r;
      // Group membership, then the groups that have members, renumbered.
      const int num_groups = l.grouping == ParamGrouping::kMegatron ? 2 : 1;
      // DeepSpeed-MoE (moe/utils.py split_params_into_different_moe_groups_for_optimizer): the
      // dense groups first, then per dense group kind the experts of each ep rank, each
      // in the engine's order (MoE layer, local expert, the expert's parameters).
      const int ep = l.deepspeed_moe ? l.ep : 1;
      std::vector<std::vector<Placed>> by_group(static_cast<size_t>(num_groups * (1 + ep)));
      for (const Placed& x : order) {
        const patterns::ResolvedParam& p = model.params[x.model_index];
        const int g = l.grouping == ParamGrouping::kMegatron ? p.optimizer_group : 0;
        int slot = g;
        if (l.deepspeed_moe && p.expert >= 0) {
          const int64_t local = experts_of_layer.at(p.layer) / ep;
          slot = num_groups + g * ep + static_cast<int>(p.expert / local);
        }
        by_group[static_cast<size_t>(slot)].push_back(x);
      }
      for (size_t slot = static_cast<size_t>(num_groups); slot < by_group.size(); ++slot) {
        std::stable_sort(by_group[slot].begin(), by_group[slot].end(),
                         [&](const Placed& a, const Placed& b) {
                           const patterns::ResolvedParam& pa = model.params[a.model_index];
                           const patterns::ResolvedParam& pb = model.params[b.model_index];
                           return std::tie(pa.layer, pa.expert, a.model_index) <
                                  std::tie(pb.layer, pb.expert, b.model_index);
                         });
      }
      for (size_t slot = 0; slot < by_group.size(); ++slot) {
        const std::vector<Placed>& members = by_group[slot];
        if (members.empty()) continue;
        const bool expert_group = slot >= static_cast<size_t>(num_groups);
        const size_t kind = expert_group ? (slot - num_groups) / ep : slot;
        // An expert group is partitioned over its expert data-parallel group.
        const int64_t ranks = int64_t{l.dp} * l.sp / (expert_group ? ep : 1);
        TargetGroup group;
        group.kind = static_cast<int>(kind);
        if (expert_group) group.ep_rank = static_cast<int>((slot - num_groups) % ep);
        std::vector<int64_t> numels;
        for (const Placed& x : members) {
          const patterns::ResolvedParam& p = model.params[x.model_index];
          UCP_ASSIGN_OR_RETURN(patterns::Slice slice, patterns::SliceParam(p, l.tp, r, 1, 0),
                               "model \"" + model.spec.name + "\" at tp=" + std::to_string(l.tp));
          TargetParam t;
          t.name = p.name;
          t.engine_name = engine_names[x.model_index];
          t.model_index = x.model_index;
          t.local_shape = slice.local_shape;
          t.numel = NumElementsOrDie(slice.local_shape);
          t.group = static_cast<int>(rank.groups.size());
          t.source_stage = x.source_stage;
          if (l.deepspeed_moe && p.expert >= 0) {
            t.moe_layer = moe_layer_of.at(p.layer);
            t.expert = p.expert;
          }
          numels.push_back(t.numel);
          group.params.push_back(static_cast<int32_t>(rank.params.size()));
          rank.params.push_back(std::move(t));
        }
        if (zero3) {
          const int64_t parts = int64_t{l.dp} * l.sp;
          layout::ZeroPartition& part = group.partition;
          part.num_fragments = static_cast<int>(parts);
          for (size_t k = 0; k < group.params.size(); ++k) {
            TargetParam& t = rank.params[static_cast<size_t>(group.params[k])];
            t.piece = (t.numel + parts - 1) / parts;
            t.offset = part.fragment_size;
            part.offsets.push_back(t.offset);
            part.fragment_size += t.piece;
          }
          part.total = part.padded_total = part.fragment_size * parts;
        } else {
          UCP_ASSIGN_OR_RETURN(
              group.partition, layout::PartitionFlat(numels, static_cast<int>(ranks), 2),
              "optimizer group " + std::to_string(rank.groups.size()) + " of pipeline stage " +
                  std::to_string(s) + ", tp rank " + std::to_string(r));
          for (size_t k = 0; k < group.params.size(); ++k) {
            rank.params[static_cast<size_t>(group.params[k])].offset = group.partition.offsets[k];
          }
        }
        rank.groups.push_back(std::move(group));
      }
      // Module weights: the mp_rank file's `module`, or GPTModelPipe's layer files. A copy of
      // the tied module on a later stage has no file (its spec there is a function).
      std::vector<std::tuple<int64_t, size_t, int32_t>> saved;  // (file order, model order, param)
      for (size_t i = 0; i < rank.params.size(); ++i) {
        const TargetParam& p = rank.params[i];
        if (p.source_stage != s || zero3) continue;  // ZeRO-3 saves no weights
        if (pipe && target.tied_embeddings && s != 0 && p.name.starts_with("embedding.")) continue;
        int64_t file_order = 0;
        if (pipe) {
          UCP_ASSIGN_OR_RETURN(PipeLayerKey at, PipeLayerOf(p.engine_name));
          file_order = at.layer_index;
        } else if (p.expert >= 0) {
          // DeepSpeed-MoE: after the module, one file per (MoE layer, expert).
          file_order = 1 + p.moe_layer * (int64_t{1} << 32) + p.expert;
        }
        saved.emplace_back(file_order, p.model_index, static_cast<int32_t>(i));
      }
      std::sort(saved.begin(), saved.end());
      for (const auto& [file_order, model_index, i] : saved) {
        const TargetParam& p = rank.params[static_cast<size_t>(i)];
        ModelRecord m;
        m.param = i;
        if (pipe) {
          UCP_ASSIGN_OR_RETURN(PipeLayerKey at, PipeLayerOf(p.engine_name));
          m.file = DeepSpeedCheckpoint::LayerFile(at.layer_index, r);
          m.key = at.key;
        } else if (p.expert >= 0) {
          m.file = DeepSpeedCheckpoint::ExpertFile(p.moe_layer, p.expert, target.MpRank(s, r));
          m.key = p.engine_name;  // the global expert index, as _save_moe_checkpoint renames it
        } else {
          m.file = target.ModelStatesFile(s, r);
          m.key = p.engine_name;
        }
        rank.model.push_back(std::move(m));
      }
      target.ranks.push_back(std::move(rank));
    }
  }
  return target;
}

}  // namespace ucp::deepspeed
