// The view tensors of a DeepSpeed checkpoint, resolved once and read as byte ranges (see
// deepspeed_source.h).
#include "ucp/deepspeed/deepspeed_source.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <set>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/pickle_values.h"
#include "ucp/io/raw_file.h"
#include "ucp/tensor/cast.h"

namespace ucp::deepspeed {

namespace fs = std::filesystem;
using convert::TensorInfo;
using convert::TensorKind;
using torch::PyKind;
using torch::PyValue;
using torch::TensorRef;
using torch::TorchFile;

namespace {
// The fp32 master partition, then one per optimizer state (DeepSpeedCheckpoint::
// optimizer_states(): Adam's exp_avg, exp_avg_sq; SGD's momentum_buffer; ...).
using Partitions = std::vector<TensorRef>;

// "fp32" and the checkpoint's optimizer states: the view's states, Partitions' order.
std::vector<std::string> StateNames(const DeepSpeedCheckpoint& ck) {
  std::vector<std::string> names = {"fp32"};
  for (const std::string& s : ck.optimizer_states()) names.push_back(s);
  return names;
}

// The fp32 partition and each state's of optimizer group `g`: `fp32` is the group's flat fp32
// tensor, `state` the torch optimizer's per-group state dict (`state_path` names it in
// messages), `names` StateNames. ZeRO-1/2 and ZeRO-3 files keep them alike.
Result<Partitions> GroupPartitions(const PyValue* fp32, const PyValue* state, size_t g,
                                   const std::string& where, const std::string& state_path,
                                   const std::vector<std::string>& names) {
  const PyValue* st = state->Get(static_cast<int64_t>(g));
  if (st == nullptr && names.size() > 1) {
    return DataLossError(where + " has no " + state_path + "[" + std::to_string(g) + "]");
  }
  Partitions refs(names.size());
  for (size_t k = 0; k < names.size(); ++k) {
    const PyValue* t = k == 0 ? fp32 : st->Get(names[k]);
    if (t == nullptr || t->kind() != PyKind::kTensor || t->tensor().dtype != DType::kFp32 ||
        !t->tensor().IsContiguous() || t->tensor().size.size() != 1) {
      return DataLossError(where + ": the " + names[k] +
                           " partition is not a contiguous 1-d fp32 tensor");
    }
    refs[k] = t->tensor();
  }
  return refs;
}

// The weight `key` (an engine name) in a module state dict: a flat key, or nested dicts whose
// keys join with '.' to it. Megatron-DeepSpeed saves GPTModel's `module` through
// state_dict_for_save_checkpoint: language_model -> embedding -> word_embeddings -> weight,
// encoder -> flat "layers.N...." keys, output_layer -> weight.
const PyValue* FindModuleTensor(const PyValue* dict, std::string_view key) {
  if (dict == nullptr || dict->kind() != PyKind::kDict) return nullptr;
  if (const PyValue* v = dict->Get(key); v != nullptr) return v;
  for (const auto& [k, v] : dict->entries()) {
    if (k->kind() != PyKind::kStr || v->kind() != PyKind::kDict) continue;
    const std::string& p = k->str();
    if (key.size() > p.size() && key.starts_with(p) && key[p.size()] == '.') {
      if (const PyValue* t = FindModuleTensor(v, key.substr(p.size() + 1)); t != nullptr) return t;
    }
  }
  return nullptr;
}
}  // namespace

struct DeepSpeedTensorSource::File {
  std::string name;  // relative to the tag folder, for messages
  TorchFile torch;
  // Optimizer files: per param group, the fp32, exp_avg and exp_avg_sq partitions.
  std::vector<std::vector<TensorRef>> groups;  // [g][state]: StateNames' order
};

// One ZeRO fragment of a TP shard: elements [offset, offset + numel) of the shard are elements
// [start, start + numel) of partition `group` of file `file`.
struct DeepSpeedTensorSource::Fragment {
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t start = 0;
  int32_t file = 0;
  int32_t group = 0;
};

struct DeepSpeedTensorSource::Entry {
  DType dtype = DType::kFp32;
  int64_t numel = 0;
  int state = -1;     // >= 0: an optimizer state (StateNames' index); -1: the model weight
  bool cast = false;  // ZeRO-3's model weight: the fp32 fragments (state 0) rounded to dtype
  int32_t list = -1;  // optimizer: index into fragment_lists_
  int32_t file = -1;  // model: the file holding the weight
  TensorRef ref;      // model: the weight
  // A fused QKV stored per-rank-blocks: where the view's per-group rows are (qkv_layout.h);
  // empty when the files hold the view's order.
  std::vector<RowBlock> qkv_blocks;
};

DeepSpeedTensorSource::~DeepSpeedTensorSource() = default;

// DeepSpeed-MoE under ZeRO-1/2 (stage_1_and_2.py _configure_moe_settings): a param group marked
// `moe` holds the experts of one expert-parallel rank, flattened in named_parameters order (MoE
// layer, local expert, the expert's parameters), zero-padded to a multiple of 2 * (dp / ep) and
// cut into dp / ep equal partitions over the expert data-parallel group; data-parallel rank d
// (file zero_pp_rank_d) is expert-parallel rank d % ep and holds partition d / ep (groups.py's
// default E + D order). DeepSpeed 0.14.4's param_slice_mappings cannot locate them when ep > 1:
// _link_all_hp_params cuts every group by the whole dp size, so the mappings list only some
// experts, at addresses of a partition 1/ep as long. The fragments are derived from the order
// and the shapes, as zero_to_fp32 does for ZeRO-3; the mappings' names (the engine's local
// expert names) only say which expert group a parameter is in.
struct DeepSpeedTensorSource::MoeGroups {
  struct Group {
    int32_t file = 0;
    int64_t length = 0;  // the partition: fp32 elements saved + padding
    int64_t limit = 0;   // elements every state holds
  };
  // [ep rank][expert group index g] -> per expert-dp index k, the partition of file k * ep + e.
  std::map<int, std::map<int32_t, std::vector<Group>>> groups;
  // [ep rank] local engine name -> group, from the param_slice_mappings.
  std::map<int, std::map<std::string, int32_t>> listed;

  // Records group `g` of data-parallel rank `d`'s file `fi` when it is an expert group.
  Result<bool> AddGroup(const DeepSpeedCheckpoint& ck, int d, int32_t fi, size_t g,
                        const PyValue& osd, const PyValue* param_groups, const Partitions& refs,
                        const PyValue& mappings, const std::string& where) {
    const PyValue* pg = param_groups != nullptr && param_groups->kind() == PyKind::kList &&
                                g < param_groups->items().size()
                            ? param_groups->items()[g]
                            : nullptr;
    if (pg == nullptr) {
      return DataLossError(where + ": base_optimizer_state.param_groups has no group " +
                           std::to_string(g));
    }
    const PyValue* flag = pg->Get("moe");
    if (flag == nullptr || flag->kind() != PyKind::kBool || !flag->bool_value()) return false;
    const int ep = ck.ep(), e = d % ep, k = d / ep, count = ck.dp_sp() / ep;
    auto list_at = [&](const char* key) -> Result<int64_t> {
      const PyValue* v = osd.Get(key);
      if (v == nullptr || v->kind() != PyKind::kList || g >= v->items().size()) {
        return DataLossError(where + ": " + key + " has no entry for the group");
      }
      return AsInt(v->items()[g], where + ": " + key);
    };
    UCP_ASSIGN_OR_RETURN(const int64_t partitions, list_at("partition_count"));
    UCP_ASSIGN_OR_RETURN(const int64_t padding, list_at("group_paddings"));
    if (partitions != count) {
      return DataLossError(where + " is an expert group (moe) of partition_count " +
                           std::to_string(partitions) + ", but dp / ep = " +
                           std::to_string(ck.dp_sp()) + " / " + std::to_string(ep) + " = " +
                           std::to_string(count) + " with the folder's " + std::to_string(ep) +
                           " expp_rank_*_mp_rank_*_optim_states.pt files: one is missing, or a "
                           "MoE layer has another ep_size (ucp reads one ep_size for all)");
    }
    int64_t limit = refs[0].num_elements();
    for (const TensorRef& ref : refs) limit = std::min(limit, ref.num_elements());
    std::vector<Group>& parts = groups[e][static_cast<int32_t>(g)];
    parts.resize(static_cast<size_t>(count));
    parts[static_cast<size_t>(k)] = Group{fi, refs[0].num_elements() + padding, limit};
    for (const auto& [name, v] : mappings.entries()) {
      if (name->kind() == PyKind::kStr) listed[e][name->str()] = static_cast<int32_t>(g);
    }
    return true;
  }

  // The expert parameters' fragments of (pp, tp) rank (s, r), into `frags` by engine name.
  Status Derive(const DeepSpeedCheckpoint& ck, int s, int r,
                std::map<std::string, std::vector<Fragment>>& frags) const {
    const int ep = ck.ep(), count = ck.dp_sp() / ep;
    for (int e = 0; e < ep; ++e) {
      const std::string file0 = ck.OptimStatesFile(s, r, e);
      auto git = groups.find(e);
      if (git == groups.end() || git->second.empty()) {
        return DataLossError(file0 + " has no expert param group (\"moe\": True), but the folder "
                                     "holds DeepSpeed-MoE expert files");
      }
      const auto& mine = git->second;
      const auto lit = listed.find(e);
      // This ep rank's experts, in the engine's order, each in its group.
      std::map<int32_t, std::vector<const DeepSpeedParam*>> members;
      for (const DeepSpeedParam& p : ck.params()) {
        if (p.expert < 0) continue;
        const int64_t local_count =
            ck.num_experts()[static_cast<size_t>(p.moe_layer)] / ep;
        if (p.expert / local_count != e) continue;
        UCP_ASSIGN_OR_RETURN(std::string local,
                             WithDeepSpeedExpertIndex(p.engine_name, p.expert % local_count));
        int32_t g = -1;
        if (lit != listed.end() && lit->second.contains(local)) {
          g = lit->second.at(local);
        } else if (mine.size() == 1) {
          g = mine.begin()->first;
        } else {
          return UnimplementedError(
              file0 + ": expert parameter \"" + p.engine_name + "\" (local \"" + local +
              "\") is in none of the param_slice_mappings of the " + std::to_string(mine.size()) +
              " expert groups, so its group is unknown (the missing piece is the engine's "
              "expert group of each parameter, which DeepSpeed 0.14.4 does not save at ep > 1)");
        }
        if (!mine.contains(g)) {
          return DataLossError(file0 + ": param_slice_mappings put expert parameter \"" + local +
                               "\" in group " + std::to_string(g) + ", not an expert group");
        }
        members[g].push_back(&p);
      }
      for (const auto& [g, parts] : mine) {
        const std::string where = file0 + ": expert param group " + std::to_string(g);
        for (int k = 0; k < count; ++k) {
          if (parts[static_cast<size_t>(k)].length != parts[0].length) {
            return DataLossError(ck.OptimStatesFile(s, r, k * ep + e) + ": expert param group " +
                                 std::to_string(g) + " has a partition of " +
                                 std::to_string(parts[static_cast<size_t>(k)].length) +
                                 " elements (with padding), that of " + file0 + " " +
                                 std::to_string(parts[0].length));
          }
        }
        const int64_t length = parts[0].length;
        int64_t offset = 0;
        auto it = members.find(g);
        for (const DeepSpeedParam* p : it == members.end()
                                          ? std::vector<const DeepSpeedParam*>{}
                                          : it->second) {
          const std::optional<Shape>& shape = p->shapes[static_cast<size_t>(s) * ck.tp() + r];
          if (!shape) continue;
          const int64_t n = NumElementsOrDie(*shape);
          for (int k = 0; k < count; ++k) {
            const int64_t lo = std::max(offset, k * length);
            const int64_t hi = std::min(offset + n, (k + 1) * length);
            if (lo >= hi) continue;
            const Group& part = parts[static_cast<size_t>(k)];
            if (hi - k * length > part.limit) {
              return DataLossError(where + ": expert parameter \"" + p->engine_name +
                                   "\" needs elements up to " + std::to_string(hi - k * length) +
                                   " of " + ck.OptimStatesFile(s, r, k * ep + e) +
                                   "'s partition, which holds " + std::to_string(part.limit));
            }
            frags[p->engine_name].push_back(Fragment{0, hi - lo, lo - k * length, part.file, g});
          }
          offset += n;
        }
        // DeepSpeed pads the flat group to a multiple of 2 * (dp / ep)
        // (nccl_start_alignment_factor).
        if (offset > count * length || count * length - offset >= 2 * int64_t{count}) {
          return DataLossError(where + ": its " + std::to_string(count) + " partitions of " +
                               std::to_string(length) + " elements do not hold exactly the " +
                               std::to_string(offset) + " elements of ep rank " +
                               std::to_string(e) + "'s expert parameters");
        }
      }
    }
    return Status::Ok();
  }
};

Status DeepSpeedTensorSource::AddZero3Partitions(
    const DeepSpeedCheckpoint& ck, int tp_rank, int dp_rank, int32_t fi, const PyValue& osd,
    File& file, std::map<std::string, std::vector<Fragment>>& frags) {
  const std::string& name = file.name;
  UCP_ASSIGN_OR_RETURN(const PyValue* fp32, osd.Find("fp32_flat_groups", name));
  UCP_ASSIGN_OR_RETURN(const PyValue* base, osd.Find("optimizer_state_dict", name));
  UCP_ASSIGN_OR_RETURN(const PyValue* state, base->Find("state", name + ": optimizer_state_dict"));
  if (fp32->kind() != PyKind::kList) {
    return DataLossError(name + ": fp32_flat_groups is not a list of sub-group partitions");
  }
  // This rank's own param_shapes say which parameters each sub-group flattens, in order.
  const std::string mname = ck.Zero3ModelStatesFile(tp_rank, dp_rank);
  UCP_ASSIGN_OR_RETURN(TorchFile model, TorchFile::Open(ck.dir() / mname));
  UCP_ASSIGN_OR_RETURN(const PyValue* shapes, model.root().Find("param_shapes", mname));
  if (shapes->kind() != PyKind::kList || shapes->items().size() != fp32->items().size()) {
    return DataLossError(mname + ": param_shapes does not list one dict per sub-group of " + name +
                         "'s " + std::to_string(fp32->items().size()) + " fp32_flat_groups");
  }
  const int64_t parts = ck.dp_sp();
  for (size_t g = 0; g < fp32->items().size(); ++g) {
    const std::string where = name + ": sub-group " + std::to_string(g);
    UCP_ASSIGN_OR_RETURN(const Partitions refs,
                         GroupPartitions(fp32->items()[g], state, g, where,
                                         "optimizer_state_dict.state", StateNames(ck)));
    const PyValue* group = shapes->items()[g];
    if (group->kind() != PyKind::kDict) {
      return DataLossError(mname + ": param_shapes[" + std::to_string(g) + "] is not a dict");
    }
    // Each parameter is cut into `parts` pieces of ceil(numel / parts) elements (the last one
    // zero-padded); this rank holds piece dp_rank of each, back to back.
    int64_t offset = 0;
    for (const auto& [k, v] : group->entries()) {
      if (k->kind() != PyKind::kStr) {
        return DataLossError(mname + ": param_shapes[" + std::to_string(g) +
                             "] has a key that is not a str");
      }
      UCP_ASSIGN_OR_RETURN(Shape shape, AsShape(v, mname + ": param_shapes[\"" + k->str() + "\"]"));
      UCP_ASSIGN_OR_RETURN(int64_t numel,
                           CheckedProduct(shape, mname + ": param_shapes[\"" + k->str() + "\"]"));
      const int64_t piece = (numel + parts - 1) / parts;
      const int64_t lo = std::min(numel, piece * dp_rank);
      const int64_t n = std::min(piece, numel - lo);
      if (n > 0) {
        frags[k->str()].push_back(Fragment{0, n, offset, fi, static_cast<int32_t>(g)});
      }
      offset += piece;
    }
    // zero_to_fp32's own sanity check: the pieces fill the partition exactly.
    for (size_t k = 0; k < refs.size(); ++k) {
      if (refs[k].num_elements() != offset) {
        return DataLossError(where + ": the " + StateNames(ck)[k] + " partition has " +
                             std::to_string(refs[k].num_elements()) + " elements, but the " +
                             std::to_string(group->entries().size()) + " parameters " + mname +
                             " lists for it take " + std::to_string(offset) + " at dp*sp=" +
                             std::to_string(parts));
      }
    }
    file.groups.push_back(refs);
  }
  if (!ck.optimizer_states().empty() && state->kind() == PyKind::kDict &&
      state->entries().size() != fp32->items().size()) {
    return DataLossError(name + ": optimizer_state_dict.state has " +
                         std::to_string(state->entries().size()) + " entries for " +
                         std::to_string(fp32->items().size()) + " sub-groups");
  }
  return Status::Ok();
}

Result<std::unique_ptr<DeepSpeedTensorSource>> DeepSpeedTensorSource::Open(
    const DeepSpeedCheckpoint& ck) {
  std::unique_ptr<DeepSpeedTensorSource> src(new DeepSpeedTensorSource());
  // Every optimizer file and every file holding weights stays open for reads: pp * tp * dp * sp
  // optimizer files, pp * tp model-state files and at most a layer file per spec and tp rank.
  int64_t expert_files = 0;
  for (int64_t n : ck.num_experts()) expert_files += n * ck.tp();
  UCP_RETURN_IF_ERROR(io::EnsureOpenFileLimit(int64_t{ck.pp()} * ck.tp() * (ck.dp_sp() + 1) +
                                                  (ck.model().num_layers + 4) * ck.tp() +
                                                  expert_files),
                      ck.dir().string());
  const layout::Layout view = ck.view();
  const std::vector<std::string> names = StateNames(ck);
  convert::PlanOptions states;
  states.optimizer_states = names;
  UCP_ASSIGN_OR_RETURN(std::vector<TensorInfo> tensors,
                       convert::DescribeLayout(ck.model(), view, states),
                       ck.dir().string() + ": the ucp view " + layout::ToString(view));
  std::map<std::string, int32_t> file_index;  // name -> files_
  auto open = [&](const std::string& name) -> Result<int32_t> {
    auto it = file_index.find(name);
    if (it != file_index.end()) return it->second;
    UCP_ASSIGN_OR_RETURN(TorchFile torch, TorchFile::Open(ck.dir() / name));
    src->files_.push_back(std::make_unique<File>(File{name, std::move(torch), {}}));
    const int32_t i = static_cast<int32_t>(src->files_.size() - 1);
    file_index[name] = i;
    return i;
  };

  // Optimizer files: per (pp, tp), each engine name's fragments in dp order.
  const int tp = ck.tp(), pp = ck.pp();
  std::vector<std::map<std::string, std::vector<Fragment>>> frags(static_cast<size_t>(pp) * tp);
  for (int s = 0; s < pp; ++s) {
    for (int r = 0; r < tp; ++r) {
      MoeGroups moe;  // DeepSpeed-MoE: the expert groups of this (pp, tp)'s files
      for (int d = 0; d < ck.dp_sp(); ++d) {
        const std::string name = ck.OptimStatesFile(s, r, d);
        UCP_ASSIGN_OR_RETURN(const int32_t fi, open(name));
        File& file = *src->files_[static_cast<size_t>(fi)];
        const PyValue& root = file.torch.root();
        UCP_ASSIGN_OR_RETURN(const PyValue* osd, root.Find("optimizer_state_dict", name));
        if (ck.zero3()) {
          UCP_RETURN_IF_ERROR(AddZero3Partitions(ck, r, d, fi, *osd, file,
                                                 frags[static_cast<size_t>(s) * tp + r]));
          continue;
        }
        UCP_ASSIGN_OR_RETURN(const PyValue* fp32,
                             osd->Find("single_partition_of_fp32_groups", name));
        UCP_ASSIGN_OR_RETURN(const PyValue* maps, osd->Find("param_slice_mappings", name));
        UCP_ASSIGN_OR_RETURN(const PyValue* base, osd->Find("base_optimizer_state", name));
        if (base->kind() != PyKind::kDict) {
          return UnimplementedError(name + ": base_optimizer_state is a " +
                                    std::string(PyKindName(base->kind())) +
                                    " (elastic checkpoint), which ucp does not read");
        }
        UCP_ASSIGN_OR_RETURN(const PyValue* state, base->Find("state", name));
        if (fp32->kind() != PyKind::kList || maps->kind() != PyKind::kList ||
            fp32->items().size() != maps->items().size()) {
          return DataLossError(name +
                               ": single_partition_of_fp32_groups and param_slice_mappings are "
                               "not lists of equal length");
        }
        std::set<std::string> seen;
        const PyValue* param_groups = base->Get("param_groups");
        for (size_t g = 0; g < fp32->items().size(); ++g) {
          const std::string where = name + ": param group " + std::to_string(g);
          UCP_ASSIGN_OR_RETURN(const Partitions refs,
                               GroupPartitions(fp32->items()[g], state, g, where,
                                               "base_optimizer_state.state", StateNames(ck)));
          file.groups.push_back(refs);
          const PyValue* m = maps->items()[g];
          if (m->kind() != PyKind::kDict) {
            return DataLossError(where + ": param_slice_mappings[" + std::to_string(g) +
                                 "] is not a dict");
          }
          if (ck.moe()) {
            UCP_ASSIGN_OR_RETURN(const bool expert_group,
                                 moe.AddGroup(ck, d, fi, g, *osd, param_groups, refs, *m, where));
            if (expert_group) continue;
          }
          for (const auto& [k, v] : m->entries()) {
            const PyValue* fa = ObjectState(v);
            if (k->kind() != PyKind::kStr || fa == nullptr) {
              return DataLossError(where +
                                   ": a param_slice_mappings entry is not name -> "
                                   "fragment_address");
            }
            const std::string what = where + ": fragment_address of \"" + k->str() + "\"";
            UCP_ASSIGN_OR_RETURN(int64_t numel, AsInt(fa->Get("numel"), what + " numel"));
            UCP_ASSIGN_OR_RETURN(int64_t start, AsInt(fa->Get("start"), what + " start"));
            // The fp32 partition may be trimmed (ZeRO) while the Adam states keep the padding.
            int64_t limit = refs[0].num_elements();
            for (const TensorRef& ref : refs) limit = std::min(limit, ref.num_elements());
            if (start < 0 || numel < 0 || start > limit || numel > limit - start) {
              return DataLossError(what + ": elements [" + std::to_string(start) + ", " +
                                   std::to_string(start + numel) + ") are outside the " +
                                   std::to_string(limit) + "-element partition");
            }
            if (!seen.insert(k->str()).second) {
              return DataLossError(name + ": \"" + k->str() +
                                   "\" is in param_slice_mappings twice");
            }
            if (numel == 0) continue;
            frags[static_cast<size_t>(s) * tp + r][k->str()].push_back(
                Fragment{0, numel, start, fi, static_cast<int32_t>(g)});
          }
        }
      }
      if (ck.moe()) {
        UCP_RETURN_IF_ERROR(moe.Derive(ck, s, r, frags[static_cast<size_t>(s) * tp + r]));
      }
    }
  }

  std::map<std::string, size_t> model_index;
  for (size_t i = 0; i < ck.model().params.size(); ++i) model_index[ck.model().params[i].name] = i;
  std::map<std::tuple<int, int, std::string>, int32_t> lists;  // (pp, tp, param) -> list
  for (const TensorInfo& t : tensors) {
    auto mi = model_index.find(t.param);
    if (mi == model_index.end())
      return InternalError("view tensor of unknown parameter " + t.param);
    const DeepSpeedParam& p = ck.params()[static_cast<size_t>(ck.ds_index(mi->second))];
    Entry e;
    e.numel = NumElementsOrDie(t.shape);
    e.dtype = t.dtype;
    TensorInfo stored = t;
    UCP_ASSIGN_OR_RETURN(e.qkv_blocks,
                         QkvRowBlocks(ck.model().params[mi->second], t.shape, tp, ck.qkv_layout()),
                         ck.dir().string());
    // The fragments of the TP shard (pp, tp) of p, in dp order, checked to tile it.
    auto fragment_list = [&]() -> Result<int32_t> {
      auto [li, inserted] = lists.try_emplace({t.pp, t.tp, t.param}, 0);
      if (inserted) {
        const auto& by_name = frags[static_cast<size_t>(t.pp) * tp + t.tp];
        auto it = by_name.find(p.engine_name);
        std::vector<Fragment> list = it == by_name.end() ? std::vector<Fragment>{} : it->second;
        int64_t offset = 0;
        const int64_t want = NumElementsOrDie(t.shape);
        for (Fragment& f : list) {
          f.offset = offset;
          offset += f.numel;
        }
        if (offset != want) {
          std::string files = ck.OptimStatesFile(t.pp, t.tp, 0);
          files.replace(files.find("_pp_rank_0_"), 11, "_pp_rank_*_");
          return DataLossError("parameter \"" + p.engine_name + "\" on pipeline stage " +
                               std::to_string(t.pp) + ", tp rank " + std::to_string(t.tp) +
                               ": the " + (ck.zero3() ? "ZeRO-3 partitions" : "param_slice_mappings") +
                               " of its " + std::to_string(ck.dp_sp()) +
                               " optimizer files (" + files + ") hold " + std::to_string(offset) +
                               " elements, its TP shard " + ShapeString(t.shape) + " has " +
                               std::to_string(want));
        }
        src->fragment_lists_.push_back(std::move(list));
        li->second = static_cast<int32_t>(src->fragment_lists_.size() - 1);
      }
      return li->second;
    };
    if (t.kind == TensorKind::kOptimSlice) {
      e.state = static_cast<int>(std::find(names.begin(), names.end(), t.state) - names.begin());
      if (e.state >= static_cast<int>(names.size())) {
        return InternalError("view tensor of unknown state " + t.state);
      }
      UCP_ASSIGN_OR_RETURN(e.list, fragment_list());
    } else if (t.kind == TensorKind::kModelSlice && ck.zero3()) {
      // ZeRO-3 saves no module weights (`module` holds empty placeholders); the engine's
      // low-precision partitions are its fp32 partitions copied (rounded) after each step and
      // again at load, so the weight is the fp32 master rounded to the training dtype.
      e.state = 0;
      e.cast = t.dtype != DType::kFp32;
      UCP_ASSIGN_OR_RETURN(e.list, fragment_list());
    } else if (t.kind == TensorKind::kModelSlice) {
      std::string name, key;
      if (p.expert >= 0) {
        // DeepSpeed-MoE: the expert's own file, a flat state dict under the global index.
        name = DeepSpeedCheckpoint::ExpertFile(p.moe_layer, p.expert, t.pp * tp + t.tp);
        key = p.engine_name;
      } else if (ck.naming() == Naming::kMegatronPipe) {
        UCP_ASSIGN_OR_RETURN(PipeLayerKey at, PipeLayerOf(p.engine_name));
        name = ck.LayerFileOf(at.layer_index, t.tp);
        key = at.key;
      } else {
        name = ck.ModelStatesFile(t.pp, t.tp);
        key = p.engine_name;
      }
      UCP_ASSIGN_OR_RETURN(e.file, open(name));
      const PyValue& root = src->files_[static_cast<size_t>(e.file)]->torch.root();
      const PyValue* module = &root;
      if (ck.naming() != Naming::kMegatronPipe && p.expert < 0) {
        UCP_ASSIGN_OR_RETURN(module, root.Find("module", name));
      }
      const PyValue* w = FindModuleTensor(module, key);
      if (w == nullptr || w->kind() != PyKind::kTensor) {
        return DataLossError(name + ": " +
                             (ck.naming() == Naming::kMegatronPipe || p.expert >= 0 ? ""
                                                                                    : "module ") +
                             "has no tensor \"" + key + "\" (the weight of parameter \"" +
                             p.engine_name + "\")");
      }
      e.ref = w->tensor();
      if (e.ref.dtype != t.dtype || e.ref.size != t.shape) {
        return DataLossError(name + ": \"" + key + "\" is " + std::string(DTypeName(e.ref.dtype)) +
                             ShapeString(e.ref.size) + ", parameter \"" + p.engine_name +
                             "\" needs " + std::string(DTypeName(t.dtype)) + ShapeString(t.shape) +
                             " (the training dtype and param_shapes)");
      }
    } else {
      return InternalError("the DeepSpeed view has a tensor of kind " +
                           std::string(convert::TensorKindName(t.kind)));
    }
    src->by_name_[t.name] = static_cast<int32_t>(src->entries_.size());
    src->entries_.push_back(std::move(e));
    src->infos_.push_back(std::move(stored));
  }

  // The records holding the data read: every partition of every optimizer file, and each
  // module weight's storage.
  std::set<std::pair<int32_t, std::string>> keys;
  for (size_t fi = 0; fi < src->files_.size(); ++fi) {
    for (const auto& refs : src->files_[fi]->groups) {
      for (const TensorRef& ref : refs) keys.insert({static_cast<int32_t>(fi), ref.storage.key});
    }
  }
  for (const Entry& e : src->entries_) {
    if (e.state < 0) keys.insert({e.file, e.ref.storage.key});
  }
  for (const auto& [fi, key] : keys) {
    const File& file = *src->files_[static_cast<size_t>(fi)];
    const auto& recs = file.torch.storages();
    auto it = std::find_if(recs.begin(), recs.end(),
                           [&](const torch::StorageRecord& r) { return r.key == key; });
    if (it == recs.end()) {
      return DataLossError(file.name + ": storage '" + key + "' is referenced but not stored");
    }
    src->records_.push_back(Record{fi, *it});
  }
  // And every other tensor record of the files opened (buffers, step counters, states no view
  // tensor reads): the checksums cover every tensor byte of those files, read or not (issue 14).
  for (size_t fi = 0; fi < src->files_.size(); ++fi) {
    for (const torch::StorageRecord& r : src->files_[fi]->torch.storages()) {
      if (keys.count({static_cast<int32_t>(fi), r.key}) == 0) {
        src->records_.push_back(Record{static_cast<int32_t>(fi), r});
      }
    }
  }
  return src;
}

Status DeepSpeedTensorSource::ReadModel(const Entry& e, int64_t begin, int64_t end,
                                        std::span<std::byte> out) const {
  const TorchFile& f = files_[static_cast<size_t>(e.file)]->torch;
  const int64_t item = DTypeSizeBytes(e.dtype);
  if (e.ref.IsContiguous()) return f.ReadTensorBytes(e.ref, begin * item, out);
  // A strided module weight (a view sharing another's storage) has no byte ranges: gather it.
  UCP_ASSIGN_OR_RETURN(Tensor whole, f.ReadTensor(e.ref));
  std::memcpy(out.data(), whole.data() + begin * item, static_cast<size_t>((end - begin) * item));
  return Status::Ok();
}

Status DeepSpeedTensorSource::ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                                            std::span<std::byte> out) const {
  auto it = by_name_.find(t.name);
  if (it == by_name_.end()) {
    return NotFoundError("tensor \"" + t.name +
                         "\" is not part of the DeepSpeed checkpoint's view");
  }
  const Entry& e = entries_[static_cast<size_t>(it->second)];
  if (t.dtype != e.dtype) {
    return InvalidArgumentError("tensor \"" + t.name + "\" is " + std::string(DTypeName(e.dtype)) +
                                ", not " + std::string(DTypeName(t.dtype)));
  }
  const int64_t item = DTypeSizeBytes(e.dtype);
  if (begin < 0 || end < begin || end > e.numel ||
      static_cast<int64_t>(out.size()) != (end - begin) * item) {
    return OutOfRangeError("tensor \"" + t.name + "\": elements [" + std::to_string(begin) + ", " +
                           std::to_string(end) + ") into " + std::to_string(out.size()) +
                           " bytes, of " + std::to_string(e.numel) + " elements");
  }
  if (begin == end) return Status::Ok();
  // A fused QKV stored in another row order is read block by block where its rows are.
  return ForEachStoredRange(
      e.qkv_blocks, begin, end, [&](int64_t view_begin, int64_t stored, int64_t n) -> Status {
        std::span<std::byte> part = out.subspan(static_cast<size_t>((view_begin - begin) * item),
                                                static_cast<size_t>(n * item));
        return ReadStored(e, stored, stored + n, part).WithContext("tensor \"" + t.name + "\"");
      });
}

Status DeepSpeedTensorSource::ReadStored(const Entry& e, int64_t begin, int64_t end,
                                         std::span<std::byte> out) const {
  if (e.state < 0) return ReadModel(e, begin, end, out);
  if (e.cast) {
    std::vector<std::byte> fp32(static_cast<size_t>((end - begin) * 4));
    UCP_RETURN_IF_ERROR(ReadFragments(e, begin, end, fp32));
    return CastElements(DType::kFp32, fp32, e.dtype, out, end - begin);
  }
  return ReadFragments(e, begin, end, out);
}

Status DeepSpeedTensorSource::ReadFragments(const Entry& e, int64_t begin, int64_t end,
                                            std::span<std::byte> out) const {
  const std::vector<Fragment>& frags = fragment_lists_[static_cast<size_t>(e.list)];
  // The last fragment starting at or before `begin` (fragments tile [0, numel) in order).
  auto f = std::upper_bound(frags.begin(), frags.end(), begin,
                            [](int64_t v, const Fragment& x) { return v < x.offset; });
  for (--f; f != frags.end() && f->offset < end; ++f) {
    const int64_t lo = std::max(begin, f->offset);
    const int64_t hi = std::min(end, f->offset + f->numel);
    if (lo >= hi) continue;
    const File& file = *files_[static_cast<size_t>(f->file)];
    UCP_RETURN_IF_ERROR(
        file.torch.ReadTensorBytes(
            file.groups[static_cast<size_t>(f->group)][e.state], (f->start + lo - f->offset) * 4,
            out.subspan(static_cast<size_t>((lo - begin) * 4), static_cast<size_t>((hi - lo) * 4))));
  }
  return Status::Ok();
}

Status DeepSpeedTensorSource::VerifyRecord(int64_t i) const {
  const Record& r = records_[static_cast<size_t>(i)];
  const File& file = *files_[static_cast<size_t>(r.file)];
  return file.torch.VerifyStorageCrc32(r.storage);
}

Status DeepSpeedTensorSource::CheckUnchanged() const {
  for (const auto& f : files_) UCP_RETURN_IF_ERROR(f->torch.CheckSourceUnchanged());
  return Status::Ok();
}

Status DeepSpeedTensorSource::VerifyChecksums() const {
  for (int64_t i = 0; i < num_records(); ++i) UCP_RETURN_IF_ERROR(VerifyRecord(i));
  return Status::Ok();
}

void DeepSpeedTensorSource::BeginVerifiedReads() const {
  for (const auto& f : files_) f->torch.VerifyReads();
}

Status DeepSpeedTensorSource::FinishVerifiedRecord(int64_t i) const {
  const Record& r = records_[static_cast<size_t>(i)];
  return files_[static_cast<size_t>(r.file)]->torch.FinishVerifiedReads(r.storage);
}

Status DeepSpeedTensorSource::VerifiedReadsFailure() const {
  for (const auto& f : files_) UCP_RETURN_IF_ERROR(f->torch.VerifyReadsFailure());
  return Status::Ok();
}

int64_t DeepSpeedTensorSource::record_bytes(int64_t i) const {
  return records_[static_cast<size_t>(i)].storage.num_bytes;
}

int64_t DeepSpeedTensorSource::verify_bytes_reread() const {
  int64_t total = 0;
  for (const auto& f : files_) total += f->torch.verify_bytes_reread();
  return total;
}

}  // namespace ucp::deepspeed
