// Model presets, rule sets, rule resolution and per-rank slicing (see model.h). JSON comes
// parsed from ucp/json; every access below checks the type first.
#include "ucp/patterns/model.h"

#include <fstream>
#include <set>
#include <sstream>

#include "ucp/base/check.h"
#include "ucp/base/status_macros.h"
#include "ucp/json/strict_json.h"

namespace ucp::patterns {
namespace {

using json = ucp::json::Json;

std::string Q(std::string_view s) { return "\"" + std::string(s) + "\""; }

// --- size expressions -----------------------------------------------------------------------

class ExprParser {
 public:
  ExprParser(std::string_view text, const std::map<std::string, int64_t>& hyper)
      : text_(text), hyper_(hyper) {}

  Result<int64_t> Parse() {
    UCP_ASSIGN_OR_RETURN(int64_t v, Sum());
    Skip();
    if (pos_ != text_.size()) return Error("unexpected " + Q(text_.substr(pos_, 1)));
    return v;
  }

 private:
  Status Error(const std::string& why) const {
    return InvalidArgumentError("size expression " + Q(text_) + ": " + why);
  }
  void Skip() {
    while (pos_ < text_.size() && text_[pos_] == ' ') ++pos_;
  }
  Result<int64_t> Sum() {
    UCP_ASSIGN_OR_RETURN(int64_t v, Product());
    for (;;) {
      Skip();
      if (pos_ >= text_.size() || (text_[pos_] != '+' && text_[pos_] != '-')) return v;
      const char op = text_[pos_++];
      UCP_ASSIGN_OR_RETURN(int64_t r, Product());
      // Hyper-parameters may come from a checkpoint's own metadata: overflow is an error.
      if (op == '+' ? __builtin_add_overflow(v, r, &v) : __builtin_sub_overflow(v, r, &v)) {
        return Error("overflows int64");
      }
    }
  }
  Result<int64_t> Product() {
    UCP_ASSIGN_OR_RETURN(int64_t v, Atom());
    for (;;) {
      Skip();
      if (pos_ >= text_.size() || (text_[pos_] != '*' && text_[pos_] != '/')) return v;
      const char op = text_[pos_++];
      UCP_ASSIGN_OR_RETURN(int64_t r, Atom());
      if (op == '*') {
        if (__builtin_mul_overflow(v, r, &v)) return Error("overflows int64");
      } else {
        if (r == 0 || v % r != 0) {
          return Error(std::to_string(v) + " / " + std::to_string(r) + " is not exact");
        }
        v /= r;
      }
    }
  }
  Result<int64_t> Atom() {
    Skip();
    if (pos_ >= text_.size()) return Error("unexpected end");
    const char c = text_[pos_];
    if (c == '(') {
      ++pos_;
      UCP_ASSIGN_OR_RETURN(int64_t v, Sum());
      Skip();
      if (pos_ >= text_.size() || text_[pos_] != ')') return Error("missing \")\"");
      ++pos_;
      return v;
    }
    if (c >= '0' && c <= '9') {
      int64_t v = 0;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        v = v * 10 + (text_[pos_++] - '0');
        if (v > (int64_t{1} << 40)) return Error("literal too large");
      }
      return v;
    }
    size_t start = pos_;
    while (pos_ < text_.size() &&
           (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) {
      ++pos_;
    }
    if (start == pos_) return Error("unexpected " + Q(text_.substr(pos_, 1)));
    std::string name(text_.substr(start, pos_ - start));
    auto it = hyper_.find(name);
    if (it == hyper_.end()) return Error("unknown hyper-parameter " + Q(name));
    return it->second;
  }

  std::string_view text_;
  const std::map<std::string, int64_t>& hyper_;
  size_t pos_ = 0;
};

// --- strict JSON ----------------------------------------------------------------------------

Result<json> ParseStrictJson(std::string_view text, const std::string& what) {
  return ucp::json::ParseStrict(text, what, StatusCode::kInvalidArgument);
}

Result<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError("cannot open " + Q(path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return IoError("cannot read " + Q(path.string()));
  return ss.str();
}

Status CheckKeys(const json& obj, const std::string& where,
                 std::initializer_list<const char*> allowed,
                 std::initializer_list<const char*> required) {
  if (!obj.is_object()) return InvalidArgumentError(where + ": expected an object");
  for (const auto& [k, v] : obj.items()) {
    bool ok = false;
    for (const char* a : allowed) ok = ok || k == a;
    if (!ok) return InvalidArgumentError(where + ": unknown field " + Q(k));
  }
  for (const char* r : required) {
    if (!obj.contains(r)) return InvalidArgumentError(where + ": missing field " + Q(r));
  }
  return Status::Ok();
}

Result<std::string> GetString(const json& obj, const char* key, const std::string& where) {
  const json& v = obj.at(key);
  if (!v.is_string())
    return InvalidArgumentError(where + ": field " + Q(key) + " must be a string");
  return v.get<std::string>();
}

Result<std::vector<std::string>> GetStrings(const json& obj, const char* key,
                                            const std::string& where) {
  std::vector<std::string> out;
  if (!obj.contains(key)) return out;
  const json& v = obj.at(key);
  if (!v.is_array()) return InvalidArgumentError(where + ": field " + Q(key) + " must be an array");
  for (const json& e : v) {
    if (!e.is_string()) {
      return InvalidArgumentError(where + ": field " + Q(key) + " must hold strings");
    }
    out.push_back(e.get<std::string>());
  }
  return out;
}

// std::regex compiles and matches recursively: a pattern's length bounds the stack it needs
// (the rule sets' longest is under 100 characters), so a bad rule file cannot overflow it.
constexpr size_t kMaxRegexChars = 256;
// And it matches by backtracking, whose time grows as the name's length to the power of the
// quantifiers that can retry: nested repetition (a quantifier on a quantifier or on a group)
// makes it exponential, and backreferences are not regular. Rule patterns need none of these
// and few quantifiers (the rule sets use at most 3), so a bad rule file cannot hang a run.
constexpr int kMaxRegexQuantifiers = 4;

Status CheckRegexShape(const std::string& p, const std::string& where) {
  enum Prev { kNone, kAtom, kGroup, kQuant } prev = kNone;
  int quantifiers = 0;
  bool lazy = false;  // the last quantifier already took its lazy '?'
  auto refuse = [&](const std::string& why) {
    return InvalidArgumentError(where + ": regular expression " + Q(p) + ": " + why);
  };
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 < p.size() && p[i + 1] >= '1' && p[i + 1] <= '9') return refuse("a backreference");
      ++i;
      prev = kAtom;
    } else if (c == '[') {  // a class: one atom; ']' first (or after '^') is a literal
      size_t j = i + 1;
      if (j < p.size() && p[j] == '^') ++j;
      if (j < p.size() && p[j] == ']') ++j;
      while (j < p.size() && p[j] != ']') j += p[j] == '\\' ? 2 : 1;
      i = j;
      prev = kAtom;
    } else if (c == '*' || c == '+' || c == '?' ||
               (c == '{' && i + 1 < p.size() && p[i + 1] >= '0' && p[i + 1] <= '9')) {
      if (c == '?' && prev == kQuant && !lazy) {
        lazy = true;  // *? +? ?? {n}?: the lazy form of the quantifier before
        continue;
      }
      if (prev == kQuant) return refuse("a quantifier on a quantifier (nested repetition)");
      if (prev == kGroup) return refuse("a quantified group (nested repetition)");
      if (++quantifiers > kMaxRegexQuantifiers) {
        return refuse("more than " + std::to_string(kMaxRegexQuantifiers) + " quantifiers");
      }
      if (c == '{') {
        while (i < p.size() && p[i] != '}') ++i;
      }
      prev = kQuant;
      lazy = false;
    } else if (c == ')') {
      prev = kGroup;
    } else if (c == '(' || c == '|' || c == '^' || c == '$') {
      prev = kNone;
    } else {
      prev = kAtom;
    }
  }
  return Status::Ok();
}

Result<std::shared_ptr<const std::regex>> CompileRegex(const std::string& pattern,
                                                       const std::string& where) {
  if (pattern.size() > kMaxRegexChars) {
    return InvalidArgumentError(where + ": regular expression of " +
                                std::to_string(pattern.size()) + " characters (at most " +
                                std::to_string(kMaxRegexChars) + ")");
  }
  UCP_RETURN_IF_ERROR(CheckRegexShape(pattern, where));
  try {
    return std::make_shared<const std::regex>(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return InvalidArgumentError(where + ": bad regular expression " + Q(pattern) + ": " + e.what());
  }
}

bool FullMatch(const std::string& s, const std::regex& re, std::smatch* m = nullptr) {
  std::smatch local;
  return std::regex_match(s, m ? *m : local, re);
}

Result<std::vector<ParamTemplate>> ParseTemplates(const json& root, const std::string& what) {
  std::vector<ParamTemplate> out;
  if (!root.contains("parameters") || !root["parameters"].is_array()) {
    return InvalidArgumentError(what + ": field \"parameters\" must be an array");
  }
  for (size_t i = 0; i < root["parameters"].size(); ++i) {
    const json& t = root["parameters"][i];
    const std::string where = what + ": parameters[" + std::to_string(i) + "]";
    UCP_RETURN_IF_ERROR(CheckKeys(t, where, {"name", "shape", "when"}, {"name", "shape"}));
    ParamTemplate pt;
    UCP_ASSIGN_OR_RETURN(pt.name, GetString(t, "name", where));
    UCP_ASSIGN_OR_RETURN(pt.shape, GetStrings(t, "shape", where));
    if (t.contains("when")) {
      UCP_ASSIGN_OR_RETURN(pt.when, GetString(t, "when", where));
    }
    out.push_back(std::move(pt));
  }
  return out;
}

bool Contains(const std::string& s, std::string_view sub) {
  return s.find(sub) != std::string::npos;
}

std::string ReplaceAll(std::string s, std::string_view from, const std::string& to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) {
    s.replace(p, from.size(), to);
  }
  return s;
}

}  // namespace

Result<int64_t> ParseRotaryLayout(std::string_view text, const std::string& what) {
  if (text == "interleaved") return 1;
  if (text == "half-split") return 0;
  return InvalidArgumentError(what + " must be interleaved or half-split, got \"" +
                              std::string(text) + "\"");
}

std::string_view RotaryLayoutName(const std::map<std::string, int64_t>& hyper) {
  auto it = hyper.find(std::string(kRotaryInterleavedHyper));
  return it != hyper.end() && it->second != 0 ? "interleaved" : "half-split";
}

Result<int64_t> EvalSizeExpr(std::string_view expr, const std::map<std::string, int64_t>& hyper) {
  return ExprParser(expr, hyper).Parse();
}

std::string_view RuleKindName(RuleKind k) {
  switch (k) {
    case RuleKind::kReplicate:
      return "replicate";
    case RuleKind::kAverage:
      return "average";
    case RuleKind::kShard:
      return "shard";
    case RuleKind::kFuse:
      return "fuse";
    case RuleKind::kPadStrip:
      return "pad_strip";
  }
  return "?";
}

Result<std::vector<ParamSpec>> ModelSpec::Parameters() const {
  std::vector<ParamSpec> out;
  auto hyper_or_zero = [&](const char* k) {
    auto it = hyper.find(k);
    return it == hyper.end() ? int64_t{0} : it->second;
  };
  const int64_t layers = hyper_or_zero("layers");
  const int64_t experts = hyper_or_zero("num_experts");
  auto emit = [&](const ParamTemplate& t, int64_t layer, int64_t expert) -> Status {
    ParamSpec p;
    p.name = ReplaceAll(ReplaceAll(t.name, "{layer}", std::to_string(layer)), "{expert}",
                        std::to_string(expert));
    p.dtype = dtype;
    for (const std::string& e : t.shape) {
      UCP_ASSIGN_OR_RETURN(int64_t d, EvalSizeExpr(e, hyper),
                           "in the shape of parameter template " + Q(t.name));
      if (d < 1) {
        return InvalidArgumentError("parameter template " + Q(t.name) + ": dim " + Q(e) + " = " +
                                    std::to_string(d) + " must be >= 1");
      }
      p.shape.push_back(d);
    }
    out.push_back(std::move(p));
    return Status::Ok();
  };
  auto active = [&](const ParamTemplate& t) {
    if (t.when.empty()) return true;
    const bool neg = t.when[0] == '!';
    const bool v = hyper_or_zero(t.when.substr(neg ? 1 : 0).c_str()) != 0;
    return neg ? !v : v;
  };
  // Consecutive {layer} templates expand layer-major, and within a layer consecutive {expert}
  // templates expand expert-major, so the order is the order modules appear in a Megatron model.
  size_t i = 0;
  while (i < templates.size()) {
    if (!Contains(templates[i].name, "{layer}")) {
      if (Contains(templates[i].name, "{expert}")) {
        return InvalidArgumentError("parameter template " + Q(templates[i].name) +
                                    ": {expert} needs {layer}");
      }
      if (active(templates[i])) UCP_RETURN_IF_ERROR(emit(templates[i], 0, 0));
      ++i;
      continue;
    }
    size_t end = i;
    while (end < templates.size() && Contains(templates[end].name, "{layer}")) ++end;
    for (int64_t l = 0; l < layers; ++l) {
      size_t j = i;
      while (j < end) {
        if (!Contains(templates[j].name, "{expert}")) {
          if (active(templates[j])) UCP_RETURN_IF_ERROR(emit(templates[j], l, 0));
          ++j;
          continue;
        }
        size_t eend = j;
        while (eend < end && Contains(templates[eend].name, "{expert}")) ++eend;
        for (int64_t e = 0; e < experts; ++e) {
          for (size_t k = j; k < eend; ++k) {
            if (active(templates[k])) UCP_RETURN_IF_ERROR(emit(templates[k], l, e));
          }
        }
        j = eend;
      }
    }
    i = end;
  }
  return out;
}

Result<RuleSet> ParseRuleSet(std::string_view json_text, const std::string& what) {
  UCP_ASSIGN_OR_RETURN(json root, ParseStrictJson(json_text, what));
  UCP_RETURN_IF_ERROR(CheckKeys(
      root, what, {"$schema", "family", "source", "parameters", "pipeline", "experts", "rules"},
      {"family", "parameters", "pipeline", "rules"}));
  RuleSet rs;
  UCP_ASSIGN_OR_RETURN(rs.family, GetString(root, "family", what));
  UCP_ASSIGN_OR_RETURN(rs.templates, ParseTemplates(root, what));
  const json& pipe = root["pipeline"];
  const std::string pw = what + ": pipeline";
  UCP_RETURN_IF_ERROR(CheckKeys(
      pipe, pw, {"layer_pattern", "first_stage", "last_stage", "tied_to_last_stage", "source"},
      {"layer_pattern", "first_stage", "last_stage"}));
  UCP_ASSIGN_OR_RETURN(rs.layer_pattern, GetString(pipe, "layer_pattern", pw));
  UCP_ASSIGN_OR_RETURN(rs.first_stage, GetStrings(pipe, "first_stage", pw));
  UCP_ASSIGN_OR_RETURN(rs.last_stage, GetStrings(pipe, "last_stage", pw));
  UCP_ASSIGN_OR_RETURN(rs.tied_to_last_stage, GetStrings(pipe, "tied_to_last_stage", pw));
  if (root.contains("experts")) {
    const std::string ew = what + ": experts";
    UCP_RETURN_IF_ERROR(CheckKeys(root["experts"], ew, {"pattern", "source"}, {"pattern"}));
    UCP_ASSIGN_OR_RETURN(rs.expert_pattern, GetString(root["experts"], "pattern", ew));
  }
  if (!root["rules"].is_array() || root["rules"].empty()) {
    return InvalidArgumentError(what + ": field \"rules\" must be a non-empty array");
  }
  for (size_t i = 0; i < root["rules"].size(); ++i) {
    const json& r = root["rules"][i];
    std::string where = what + ": rules[" + std::to_string(i) + "]";
    UCP_RETURN_IF_ERROR(CheckKeys(r, where,
                                  {"match", "kind", "dim", "axis", "order", "parts", "groups",
                                   "group_name", "split_groups_up_to", "divisible_by", "source"},
                                  {"match", "kind", "source"}));
    Rule rule;
    UCP_ASSIGN_OR_RETURN(rule.match, GetString(r, "match", where));
    where += " " + Q(rule.match);
    UCP_ASSIGN_OR_RETURN(rule.re, CompileRegex(rule.match, where));
    UCP_ASSIGN_OR_RETURN(std::string kind, GetString(r, "kind", where));
    UCP_ASSIGN_OR_RETURN(rule.source, GetString(r, "source", where));
    static const std::pair<const char*, RuleKind> kKinds[] = {{"replicate", RuleKind::kReplicate},
                                                              {"average", RuleKind::kAverage},
                                                              {"shard", RuleKind::kShard},
                                                              {"fuse", RuleKind::kFuse},
                                                              {"pad_strip", RuleKind::kPadStrip}};
    bool found = false;
    for (const auto& [n, k] : kKinds) {
      if (kind == n) {
        rule.kind = k;
        found = true;
      }
    }
    if (!found) {
      return InvalidArgumentError(where + ": unknown kind " + Q(kind) +
                                  " (expected replicate, average, shard, fuse, pad_strip)");
    }
    const bool has_dim = rule.kind == RuleKind::kShard || rule.kind == RuleKind::kFuse ||
                         rule.kind == RuleKind::kPadStrip;
    if (has_dim != r.contains("dim")) {
      return InvalidArgumentError(where + ": field \"dim\" is " +
                                  (has_dim ? "required" : "not allowed") + " for kind " + Q(kind));
    }
    if (has_dim) {
      if (!r["dim"].is_number_integer() || r["dim"].get<int64_t>() < 0 ||
          r["dim"].get<int64_t>() > 7) {
        return InvalidArgumentError(where + ": field \"dim\" must be an integer in 0..7");
      }
      rule.dim = r["dim"].get<int>();
    }
    if (r.contains("axis")) {
      UCP_ASSIGN_OR_RETURN(std::string axis, GetString(r, "axis", where));
      if (axis != "tp" && axis != "ep") {
        return InvalidArgumentError(where + ": field \"axis\" must be \"tp\" or \"ep\", not " +
                                    Q(axis));
      }
      if (rule.kind != RuleKind::kShard && axis == "ep") {
        return InvalidArgumentError(where + ": axis \"ep\" is only allowed for kind \"shard\"");
      }
      rule.axis = axis == "tp" ? Axis::kTp : Axis::kEp;
    }
    const bool is_fuse = rule.kind == RuleKind::kFuse;
    if (is_fuse != r.contains("parts") || is_fuse != r.contains("order")) {
      return InvalidArgumentError(where + ": fields \"parts\" and \"order\" are " +
                                  (is_fuse ? "required" : "only allowed") + " for kind \"fuse\"");
    }
    if (is_fuse) {
      UCP_ASSIGN_OR_RETURN(std::string order, GetString(r, "order", where));
      if (order == "concat") {
        rule.order = FuseOrder::kConcat;
      } else if (order == "interleaved_groups") {
        rule.order = FuseOrder::kInterleavedGroups;
      } else {
        return InvalidArgumentError(where +
                                    ": field \"order\" must be \"concat\" or "
                                    "\"interleaved_groups\", not " +
                                    Q(order));
      }
      if (!r["parts"].is_array() || r["parts"].empty()) {
        return InvalidArgumentError(where + ": field \"parts\" must be a non-empty array");
      }
      for (size_t p = 0; p < r["parts"].size(); ++p) {
        const std::string pw2 = where + ": parts[" + std::to_string(p) + "]";
        UCP_RETURN_IF_ERROR(CheckKeys(r["parts"][p], pw2, {"name", "size"}, {"name", "size"}));
        FusePart part;
        UCP_ASSIGN_OR_RETURN(part.name, GetString(r["parts"][p], "name", pw2));
        UCP_ASSIGN_OR_RETURN(part.size, GetString(r["parts"][p], "size", pw2));
        rule.parts.push_back(std::move(part));
      }
      if ((rule.order == FuseOrder::kInterleavedGroups) != r.contains("groups")) {
        return InvalidArgumentError(where +
                                    ": field \"groups\" is required exactly for order "
                                    "\"interleaved_groups\"");
      }
      if (r.contains("groups")) {
        UCP_ASSIGN_OR_RETURN(rule.groups, GetString(r, "groups", where));
      }
      if (r.contains("group_name")) {
        UCP_ASSIGN_OR_RETURN(rule.group_name, GetString(r, "group_name", where));
      }
      if (r.contains("split_groups_up_to")) {
        if (rule.order != FuseOrder::kInterleavedGroups) {
          return InvalidArgumentError(where +
                                      ": field \"split_groups_up_to\" is only allowed for order "
                                      "\"interleaved_groups\"");
        }
        UCP_ASSIGN_OR_RETURN(rule.split_groups_up_to, GetString(r, "split_groups_up_to", where));
      }
    } else if (r.contains("groups") || r.contains("group_name") ||
               r.contains("split_groups_up_to")) {
      return InvalidArgumentError(where +
                                  ": fields \"groups\"/\"group_name\"/\"split_groups_up_to\" are "
                                  "only allowed for kind \"fuse\"");
    }
    if ((rule.kind == RuleKind::kPadStrip) != r.contains("divisible_by")) {
      return InvalidArgumentError(where +
                                  ": field \"divisible_by\" is required exactly for kind "
                                  "\"pad_strip\"");
    }
    if (r.contains("divisible_by")) {
      UCP_ASSIGN_OR_RETURN(rule.divisible_by, GetString(r, "divisible_by", where));
    }
    rs.rules.push_back(std::move(rule));
  }
  return rs;
}

Status ValidateRuleSetName(std::string_view name, const std::string& what, StatusCode code) {
  bool ok = !name.empty() && name.size() <= kMaxRuleSetNameBytes;
  for (char c : name) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '-');
  }
  if (ok) return Status::Ok();
  std::string shown;
  for (unsigned char c : name.substr(0, 80)) {
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      shown += static_cast<char>(c);
    } else {
      static const char* kHex = "0123456789abcdef";
      shown += std::string("\\x") + kHex[c >> 4] + kHex[c & 15];
    }
  }
  return Status(code, what + ": " + Q(shown) +
                          " is not a rule-set or preset name (1 to " +
                          std::to_string(kMaxRuleSetNameBytes) +
                          " bytes of [A-Za-z0-9_-]; a name read from a file is never a path)");
}

Result<RuleSet> LoadRuleSet(const std::filesystem::path& data_dir, std::string_view family) {
  // Every caller's family comes from a file (a preset, a model file, a checkpoint's metadata), so
  // it is a name: it may never leave `data_dir`.
  UCP_RETURN_IF_ERROR(ValidateRuleSetName(family, "family", StatusCode::kInvalidArgument));
  const std::filesystem::path path = data_dir / (std::string(family) + ".json");
  UCP_ASSIGN_OR_RETURN(std::string text, ReadFile(path), "rule set of family " + Q(family));
  return ParseRuleSet(text, path.string());
}

namespace {
Result<ModelSpec> LoadModelFile(const std::filesystem::path& data_dir,
                                const std::filesystem::path& path, const std::string& n);
}  // namespace

Result<ModelSpec> LoadModel(const std::filesystem::path& data_dir, std::string_view name_or_path) {
  std::filesystem::path path;
  const std::string n(name_or_path);
  if (n.size() > 5 && n.ends_with(".json")) {
    path = n;
  } else {
    if (n.empty() || n.find_first_of("/\\.") != std::string::npos) {
      return InvalidArgumentError("model " + Q(n) + ": a preset name has no '/', '\\' or '.'");
    }
    path = data_dir / "models" / (n + ".json");
  }
  return LoadModelFile(data_dir, path, n);
}

Result<ModelSpec> LoadModelPreset(const std::filesystem::path& data_dir, std::string_view name) {
  UCP_RETURN_IF_ERROR(ValidateRuleSetName(name, "model", StatusCode::kInvalidArgument));
  const std::string n(name);
  return LoadModelFile(data_dir, data_dir / "models" / (n + ".json"), n);
}

namespace {
Result<ModelSpec> LoadModelFile(const std::filesystem::path& data_dir,
                                const std::filesystem::path& path, const std::string& n) {
  UCP_ASSIGN_OR_RETURN(std::string text, ReadFile(path), "model " + Q(n));
  const std::string what = path.string();
  UCP_ASSIGN_OR_RETURN(json root, ParseStrictJson(text, what));
  UCP_RETURN_IF_ERROR(CheckKeys(root, what,
                                {"$schema", "name", "family", "dtype", "source", "hyper"},
                                {"name", "family", "hyper"}));
  ModelSpec spec;
  UCP_ASSIGN_OR_RETURN(spec.name, GetString(root, "name", what));
  UCP_ASSIGN_OR_RETURN(spec.family, GetString(root, "family", what));
  if (root.contains("dtype")) {
    UCP_ASSIGN_OR_RETURN(std::string dt, GetString(root, "dtype", what));
    UCP_ASSIGN_OR_RETURN(spec.dtype, DTypeFromName(dt), what + ": field \"dtype\"");
  }
  const json& hyper = root["hyper"];
  if (!hyper.is_object()) return InvalidArgumentError(what + ": field \"hyper\" must be an object");
  for (const auto& [k, v] : hyper.items()) {
    if (v.is_boolean()) {
      spec.hyper[k] = v.get<bool>() ? 1 : 0;
    } else if (v.is_number_integer() && v.get<int64_t>() >= 0 &&
               v.get<int64_t>() < (int64_t{1} << 40)) {
      spec.hyper[k] = v.get<int64_t>();
    } else {
      return InvalidArgumentError(what + ": hyper." + k +
                                  " must be a non-negative integer or bool");
    }
  }
  for (const char* req : {"hidden", "layers", "heads", "vocab"}) {
    if (!spec.hyper.contains(req)) {
      return InvalidArgumentError(what + ": missing hyper-parameter " + Q(req));
    }
  }
  if (spec.hyper["heads"] == 0 || spec.hyper["hidden"] % spec.hyper["heads"] != 0) {
    return InvalidArgumentError(what + ": hidden=" + std::to_string(spec.hyper["hidden"]) +
                                " not divisible by heads=" + std::to_string(spec.hyper["heads"]));
  }
  spec.hyper.try_emplace("head_dim", spec.hyper["hidden"] / spec.hyper["heads"]);
  spec.hyper.try_emplace("kv_heads", spec.hyper["heads"]);
  spec.hyper.try_emplace("make_vocab_size_divisible_by", 1);
  spec.hyper.try_emplace("tied_embeddings", 0);
  spec.hyper.try_emplace("num_experts", 0);
  UCP_ASSIGN_OR_RETURN(RuleSet rs, LoadRuleSet(data_dir, spec.family), "model " + Q(spec.name));
  spec.templates = std::move(rs.templates);
  return spec;
}
}  // namespace

Result<ResolvedModel> Resolve(const ModelSpec& spec, const RuleSet& rules) {
  ResolvedModel out;
  out.spec = spec;
  out.num_layers = spec.hyper.contains("layers") ? spec.hyper.at("layers") : 0;
  out.num_experts = spec.hyper.contains("num_experts") ? spec.hyper.at("num_experts") : 0;
  const bool tied = spec.hyper.contains("tied_embeddings") && spec.hyper.at("tied_embeddings");
  const std::string rs_what = "rule set " + Q(rules.family);
  UCP_ASSIGN_OR_RETURN(auto layer_re,
                       CompileRegex(rules.layer_pattern, rs_what + " layer_pattern"));
  std::shared_ptr<const std::regex> expert_re;
  if (!rules.expert_pattern.empty()) {
    UCP_ASSIGN_OR_RETURN(expert_re,
                         CompileRegex(rules.expert_pattern, rs_what + " experts.pattern"));
  }
  auto compile_all =
      [&](const std::vector<std::string>& pats,
          const char* field) -> Result<std::vector<std::shared_ptr<const std::regex>>> {
    std::vector<std::shared_ptr<const std::regex>> res;
    for (const auto& p : pats) {
      UCP_ASSIGN_OR_RETURN(auto re, CompileRegex(p, rs_what + " pipeline." + field));
      res.push_back(std::move(re));
    }
    return res;
  };
  UCP_ASSIGN_OR_RETURN(auto first_re, compile_all(rules.first_stage, "first_stage"));
  UCP_ASSIGN_OR_RETURN(auto last_re, compile_all(rules.last_stage, "last_stage"));
  UCP_ASSIGN_OR_RETURN(auto tied_re, compile_all(rules.tied_to_last_stage, "tied_to_last_stage"));
  auto any_match = [](const std::string& s,
                      const std::vector<std::shared_ptr<const std::regex>>& v) {
    for (const auto& re : v) {
      if (FullMatch(s, *re)) return true;
    }
    return false;
  };

  UCP_ASSIGN_OR_RETURN(std::vector<ParamSpec> params, spec.Parameters(), "model " + Q(spec.name));
  std::vector<int> rule_hits(rules.rules.size(), 0);
  std::set<std::string> seen;
  for (const ParamSpec& p : params) {
    const std::string pq = "parameter " + Q(p.name);
    if (!seen.insert(p.name).second) {
      return InvalidArgumentError(pq + ": defined twice by the templates of " + rs_what);
    }
    ResolvedParam rp;
    rp.name = p.name;
    rp.shape = p.shape;
    rp.dtype = p.dtype;
    int matched = -1;
    for (size_t r = 0; r < rules.rules.size(); ++r) {
      if (!FullMatch(p.name, *rules.rules[r].re)) continue;
      if (matched >= 0) {
        return InvalidArgumentError(pq + " is matched by two rules of " + rs_what + ": " +
                                    Q(rules.rules[matched].match) + " and " +
                                    Q(rules.rules[r].match));
      }
      matched = static_cast<int>(r);
    }
    if (matched < 0) return InvalidArgumentError(pq + " is matched by no rule of " + rs_what);
    ++rule_hits[matched];
    const Rule& rule = rules.rules[matched];
    const std::string where = pq + " (rule " + Q(rule.match) + ")";
    ResolvedRule& rr = rp.rule;
    rr.match = rule.match;
    rr.kind = rule.kind;
    rr.dim = rule.dim;
    rr.axis = rule.axis;
    rr.order = rule.order;
    rr.group_name = rule.group_name;
    const bool has_dim = rule.kind == RuleKind::kShard || rule.kind == RuleKind::kFuse ||
                         rule.kind == RuleKind::kPadStrip;
    if (has_dim && rule.dim >= static_cast<int>(p.shape.size())) {
      return InvalidArgumentError(where + ": dim " + std::to_string(rule.dim) + " but the shape " +
                                  ShapeToString(p.shape) + " has " +
                                  std::to_string(p.shape.size()) + " dims");
    }
    if (rule.kind == RuleKind::kFuse) {
      int64_t per_group = 0;
      for (const FusePart& part : rule.parts) {
        UCP_ASSIGN_OR_RETURN(int64_t n, EvalSizeExpr(part.size, spec.hyper), where);
        if (n < 1) {
          return InvalidArgumentError(where + ": part " + Q(part.name) + " has " +
                                      std::to_string(n) + " rows");
        }
        rr.part_names.push_back(part.name);
        rr.part_sizes.push_back(n);
        per_group += n;
      }
      if (rule.order == FuseOrder::kInterleavedGroups) {
        UCP_ASSIGN_OR_RETURN(rr.groups, EvalSizeExpr(rule.groups, spec.hyper), where);
        if (rr.groups < 1) return InvalidArgumentError(where + ": groups must be >= 1");
        if (!rule.split_groups_up_to.empty()) {
          UCP_ASSIGN_OR_RETURN(rr.split_groups_up_to,
                               EvalSizeExpr(rule.split_groups_up_to, spec.hyper), where);
          if (rr.split_groups_up_to < 1) {
            return InvalidArgumentError(where + ": split_groups_up_to must be >= 1");
          }
          rr.split_groups_up_to_expr = rule.split_groups_up_to;
        }
      }
      if (per_group * rr.groups != p.shape[rule.dim]) {
        return InvalidArgumentError(
            where + ": parts add up to " + std::to_string(per_group * rr.groups) + " rows, dim " +
            std::to_string(rule.dim) + " has " + std::to_string(p.shape[rule.dim]));
      }
    }
    if (rule.kind == RuleKind::kPadStrip) {
      UCP_ASSIGN_OR_RETURN(rr.divisible_by, EvalSizeExpr(rule.divisible_by, spec.hyper), where);
      if (rr.divisible_by < 1) return InvalidArgumentError(where + ": divisible_by must be >= 1");
    }
    std::smatch m;
    if (std::regex_match(p.name, m, *layer_re)) {
      if (m.size() < 2 || !m[1].matched) {
        return InvalidArgumentError(rs_what + " layer_pattern " + Q(rules.layer_pattern) +
                                    " has no capture group 1 for " + pq);
      }
      rp.stage = StagePlacement::kLayer;
      rp.layer = std::stoll(m[1].str());
      rp.layer_pos = static_cast<size_t>(m.position(1));
      rp.layer_len = static_cast<size_t>(m.length(1));
      if (rp.layer >= out.num_layers) {
        return InvalidArgumentError(pq + ": layer " + std::to_string(rp.layer) +
                                    " >= layers=" + std::to_string(out.num_layers));
      }
    } else {
      const bool first = any_match(p.name, first_re);
      const bool last = any_match(p.name, last_re);
      if (first && last) {
        return FailedPreconditionError(pq +
                                       " is matched by both pipeline.first_stage and "
                                       "pipeline.last_stage of " +
                                       rs_what);
      }
      if (!first && !last) {
        return FailedPreconditionError(pq +
                                       " is in no layer and matched by neither "
                                       "pipeline.first_stage nor pipeline.last_stage of " +
                                       rs_what);
      }
      rp.stage = first ? StagePlacement::kFirst : StagePlacement::kLast;
      if (first && tied && any_match(p.name, tied_re)) rp.stage = StagePlacement::kFirstAndLast;
    }
    if (expert_re && std::regex_match(p.name, m, *expert_re)) {
      if (m.size() < 2 || !m[1].matched) {
        return InvalidArgumentError(rs_what + " experts.pattern has no capture group 1 for " + pq);
      }
      rp.expert = std::stoll(m[1].str());
      rp.expert_pos = static_cast<size_t>(m.position(1));
      rp.expert_len = static_cast<size_t>(m.length(1));
      if (rp.expert >= out.num_experts) {
        return InvalidArgumentError(pq + ": expert " + std::to_string(rp.expert) +
                                    " >= num_experts=" + std::to_string(out.num_experts));
      }
      if (rp.rule.axis == Axis::kEp) {
        return InvalidArgumentError(where +
                                    ": a per-expert parameter cannot also be sharded on ep");
      }
    }
    const bool is_bias = p.name.ends_with(".bias");
    rp.optimizer_group = (p.shape.size() >= 2 && !is_bias) ? 0 : 1;
    out.params.push_back(std::move(rp));
  }
  for (size_t r = 0; r < rules.rules.size(); ++r) {
    if (rule_hits[r] == 0) {
      return InvalidArgumentError("rule " + Q(rules.rules[r].match) + " of " + rs_what +
                                  " matched no parameter of model " + Q(spec.name));
    }
  }
  return out;
}

Result<Slice> SliceParam(const ResolvedParam& p, int tp, int tp_rank, int ep, int ep_rank) {
  UCP_CHECK(tp >= 1 && tp_rank >= 0 && tp_rank < tp && ep >= 1 && ep_rank >= 0 && ep_rank < ep);
  const ResolvedRule& r = p.rule;
  const std::string pq = "parameter " + Q(p.name);
  const size_t nd = p.shape.size();
  Slice s;
  s.local_shape = p.shape;
  auto whole = [&]() { s.pieces.push_back({Shape(nd, 0), Shape(nd, 0), p.shape}); };
  // A piece that covers the full extent of every dim except `dim`.
  auto along = [&](int64_t local_start, int64_t full_start, int64_t count) {
    Piece pc{Shape(nd, 0), Shape(nd, 0), s.local_shape};
    pc.local_start[r.dim] = local_start;
    pc.full_start[r.dim] = full_start;
    pc.counts[r.dim] = count;
    s.pieces.push_back(std::move(pc));
  };
  switch (r.kind) {
    case RuleKind::kReplicate:
    case RuleKind::kAverage:
      whole();
      s.replica = tp_rank;
      return s;
    case RuleKind::kShard: {
      const int parts = r.axis == Axis::kTp ? tp : ep;
      const int index = r.axis == Axis::kTp ? tp_rank : ep_rank;
      UCP_ASSIGN_OR_RETURN(
          layout::IndexRange range,
          layout::EvenSplit(p.shape[r.dim], parts, index, "rows of dim " + std::to_string(r.dim),
                            r.axis == Axis::kTp ? "tp" : "ep"),
          pq);
      // An ep-sharded tensor is whole on every tp rank of its ep rank.
      s.replica = r.axis == Axis::kEp ? tp_rank : 0;
      s.local_shape[r.dim] = range.size();
      along(0, range.inclusive_min, range.size());
      return s;
    }
    case RuleKind::kFuse: {
      if (r.order == FuseOrder::kInterleavedGroups) {
        int64_t per_group = 0;
        for (int64_t n : r.part_sizes) per_group += n;
        const std::string tps = "tp=" + std::to_string(tp);
        const std::string groups = std::to_string(r.groups) + " " + r.group_name;
        if (r.groups % tp != 0) {
          if (r.split_groups_up_to == 0) {
            return FailedPreconditionError(pq + ": " + groups + " not divisible by " + tps);
          }
          // tp above the groups: Megatron-Core keeps linear_qkv column-parallel, so a rank holds
          // rows [r*R/tp, (r+1)*R/tp) of the interleaved tensor, part of one group; its attention
          // all-gathers the qkv activations and takes its group's k, v and its own q heads. No
          // row is replicated, so there are no copies to compare.
          if (tp % r.groups != 0) {
            return FailedPreconditionError(pq + ": " + groups + " not divisible by " + tps +
                                           ", nor is " + tps + " a multiple of them");
          }
          if (r.split_groups_up_to % tp != 0) {
            return FailedPreconditionError(
                pq + ": " + r.split_groups_up_to_expr + "=" + std::to_string(r.split_groups_up_to) +
                " not divisible by " + tps + " (tp above the " + groups +
                " splits each group over " + std::to_string(tp / r.groups) + " ranks)");
          }
          if (per_group % (tp / r.groups) != 0) {
            return FailedPreconditionError(
                pq + ": " + std::to_string(per_group) + " rows per group not divisible by the " +
                std::to_string(tp / r.groups) + " ranks that share a group at " + tps);
          }
        }
        // With tp dividing the groups this is the split by whole groups; above them, the same
        // contiguous split cuts inside a group.
        const int64_t rows = r.groups * per_group / tp;
        s.local_shape[r.dim] = rows;
        along(0, tp_rank * rows, rows);
        return s;
      }
      int64_t local_rows = 0;
      for (size_t i = 0; i < r.part_sizes.size(); ++i) {
        if (r.part_sizes[i] % tp != 0) {
          return FailedPreconditionError(pq + ": part " + Q(r.part_names[i]) + " has " +
                                         std::to_string(r.part_sizes[i]) +
                                         " rows, not divisible by tp=" + std::to_string(tp));
        }
        local_rows += r.part_sizes[i] / tp;
      }
      s.local_shape[r.dim] = local_rows;
      int64_t local = 0, full = 0;
      for (int64_t n : r.part_sizes) {
        along(local, full + tp_rank * (n / tp), n / tp);
        local += n / tp;
        full += n;
      }
      return s;
    }
    case RuleKind::kPadStrip: {
      UCP_ASSIGN_OR_RETURN(layout::PaddedPart part,
                           layout::PaddedSplit(p.shape[r.dim], r.divisible_by * tp, tp, tp_rank),
                           pq);
      const int64_t rows = part.range.size();
      s.local_shape[r.dim] = rows;
      if (!part.valid.empty()) along(0, part.valid.inclusive_min, part.valid.size());
      if (part.valid.size() < rows) {
        Box pad{Shape(nd, 0), s.local_shape};
        pad.start[r.dim] = part.valid.size();
        pad.counts[r.dim] = rows - part.valid.size();
        s.pad.push_back(std::move(pad));
      }
      return s;
    }
  }
  return InternalError(pq + ": unknown rule kind");
}

std::string LocalName(const ResolvedParam& p, const layout::StageAssignment& stages,
                      const layout::ExpertPlacement* experts) {
  std::string name = p.name;
  // Replace the later index first so the earlier position stays valid.
  struct Edit {
    size_t pos, len;
    std::string text;
  };
  std::vector<Edit> edits;
  if (p.stage == StagePlacement::kLayer && p.layer >= 0) {
    edits.push_back({p.layer_pos, p.layer_len, std::to_string(stages.LocalIndex(p.layer))});
  }
  if (p.expert >= 0 && experts != nullptr) {
    edits.push_back({p.expert_pos, p.expert_len, std::to_string(experts->LocalIndex(p.expert))});
  }
  std::sort(edits.begin(), edits.end(), [](const Edit& a, const Edit& b) { return a.pos > b.pos; });
  for (const Edit& e : edits) name.replace(e.pos, e.len, e.text);
  return name;
}

}  // namespace ucp::patterns
