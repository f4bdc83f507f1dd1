// Binding a DeepSpeed checkpoint to a ucp model (DeepSpeedCheckpoint::BindModel): the family from
// --model or from the parameter names, the hyper-parameters from a preset, else from the
// Megatron args and the shapes, then every parameter, TP shard shape and pipeline stage checked
// against what ucp's rules say the model holds at the checkpoint's tp and pp.
#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/deepspeed/pickle_values.h"
#include "ucp/deepspeed/stage_assignment.h"
#include "ucp/io/torch/py_value.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using torch::PyKind;
using torch::PyValue;

std::string Q(std::string_view s) { return "\"" + std::string(s) + "\""; }

// How the checkpoint's canonical names fit one family's parameter templates.
struct Fit {
  std::string problem;  // empty when they fit
  // Per canonical name, the template it instantiates ("layers.{layer}.mlp.router.weight").
  std::map<std::string, std::string> template_of;
  // Flags the optional templates decide (tied_embeddings = 0 when output_layer is present).
  std::map<std::string, int64_t> flags;
  int64_t layers = 0;
  int64_t experts = 0;
};

// The names fit a family when each is an instance of one of its templates (layer and expert
// indices replaced by {layer} / {expert} through the rule set's patterns) and each template
// without a `when` has an instance. Rule matching alone cannot tell gpt from llama (llama's names
// are a subset of gpt's rules), the template set can.
Result<Fit> FitFamily(const patterns::RuleSet& rules, const std::vector<DeepSpeedParam>& params) {
  Fit fit;
  const std::string family = Q(rules.family);
  std::regex layer_re, expert_re;
  try {
    layer_re = std::regex(rules.layer_pattern, std::regex::ECMAScript);
    if (!rules.expert_pattern.empty()) {
      expert_re = std::regex(rules.expert_pattern, std::regex::ECMAScript);
    }
  } catch (const std::regex_error& e) {
    return InvalidArgumentError("rule set " + family +
                                ": bad layer or expert pattern: " + e.what());
  }
  std::map<std::string, const patterns::ParamTemplate*> templates;
  for (const patterns::ParamTemplate& t : rules.templates) templates[t.name] = &t;
  std::set<std::string> present;
  std::set<int64_t> layers, experts;
  for (const DeepSpeedParam& p : params) {
    struct Edit {
      size_t pos, len;
      const char* text;
    };
    std::vector<Edit> edits;
    std::smatch m;
    if (std::regex_match(p.name, m, layer_re) && m.size() > 1 && m[1].matched && m.length(1) <= 9) {
      edits.push_back(
          {static_cast<size_t>(m.position(1)), static_cast<size_t>(m.length(1)), "{layer}"});
      layers.insert(std::stoll(m[1].str()));
    }
    if (!rules.expert_pattern.empty() && std::regex_match(p.name, m, expert_re) && m.size() > 1 &&
        m[1].matched && m.length(1) <= 9) {
      edits.push_back(
          {static_cast<size_t>(m.position(1)), static_cast<size_t>(m.length(1)), "{expert}"});
      experts.insert(std::stoll(m[1].str()));
    }
    std::sort(edits.begin(), edits.end(),
              [](const Edit& a, const Edit& b) { return a.pos > b.pos; });
    std::string t = p.name;
    for (const Edit& e : edits) t.replace(e.pos, e.len, e.text);
    if (!templates.contains(t)) {
      fit.problem = "parameter " + Q(p.name) + " is no instance of its parameter templates";
      return fit;
    }
    fit.template_of[p.name] = t;
    present.insert(t);
  }
  for (const patterns::ParamTemplate& t : rules.templates) {
    const bool is_present = present.contains(t.name);
    if (t.when.empty()) {
      if (!is_present) {
        fit.problem = "the checkpoint has no parameter of its template " + Q(t.name);
        return fit;
      }
      continue;
    }
    const bool negated = t.when[0] == '!';
    const std::string flag = t.when.substr(negated ? 1 : 0);
    const int64_t value = (negated ? !is_present : is_present) ? 1 : 0;
    auto [it, inserted] = fit.flags.try_emplace(flag, value);
    if (!inserted && it->second != value) {
      fit.problem = "its templates disagree on " + flag + " for these parameters";
      return fit;
    }
  }
  fit.layers = layers.empty() ? 0 : *layers.rbegin() + 1;
  fit.experts = experts.empty() ? 0 : *experts.rbegin() + 1;
  return fit;
}

// The identifiers of a size expression ("heads/kv_heads*head_dim" -> heads, kv_heads, head_dim).
std::set<std::string> Identifiers(std::string_view expr) {
  std::set<std::string> out;
  for (size_t i = 0; i < expr.size();) {
    if (std::isalpha(static_cast<unsigned char>(expr[i])) || expr[i] == '_') {
      size_t j = i;
      while (j < expr.size() &&
             (std::isalnum(static_cast<unsigned char>(expr[j])) || expr[j] == '_')) {
        ++j;
      }
      out.insert(std::string(expr.substr(i, j - i)));
      i = j;
    } else {
      ++i;
    }
  }
  return out;
}

// Every hyper-parameter the family's templates and rules refer to.
std::set<std::string> UsedHyper(const patterns::RuleSet& rules) {
  std::set<std::string> used;
  auto add = [&](std::string_view e) {
    for (std::string id : Identifiers(e)) used.insert(std::move(id));
  };
  for (const patterns::ParamTemplate& t : rules.templates) {
    for (const std::string& e : t.shape) add(e);
    if (!t.when.empty()) add(t.when);
  }
  for (const patterns::Rule& r : rules.rules) {
    for (const patterns::FusePart& part : r.parts) add(part.size);
    add(r.groups);
    add(r.divisible_by);
  }
  return used;
}

// x with expr(hyper + {unknown: x}) == value, for an expression linear in `unknown` (probed at 1
// and 2, then verified); nullopt otherwise.
std::optional<int64_t> SolveFor(const std::string& expr, const std::string& unknown, int64_t value,
                                const std::map<std::string, int64_t>& hyper) {
  auto eval = [&](int64_t x) -> std::optional<int64_t> {
    std::map<std::string, int64_t> h = hyper;
    h[unknown] = x;
    Result<int64_t> r = patterns::EvalSizeExpr(expr, h);
    return r.ok() ? std::optional<int64_t>(*r) : std::nullopt;
  };
  const std::optional<int64_t> v1 = eval(1), v2 = eval(2);
  if (!v1 || !v2 || *v2 <= *v1) return std::nullopt;
  const int64_t a = *v2 - *v1, b = *v1 - a;
  if ((value - b) % a != 0 || (value - b) / a < 1) return std::nullopt;
  const int64_t x = (value - b) / a;
  const std::optional<int64_t> check = eval(x);
  if (!check || *check != value) return std::nullopt;
  return x;
}

// Hyper-parameters the Megatron args give (unset arguments are None and skipped).
// Errors: kDataLoss for a value no model has (beyond 2^31), naming the argument.
Result<std::map<std::string, int64_t>> FromArgs(const PyValue* args, const std::string& file) {
  std::map<std::string, int64_t> out;
  if (args == nullptr) return out;
  for (const MegatronArgName& a : kMegatronArgNames) {
    const PyValue* v = args->Get(a.arg);
    if (v != nullptr && v->kind() == PyKind::kInt && v->int_value() > 0) {
      if (v->int_value() > (int64_t{1} << 31)) {
        return DataLossError(file + ": args." + a.arg + " = " + std::to_string(v->int_value()) +
                             " is implausibly large");
      }
      out[a.hyper] = v->int_value();
    }
  }
  if (const PyValue* v = args->Get("untie_embeddings_and_output_weights");
      v != nullptr && v->kind() == PyKind::kBool) {
    out["tied_embeddings"] = v->bool_value() ? 0 : 1;
  }
  // Megatron's --rotary-interleaved: the q/k rows pair adjacent elements (docs/hf.md); recorded
  // only when set, absent meaning half-split.
  if (const PyValue* v = args->Get("rotary_interleaved");
      v != nullptr && v->kind() == PyKind::kBool && v->bool_value()) {
    out[std::string(patterns::kRotaryInterleavedHyper)] = 1;
  }
  return out;
}

// The order in which missing hyper-parameters are named: the ones shapes never determine first.
int MissingRank(const std::string& k) {
  static const char* kOrder[] = {
      "heads",  "kv_heads",   "head_dim",      "vocab",       "hidden",
      "layers", "ffn_hidden", "max_positions", "num_experts", "make_vocab_size_divisible_by"};
  for (size_t i = 0; i < std::size(kOrder); ++i) {
    if (k == kOrder[i]) return static_cast<int>(i);
  }
  return 100;
}

std::string HyperText(const std::map<std::string, int64_t>& hyper) {
  std::string s;
  for (const auto& [k, v] : hyper) s += (s.empty() ? "" : ", ") + k + "=" + std::to_string(v);
  return s.empty() ? "nothing" : s;
}

}  // namespace

Status DeepSpeedCheckpoint::BindModel(const OpenOptions& options, const PyValue* args,
                                      const PyValue* ucp_model) {
  const fs::path data_dir = RuleSetDir(options.data_dir);
  const std::string where = dir_.string();
  // 1. The family: named by --model (a family, or the preset's / model file's), else the one
  //    rule set whose templates the names are.
  std::optional<patterns::ModelSpec> preset;
  std::string family;
  if (!options.model.empty()) {
    std::error_code ec;
    if (!options.model.ends_with(".json") &&
        options.model.find_first_of("/\\.") == std::string::npos &&
        fs::is_regular_file(data_dir / (options.model + ".json"), ec)) {
      family = options.model;
    } else {
      UCP_ASSIGN_OR_RETURN(preset, patterns::LoadModel(data_dir, options.model),
                           "model " + Q(options.model));
      family = preset->family;
    }
  }
  // A checkpoint ucp wrote records its model (client key ucp_model): it is the preset then.
  std::string label = options.model;
  bool recorded = false;
  if (options.model.empty() && ucp_model != nullptr && !ucp_model->is_none()) {
    const std::string file = ModelStatesFile(0, 0);
    const PyValue* name = ucp_model->Get("name");
    const PyValue* fam = ucp_model->Get("family");
    const PyValue* hyper = ucp_model->Get("hyper");
    if (name == nullptr || name->kind() != PyKind::kStr || fam == nullptr ||
        fam->kind() != PyKind::kStr || hyper == nullptr || hyper->kind() != PyKind::kDict) {
      return DataLossError(file + ": ucp_model is not {name, family, hyper}");
    }
    patterns::ModelSpec spec;
    spec.name = name->str();
    spec.family = fam->str();
    for (const auto& [k, v] : hyper->entries()) {
      if (k->kind() != PyKind::kStr)
        return DataLossError(file + ": ucp_model.hyper has a non-str key");
      UCP_ASSIGN_OR_RETURN(spec.hyper[k->str()], AsInt(v, file + ": ucp_model.hyper." + k->str()));
    }
    family = spec.family;
    label = spec.name;
    preset = std::move(spec);
    recorded = true;
  }
  patterns::RuleSet rules;
  Fit fit;
  if (!family.empty()) {
    UCP_ASSIGN_OR_RETURN(rules, patterns::LoadRuleSet(data_dir, family), "model " + Q(label));
    UCP_ASSIGN_OR_RETURN(fit, FitFamily(rules, params_));
    if (!fit.problem.empty()) {
      return FailedPreconditionError(where + ": the checkpoint is not a model of family " +
                                     Q(family) + " (model " + Q(label) + "): " + fit.problem);
    }
  } else {
    std::vector<std::string> families;
    std::error_code ec;
    for (fs::directory_iterator it(data_dir, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->is_regular_file() && it->path().extension() == ".json") {
        families.push_back(it->path().stem().string());
      }
    }
    if (ec)
      return NotFoundError("cannot list rule sets in " + data_dir.string() + ": " + ec.message());
    std::sort(families.begin(), families.end());
    std::vector<std::pair<patterns::RuleSet, Fit>> fits;
    std::string problems;
    for (const std::string& f : families) {
      UCP_ASSIGN_OR_RETURN(patterns::RuleSet rs, patterns::LoadRuleSet(data_dir, f));
      UCP_ASSIGN_OR_RETURN(Fit one, FitFamily(rs, params_));
      if (one.problem.empty()) {
        fits.emplace_back(std::move(rs), std::move(one));
      } else {
        problems += (problems.empty() ? "" : "; ") + f + ": " + one.problem;
      }
    }
    if (fits.empty()) {
      return InvalidArgumentError(
          where + ": the parameter names fit no rule set in " + data_dir.string() + " (" +
          (problems.empty() ? "there is none" : problems) + "); name the model with --model");
    }
    if (fits.size() > 1) {
      return InvalidArgumentError(where + ": the parameter names fit the rule sets of families " +
                                  fits[0].first.family + " and " + fits[1].first.family + " in " +
                                  data_dir.string() + "; choose one with --model");
    }
    rules = std::move(fits[0].first);
    fit = std::move(fits[0].second);
  }
  // Each canonical name has exactly one rule (Resolve checks it again for the whole model).
  std::map<std::string, const patterns::Rule*> rule_of;
  for (const DeepSpeedParam& p : params_) {
    const patterns::Rule* found = nullptr;
    for (const patterns::Rule& rule : rules.rules) {
      if (!std::regex_match(p.name, *rule.re)) continue;
      if (found != nullptr) {
        return InvalidArgumentError(where + ": parameter " + Q(p.name) +
                                    " matches two rules of family " + rules.family + ": " +
                                    found->match + " and " + rule.match);
      }
      found = &rule;
    }
    if (found == nullptr) {
      return InvalidArgumentError(where + ": parameter " + Q(p.name) +
                                  " matches no rule of family " + rules.family);
    }
    rule_of[p.name] = found;
  }

  // 2. Hyper-parameters.
  const std::set<std::string> used = UsedHyper(rules);
  std::map<std::string, int64_t> from_names = fit.flags;
  from_names["layers"] = fit.layers;
  if (fit.experts > 0) from_names["num_experts"] = fit.experts;
  using HyperMap = std::map<std::string, int64_t>;
  UCP_ASSIGN_OR_RETURN(HyperMap from_args, FromArgs(args, ModelStatesFile(0, 0)), where);
  if (original_vocab_ > 0) from_args["vocab"] = original_vocab_;
  std::map<std::string, int64_t> hyper;
  if (preset) {
    model_origin_ =
        recorded ? "the ucp_model it records"
                 : (options.model.ends_with(".json") ? "model file " : "preset ") + options.model;
    hyper = preset->hyper;
    auto check = [&](const std::map<std::string, int64_t>& have, const std::string& source) {
      for (const auto& [k, v] : have) {
        if (!used.contains(k) && k != "layers" && k != "num_experts") continue;
        auto it = hyper.find(k);
        const int64_t mine = it == hyper.end() ? 0 : it->second;
        if (mine != v) {
          return FailedPreconditionError(where + ": model " + Q(label) + " has " + k + "=" +
                                         std::to_string(mine) + " but the checkpoint's " + source +
                                         " give " + std::to_string(v));
        }
      }
      return Status::Ok();
    };
    UCP_RETURN_IF_ERROR(check(from_names, "parameter names"));
    UCP_RETURN_IF_ERROR(check(from_args, "Megatron args"));
    // A property of the training code, not of the preset: kept from the args.
    if (auto r = from_args.find(std::string(patterns::kRotaryInterleavedHyper));
        r != from_args.end()) {
      hyper[r->first] = r->second;
    }
  } else {
    hyper = from_names;
    for (const auto& [k, v] : from_args) {
      auto [it, inserted] = hyper.try_emplace(k, v);
      if (!inserted && it->second != v) {
        return FailedPreconditionError(where + ": the Megatron args give " + k + "=" +
                                       std::to_string(v) + " but the parameter names " +
                                       std::to_string(it->second));
      }
    }
    model_origin_ = args != nullptr ? "Megatron args" : "shapes";
    // Plain DeepSpeed does not pad the vocabulary.
    if (args == nullptr && used.contains("make_vocab_size_divisible_by")) {
      hyper.try_emplace("make_vocab_size_divisible_by", 1);
    }
    // Megatron's defaults for arguments left unset.
    if (args != nullptr && hyper.contains("heads")) hyper.try_emplace("kv_heads", hyper["heads"]);
    // What the shapes determine: every dim whose size expression has one unknown.
    const std::map<std::string, int64_t> before = hyper;
    for (bool progress = true; progress;) {
      progress = false;
      for (const DeepSpeedParam& p : params_) {
        const patterns::ParamTemplate* t = nullptr;
        for (const patterns::ParamTemplate& c : rules.templates) {
          if (c.name == fit.template_of.at(p.name)) t = &c;
        }
        const patterns::Rule& rule = *rule_of.at(p.name);
        // A parameter tp rank 0 lacks is reported by the checks below.
        const std::optional<Shape>& first = p.shapes[static_cast<size_t>(p.stages.front()) * tp_];
        if (t == nullptr || !first || t->shape.size() != first->size()) continue;
        const Shape& local = *first;
        for (size_t k = 0; k < local.size(); ++k) {
          const bool split =
              static_cast<int>(k) == rule.dim && rule.axis == patterns::Axis::kTp &&
              (rule.kind == patterns::RuleKind::kShard || rule.kind == patterns::RuleKind::kFuse ||
               rule.kind == patterns::RuleKind::kPadStrip);
          // A padded dim's logical size is known only when nothing was padded.
          if (split && rule.kind == patterns::RuleKind::kPadStrip &&
              (tp_ != 1 || !hyper.contains("make_vocab_size_divisible_by") ||
               hyper.at("make_vocab_size_divisible_by") != 1)) {
            continue;
          }
          const int64_t full = local[k] * (split ? tp_ : 1);
          std::vector<std::string> unknown;
          for (const std::string& id : Identifiers(t->shape[k])) {
            if (!hyper.contains(id)) unknown.push_back(id);
          }
          if (unknown.size() != 1) continue;
          if (std::optional<int64_t> x = SolveFor(t->shape[k], unknown[0], full, hyper)) {
            hyper[unknown[0]] = *x;
            progress = true;
          }
        }
      }
    }
    if (hyper.size() > before.size()) {
      model_origin_ = args != nullptr ? "Megatron args and shapes" : "shapes";
    }
  }
  // Derived defaults, as patterns::LoadModel applies them to presets.
  if (hyper.contains("heads") && hyper.contains("hidden") && hyper["heads"] > 0 &&
      hyper["hidden"] % hyper["heads"] == 0) {
    hyper.try_emplace("head_dim", hyper["hidden"] / hyper["heads"]);
  }
  hyper.try_emplace("tied_embeddings", 0);
  hyper.try_emplace("num_experts", 0);
  std::vector<std::string> missing;
  for (const std::string& k : used) {
    if (!hyper.contains(k)) missing.push_back(k);
  }
  for (const char* k : {"hidden", "layers", "heads", "vocab"}) {
    if (!hyper.contains(k) && std::find(missing.begin(), missing.end(), k) == missing.end()) {
      missing.push_back(k);
    }
  }
  if (!missing.empty()) {
    std::stable_sort(
        missing.begin(), missing.end(),
        [](const std::string& a, const std::string& b) { return MissingRank(a) < MissingRank(b); });
    std::string list;
    for (const std::string& m : missing) list += (list.empty() ? "" : ", ") + m;
    return InvalidArgumentError(
        where + ": hyper-parameter " + Q(missing[0]) + " of family " + rules.family +
        " is unknown: " +
        (args == nullptr ? "no Megatron args are saved" : "the Megatron args lack it") +
        " and the shapes do not determine it (missing: " + list + "; known: " + HyperText(hyper) +
        "); pass --model with a preset or a model .json file");
  }

  // 3. The model, in the checkpoint's training dtype.
  spec_ = patterns::ModelSpec{};
  spec_.name = preset ? preset->name : rules.family;
  spec_.family = rules.family;
  spec_.dtype = dtype_;
  spec_.hyper = std::move(hyper);
  spec_.templates = rules.templates;
  UCP_ASSIGN_OR_RETURN(model_, patterns::Resolve(spec_, rules),
                       where + ": model " + Q(spec_.name) + " (" + model_origin_ + ")");

  // 4. The checkpoint is the model: the same parameters, engine names that round-trip, each on
  //    the pipeline stages ucp assigns it, each TP shard the slice ucp's rule cuts.
  std::map<std::string, int> by_name;
  for (size_t i = 0; i < params_.size(); ++i) by_name[params_[i].name] = static_cast<int>(i);
  ds_index_.assign(model_.params.size(), -1);
  std::vector<bool> used_ds(params_.size(), false);
  for (size_t i = 0; i < model_.params.size(); ++i) {
    auto it = by_name.find(model_.params[i].name);
    if (it == by_name.end()) {
      return FailedPreconditionError(where + ": parameter " + Q(model_.params[i].name) +
                                     " of model " + Q(spec_.name) +
                                     " is not in the checkpoint's param_shapes");
    }
    ds_index_[i] = it->second;
    used_ds[static_cast<size_t>(it->second)] = true;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!used_ds[i]) {
      return FailedPreconditionError(
          where + ": parameter " + Q(params_[i].engine_name) + " (" + params_[i].name +
          ") of the checkpoint is not a parameter of model " + Q(spec_.name));
    }
  }
  const EngineNameContext names{model_.num_layers, spec_.hyper.at("tied_embeddings") != 0, moe_};
  for (const DeepSpeedParam& p : params_) {
    UCP_ASSIGN_OR_RETURN(std::string engine, EngineName(p.name, naming_, names), where);
    if (engine != p.engine_name) {
      return DataLossError(where + ": parameter " + Q(p.engine_name) + " is named " + Q(engine) +
                           " by a " + std::string(NamingName(naming_)) + " of " +
                           std::to_string(model_.num_layers) + " layers" +
                           (names.tied_embeddings ? " with tied embeddings" : ""));
    }
  }
  // The split the files hold (uneven under DeepSpeed's partition_method), not a recomputed one.
  UCP_ASSIGN_OR_RETURN(layout::StageAssignment stages,
                       StagesOfCheckpoint(model_, params_, ds_index_, pp_, where),
                       "model " + Q(spec_.name) + " at pp=" + std::to_string(pp_));
  if (const auto counts = layout::StageCounts(stages); !layout::IsEvenSplit(counts)) {
    stages_ = counts;
  }
  auto stage_list = [](const std::vector<int>& v) {
    std::string s;
    for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
    return "[" + s + "]";
  };
  for (size_t i = 0; i < model_.params.size(); ++i) {
    const patterns::ResolvedParam& mp = model_.params[i];
    const DeepSpeedParam& p = params_[static_cast<size_t>(ds_index_[i])];
    std::vector<int> expected;
    switch (mp.stage) {
      case patterns::StagePlacement::kLayer:
        expected = {stages.StageOfLayer(mp.layer)};
        break;
      case patterns::StagePlacement::kFirst:
        expected = {0};
        break;
      case patterns::StagePlacement::kLast:
        expected = {pp_ - 1};
        break;
      case patterns::StagePlacement::kFirstAndLast:
        expected = pp_ > 1 ? std::vector<int>{0, pp_ - 1} : std::vector<int>{0};
        break;
    }
    for (int s : p.stages) {
      // A TiedLayerSpec module lives whole on every stage that uses it (GPTModelPipe's last
      // stage holds the position embedding too); such extra copies are not part of the view.
      if (std::find(expected.begin(), expected.end(), s) == expected.end() &&
          !p.engine_name.starts_with("tied_modules.")) {
        return FailedPreconditionError(
            where + ": parameter " + Q(p.engine_name) + " is on pipeline stages " +
            stage_list(p.stages) + " but model " + Q(spec_.name) + " at pp=" + std::to_string(pp_) +
            " puts it on " + stage_list(expected));
      }
    }
    for (int s : expected) {
      for (int r = 0; r < tp_; ++r) {
        // DeepSpeed-MoE lists no param_shapes: the shapes are the saved tensors'.
        const std::string file = p.expert >= 0 ? ExpertFile(p.moe_layer, p.expert, s * tp_ + r)
                                               : ModelStatesFile(s, r);
        const std::string listing =
            moe_ ? "the tensor in " + file + " is " : "param_shapes in " + file + " say ";
        const std::optional<Shape>& have = p.shapes[static_cast<size_t>(s) * tp_ + r];
        if (!have) {
          return FailedPreconditionError(
              where + ": parameter " + Q(p.engine_name) + " is not in " + file +
              " (pipeline stage " + std::to_string(s) + ", tp rank " + std::to_string(r) +
              "), where model " + Q(spec_.name) + " at pp=" + std::to_string(pp_) + " puts it");
        }
        UCP_ASSIGN_OR_RETURN(patterns::Slice slice, patterns::SliceParam(mp, tp_, r, 1, 0),
                             where + ": model " + Q(spec_.name));
        if (slice.local_shape != *have) {
          return FailedPreconditionError(
              where + ": parameter " + Q(p.engine_name) + ": " + listing +
              ShapeString(*have) + ", but model " + Q(spec_.name) + " (" + model_origin_ +
              ") holds " + ShapeString(slice.local_shape) + " on tp rank " + std::to_string(r) +
              " of tp=" + std::to_string(tp_) + " (rule " + mp.rule.match + ")");
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace ucp::deepspeed
