// DeepSpeed checkpoint reader, extraction into ucp's universal checkpoint, and DeepSpeed's own
// universal layout writer. See deepspeed_checkpoint.h and docs/deepspeed.md.
#include "ucp/deepspeed/deepspeed_checkpoint.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include "ucp/base/check.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/torch/torch_writer.h"
#include "ucp/patterns/model.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using torch::PyKind;
using torch::PyValue;
using torch::TensorRef;
using torch::TorchFile;

constexpr const char* kStates[3] = {"fp32", "exp_avg", "exp_avg_sq"};

#ifndef UCP_DATA_DIR
#define UCP_DATA_DIR "."
#endif

// The rule-set folder: the option, else env UCP_DATA_DIR + "/patterns", else the source tree's.
fs::path RuleSetDir(const fs::path& option) {
  if (!option.empty()) return option;
  const char* env = std::getenv("UCP_DATA_DIR");
  return fs::path(env != nullptr && *env != '\0' ? env : UCP_DATA_DIR) / "patterns";
}

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

// The merge the extractor does for a rule kind; kinds it cannot honour are refused by name.
Result<std::pair<MergeKind, int>> MergeOf(const patterns::Rule& rule, const std::string& name) {
  auto unimplemented = [&](const std::string& what) {
    return UnimplementedError("parameter \"" + name + "\": rule kind " +
                              std::string(patterns::RuleKindName(rule.kind)) + " (" + rule.match +
                              ")" + (what.empty() ? "" : " " + what) +
                              " is not merged from DeepSpeed checkpoints");
  };
  if (rule.axis != patterns::Axis::kTp) return unimplemented("on axis ep");
  switch (rule.kind) {
    case patterns::RuleKind::kReplicate:
      return std::pair{MergeKind::kReplicate, 0};
    case patterns::RuleKind::kShard:
      return std::pair{MergeKind::kShard, rule.dim};
    case patterns::RuleKind::kPadStrip:
      if (rule.dim != 0) return unimplemented("on dim " + std::to_string(rule.dim));
      return std::pair{MergeKind::kPadStrip, 0};
    case patterns::RuleKind::kFuse:
      // Megatron splits an interleaved_groups tensor (QKV: per group [q | k | v] rows) over tp by
      // whole groups, so the dim-0 concatenation of the TP slices already is the full tensor in
      // the rule's interleaved order: no reordering, a plain dim-0 shard merge. A concat-ordered
      // fuse would need each slice's parts regrouped, which the extractor does not do.
      if (rule.order != patterns::FuseOrder::kInterleavedGroups) {
        return unimplemented("with order concat");
      }
      if (rule.dim != 0) return unimplemented("on dim " + std::to_string(rule.dim));
      return std::pair{MergeKind::kShard, 0};
    case patterns::RuleKind::kAverage:
      break;
  }
  return unimplemented("");
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

bool AllDigits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

Naming DetectNaming(const std::string& engine_name) {
  if (engine_name.starts_with("tied_modules.")) return Naming::kMegatronPipe;
  const size_t dot = engine_name.find('.');
  if (dot != std::string::npos && AllDigits(std::string_view(engine_name).substr(0, dot))) {
    return Naming::kMegatronPipe;
  }
  if (engine_name.starts_with("language_model.")) return Naming::kMegatronGpt;
  return Naming::kPlain;
}

// Engine name -> canonical name.
Result<std::string> Canonical(const std::string& n, Naming naming) {
  switch (naming) {
    case Naming::kPlain:
      return n;
    case Naming::kMegatronGpt:
      if (n.starts_with("language_model.encoder.")) return n.substr(23);
      if (n.starts_with("language_model.")) return n.substr(15);
      break;
    case Naming::kMegatronPipe: {
      if (n.starts_with("tied_modules.embed.")) return "embedding." + n.substr(19);
      const size_t dot = n.find('.');
      if (dot == std::string::npos || !AllDigits(std::string_view(n).substr(0, dot))) break;
      const int64_t idx = std::stoll(n.substr(0, dot));
      const std::string rest = n.substr(dot + 1);
      if (rest == "weight" || rest == "bias") return "final_layernorm." + rest;
      if (rest.starts_with("word_embeddings.") || rest.starts_with("position_embeddings.")) {
        return "embedding." + rest;
      }
      if (idx < 2) break;
      return "layers." + std::to_string(idx - 2) + "." + rest;
    }
  }
  return InvalidArgumentError("parameter \"" + n + "\" is not a " +
                              std::string(NamingName(naming)) + " name of the gpt family");
}

// Canonical name -> Megatron-DeepSpeed GPTModelPipe name for a model of `layers` layers.
std::string PipeName(const std::string& c, int64_t layers) {
  if (c.starts_with("embedding.")) return "tied_modules.embed." + c.substr(10);
  if (c.starts_with("layers.")) {
    const size_t dot = c.find('.', 7);
    return std::to_string(std::stoll(c.substr(7, dot - 7)) + 2) + c.substr(dot);
  }
  return std::to_string(layers + 2) + c.substr(c.find('.'));
}

// Canonical order: embeddings, layers by index then template order, final norm.
int64_t LayerOf(const std::string& c) {
  if (!c.starts_with("layers.")) return c.starts_with("embedding.") ? -1 : INT64_MAX;
  return std::stoll(c.substr(7, c.find('.', 7) - 7));
}

Result<int64_t> AsInt(const PyValue* v, std::string_view what) {
  if (v == nullptr) return NotFoundError(std::string(what) + " is missing");
  if (v->kind() == PyKind::kInt) return v->int_value();
  if (v->kind() == PyKind::kBool) return int64_t{v->bool_value()};
  return DataLossError(std::string(what) + " is a " + std::string(PyKindName(v->kind())) +
                       ", not an int");
}

Result<double> AsDouble(const PyValue* v, std::string_view what) {
  if (v != nullptr && v->kind() == PyKind::kFloat) return v->float_value();
  UCP_ASSIGN_OR_RETURN(int64_t i, AsInt(v, what));
  return static_cast<double>(i);
}

Result<Shape> AsShape(const PyValue* v, std::string_view what) {
  if (v == nullptr || (v->kind() != PyKind::kTuple && v->kind() != PyKind::kList)) {
    return DataLossError(std::string(what) + " is not a torch.Size");
  }
  Shape s;
  for (const PyValue* d : v->items()) {
    UCP_ASSIGN_OR_RETURN(int64_t x, AsInt(d, what));
    if (x < 0) return DataLossError(std::string(what) + " has a negative dim " + std::to_string(x));
    s.push_back(x);
  }
  return s;
}

std::string ShapeString(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// JSON of the representable part of a Python value: objects with a __dict__ (argparse.Namespace)
// become their attributes; tensors, RNG tuples of numpy arrays and other opaque values are null.
void ToJson(const PyValue* v, std::string& out, int depth) {
  auto str = [&out](std::string_view s) {
    out += '"';
    for (unsigned char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += static_cast<char>(c);
      } else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        out += buf;
      } else {
        out += static_cast<char>(c);
      }
    }
    out += '"';
  };
  if (v == nullptr || depth > 32) {
    out += "null";
    return;
  }
  switch (v->kind()) {
    case PyKind::kBool:
      out += v->bool_value() ? "true" : "false";
      return;
    case PyKind::kInt:
      out += std::to_string(v->int_value());
      return;
    case PyKind::kFloat: {
      if (!std::isfinite(v->float_value())) {
        out += "null";
        return;
      }
      char buf[32];
      auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v->float_value());
      std::string_view text(buf, end - buf);
      out += text;
      if (text.find_first_of(".e") == std::string_view::npos) out += ".0";
      return;
    }
    case PyKind::kStr:
      str(v->str());
      return;
    case PyKind::kList:
    case PyKind::kTuple: {
      out += '[';
      for (size_t i = 0; i < v->items().size(); ++i) {
        if (i) out += ',';
        ToJson(v->items()[i], out, depth + 1);
      }
      out += ']';
      return;
    }
    case PyKind::kDict: {
      out += '{';
      bool first = true;
      for (const auto& [k, val] : v->entries()) {
        if (k->kind() != PyKind::kStr) continue;
        if (!first) out += ',';
        first = false;
        str(k->str());
        out += ':';
        ToJson(val, out, depth + 1);
      }
      out += '}';
      return;
    }
    case PyKind::kObject:
      if (v->state() != nullptr && v->state()->kind() == PyKind::kDict) {
        ToJson(v->state(), out, depth + 1);
        return;
      }
      out += "null";
      return;
    default:
      out += "null";
      return;
  }
}

// ZeroStageEnum pickled as getattr(ZeroStageEnum, 'name') (Python >= 3.11) or ZeroStageEnum(v).
Result<int64_t> ZeroStage(const PyValue* v, const std::string& file) {
  if (v->kind() == PyKind::kInt) return v->int_value();
  if (v->kind() == PyKind::kObject) {
    for (const PyValue* a : v->items()) {
      if (a->kind() == PyKind::kInt) return a->int_value();
      if (a->kind() == PyKind::kStr) {
        if (a->str() == "optimizer_states") return 1;
        if (a->str() == "gradients") return 2;
        if (a->str() == "weights") return 3;
        if (a->str() == "disabled") return 0;
      }
    }
  }
  return DataLossError(file + ": optimizer_state_dict.zero_stage is not a ZeroStageEnum");
}

struct RankFiles {
  int pp = 0, tp = 0;
  std::string file;
};

struct FileNames {
  std::map<int, std::string> mp;                     // mp rank -> name
  std::map<std::pair<int, int>, std::string> optim;  // (dp, mp) -> name
  std::string optim_prefix;
  std::map<int, int> layer_files_per_index;  // layer index -> count
};

Result<FileNames> ListFiles(const fs::path& dir) {
  static const std::regex mp_re(R"(mp_rank_(\d+)_model_states\.pt)");
  static const std::regex optim_re(
      R"((bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  static const std::regex layer_re(R"(layer_(\d+)-model_(\d+)-model_states\.pt)");
  static const std::regex zero3_re(R"(zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt)");
  FileNames f;
  std::error_code ec;
  bool zero3 = false;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    std::smatch m;
    if (std::regex_match(n, m, mp_re)) {
      f.mp[std::stoi(m[1])] = n;
    } else if (std::regex_match(n, m, optim_re)) {
      if (!f.optim.empty() && f.optim_prefix != m[1].str()) {
        return DataLossError("checkpoint folder " + dir.string() + " mixes optim file prefixes \"" +
                             f.optim_prefix + "\" and \"" + m[1].str() + "\"");
      }
      f.optim_prefix = m[1];
      f.optim[{std::stoi(m[2]), std::stoi(m[3])}] = n;
    } else if (std::regex_match(n, m, layer_re)) {
      ++f.layer_files_per_index[std::stoi(m[1])];
    } else if (std::regex_match(n, zero3_re)) {
      zero3 = true;
    }
  }
  if (ec) return IoError("cannot list checkpoint folder " + dir.string() + ": " + ec.message());
  if (zero3 && f.mp.empty()) {
    return UnimplementedError("checkpoint folder " + dir.string() +
                              " is a ZeRO-3 checkpoint (zero_pp_rank_*_model_states.pt), which ucp "
                              "does not read yet");
  }
  if (f.mp.empty()) {
    return NotFoundError("checkpoint folder " + dir.string() + " has no mp_rank_*_model_states.pt");
  }
  if (f.optim.empty()) {
    return NotFoundError("checkpoint folder " + dir.string() +
                         " has no *zero_pp_rank_*_optim_states.pt");
  }
  return f;
}

Result<fs::path> ResolveTagDir(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return NotFoundError("no checkpoint folder " + path.string());
  const fs::path latest = path / "latest";
  if (fs::is_regular_file(latest, ec)) {
    UCP_ASSIGN_OR_RETURN(std::string tag, io::ReadFileToString(latest, 4096), "reading `latest`");
    while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ' || tag.back() == '\r')) {
      tag.pop_back();
    }
    if (tag.empty() || tag.find('/') != std::string::npos || tag == "..") {
      return DataLossError(latest.string() + " does not hold a tag folder name");
    }
    if (!fs::is_directory(path / tag, ec)) {
      return NotFoundError(latest.string() + " names tag \"" + tag + "\" but " +
                           (path / tag).string() + " is not a folder");
    }
    return path / tag;
  }
  return path;
}

}  // namespace

std::string_view NamingName(Naming n) {
  switch (n) {
    case Naming::kMegatronPipe:
      return "megatron-deepspeed GPTModelPipe";
    case Naming::kMegatronGpt:
      return "megatron-deepspeed GPTModel";
    case Naming::kPlain:
      return "plain deepspeed";
  }
  return "?";
}

bool LooksLikeDeepSpeedCheckpoint(const fs::path& path) {
  Result<fs::path> dir = ResolveTagDir(path);
  if (!dir.ok()) return false;
  Result<FileNames> f = ListFiles(*dir);
  return f.ok();
}

std::string DeepSpeedCheckpoint::LayoutString() const {
  const std::string zero = optimizer_ == "zero2" ? "2" : "1";
  return "tp=" + std::to_string(tp_) + ",pp=" + std::to_string(pp_) + ",dp=" + std::to_string(dp_) +
         ",sp=" + std::to_string(sp_) + ",zero=" + zero;
}

std::string DeepSpeedCheckpoint::ModelStatesFile(int pp_rank, int tp_rank) const {
  const int mp = naming_ == Naming::kMegatronPipe || pp_ > 1 ? pp_rank * tp_ + tp_rank : tp_rank;
  char buf[64];
  std::snprintf(buf, sizeof buf, "mp_rank_%02d_model_states.pt", mp);
  return buf;
}

std::string DeepSpeedCheckpoint::OptimStatesFile(int pp_rank, int tp_rank, int dp_rank) const {
  const int mp = naming_ == Naming::kMegatronPipe || pp_ > 1 ? pp_rank * tp_ + tp_rank : tp_rank;
  char buf[96];
  std::snprintf(buf, sizeof buf, "%szero_pp_rank_%d_mp_rank_%02d_optim_states.pt",
                optim_prefix_.c_str(), dp_rank, mp);
  return buf;
}

Result<DeepSpeedCheckpoint> DeepSpeedCheckpoint::Open(const fs::path& path,
                                                      const OpenOptions& options) {
  DeepSpeedCheckpoint ck;
  UCP_ASSIGN_OR_RETURN(ck.dir_, ResolveTagDir(path));
  UCP_ASSIGN_OR_RETURN(FileNames files, ListFiles(ck.dir_));
  ck.optim_prefix_ = files.optim_prefix;
  const int num_mp = static_cast<int>(files.mp.size());
  for (int i = 0; i < num_mp; ++i) {
    if (!files.mp.contains(i)) {
      return NotFoundError("checkpoint folder " + ck.dir_.string() + " has " +
                           std::to_string(num_mp) + " mp_rank files but no mp_rank_" +
                           (i < 10 ? "0" : "") + std::to_string(i) + "_model_states.pt");
    }
  }
  // Rank 0's model states: topology, client state.
  UCP_ASSIGN_OR_RETURN(TorchFile mp0, TorchFile::Open(ck.dir_ / files.mp.at(0)));
  const PyValue& root = mp0.root();
  if (const PyValue* dims = root.Get("checkpoint_parallel_dimensions");
      dims != nullptr && !dims->is_none()) {
    UCP_ASSIGN_OR_RETURN(int64_t pp,
                         AsInt(dims->Get("pp_degree"), "checkpoint_parallel_dimensions.pp_degree"));
    UCP_ASSIGN_OR_RETURN(int64_t tp,
                         AsInt(dims->Get("tp_degree"), "checkpoint_parallel_dimensions.tp_degree"));
    ck.pp_ = static_cast<int>(pp);
    ck.tp_ = static_cast<int>(tp);
  } else if (!files.layer_files_per_index.empty()) {
    if (!files.layer_files_per_index.contains(1)) {
      return NotFoundError("checkpoint folder " + ck.dir_.string() +
                           " has layer_* files but no layer_01-model_*-model_states.pt");
    }
    ck.tp_ = files.layer_files_per_index.at(1);
    ck.pp_ = num_mp / ck.tp_;
  } else {
    ck.tp_ = num_mp;
    ck.pp_ = 1;
  }
  if (ck.tp_ < 1 || ck.pp_ < 1 || ck.tp_ * ck.pp_ != num_mp) {
    return DataLossError("checkpoint folder " + ck.dir_.string() + ": " + std::to_string(num_mp) +
                         " mp_rank files do not form tp=" + std::to_string(ck.tp_) +
                         " x pp=" + std::to_string(ck.pp_));
  }
  // The partition count is the largest dp index + 1, so a missing file is named below.
  const int dp_sp = files.optim.rbegin()->first.first + 1;
  for (int d = 0; d < dp_sp; ++d) {
    for (int m = 0; m < num_mp; ++m) {
      if (!files.optim.contains({d, m})) {
        char buf[96];
        std::snprintf(buf, sizeof buf, "%szero_pp_rank_%d_mp_rank_%02d_optim_states.pt",
                      files.optim_prefix.c_str(), d, m);
        return NotFoundError("checkpoint folder " + ck.dir_.string() + " lacks " + buf +
                             " (tp=" + std::to_string(ck.tp_) + ", pp=" + std::to_string(ck.pp_) +
                             ", " + std::to_string(dp_sp) + " data-parallel partitions)");
      }
    }
  }
  if (files.optim.size() != static_cast<size_t>(dp_sp) * num_mp) {
    return DataLossError("checkpoint folder " + ck.dir_.string() + " has " +
                         std::to_string(files.optim.size()) + " optim files, more than " +
                         std::to_string(dp_sp) + " partitions x " + std::to_string(num_mp) +
                         " model-parallel ranks");
  }
  const PyValue* args = root.Get("args");
  ck.sp_ = 1;
  if (args != nullptr && args->state() != nullptr) {
    if (const PyValue* sp = args->state()->Get("ds_sequence_parallel_size");
        sp != nullptr && sp->kind() == PyKind::kInt && sp->int_value() > 0) {
      ck.sp_ = static_cast<int>(sp->int_value());
    }
  }
  if (dp_sp % ck.sp_ != 0) {
    return DataLossError(
        "checkpoint folder " + ck.dir_.string() + ": " + std::to_string(dp_sp) +
        " optimizer partitions per model rank not divisible by sp=" + std::to_string(ck.sp_));
  }
  ck.dp_ = dp_sp / ck.sp_;
  const PyValue* ds_config = root.Get("ds_config");
  auto enabled = [ds_config](const char* key) {
    const PyValue* c = ds_config ? ds_config->Get(key) : nullptr;
    const PyValue* e = c ? c->Get("enabled") : nullptr;
    return e != nullptr && e->kind() == PyKind::kBool && e->bool_value();
  };
  ck.dtype_ = files.optim_prefix == "bf16_" || enabled("bf16") ? DType::kBf16
              : enabled("fp16")                                ? DType::kFp16
                                                               : DType::kFp32;
  if (const PyValue* it = root.Get("iteration"); it != nullptr && it->kind() == PyKind::kInt) {
    ck.iteration_ = it->int_value();
  } else {
    UCP_ASSIGN_OR_RETURN(ck.iteration_,
                         AsInt(root.Get("global_steps"), files.mp.at(0) + ": global_steps"));
  }
  if (const PyValue* uci = root.Get("universal_checkpoint_info"); uci != nullptr) {
    if (const PyValue* v = uci->Get("original_vocab_size"); v != nullptr) {
      UCP_ASSIGN_OR_RETURN(ck.original_vocab_,
                           AsInt(v, "universal_checkpoint_info.original_vocab_size"));
    }
  }

  // Parameters: param_shapes of every (pp, tp) rank.
  ck.naming_ = Naming::kPlain;
  bool naming_known = false;
  std::map<std::string, size_t> index;        // canonical -> params_
  std::vector<std::vector<Shape>> tp_shapes;  // per param, per tp rank
  for (int s = 0; s < ck.pp_; ++s) {
    for (int r = 0; r < ck.tp_; ++r) {
      const int mp = s * ck.tp_ + r;
      const std::string fname = files.mp.at(mp);
      std::optional<TorchFile> owned;
      const TorchFile* file = &mp0;
      if (mp != 0) {
        UCP_ASSIGN_OR_RETURN(owned, TorchFile::Open(ck.dir_ / fname));
        file = &*owned;
      }
      UCP_ASSIGN_OR_RETURN(const PyValue* shapes, file->root().Find("param_shapes", fname));
      if (shapes->kind() != PyKind::kList) {
        return DataLossError(fname + ": param_shapes is a " +
                             std::string(PyKindName(shapes->kind())) + ", not a list of groups");
      }
      for (size_t g = 0; g < shapes->items().size(); ++g) {
        const PyValue* group = shapes->items()[g];
        if (group->kind() != PyKind::kDict) {
          return DataLossError(fname + ": param_shapes[" + std::to_string(g) + "] is not a dict");
        }
        for (const auto& [k, v] : group->entries()) {
          if (k->kind() != PyKind::kStr)
            return DataLossError(fname + ": param_shapes key not a str");
          if (!naming_known) {
            ck.naming_ = DetectNaming(k->str());
            naming_known = true;
          }
          UCP_ASSIGN_OR_RETURN(std::string canon, Canonical(k->str(), ck.naming_), fname);
          UCP_ASSIGN_OR_RETURN(Shape shape,
                               AsShape(v, fname + ": param_shapes[\"" + k->str() + "\"]"));
          auto [it, inserted] = index.try_emplace(canon, ck.params_.size());
          if (inserted) {
            DeepSpeedParam p;
            p.name = canon;
            p.engine_name = k->str();
            p.stage = s;
            p.group = static_cast<int>(g);
            p.tp_shape = shape;
            ck.params_.push_back(std::move(p));
            tp_shapes.emplace_back(ck.tp_);
          }
          DeepSpeedParam& p = ck.params_[it->second];
          std::vector<Shape>& per_tp = tp_shapes[it->second];
          if (p.stage != s) {
            // A pipeline replica (tied embedding on the last stage): only its shape is checked.
            if (per_tp[r] != shape) {
              return DataLossError(fname + ": parameter \"" + k->str() + "\" has shape " +
                                   ShapeString(shape) + " but " + ShapeString(per_tp[r]) +
                                   " on pipeline stage " + std::to_string(p.stage));
            }
            continue;
          }
          if (!per_tp[r].empty() || (r == 0 && !inserted)) {
            return DataLossError(fname + ": parameter \"" + k->str() + "\" listed twice");
          }
          per_tp[r] = shape;
          if (shape != p.tp_shape) {
            return DataLossError(fname + ": parameter \"" + k->str() + "\" has shard shape " +
                                 ShapeString(shape) + " on tp rank " + std::to_string(r) + " but " +
                                 ShapeString(p.tp_shape) + " on tp rank 0");
          }
        }
      }
    }
  }
  // Merge rules: the family's rule set, one full-match rule per canonical name.
  {
    std::vector<std::string> names;
    for (const DeepSpeedParam& p : ck.params_) names.push_back(p.name);
    UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules,
                         SelectRuleSet(RuleSetDir(options.data_dir), options.model, names),
                         ck.dir_.string());
    ck.family_ = rules.family;
    for (DeepSpeedParam& p : ck.params_) {
      UCP_ASSIGN_OR_RETURN(const patterns::Rule* rule, MatchRule(rules, p.name));
      UCP_ASSIGN_OR_RETURN(std::tie(p.merge, p.dim), MergeOf(*rule, p.name), ck.dir_.string());
      p.rule = rule->match;
    }
  }
  // Logical shapes.
  for (size_t i = 0; i < ck.params_.size(); ++i) {
    DeepSpeedParam& p = ck.params_[i];
    for (int r = 0; r < ck.tp_; ++r) {
      if (tp_shapes[i][r].empty() && !p.tp_shape.empty()) {
        return NotFoundError("parameter \"" + p.engine_name + "\" is missing from tp rank " +
                             std::to_string(r) + " of pipeline stage " + std::to_string(p.stage));
      }
    }
    p.shape = p.tp_shape;
    if (p.merge != MergeKind::kReplicate) {
      if (p.dim >= static_cast<int>(p.shape.size())) {
        return DataLossError("parameter \"" + p.engine_name + "\" has shape " +
                             ShapeString(p.shape) + " without dim " + std::to_string(p.dim));
      }
      p.shape[p.dim] *= ck.tp_;
    }
    if (p.merge == MergeKind::kPadStrip && ck.original_vocab_ > 0) {
      if (ck.original_vocab_ > p.shape[0]) {
        return DataLossError("parameter \"" + p.engine_name + "\": original vocabulary size " +
                             std::to_string(ck.original_vocab_) + " exceeds its " +
                             std::to_string(p.shape[0]) + " padded rows");
      }
      p.shape[0] = ck.original_vocab_;
    }
  }
  std::stable_sort(ck.params_.begin(), ck.params_.end(),
                   [](const DeepSpeedParam& a, const DeepSpeedParam& b) {
                     return LayerOf(a.name) < LayerOf(b.name);
                   });

  // Rank 0's optimizer file: optimizer kind, step, hyper-parameters.
  const std::string optim0 = files.optim.at({0, 0});
  UCP_ASSIGN_OR_RETURN(TorchFile of, TorchFile::Open(ck.dir_ / optim0));
  UCP_ASSIGN_OR_RETURN(const PyValue* osd, of.root().Find("optimizer_state_dict", optim0));
  if (const PyValue* zs = osd->Get("zero_stage"); zs != nullptr) {
    UCP_ASSIGN_OR_RETURN(int64_t stage, ZeroStage(zs, optim0));
    if (stage == 3)
      return UnimplementedError(optim0 + ": ZeRO-3 optimizer states are not read yet");
    if (stage != 1 && stage != 2) {
      return UnimplementedError(optim0 + ": zero_stage " + std::to_string(stage) +
                                " is not supported (ZeRO-1 and ZeRO-2 are)");
    }
    ck.optimizer_ = stage == 1 ? "zero1" : "zero2";
  } else {
    ck.optimizer_ = "bf16_optimizer";
  }
  UCP_ASSIGN_OR_RETURN(const PyValue* base, osd->Find("base_optimizer_state", optim0));
  if (base->kind() != PyKind::kDict) {
    return UnimplementedError(optim0 + ": base_optimizer_state is a " +
                              std::string(PyKindName(base->kind())) +
                              " (elastic checkpoint), which ucp does not read");
  }
  UCP_ASSIGN_OR_RETURN(const PyValue* state,
                       base->Find("state", optim0 + ": base_optimizer_state"));
  const PyValue* s0 = state->Get(int64_t{0});
  if (s0 == nullptr || s0->Get("exp_avg") == nullptr || s0->Get("exp_avg_sq") == nullptr) {
    return UnimplementedError(optim0 +
                              ": base_optimizer_state.state[0] has no exp_avg / "
                              "exp_avg_sq (only Adam-style optimizers are read)");
  }
  ck.step_ = ck.iteration_;
  if (const PyValue* st = s0->Get("step"); st != nullptr) {
    if (st->kind() == PyKind::kTensor) {
      UCP_ASSIGN_OR_RETURN(Tensor t, of.ReadTensor(st->tensor()), "reading step");
      if (t.num_elements() != 1) return DataLossError(optim0 + ": step is not a scalar");
      if (t.dtype() == DType::kFp32)
        ck.step_ = static_cast<int64_t>(t.as<float>()[0]);
      else if (t.dtype() == DType::kInt64)
        ck.step_ = t.as<int64_t>()[0];
      else if (t.dtype() == DType::kFp64)
        ck.step_ = static_cast<int64_t>(t.as<double>()[0]);
    } else {
      UCP_ASSIGN_OR_RETURN(ck.step_, AsInt(st, optim0 + ": step"));
    }
  }
  ck.hyper_ = {0, 0, 0, 0, 0};
  if (const PyValue* groups = base->Get("param_groups");
      groups != nullptr && groups->kind() == PyKind::kList && !groups->items().empty()) {
    const PyValue* g0 = groups->items()[0];
    if (const PyValue* v = g0->Get("lr")) {
      UCP_ASSIGN_OR_RETURN(ck.hyper_[0], AsDouble(v, "lr"));
    }
    if (const PyValue* b = g0->Get("betas"); b && b->items().size() == 2) {
      UCP_ASSIGN_OR_RETURN(ck.hyper_[1], AsDouble(b->items()[0], "betas[0]"));
      UCP_ASSIGN_OR_RETURN(ck.hyper_[2], AsDouble(b->items()[1], "betas[1]"));
    }
    if (const PyValue* v = g0->Get("eps")) {
      UCP_ASSIGN_OR_RETURN(ck.hyper_[3], AsDouble(v, "eps"));
    }
    if (const PyValue* v = g0->Get("weight_decay")) {
      UCP_ASSIGN_OR_RETURN(ck.hyper_[4], AsDouble(v, "weight_decay"));
    }
  }

  // Client state, as JSON where representable.
  std::string js = "{\"deepspeed\":{\"naming\":\"" + std::string(NamingName(ck.naming_)) +
                   "\",\"tag\":\"" + ck.dir_.filename().string() + "\",\"layout\":\"" +
                   ck.LayoutString() + "\",\"optimizer\":\"" + ck.optimizer_ + "\"}";
  for (const char* key :
       {"iteration", "args", "checkpoint_version", "tokens", "global_steps", "global_samples",
        "skipped_steps", "ds_version", "ds_config", "lr_scheduler", "universal_checkpoint_info"}) {
    if (const PyValue* v = root.Get(key); v != nullptr) {
      js += ",\"" + std::string(key) + "\":";
      ToJson(v, js, 0);
    }
  }
  js += "}";
  ck.client_state_json_ = std::move(js);
  return ck;
}

// Extraction: every (pp, tp, dp) optim file open (their pickles only), fragments read as byte
// ranges, parameters processed by a small pool of threads.
class Extractor {
 public:
  struct Fragment {
    int file = 0;  // index into files_
    int group = 0;
    int64_t start = 0, numel = 0;
  };
  struct OptimFile {
    TorchFile file;
    std::vector<std::array<TensorRef, 3>> groups;  // fp32, exp_avg, exp_avg_sq per group
  };

  explicit Extractor(const DeepSpeedCheckpoint& ck) : ck_(ck) {}

  Status OpenAll() {
    const int n = ck_.pp_ * ck_.tp_;
    frags_.resize(n);
    for (int s = 0; s < ck_.pp_; ++s) {
      for (int r = 0; r < ck_.tp_; ++r) {
        for (int d = 0; d < ck_.dp_sp(); ++d) {
          const std::string name = ck_.OptimStatesFile(s, r, d);
          UCP_ASSIGN_OR_RETURN(TorchFile f, TorchFile::Open(ck_.dir_ / name));
          UCP_ASSIGN_OR_RETURN(const PyValue* osd, f.root().Find("optimizer_state_dict", name));
          UCP_ASSIGN_OR_RETURN(const PyValue* fp32,
                               osd->Find("single_partition_of_fp32_groups", name));
          UCP_ASSIGN_OR_RETURN(const PyValue* maps, osd->Find("param_slice_mappings", name));
          UCP_ASSIGN_OR_RETURN(const PyValue* base, osd->Find("base_optimizer_state", name));
          UCP_ASSIGN_OR_RETURN(const PyValue* state, base->Find("state", name));
          if (fp32->kind() != PyKind::kList || maps->kind() != PyKind::kList ||
              fp32->items().size() != maps->items().size()) {
            return DataLossError(name +
                                 ": single_partition_of_fp32_groups and "
                                 "param_slice_mappings are not lists of equal length");
          }
          OptimFile of{std::move(f), {}};
          const int file_index = static_cast<int>(files_.size());
          for (size_t g = 0; g < fp32->items().size(); ++g) {
            const std::string where = name + ": group " + std::to_string(g);
            const PyValue* st = state->Get(static_cast<int64_t>(g));
            if (st == nullptr) return NotFoundError(where + " has no base_optimizer_state.state");
            std::array<const PyValue*, 3> t = {fp32->items()[g], st->Get("exp_avg"),
                                               st->Get("exp_avg_sq")};
            std::array<TensorRef, 3> refs;
            for (int k = 0; k < 3; ++k) {
              if (t[k] == nullptr || t[k]->kind() != PyKind::kTensor ||
                  t[k]->tensor().dtype != DType::kFp32 || !t[k]->tensor().IsContiguous()) {
                return DataLossError(where + ": " + kStates[k] +
                                     " partition is not a contiguous fp32 tensor");
              }
              refs[k] = t[k]->tensor();
            }
            of.groups.push_back(refs);
            const PyValue* m = maps->items()[g];
            for (const auto& [k, v] : m->entries()) {
              if (k->kind() != PyKind::kStr || v->state() == nullptr) {
                return DataLossError(where +
                                     ": param_slice_mappings entry is not name -> "
                                     "fragment_address");
              }
              UCP_ASSIGN_OR_RETURN(int64_t numel,
                                   AsInt(v->state()->Get("numel"), where + " numel"));
              UCP_ASSIGN_OR_RETURN(int64_t start,
                                   AsInt(v->state()->Get("start"), where + " start"));
              // The fp32 partition may be trimmed (ZeRO) while the Adam states keep padding.
              const int64_t limit = refs[0].num_elements();
              if (start < 0 || numel < 0 || start + numel > limit) {
                return DataLossError(where + ": fragment of \"" + k->str() + "\" [" +
                                     std::to_string(start) + ", " + std::to_string(start + numel) +
                                     ") is outside the " + std::to_string(limit) +
                                     "-element partition");
              }
              frags_[s * ck_.tp_ + r][k->str()].push_back(
                  Fragment{file_index, static_cast<int>(g), start, numel});
            }
          }
          files_.push_back(std::move(of));
        }
      }
    }
    return Status::Ok();
  }

  // One TP shard of `p` for tp rank `r`: three states, fragments concatenated in dp order.
  // Reads the shard's bytes [0, limit) to dst[k] + 0 (fragments past `limit`, vocabulary
  // padding, are checked for presence but not read).
  Status ReadShard(const DeepSpeedParam& p, int r, const std::array<std::byte*, 3>& dst,
                   int64_t limit_bytes) const {
    const auto& m = frags_[p.stage * ck_.tp_ + r];
    auto it = m.find(p.engine_name);
    const int64_t numel = NumElementsOrDie(p.tp_shape);
    int64_t filled = 0;
    if (it != m.end()) {
      for (const Fragment& f : it->second) {
        if (filled + f.numel > numel) break;
        const int64_t n = std::min(f.numel * 4, limit_bytes - filled * 4);
        for (int k = 0; k < 3 && n > 0; ++k) {
          UCP_RETURN_IF_ERROR(
              files_[f.file].file.ReadTensorBytes(files_[f.file].groups[f.group][k], f.start * 4,
                                                  std::span<std::byte>(dst[k] + filled * 4, n)),
              "parameter \"" + p.engine_name + "\"");
        }
        filled += f.numel;
      }
    }
    if (filled != numel || (it != m.end() && [&] {
          int64_t sum = 0;
          for (const Fragment& f : it->second) sum += f.numel;
          return sum != numel;
        }())) {
      return DataLossError("parameter \"" + p.engine_name + "\" on pipeline stage " +
                           std::to_string(p.stage) + ", tp rank " + std::to_string(r) +
                           ": fragments hold " + std::to_string(filled) + " of " +
                           std::to_string(numel) + " elements of shard " + ShapeString(p.tp_shape));
    }
    return Status::Ok();
  }

  Status ExtractOne(const DeepSpeedParam& p, io::UniversalWriter& writer) const {
    std::array<Tensor, 3> full;
    for (int k = 0; k < 3; ++k) {
      UCP_ASSIGN_OR_RETURN(full[k], Tensor::Uninitialized(DType::kFp32, p.shape));
    }
    const int64_t shard_bytes = NumElementsOrDie(p.tp_shape) * 4;
    // Rows of the merged dim and the contiguous run each row of a shard has.
    int64_t outer = 1, inner = 1;
    for (int i = 0; i < p.dim && p.merge != MergeKind::kReplicate; ++i) outer *= p.tp_shape[i];
    for (size_t i = p.dim; i < p.tp_shape.size(); ++i) inner *= p.tp_shape[i];
    const int64_t full_bytes = NumElementsOrDie(p.shape) * 4;
    // Dim-0 shards (and tp rank 0 of a replicated parameter) are contiguous in the full
    // tensor, so their fragments are read in place; the others go through a shard buffer.
    const bool in_place = p.merge != MergeKind::kShard || p.dim == 0;
    std::array<Tensor, 3> shard;
    std::array<std::byte*, 3> shard_ptr{};
    if (!in_place || (p.merge == MergeKind::kReplicate && ck_.tp_ > 1)) {
      for (int k = 0; k < 3; ++k) {
        UCP_ASSIGN_OR_RETURN(shard[k], Tensor::Uninitialized(DType::kFp32, p.tp_shape));
        shard_ptr[k] = shard[k].data();
      }
    }
    for (int r = 0; r < ck_.tp_; ++r) {
      if (p.merge == MergeKind::kReplicate) {
        if (r == 0) {
          UCP_RETURN_IF_ERROR(
              ReadShard(p, 0, {full[0].data(), full[1].data(), full[2].data()}, shard_bytes));
          continue;
        }
        UCP_RETURN_IF_ERROR(ReadShard(p, r, shard_ptr, shard_bytes));
        for (int k = 0; k < 3; ++k) {
          if (std::memcmp(full[k].data(), shard_ptr[k], shard_bytes) != 0) {
            return DataLossError("replicated parameter \"" + p.engine_name + "\": " + kStates[k] +
                                 " on tp rank " + std::to_string(r) + " differs from tp rank 0");
          }
        }
        continue;
      }
      if (in_place) {
        // Rows past the logical vocabulary (pad_strip) are not read.
        const int64_t at = r * shard_bytes;
        const int64_t limit = std::max<int64_t>(0, std::min(shard_bytes, full_bytes - at));
        UCP_RETURN_IF_ERROR(ReadShard(
            p, r, {full[0].data() + at, full[1].data() + at, full[2].data() + at}, limit));
        continue;
      }
      UCP_RETURN_IF_ERROR(ReadShard(p, r, shard_ptr, shard_bytes));
      for (int k = 0; k < 3; ++k) {
        // Row o of the shard lands at row o of the full tensor, columns [r*inner, (r+1)*inner)
        // of the merged dim's run.
        const int64_t full_run = inner * ck_.tp_ * 4;
        for (int64_t o = 0; o < outer; ++o) {
          std::memcpy(full[k].data() + o * full_run + r * inner * 4, shard_ptr[k] + o * inner * 4,
                      inner * 4);
        }
      }
    }
    io::UniversalParamInfo meta;
    meta.name = p.name;
    meta.shape = p.shape;
    meta.dtype = ck_.dtype_;
    meta.pattern_json = p.merge == MergeKind::kReplicate
                            ? "{\"kind\":\"replicate\"}"
                            : std::string("{\"kind\":\"") +
                                  (p.merge == MergeKind::kShard ? "shard" : "pad_strip") +
                                  "\",\"dim\":" + std::to_string(p.dim) + "}";
    std::vector<io::NamedState> states;
    for (int k = 0; k < 3; ++k) states.emplace_back(kStates[k], full[k].view());
    return writer.WriteParameter(meta, states);
  }

 private:
  const DeepSpeedCheckpoint& ck_;
  std::vector<OptimFile> files_;
  std::vector<std::map<std::string, std::vector<Fragment>>> frags_;  // per (pp, tp)
};

Status ExtractDeepSpeedToUniversal(const fs::path& src, const fs::path& dst,
                                   const ExtractOptions& options) {
  UCP_ASSIGN_OR_RETURN(
      DeepSpeedCheckpoint ck,
      DeepSpeedCheckpoint::Open(src, OpenOptions{options.model, options.data_dir}));
  Extractor ex(ck);
  UCP_RETURN_IF_ERROR(ex.OpenAll());
  io::UniversalWriteOptions wo = options.write;
  wo.step = ck.step();
  UCP_ASSIGN_OR_RETURN(io::UniversalWriter writer, io::UniversalWriter::Create(dst, wo));
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first = Status::Ok();
  auto work = [&] {
    for (size_t i = next++; i < ck.params().size(); i = next++) {
      Status st = ex.ExtractOne(ck.params()[i], writer);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.ok()) first = std::move(st);
        next = ck.params().size();
      }
    }
  };
  const int n = std::max(1, std::min<int>(options.threads, static_cast<int>(ck.params().size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  UCP_RETURN_IF_ERROR(first);
  io::UniversalManifest m;
  m.step = ck.step();
  m.optimizer_kind = ck.hyper()[4] != 0 ? "adamw" : "adam";
  m.hyper = {{"lr", ck.hyper()[0]},
             {"beta1", ck.hyper()[1]},
             {"beta2", ck.hyper()[2]},
             {"eps", ck.hyper()[3]},
             {"weight_decay", ck.hyper()[4]}};
  m.optimizer_states = {"exp_avg", "exp_avg_sq"};
  m.source_layout = ck.LayoutString();
  m.source_model = options.model.empty() ? ck.family() : options.model;
  m.source_framework = ck.naming() == Naming::kPlain ? "deepspeed" : "megatron-deepspeed";
  m.client_state_json = ck.client_state_json();
  return writer.Commit(m);
}

// ---- DeepSpeed's universal layout ------------------------------------------------------------

namespace {

Status WriteStateFile(const fs::path& path, Tensor t, MergeKind merge, int dim) {
  torch::TorchWriter w;
  torch::PyArena& a = w.arena();
  torch::PyValue* d = a.Dict();
  UCP_ASSIGN_OR_RETURN(const PyValue* tv, w.AddOwnedTensor(std::move(t)));
  d->SetItem(a.Str("param"), tv);
  if (merge != MergeKind::kReplicate) d->SetItem(a.Str("cat_dim"), a.Int(dim));
  if (merge == MergeKind::kPadStrip) d->SetItem(a.Str("vocab_tensor"), a.Bool(true));
  return w.Write(path, *d);
}

}  // namespace

Status WriteDeepSpeedUniversal(const io::UniversalReader& reader, const fs::path& dst,
                               const DeepSpeedUniversalOptions& options) {
  std::error_code ec;
  if (fs::exists(dst, ec)) return AlreadyExistsError("output " + dst.string() + " exists");
  const fs::path tmp = dst.parent_path() / (".tmp-" + dst.filename().string());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp / "zero", ec);
  if (ec) return IoError("cannot create " + (tmp / "zero").string() + ": " + ec.message());
  const io::UniversalManifest& m = reader.manifest();
  int64_t layers = 0;
  for (const auto& p : m.params) {
    const int64_t l = LayerOf(p.name);
    if (l >= 0 && l != INT64_MAX) layers = std::max(layers, l + 1);
  }
  std::vector<std::string> names;
  for (const auto& p : m.params) names.push_back(p.name);
  UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules,
                       SelectRuleSet(RuleSetDir(options.data_dir),
                                     options.model.empty() ? m.source_model : options.model, names),
                       reader.dir().string());
  for (const auto& p : m.params) {
    UCP_ASSIGN_OR_RETURN(const patterns::Rule* rule, MatchRule(rules, p.name));
    UCP_ASSIGN_OR_RETURN(auto merge, MergeOf(*rule, p.name), reader.dir().string());
    const std::string engine = PipeName(p.name, layers);
    const fs::path pdir = tmp / "zero" / engine;
    fs::create_directories(pdir, ec);
    if (ec) return IoError("cannot create " + pdir.string() + ": " + ec.message());
    for (const char* s : kStates) {
      UCP_ASSIGN_OR_RETURN(Tensor t, reader.ReadState(p.name, s));
      if (t.dtype() != DType::kFp32) {
        return InvalidArgumentError("parameter \"" + p.name + "\" state " + s + " is " +
                                    std::string(DTypeName(t.dtype())) + ", not fp32");
      }
      UCP_RETURN_IF_ERROR(
          WriteStateFile(pdir / (std::string(s) + ".pt"), std::move(t), merge.first, merge.second));
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
    if (!options.model_states_from.empty()) {
      UCP_ASSIGN_OR_RETURN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(options.model_states_from));
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
  if (!options.model_states_from.empty()) {
    UCP_ASSIGN_OR_RETURN(DeepSpeedCheckpoint ck,
                         DeepSpeedCheckpoint::Open(options.model_states_from));
    for (int s = 0; s < ck.pp(); ++s) {
      for (int r = 0; r < ck.tp(); ++r) {
        const std::string name = ck.ModelStatesFile(s, r);
        fs::copy_file(ck.dir() / name, tmp / name, ec);
        if (ec) return IoError("cannot copy " + (ck.dir() / name).string() + ": " + ec.message());
      }
    }
  } else {
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
      char buf[64];
      std::snprintf(buf, sizeof buf, "mp_rank_%02d_model_states.pt", i);
      UCP_RETURN_IF_ERROR(w.Write(tmp / buf, *d));
    }
  }
  fs::rename(tmp, dst, ec);
  if (ec)
    return IoError("cannot rename " + tmp.string() + " to " + dst.string() + ": " + ec.message());
  UCP_RETURN_IF_ERROR(io::WriteFileAtomic(dst.parent_path() / "latest_universal",
                                          std::string_view(dst.filename().string())));
  return Status::Ok();
}

}  // namespace ucp::deepspeed
