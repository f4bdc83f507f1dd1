// DeepSpeed's universal layout writer (see deepspeed_universal.h).
#include "ucp/deepspeed/deepspeed_universal.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <optional>
#include <regex>
#include <utility>

#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/deepspeed/pickle_values.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/torch/torch_writer.h"
#include "ucp/json/strict_json.h"
#include "ucp/patterns/model.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using torch::PyKind;
using torch::PyValue;
using torch::TorchFile;

constexpr const char* kStates[3] = {"fp32", "exp_avg", "exp_avg_sq"};

// How DeepSpeed's loader cuts a parameter's TP slice from the full tensor (load_hp_checkpoint_state
// of deepspeed/checkpoint/universal_checkpoint.py, 0.14.4; deepspeed_ucp.md 7).
enum class MergeKind : uint8_t {
  kReplicate,  // no cat_dim: the full shape equals the rank's, so the loader copies it whole
  kShard,      // cat_dim: chunk(tp, cat_dim)[tp_rank]
  kPadStrip,   // cat_dim 0 and vocab_tensor: zero rows added up to the rank's rows * tp first
  kSubParams,  // parts each chunked over tp, the rank's chunks concatenated (SwiGLU [gate; up])
};

struct Merge {
  MergeKind kind = MergeKind::kReplicate;
  int dim = 0;
  std::vector<int64_t> sub_sizes;  // kSubParams: the parts' sizes along dim, in order
};

// The rule of `rules` whose regex fully matches `name`; none or two is an error naming it.
Result<const patterns::Rule*> MatchRule(const patterns::RuleSet& rules, const std::string& name) {
  const patterns::Rule* found = nullptr;
  for (const patterns::Rule& rule : rules.rules) {
    if (!std::regex_match(name, *rule.re)) continue;
    if (found != nullptr) {
      return InvalidArgumentError("parameter \"" + name + "\" matches two rules of family " +
                                  rules.family + ": " + found->match + " and " + rule.match);
    }
    found = &rule;
  }
  if (found == nullptr) {
    return InvalidArgumentError("parameter \"" + name + "\" matches no rule of family " +
                                rules.family);
  }
  return found;
}

// The sizes along the rule's dim of a concat-ordered fuse's parts for a parameter of `shape`:
// evaluated over `hyper` when that is known and holds their names, else equal shares when every
// part has the same size expression (SwiGLU's two ffn_hidden).
Result<std::vector<int64_t>> ConcatPartSizes(const patterns::Rule& rule, const Shape& shape,
                                             const std::map<std::string, int64_t>* hyper,
                                             const std::string& name) {
  const std::string where = "parameter \"" + name + "\" (rule " + rule.match + ")";
  if (rule.dim < 0 || static_cast<size_t>(rule.dim) >= shape.size()) {
    return InvalidArgumentError(where + ": fuse dim " + std::to_string(rule.dim) +
                                " is not a dim of shape " + ShapeToString(shape));
  }
  const int64_t total = shape[static_cast<size_t>(rule.dim)];
  const int64_t n = static_cast<int64_t>(rule.parts.size());
  std::vector<int64_t> sizes;
  Status evaluated = InvalidArgumentError(
      where + ": the parts' sizes are unknown: the universal checkpoint records no model "
              "hyper-parameters (client_state.ucp_model) and its source model is no preset");
  if (hyper != nullptr) {
    evaluated = Status::Ok();
    for (const patterns::FusePart& part : rule.parts) {
      Result<int64_t> v = patterns::EvalSizeExpr(part.size, *hyper);
      if (!v.ok()) {
        evaluated = Status(v.status().code(),
                           where + ", part " + part.name + ": " + v.status().message());
        break;
      }
      sizes.push_back(*v);
    }
  }
  if (!evaluated.ok()) {
    // Parts of one size expression are equal shares whatever the hyper-parameters.
    for (const patterns::FusePart& part : rule.parts) {
      if (part.size != rule.parts[0].size) return evaluated;
    }
    if (n == 0 || total % n != 0) {
      return InvalidArgumentError(where + ": " + std::to_string(total) + " rows on dim " +
                                  std::to_string(rule.dim) + " do not split into " +
                                  std::to_string(n) + " equal parts");
    }
    sizes.assign(static_cast<size_t>(n), total / n);
  }
  int64_t sum = 0;
  for (int64_t v : sizes) sum += v;
  if (sum != total) {
    return InvalidArgumentError(where + ": the parts add up to " + std::to_string(sum) +
                                " rows on dim " + std::to_string(rule.dim) + ", the shape " +
                                ShapeToString(shape) + " has " + std::to_string(total));
  }
  return sizes;
}

// How a parameter's full tensor is written so that DeepSpeed's loader cuts each tp rank's slice
// exactly as ucp's rule places it; kinds it cannot honour are refused, naming the missing piece.
// `expert_ep`: the ep a per-expert parameter is asked at (1 otherwise).
Result<Merge> MergeOf(const patterns::Rule& rule, const std::string& name, const Shape& shape,
                      const std::map<std::string, int64_t>* hyper, int expert_ep) {
  auto unimplemented = [&](const std::string& what) {
    return UnimplementedError("parameter \"" + name + "\": rule kind " +
                              std::string(patterns::RuleKindName(rule.kind)) + " (" + rule.match +
                              ") " + what);
  };
  // DeepSpeed 0.14.4's universal loader finds a parameter's folder by the rank's own engine name
  // and cuts only tp (tp_rank, tp_world_size): nothing in the folder or the call says which
  // expert-parallel rank holds what. Native DeepSpeed-MoE names experts by their index on the ep
  // rank (deepspeed_experts.0 on every rank), so at ep > 1 every ep rank would load the same
  // folder; and 0.14.4 links expert fragments by the dense dp size, not the expert-data-parallel
  // one (docs/deepspeed.md). ds_to_universal has no expert handling either (DeepSpeed #5716).
  constexpr const char* kNoEp =
      "DeepSpeed's universal loader (0.14.4) cuts tp only and finds each folder by the rank's "
      "own parameter name, so it cannot place expert-parallel slices; the missing piece is an "
      "expert-parallel slice in the universal format (DeepSpeed #5716)";
  if (rule.axis != patterns::Axis::kTp) {
    return unimplemented(std::string("on axis ep: ") + kNoEp);
  }
  if (expert_ep > 1) {
    return UnimplementedError("parameter \"" + name + "\" is an expert at ep=" +
                              std::to_string(expert_ep) + ": " + kNoEp +
                              "; write ep=1 (experts as ordinary parameters)");
  }
  Merge m;
  switch (rule.kind) {
    case patterns::RuleKind::kReplicate:
    case patterns::RuleKind::kAverage:
      // ucp gives every tp rank the whole (averaged) tensor, as the loader does with a tensor of
      // the rank's own shape (and as ds_to_universal writes parameter_to_average_patterns).
      m.kind = MergeKind::kReplicate;
      return m;
    case patterns::RuleKind::kShard:
      m.kind = MergeKind::kShard;
      m.dim = rule.dim;
      return m;
    case patterns::RuleKind::kPadStrip:
      // vocab_tensor pads rows (dim 0) only.
      if (rule.dim != 0) {
        return unimplemented("on dim " + std::to_string(rule.dim) +
                             ": DeepSpeed's vocab_tensor re-pads dim 0 only");
      }
      m.kind = MergeKind::kPadStrip;
      return m;
    case patterns::RuleKind::kFuse:
      if (rule.order == patterns::FuseOrder::kInterleavedGroups) {
        // Megatron splits an interleaved_groups tensor (QKV: per group [q | k | v] rows) over tp
        // as a plain column-parallel cut of those rows (whole groups when tp divides them, inside
        // a group otherwise), so the rank's slice is chunk(tp, 0)[rank] of the full tensor in the
        // rule's order: a plain shard.
        if (rule.dim != 0) {
          return unimplemented("on dim " + std::to_string(rule.dim) +
                               ": Megatron's interleaved groups are rows");
        }
        m.kind = MergeKind::kShard;
        return m;
      }
      // concat: each part split over tp on its own, the rank's chunks concatenated: the loader's
      // sub-parameters (param_n_sub_params for equal parts, sub_param_shape otherwise).
      m.kind = MergeKind::kSubParams;
      m.dim = rule.dim;
      UCP_ASSIGN_OR_RETURN(m.sub_sizes, ConcatPartSizes(rule, shape, hyper, name));
      return m;
  }
  return unimplemented("is not known");
}

// The rule set for `model` (a family or a preset), or, when it is empty, the one rule set in
// `dir` that gives every name in `names` exactly one rule.
Result<patterns::RuleSet> SelectRuleSet(const fs::path& dir, const std::string& model,
                                        const std::vector<std::string>& names) {
  auto check = [&](const patterns::RuleSet& rules) -> Status {
    for (const std::string& n : names) {
      UCP_RETURN_IF_ERROR(MatchRule(rules, n).status(),
                          "rule set " + (dir / (rules.family + ".json")).string());
    }
    return Status::Ok();
  };
  if (!model.empty()) {
    std::string family = model;
    std::error_code ec;
    if (!fs::is_regular_file(dir / (model + ".json"), ec)) {
      UCP_ASSIGN_OR_RETURN(patterns::ModelSpec spec, patterns::LoadModel(dir, model));
      family = spec.family;
    }
    UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules, patterns::LoadRuleSet(dir, family),
                         "model \"" + model + "\"");
    UCP_RETURN_IF_ERROR(check(rules), "model \"" + model + "\"");
    return rules;
  }
  std::vector<std::string> families;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file() && it->path().extension() == ".json") {
      families.push_back(it->path().stem().string());
    }
  }
  if (ec) return NotFoundError("cannot list rule sets in " + dir.string() + ": " + ec.message());
  std::sort(families.begin(), families.end());
  if (families.empty()) return NotFoundError("no rule set (<family>.json) in " + dir.string());
  std::vector<patterns::RuleSet> fits;
  Status best = Status::Ok();
  size_t best_matched = 0;
  for (const std::string& f : families) {
    UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules, patterns::LoadRuleSet(dir, f));
    size_t matched = 0;
    for (const std::string& n : names) matched += MatchRule(rules, n).ok() ? 1 : 0;
    if (matched == names.size()) {
      fits.push_back(std::move(rules));
    } else if (best.ok() || matched > best_matched) {
      // The error of the family that fits most names (the first such) is the one reported.
      best = check(rules);
      best_matched = matched;
    }
  }
  if (fits.size() > 1) {
    return InvalidArgumentError("parameter names fit the rule sets of families " + fits[0].family +
                                " and " + fits[1].family + " in " + dir.string() +
                                "; choose one with the model option");
  }
  if (fits.empty()) return best;
  return std::move(fits[0]);
}

// The layer index of a canonical "layers.<i>.…" name; -1 for the others.
int64_t LayerOf(const std::string& c) {
  if (!c.starts_with("layers.")) return -1;
  const size_t dot = c.find('.', 7);
  int64_t i = -1;
  if (dot == std::string::npos || dot - 7 > 12) return -1;
  auto [p, ec] = std::from_chars(c.data() + 7, c.data() + dot, i);
  return ec == std::errc() && p == c.data() + dot ? i : -1;
}

// The engine naming a universal checkpoint extracted from DeepSpeed records in its client state
// ({"deepspeed": {"naming": ...}}); GPTModelPipe's when it records none.
Result<Naming> RecordedNaming(const io::UniversalManifest& m, const std::string& where) {
  UCP_ASSIGN_OR_RETURN(json::Json j,
                       json::ParseStrict(m.client_state_json.empty() ? "{}" : m.client_state_json,
                                         where + ": client_state", StatusCode::kDataLoss));
  if (!j.is_object() || !j.contains("deepspeed") || !j["deepspeed"].is_object() ||
      !j["deepspeed"].contains("naming")) {
    return Naming::kMegatronPipe;
  }
  const json::Json& n = j["deepspeed"]["naming"];
  if (!n.is_string())
    return DataLossError(where + ": client_state.deepspeed.naming is not a string");
  UCP_ASSIGN_OR_RETURN(Naming naming, NamingFromName(n.get<std::string>()),
                       where + ": client_state.deepspeed.naming");
  return naming;
}

// One state file: {'param': t} plus the keys that tell DeepSpeed's loader how to cut it.
Status WriteStateFile(const fs::path& path, Tensor t, const Merge& merge,
                      const std::string& engine) {
  torch::TorchWriter w;
  torch::PyArena& a = w.arena();
  torch::PyValue* d = a.Dict();
  const Shape shape = t.shape();
  UCP_ASSIGN_OR_RETURN(const PyValue* tv, w.AddOwnedTensor(std::move(t)));
  d->SetItem(a.Str("param"), tv);
  switch (merge.kind) {
    case MergeKind::kReplicate:
      break;
    case MergeKind::kShard:
    case MergeKind::kPadStrip:
      d->SetItem(a.Str("cat_dim"), a.Int(merge.dim));
      break;
    case MergeKind::kSubParams: {
      const bool equal = std::all_of(merge.sub_sizes.begin(), merge.sub_sizes.end(),
                                     [&](int64_t v) { return v == merge.sub_sizes[0]; });
      if (equal) {
        // What ds_to_universal writes for parameter_with_2_sub_params_cat_dim_0 (SwiGLU's
        // dense_h_to_4h): the loader chunks the tensor into n parts along cat_dim.
        d->SetItem(a.Str("cat_dim"), a.Int(merge.dim));
        d->SetItem(a.Str("param_n_sub_params"),
                   a.Int(static_cast<int64_t>(merge.sub_sizes.size())));
      } else {
        // Parts of other sizes: a SubparamShape (a dataclass, pickled as cls.__new__ + BUILD)
        // whose shape holds the parts' sizes as a tuple at partition_dim.
        PyValue* o =
            a.Object(a.Global("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
                     a.Tuple(), /*newobj=*/true);
        PyValue* fields = a.Dict();
        PyValue* patterns = a.List();
        patterns->Append(a.Str(engine));
        fields->SetItem(a.Str("patterns"), patterns);
        std::vector<const PyValue*> dims;
        for (size_t i = 0; i < shape.size(); ++i) {
          if (static_cast<int>(i) != merge.dim) {
            dims.push_back(a.Int(shape[i]));
            continue;
          }
          std::vector<const PyValue*> parts;
          for (int64_t v : merge.sub_sizes) parts.push_back(a.Int(v));
          dims.push_back(a.Tuple(std::move(parts)));
        }
        fields->SetItem(a.Str("shape"), a.Tuple(std::move(dims)));
        fields->SetItem(a.Str("partition_dim"), a.Int(merge.dim));
        o->SetState(fields);
        d->SetItem(a.Str("sub_param_shape"), o);
      }
      break;
    }
  }
  if (merge.kind == MergeKind::kPadStrip) d->SetItem(a.Str("vocab_tensor"), a.Bool(true));
  return w.Write(path, *d);
}

// The model's hyper-parameters, for the sizes of fuse parts: the universal checkpoint's recorded
// model (client_state.ucp_model.hyper), else the preset `model` names; nullopt when neither.
std::optional<std::map<std::string, int64_t>> KnownHyper(const json::Json& cs,
                                                         const fs::path& rules_dir,
                                                         const std::string& model) {
  std::map<std::string, int64_t> hyper;
  if (cs.is_object() && cs.contains("ucp_model") && cs["ucp_model"].is_object() &&
      cs["ucp_model"].contains("hyper") && cs["ucp_model"]["hyper"].is_object()) {
    for (const auto& [k, v] : cs["ucp_model"]["hyper"].items()) {
      if (v.is_number_integer()) hyper[k] = v.get<int64_t>();
    }
  } else if (!model.empty()) {
    Result<patterns::ModelSpec> spec = patterns::LoadModel(rules_dir, model);
    if (!spec.ok()) return std::nullopt;  // a family, not a preset: no sizes
    hyper = spec->hyper;
  } else {
    return std::nullopt;
  }
  if (!hyper.contains("head_dim") && hyper.contains("hidden") && hyper.contains("heads") &&
      hyper.at("heads") > 0) {
    hyper["head_dim"] = hyper.at("hidden") / hyper.at("heads");
  }
  return hyper;
}

// Writes the folder's content into `tmp` (the caller's temporary folder for it).
Status WriteUniversalTree(const io::UniversalReader& reader, const fs::path& tmp,
                          const DeepSpeedUniversalOptions& options) {
  std::error_code ec;
  fs::create_directories(tmp / "zero", ec);
  if (ec) return IoError("cannot create " + (tmp / "zero").string() + ": " + ec.message());
  const io::UniversalManifest& m = reader.manifest();
  // The layout holds Adam's two moments beside fp32 (what ds_to_universal writes and the
  // universal loader reads); another optimizer's states have nowhere to go.
  for (const char* s : {"exp_avg", "exp_avg_sq"}) {
    if (std::find(m.optimizer_states.begin(), m.optimizer_states.end(), s) ==
        m.optimizer_states.end()) {
      std::string have;
      for (const std::string& o : m.optimizer_states) {
        if (o != "fp32") have += (have.empty() ? "" : ", ") + o;
      }
      return UnimplementedError("the source's optimizer (" + m.optimizer_kind + ", states [" +
                                have + "]) has no " + s +
                                ": DeepSpeed's universal checkpoint holds Adam's states only");
    }
  }
  EngineNameContext context;
  context.tied_embeddings = true;
  for (const auto& p : m.params) {
    context.num_layers = std::max(context.num_layers, LayerOf(p.name) + 1);
    if (p.name.starts_with("output_layer.")) context.tied_embeddings = false;
  }
  UCP_ASSIGN_OR_RETURN(Naming naming, RecordedNaming(m, reader.dir().string()));
  std::optional<DeepSpeedCheckpoint> source;
  if (!options.model_states_from.empty()) {
    OpenOptions o;
    o.bind_model = false;
    UCP_ASSIGN_OR_RETURN(source, DeepSpeedCheckpoint::Open(options.model_states_from, o),
                         "--model-states-from");
  }
  std::vector<std::string> names;
  for (const auto& p : m.params) names.push_back(p.name);
  UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules,
                       SelectRuleSet(RuleSetDir(options.data_dir),
                                     options.model.empty() ? m.source_model : options.model, names),
                       reader.dir().string());
  UCP_ASSIGN_OR_RETURN(json::Json cs,
                       json::ParseStrict(m.client_state_json.empty() ? "{}" : m.client_state_json,
                                         reader.dir().string() + ": client_state",
                                         StatusCode::kDataLoss));
  const std::optional<std::map<std::string, int64_t>> known_hyper = KnownHyper(
      cs, RuleSetDir(options.data_dir), options.model.empty() ? m.source_model : options.model);
  std::optional<std::regex> expert_re;
  if (!rules.expert_pattern.empty()) expert_re.emplace(rules.expert_pattern);
  for (const auto& p : m.params) {
    UCP_ASSIGN_OR_RETURN(const patterns::Rule* rule, MatchRule(rules, p.name));
    const bool expert = expert_re && std::regex_match(p.name, *expert_re);
    UCP_ASSIGN_OR_RETURN(const Merge merge,
                         MergeOf(*rule, p.name, p.shape, known_hyper ? &*known_hyper : nullptr,
                                 expert ? options.ep : 1),
                         reader.dir().string());
    UCP_ASSIGN_OR_RETURN(const std::string engine, EngineName(p.name, naming, context),
                         reader.dir().string());
    const fs::path pdir = tmp / "zero" / engine;
    fs::create_directories(pdir, ec);
    if (ec) return IoError("cannot create " + pdir.string() + ": " + ec.message());
    for (const char* s : kStates) {
      UCP_ASSIGN_OR_RETURN(Tensor t, reader.ReadState(p.name, s));
      if (t.dtype() != DType::kFp32) {
        return InvalidArgumentError("parameter \"" + p.name + "\" state " + s + " is " +
                                    std::string(DTypeName(t.dtype())) + ", not fp32");
      }
      UCP_RETURN_IF_ERROR(WriteStateFile(pdir / (std::string(s) + ".pt"), std::move(t), merge,
                                         engine));
    }
    torch::TorchWriter w;
    UCP_ASSIGN_OR_RETURN(Tensor step, Tensor::Uninitialized(DType::kFp32, Shape{}));
    step.as<float>()[0] = static_cast<float>(m.step);
    UCP_ASSIGN_OR_RETURN(const PyValue* sv, w.AddOwnedTensor(std::move(step)));
    UCP_RETURN_IF_ERROR(w.Write(pdir / "step.pt", *sv));
  }
  // zero/optimizer_state.pt: the source's rank-0 optimizer_state_dict minus the per-rank flat
  // state when the source is at hand, plus the hyper-parameter groups.
  {
    torch::TorchWriter w;
    torch::PyArena& a = w.arena();
    torch::PyValue* d = a.Dict();
    std::optional<TorchFile> src;
    if (source) {
      const DeepSpeedCheckpoint& ck = *source;
      const std::string name = ck.OptimStatesFile(0, 0, 0);
      UCP_ASSIGN_OR_RETURN(src, TorchFile::Open(ck.dir() / name));
      UCP_ASSIGN_OR_RETURN(const PyValue* osd, src->root().Find("optimizer_state_dict", name));
      for (const auto& [k, v] : osd->entries()) {
        if (k->kind() == PyKind::kStr &&
            (k->str() == "base_optimizer_state" || k->str() == "param_slice_mappings" ||
             k->str() == "single_partition_of_fp32_groups")) {
          continue;
        }
        UCP_ASSIGN_OR_RETURN(const PyValue* kc, w.CopyFrom(*src, *k));
        UCP_ASSIGN_OR_RETURN(const PyValue* vc, w.CopyFrom(*src, *v));
        d->SetItem(kc, vc);
      }
    }
    torch::PyValue* groups = a.List();
    for (int g = 0; g < 2; ++g) {
      torch::PyValue* pg = a.Dict();
      pg->SetItem(a.Str("lr"), a.Float(m.hyper.contains("lr") ? m.hyper.at("lr") : 0));
      pg->SetItem(a.Str("betas"),
                  a.Tuple({a.Float(m.hyper.contains("beta1") ? m.hyper.at("beta1") : 0.9),
                           a.Float(m.hyper.contains("beta2") ? m.hyper.at("beta2") : 0.999)}));
      pg->SetItem(a.Str("eps"), a.Float(m.hyper.contains("eps") ? m.hyper.at("eps") : 1e-8));
      const double wd = m.hyper.contains("weight_decay") ? m.hyper.at("weight_decay") : 0;
      pg->SetItem(a.Str("weight_decay"), a.Float(g == 0 ? wd : 0.0));
      torch::PyValue* params = a.List();
      params->Append(a.Int(g));
      pg->SetItem(a.Str("params"), params);
      groups->Append(pg);
    }
    d->SetItem(a.Str("param_groups"), groups);
    UCP_RETURN_IF_ERROR(w.Write(tmp / "zero" / "optimizer_state.pt", *d));
  }
  // Model-state files: byte copies of the source's, or minimal ones.
  if (source) {
    const DeepSpeedCheckpoint& ck = *source;
    for (int s = 0; s < ck.pp(); ++s) {
      for (int r = 0; r < ck.tp(); ++r) {
        const std::string name = ck.ModelStatesFile(s, r);
        fs::copy_file(ck.dir() / name, tmp / name, ec);
        if (ec) return IoError("cannot copy " + (ck.dir() / name).string() + ": " + ec.message());
      }
    }
  } else {
    // The model the manifest records, so that ucp reads the folder back without --model.
    const json::Json* ucp_model = nullptr;
    if (cs.is_object() && cs.contains("ucp_model") && cs["ucp_model"].is_object()) {
      ucp_model = &cs["ucp_model"];
    }
    for (int i = 0; i < options.tp * options.pp; ++i) {
      torch::TorchWriter w;
      torch::PyArena& a = w.arena();
      torch::PyValue* d = a.Dict();
      d->SetItem(a.Str("module"), a.None());
      d->SetItem(a.Str("iteration"), a.Int(m.step));
      d->SetItem(a.Str("global_steps"), a.Int(m.step));
      d->SetItem(a.Str("mp_world_size"), a.Int(options.tp * options.pp));
      torch::PyValue* dims = a.Dict();
      dims->SetItem(a.Str("pp_degree"), a.Int(options.pp));
      dims->SetItem(a.Str("tp_degree"), a.Int(options.tp));
      d->SetItem(a.Str("checkpoint_parallel_dimensions"), dims);
      d->SetItem(a.Str("ds_version"), a.Str("0.16.9"));
      if (ucp_model != nullptr) {
        const std::string where = reader.dir().string() + ": client_state.ucp_model";
        torch::PyValue* um = a.Dict();
        for (const char* k : {"name", "family", "dtype"}) {
          if (!ucp_model->contains(k) || !(*ucp_model)[k].is_string()) {
            return DataLossError(where + "." + k + " is not a string");
          }
          um->SetItem(a.Str(k), a.Str((*ucp_model)[k].get<std::string>()));
        }
        if (!ucp_model->contains("hyper") || !(*ucp_model)["hyper"].is_object()) {
          return DataLossError(where + ".hyper is not an object");
        }
        torch::PyValue* hyper = a.Dict();
        for (const auto& [k, v] : (*ucp_model)["hyper"].items()) {
          if (!v.is_number_integer()) return DataLossError(where + ".hyper." + k + " is not an integer");
          hyper->SetItem(a.Str(k), a.Int(v.get<int64_t>()));
        }
        um->SetItem(a.Str("hyper"), hyper);
        d->SetItem(a.Str("ucp_model"), um);
      }
      char buf[64];
      std::snprintf(buf, sizeof buf, "mp_rank_%02d_model_states.pt", i);
      UCP_RETURN_IF_ERROR(w.Write(tmp / buf, *d));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<patterns::RuleSet> SelectUniversalRuleSet(const fs::path& rules_dir,
                                                 const std::string& model,
                                                 const std::vector<std::string>& names) {
  return SelectRuleSet(rules_dir, model, names);
}

Status WriteDeepSpeedUniversal(const io::UniversalReader& reader, const fs::path& dst_in,
                               const DeepSpeedUniversalOptions& options) {
  // Built in a DST.tmp-XXXXXX sibling (removed on failure and on SIGINT/SIGTERM) and renamed
  // into place: nothing is written outside DST, DeepSpeed's latest_universal pointer included
  // (the CLI's --into-root writes it, when asked).
  const fs::path dst = io::WithoutTrailingSlash(dst_in);
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dst, ec))) {
    return AlreadyExistsError("output " + dst.string() + " exists");
  }
  const fs::path parent = dst.parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) return IoError("cannot create folder " + parent.string() + ": " + ec.message());
  }
  UCP_ASSIGN_OR_RETURN(const fs::path tmp, io::MakeTempSiblingDir(dst));
  Status st = WriteUniversalTree(reader, tmp, options);
  if (st.ok()) st = io::FsyncTree(tmp);
  if (st.ok()) st = io::RenameNoReplace(tmp, dst);
  if (!st.ok()) io::RemoveTreeBestEffort(tmp);
  return st;
}

}  // namespace ucp::deepspeed
