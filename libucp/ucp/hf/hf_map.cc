// Hugging Face name and layout maps (see hf_map.h).
#include "ucp/hf/hf_map.h"

#include <algorithm>
#include <cstdio>
#include <regex>
#include <set>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/tensor/shape.h"

namespace ucp::hf {

namespace fs = std::filesystem;
using json::Json;

namespace {

std::string ReplaceKey(std::string s, const std::string& key, int64_t value) {
  if (value < 0) return s;
  const std::string n = std::to_string(value);
  for (size_t p = s.find(key); p != std::string::npos; p = s.find(key, p)) {
    s.replace(p, key.size(), n);
    p += n.size();
  }
  return s;
}

// A template with {layer} (and {expert}) filled in; a negative index leaves its key.
std::string ReplaceLayer(const std::string& s, int64_t layer, int64_t expert = -1) {
  return ReplaceKey(ReplaceKey(s, "{layer}", layer), "{expert}", expert);
}

bool HasLayer(const std::string& s) { return s.find("{layer}") != std::string::npos; }
bool HasExpert(const std::string& s) { return s.find("{expert}") != std::string::npos; }

Result<std::string> StringField(const Json& j, const char* key, const std::string& what,
                                bool required = true) {
  if (!j.contains(key)) {
    if (!required) return std::string();
    return InvalidArgumentError(what + ": field " + key + " is missing");
  }
  if (!j[key].is_string())
    return InvalidArgumentError(what + ": field " + key + " is not a string");
  return j[key].get<std::string>();
}

Result<std::vector<std::string>> StringList(const Json& j, const char* key,
                                            const std::string& what) {
  std::vector<std::string> out;
  if (!j.contains(key)) return out;
  if (!j[key].is_array()) return InvalidArgumentError(what + ": field " + key + " is not a list");
  for (const Json& v : j[key]) {
    if (!v.is_string())
      return InvalidArgumentError(what + ": field " + key + " holds a non-string");
    out.push_back(v.get<std::string>());
  }
  return out;
}

bool WhenHolds(const std::string& when, const std::map<std::string, int64_t>& hyper) {
  if (when.empty()) return true;
  const bool negate = when[0] == '!';
  const std::string key = negate ? when.substr(1) : when;
  auto it = hyper.find(key);
  const bool value = it != hyper.end() && it->second != 0;
  return negate ? !value : value;
}

}  // namespace

Result<HfMap> ParseHfMap(std::string_view text, const std::string& what) {
  UCP_ASSIGN_OR_RETURN(Json j, json::ParseStrict(text, what, StatusCode::kInvalidArgument));
  if (!j.is_object()) return InvalidArgumentError(what + ": not a JSON object");
  static const std::set<std::string> kKeys = {"$schema",
                                              "architecture",
                                              "model_type",
                                              "family",
                                              "default_for_family",
                                              "source",
                                              "base_model_prefix",
                                              "hyper",
                                              "requires",
                                              "config",
                                              "skip",
                                              "tensors"};
  for (const auto& [k, v] : j.items()) {
    if (!kKeys.contains(k)) return InvalidArgumentError(what + ": unknown field " + k);
  }
  HfMap m;
  m.file = what;
  UCP_ASSIGN_OR_RETURN(m.architecture, StringField(j, "architecture", what));
  UCP_ASSIGN_OR_RETURN(m.model_type, StringField(j, "model_type", what));
  UCP_ASSIGN_OR_RETURN(m.family, StringField(j, "family", what));
  UCP_RETURN_IF_ERROR(StringField(j, "source", what).status());
  UCP_ASSIGN_OR_RETURN(m.base_model_prefix, StringField(j, "base_model_prefix", what, false));
  m.default_for_family = j.value("default_for_family", false);
  if (!j.contains("hyper") || !j["hyper"].is_array()) {
    return InvalidArgumentError(what + ": field hyper is not a list");
  }
  for (const Json& h : j["hyper"]) {
    const std::string w = what + ": hyper";
    if (!h.is_object()) return InvalidArgumentError(w + " holds a non-object");
    HyperKey k;
    UCP_ASSIGN_OR_RETURN(k.name, StringField(h, "name", w));
    UCP_ASSIGN_OR_RETURN(k.keys, StringList(h, "keys", w + " " + k.name));
    UCP_ASSIGN_OR_RETURN(k.default_expr, StringField(h, "default", w + " " + k.name, false));
    if (k.keys.empty() && k.default_expr.empty()) {
      return InvalidArgumentError(w + " " + k.name + ": neither keys nor default");
    }
    m.hyper.push_back(std::move(k));
  }
  if (j.contains("requires")) {
    for (const Json& r : j["requires"]) {
      const std::string w = what + ": requires";
      if (!r.is_object() || !r.contains("equals")) {
        return InvalidArgumentError(w + " holds an entry without equals");
      }
      Requirement q;
      UCP_ASSIGN_OR_RETURN(q.key, StringField(r, "key", w));
      UCP_ASSIGN_OR_RETURN(q.why, StringField(r, "why", w));
      q.equals = r["equals"];
      q.default_value = r.contains("default") ? r["default"] : Json();
      m.requires_.push_back(std::move(q));
    }
  }
  m.config_defaults = j.contains("config") ? j["config"] : Json::object();
  if (!m.config_defaults.is_object())
    return InvalidArgumentError(what + ": config is not an object");
  UCP_ASSIGN_OR_RETURN(m.skip, StringList(j, "skip", what));
  for (const std::string& s : m.skip) {
    try {
      std::regex re(s);
    } catch (const std::regex_error& e) {
      return InvalidArgumentError(what + ": skip regex \"" + s + "\": " + e.what());
    }
  }
  if (!j.contains("tensors") || !j["tensors"].is_array()) {
    return InvalidArgumentError(what + ": field tensors is not a list");
  }
  for (const Json& t : j["tensors"]) {
    const std::string w = what + ": tensors";
    if (!t.is_object()) return InvalidArgumentError(w + " holds a non-object");
    MapTensor e;
    UCP_ASSIGN_OR_RETURN(e.param, StringField(t, "param", w));
    const std::string we = w + " " + e.param;
    UCP_ASSIGN_OR_RETURN(e.when, StringField(t, "when", we, false));
    e.transpose = t.value("transpose", false);
    if (t.contains("groups")) {
      UCP_ASSIGN_OR_RETURN(e.groups, StringField(t, "groups", we));
    }
    if (t.contains("hf") == t.contains("parts")) {
      return InvalidArgumentError(we + ": exactly one of hf and parts");
    }
    if (t.contains("hf")) {
      MapPart p;
      UCP_ASSIGN_OR_RETURN(p.hf, StringField(t, "hf", we));
      e.parts.push_back(std::move(p));
    } else {
      if (!t["parts"].is_array() || t["parts"].empty()) {
        return InvalidArgumentError(we + ": parts is not a non-empty list");
      }
      for (const Json& pj : t["parts"]) {
        MapPart p;
        UCP_ASSIGN_OR_RETURN(p.hf, StringField(pj, "hf", we + " part"));
        UCP_ASSIGN_OR_RETURN(p.size, StringField(pj, "size", we + " part " + p.hf));
        UCP_ASSIGN_OR_RETURN(p.offset, StringField(pj, "offset", we + " part " + p.hf, false));
        if (p.offset.empty()) p.offset = "0";
        if (pj.contains("rotary")) {
          const std::string wr = we + " part " + p.hf + ": rotary";
          if (!pj["rotary"].is_object()) return InvalidArgumentError(wr + " is not an object");
          UCP_ASSIGN_OR_RETURN(p.rotary_when, StringField(pj["rotary"], "when", wr));
          UCP_ASSIGN_OR_RETURN(p.rotary_head, StringField(pj["rotary"], "head", wr));
          if (t.value("transpose", false)) {
            return InvalidArgumentError(wr + ": a rotary row permutation of a transposed tensor");
          }
        }
        e.parts.push_back(std::move(p));
      }
    }
    m.tensors.push_back(std::move(e));
  }
  return m;
}

Result<std::vector<HfMap>> LoadHfMaps(const fs::path& data_dir) {
  const fs::path dir = data_dir / "hf";
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return NotFoundError("no Hugging Face maps folder " + dir.string());
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".json") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<HfMap> maps;
  for (const fs::path& f : files) {
    UCP_ASSIGN_OR_RETURN(std::string text, io::ReadFileToString(f, int64_t{16} << 20));
    UCP_ASSIGN_OR_RETURN(HfMap m, ParseHfMap(text, f.string()));
    maps.push_back(std::move(m));
  }
  return maps;
}

Result<std::map<std::string, int64_t>> HyperFromConfig(const HfMap& map, const Json& config,
                                                       const std::string& where) {
  for (const Requirement& r : map.requires_) {
    const Json value =
        config.contains(r.key) && !config[r.key].is_null() ? config[r.key] : r.default_value;
    if (value != r.equals) {
      return UnimplementedError(where + ": " + r.key + " is " + value.dump() + "; " +
                                map.architecture + " is mapped only with " + r.equals.dump() +
                                " (" + r.why + ")");
    }
  }
  std::map<std::string, int64_t> hyper;
  for (const HyperKey& k : map.hyper) {
    bool found = false;
    for (const std::string& key : k.keys) {
      if (!config.contains(key) || config[key].is_null()) continue;
      const Json& v = config[key];
      if (v.is_boolean()) {
        hyper[k.name] = v.get<bool>() ? 1 : 0;
      } else if (v.is_number_integer()) {
        hyper[k.name] = v.get<int64_t>();
      } else {
        return InvalidArgumentError(where + ": " + key + " is " + v.dump() + ", not an integer");
      }
      found = true;
      break;
    }
    if (found) continue;
    if (k.default_expr.empty()) {
      return InvalidArgumentError(where + ": " + k.keys[0] + " is missing (" + map.architecture +
                                  " needs it for " + k.name + ")");
    }
    UCP_ASSIGN_OR_RETURN(hyper[k.name], patterns::EvalSizeExpr(k.default_expr, hyper),
                         where + ": default of " + k.name);
  }
  return hyper;
}

Json NormalizeConfig(Json config) {
  if (!config.is_object()) return config;
  if (config.contains("dtype")) {
    if (!config.contains("torch_dtype")) config["torch_dtype"] = config["dtype"];
    config.erase("dtype");
  }
  if (config.contains("rope_parameters") && config["rope_parameters"].is_object()) {
    Json rp = config["rope_parameters"];
    if (rp.contains("rope_theta") && !config.contains("rope_theta")) {
      config["rope_theta"] = rp["rope_theta"];
    }
    rp.erase("rope_theta");
    const bool plain = !rp.contains("rope_type") || rp["rope_type"] == "default";
    if (!plain && !config.contains("rope_scaling")) config["rope_scaling"] = rp;
    config.erase("rope_parameters");
  }
  return config;
}

Result<Json> ConfigForModel(const HfMap& map, const patterns::ModelSpec& model, const Json& base,
                            DType dtype) {
  Json c = NormalizeConfig(base.is_object() ? base : map.config_defaults);
  c["architectures"] = Json::array({map.architecture});
  c["model_type"] = map.model_type;
  std::map<std::string, int64_t> hyper = model.hyper;
  hyper.try_emplace("tied_embeddings", 0);  // absent means untied, as in the rule sets' `when`
  for (const HyperKey& k : map.hyper) {
    if (k.keys.empty()) continue;
    auto it = hyper.find(k.name);
    if (it == hyper.end()) continue;
    if (k.name == "tied_embeddings") {
      c[k.keys[0]] = it->second != 0;
    } else {
      c[k.keys[0]] = it->second;
    }
    // Other spellings of the same value would contradict it when they differ.
    for (size_t i = 1; i < k.keys.size(); ++i) c.erase(k.keys[i]);
  }
  switch (dtype) {
    case DType::kFp32:
      c["torch_dtype"] = "float32";
      break;
    case DType::kBf16:
      c["torch_dtype"] = "bfloat16";
      break;
    case DType::kFp16:
      c["torch_dtype"] = "float16";
      break;
    default:
      return InvalidArgumentError("--dtype " + std::string(DTypeName(dtype)) +
                                  ": Hugging Face weights are written as fp32, bf16 or fp16");
  }
  // The config must read back as the same model.
  UCP_ASSIGN_OR_RETURN(auto back, HyperFromConfig(map, c, "the generated config.json"));
  for (const auto& [name, value] : back) {
    auto it = hyper.find(name);
    if (name == "make_vocab_size_divisible_by" || it == hyper.end()) continue;
    const int64_t want = it->second;
    if (want != value) {
      return FailedPreconditionError("model " + model.name + " cannot be written as " +
                                     map.architecture + ": its " + name + " is " +
                                     std::to_string(want) + " but " + map.architecture +
                                     "'s config.json gives " + std::to_string(value));
    }
  }
  return c;
}

std::string Unprefixed(const HfMap& map, const std::string& name) {
  const std::string& p = map.base_model_prefix;
  if (!p.empty() && name.compare(0, p.size(), p) == 0) return name.substr(p.size());
  return name;
}

Result<HfLayout> LayOutHf(const HfMap& map, const patterns::ResolvedModel& model) {
  const std::map<std::string, int64_t>& hyper = model.spec.hyper;
  std::map<std::string, const patterns::ResolvedParam*> params;
  for (const auto& p : model.params) params[p.name] = &p;
  std::set<std::string> mapped;
  HfLayout out;
  std::map<std::string, int32_t> tensor_index;
  // Per HF tensor: its [out, in...] extents and the out-dim intervals that parts take.
  struct Extent {
    Shape rest;
    int64_t out = 0;
    bool transpose = false;
    std::vector<std::pair<int64_t, int64_t>> rows;
  };
  std::vector<Extent> extents;
  bool permuted_rotary = false;

  auto add_entry = [&](const MapTensor& e, int64_t layer, int64_t expert) -> Status {
    if (!WhenHolds(e.when, hyper)) {
      for (const MapPart& part : e.parts) {
        out.unused.push_back(ReplaceLayer(part.hf, layer, expert));
      }
      return Status::Ok();
    }
    const std::string pname = ReplaceLayer(e.param, layer, expert);
    const std::string what = map.file + ": parameter \"" + pname + "\"";
    auto pit = params.find(pname);
    if (pit == params.end()) {
      return InvalidArgumentError(what + " is not a parameter of model " + model.spec.name +
                                  " (family " + model.spec.family + ")");
    }
    if (!mapped.insert(pname).second) return InvalidArgumentError(what + " is mapped twice");
    const patterns::ResolvedParam& p = *pit->second;
    if (p.shape.empty()) return InvalidArgumentError(what + " is 0-d");
    const int64_t rows = p.shape[0];
    const Shape rest(p.shape.begin() + 1, p.shape.end());
    const int64_t inner = NumElementsOrDie(rest);
    if (e.transpose && p.shape.size() != 2) {
      return InvalidArgumentError(what + ": transpose needs a 2-d parameter, it is " +
                                  ShapeToString(p.shape));
    }
    UCP_ASSIGN_OR_RETURN(int64_t groups, patterns::EvalSizeExpr(e.groups, hyper), what);
    std::vector<int64_t> sizes, offsets;
    // Per part: the head size of its rotary row permutation where that applies, else 0.
    std::vector<int64_t> rotary;
    int64_t per_group = 0;
    for (const MapPart& part : e.parts) {
      int64_t size = 0;
      if (part.size.empty()) {
        size = groups > 0 ? rows / groups : 0;
      } else {
        UCP_ASSIGN_OR_RETURN(size, patterns::EvalSizeExpr(part.size, hyper), what);
      }
      UCP_ASSIGN_OR_RETURN(int64_t offset, patterns::EvalSizeExpr(part.offset, hyper), what);
      sizes.push_back(size);
      offsets.push_back(offset);
      per_group += size;
      int64_t head = 0;
      if (!part.rotary_when.empty() && WhenHolds(part.rotary_when, hyper)) {
        UCP_ASSIGN_OR_RETURN(head, patterns::EvalSizeExpr(part.rotary_head, hyper), what);
        if (head <= 0 || head % 2 != 0 || size % head != 0) {
          return InvalidArgumentError(what + ": part " + part.hf + " of " +
                                      std::to_string(size) + " rows is not heads of an even " +
                                      part.rotary_head + " = " + std::to_string(head) +
                                      " rows (" + part.rotary_when + ")");
        }
      }
      rotary.push_back(head);
      if (head > 0) permuted_rotary = true;
    }
    if (groups <= 0 || groups * per_group != rows) {
      return InvalidArgumentError(what + ": " + std::to_string(groups) + " groups of " +
                                  std::to_string(per_group) + " rows do not make its " +
                                  std::to_string(rows) + " rows");
    }
    int64_t part_row = 0;
    for (size_t k = 0; k < e.parts.size(); ++k) {
      const std::string hf_name = ReplaceLayer(e.parts[k].hf, layer, expert);
      auto [it, fresh] = tensor_index.try_emplace(hf_name, static_cast<int32_t>(extents.size()));
      if (fresh) {
        extents.push_back({rest, 0, e.transpose, {}});
        out.tensors.push_back({hf_name, {}, e.when});
      }
      Extent& x = extents[it->second];
      if (x.rest != rest || x.transpose != e.transpose) {
        return InvalidArgumentError(what + ": HF tensor " + hf_name +
                                    " is given parts of different shapes");
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * per_group + part_row;
        const int64_t h0 = offsets[k] + g * sizes[k];
        x.rows.push_back({h0, sizes[k]});
        x.out = std::max(x.out, h0 + sizes[k]);
        HfBlock b;
        b.param = pname;
        b.tensor = it->second;
        b.param_offset = r0 * inner;
        if (rotary[k] > 0) {
          // Heads of `head` rows, rotary pairs adjacent in ucp and halves in HF: one block per
          // member s of the pairs, over (heads, head/2 pairs, the row), ucp row 2i+s <-> HF row
          // s*head/2 + i of each head.
          const int64_t head = rotary[k];
          for (int64_t s = 0; s < 2; ++s) {
            HfBlock h;
            h.param = pname;
            h.tensor = it->second;
            h.counts = {sizes[k] / head, head / 2, inner};
            h.param_offset = (r0 + s) * inner;
            h.param_strides = {head * inner, 2 * inner, 1};
            h.hf_offset = (h0 + s * (head / 2)) * inner;
            h.hf_strides = {head * inner, inner, 1};
            if (NumElementsOrDie(Shape(h.counts.begin(), h.counts.end())) > 0) {
              out.blocks.push_back(std::move(h));
            }
          }
          continue;
        }
        if (!e.transpose) {
          // Rows are rows on both sides: one block of whole rows.
          b.counts = {sizes[k] * inner};
          b.param_strides = {1};
          b.hf_offset = h0 * inner;
          b.hf_strides = {1};
        } else {
          // ucp (r, c) is HF (c, r): rows of the parameter, columns of the HF tensor. The HF
          // stride is filled in once the tensor's out extent is known.
          b.counts = {sizes[k], inner};
          b.param_strides = {inner, 1};
          b.hf_offset = h0;
          b.hf_strides = {1, -1};
        }
        if (NumElementsOrDie(Shape(b.counts.begin(), b.counts.end())) > 0) {
          out.blocks.push_back(std::move(b));
        }
      }
      part_row += sizes[k];
    }
    return Status::Ok();
  };

  // Consecutive {layer} entries repeat per layer, and within them consecutive {expert} entries
  // per expert (HF's state-dict order: layer by layer, expert by expert).
  const int64_t num_experts = hyper.contains("num_experts") ? hyper.at("num_experts") : 0;
  for (size_t i = 0; i < map.tensors.size();) {
    if (!HasLayer(map.tensors[i].param)) {
      if (HasExpert(map.tensors[i].param)) {
        return InvalidArgumentError(map.file + ": parameter \"" + map.tensors[i].param +
                                    "\" has {expert} without {layer}");
      }
      UCP_RETURN_IF_ERROR(add_entry(map.tensors[i], -1, -1));
      ++i;
      continue;
    }
    size_t j = i;
    while (j < map.tensors.size() && HasLayer(map.tensors[j].param)) ++j;
    for (int64_t l = 0; l < model.num_layers; ++l) {
      for (size_t k = i; k < j;) {
        if (!HasExpert(map.tensors[k].param)) {
          UCP_RETURN_IF_ERROR(add_entry(map.tensors[k], l, -1));
          ++k;
          continue;
        }
        size_t m = k;
        while (m < j && HasExpert(map.tensors[m].param)) ++m;
        for (int64_t x = 0; x < num_experts; ++x) {
          for (size_t q = k; q < m; ++q) UCP_RETURN_IF_ERROR(add_entry(map.tensors[q], l, x));
        }
        k = m;
      }
    }
    i = j;
  }
  // An interleaved-rotary model whose map permutes nothing would be written as if half-split.
  if (auto r = hyper.find(std::string(patterns::kRotaryInterleavedHyper));
      r != hyper.end() && r->second != 0 && !permuted_rotary) {
    return FailedPreconditionError("model " + model.spec.name + " (family " + model.spec.family +
                                   ") records interleaved rotary pairs, but " + map.file +
                                   " has no rotary q/k rows to permute");
  }
  for (const auto& p : model.params) {
    if (!mapped.contains(p.name)) {
      return InvalidArgumentError(map.file + ": parameter \"" + p.name + "\" of model " +
                                  model.spec.name + " has no " + map.architecture + " tensor");
    }
  }
  for (size_t t = 0; t < extents.size(); ++t) {
    Extent& x = extents[t];
    std::sort(x.rows.begin(), x.rows.end());
    int64_t next = 0;
    for (const auto& [begin, size] : x.rows) {
      if (begin != next) {
        return InvalidArgumentError(map.file + ": HF tensor " + out.tensors[t].name + " rows [" +
                                    std::to_string(next) + ", " + std::to_string(begin) + ") are " +
                                    (begin > next ? "given by no part" : "given twice"));
      }
      next = begin + size;
    }
    Shape shape;
    if (x.transpose) {
      shape = {x.rest[0], x.out};
    } else {
      shape.push_back(x.out);
      shape.insert(shape.end(), x.rest.begin(), x.rest.end());
    }
    out.tensors[t].shape = shape;
  }
  for (HfBlock& b : out.blocks) {
    if (b.hf_strides.size() == 2 && b.hf_strides[1] == -1) {
      b.hf_strides = {1, out.tensors[b.tensor].shape[1]};
    }
  }
  return out;
}

std::vector<int> SplitShards(const std::vector<int64_t>& tensor_bytes, int64_t max_shard_bytes) {
  // Shards as lists of tensor indices, in the order huggingface_hub appends them.
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  int64_t current_bytes = 0;
  for (size_t i = 0; i < tensor_bytes.size(); ++i) {
    const int64_t b = tensor_bytes[i];
    if (b > max_shard_bytes) {
      shards.push_back({i});
      continue;
    }
    if (current_bytes + b > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += b;
  }
  if (!current.empty()) shards.push_back(std::move(current));
  std::vector<int> out(tensor_bytes.size(), 0);
  for (size_t s = 0; s < shards.size(); ++s) {
    for (size_t i : shards[s]) out[i] = static_cast<int>(s);
  }
  return out;
}

Result<int64_t> ParseShardSize(std::string_view text) {
  static const std::pair<std::string_view, int64_t> kUnits[] = {
      {"TB", 1'000'000'000'000}, {"GB", 1'000'000'000}, {"MB", 1'000'000}, {"KB", 1'000}};
  int64_t unit = 1;
  std::string_view digits = text;
  for (const auto& [suffix, scale] : kUnits) {
    if (digits.size() > suffix.size() && digits.substr(digits.size() - suffix.size()) == suffix) {
      unit = scale;
      digits.remove_suffix(suffix.size());
      break;
    }
  }
  const std::string err =
      "--max-shard-size must be N, NKB, NMB, NGB or NTB (decimal units, as "
      "transformers), got \"" +
      std::string(text) + "\"";
  if (digits.empty() || digits.size() > 15) return InvalidArgumentError(err);
  int64_t n = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return InvalidArgumentError(err);
    n = n * 10 + (c - '0');
  }
  if (n <= 0 || n > INT64_MAX / unit) return InvalidArgumentError(err);
  return n * unit;
}

std::string ShardFileName(int index, int count) {
  if (count == 1) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", index + 1, count);
  return buf;
}

}  // namespace ucp::hf
