// ucp_layout.json over ucp/json: a strict walk of the parsed document.
#include "ucp/dist/dist_manifest.h"

#include <cmath>
#include <cstdio>
#include <set>
#include <utility>

#include "ucp/base/status_macros.h"
#include "ucp/io/checksum.h"
#include "ucp/json/strict_json.h"

namespace ucp::dist {
namespace {

using json = ucp::json::Json;

// As the universal manifest (docs/format.md): deep enough for carried client state.
constexpr int kMaxDepth = 64;

Result<json> ParseStrict(std::string_view text, const std::string& file) {
  return ucp::json::ParseStrict(text, file, StatusCode::kDataLoss, kMaxDepth);
}

bool IsRuleSetName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

// A JSON object whose keys must be exactly `allowed`, plus any of `optional`.
Status CheckKeys(const json& j, const std::string& file, const std::string& path,
                 const std::set<std::string>& allowed, const std::set<std::string>& optional = {}) {
  if (!j.is_object()) return DataLossError(file + ": " + path + ": expected an object");
  for (const auto& [k, v] : j.items()) {
    if (!allowed.count(k) && !optional.count(k)) {
      return DataLossError(file + ": " + path + ": unknown key \"" + k + "\"");
    }
  }
  for (const auto& k : allowed) {
    if (!j.contains(k)) return DataLossError(file + ": " + path + ": missing key \"" + k + "\"");
  }
  return Status::Ok();
}

Result<std::string> GetString(const json& j, const std::string& key, const std::string& file,
                              const std::string& path) {
  const json& v = j.at(key);
  if (!v.is_string()) return DataLossError(file + ": " + path + "." + key + ": expected a string");
  return v.get<std::string>();
}

Result<int64_t> GetInt(const json& j, const std::string& key, const std::string& file,
                       const std::string& path) {
  const json& v = j.at(key);
  if (!v.is_number_integer()) {
    return DataLossError(file + ": " + path + "." + key + ": expected an integer");
  }
  return v.get<int64_t>();
}

Result<DType> GetDType(const json& j, const std::string& key, const std::string& file,
                       const std::string& path) {
  UCP_ASSIGN_OR_RETURN(std::string name, GetString(j, key, file, path));
  Result<DType> d = DTypeFromName(name);
  if (!d.ok()) {
    return DataLossError(file + ": " + path + "." + key + ": unknown dtype \"" + name + "\"");
  }
  return *d;
}

Result<Shape> GetShape(const json& j, const std::string& key, const std::string& file,
                       const std::string& path) {
  const json& v = j.at(key);
  const std::string where = file + ": " + path + "." + key;
  if (!v.is_array() || v.size() > 32) return DataLossError(where + ": expected an array of dims");
  Shape s;
  for (const json& d : v) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) {
      return DataLossError(where + ": dims must be integers >= 0");
    }
    s.push_back(d.get<int64_t>());
  }
  Result<int64_t> n = NumElements(s, where);
  if (!n.ok()) return DataLossError(where + ": element count overflows int64");
  return s;
}

json ShapeJson(const Shape& s) {
  json a = json::array();
  for (int64_t d : s) a.push_back(d);
  return a;
}

Result<DistManifest> ParseImpl(const json& j, const std::string& file) {
  UCP_RETURN_IF_ERROR(
      CheckKeys(j, file, "$",
                {"format", "version", "model", "layout", "step", "optimizer", "params", "ranks"},
                {"client_state"}));
  UCP_ASSIGN_OR_RETURN(std::string format, GetString(j, "format", file, "$"));
  if (format != kDistFormatName) {
    return DataLossError(file + ": $.format: expected \"ucp-distributed\", found \"" + format +
                         "\"");
  }
  UCP_ASSIGN_OR_RETURN(int64_t version, GetInt(j, "version", file, "$"));
  if (version != kDistFormatVersion) {
    return UnimplementedError(file + ": $.version: format version " + std::to_string(version) +
                              " is not supported (this build reads version 1)");
  }
  DistManifest m;
  if (j.contains("client_state")) {
    const json& cs = j.at("client_state");
    if (!cs.is_object()) return DataLossError(file + ": $.client_state: expected an object");
    if (cs.contains("ucp_model")) {
      return DataLossError(file + ": $.client_state.ucp_model: not allowed (the model is $.model)");
    }
    m.client_state_json = cs.dump();
  }
  const json& model = j.at("model");
  UCP_RETURN_IF_ERROR(CheckKeys(model, file, "$.model", {"name", "family", "dtype", "hyper"}));
  UCP_ASSIGN_OR_RETURN(m.model.name, GetString(model, "name", file, "$.model"));
  UCP_ASSIGN_OR_RETURN(m.model.family, GetString(model, "family", file, "$.model"));
  // The family becomes a rule-file name (patterns::LoadRuleSet): a name, never a path. The same
  // rule as patterns::ValidateRuleSetName, checked here so the error is data_loss on this file.
  if (!IsRuleSetName(m.model.family)) {
    return DataLossError(file + ": $.model.family: not a rule-set name (1 to 64 bytes of " +
                         "[A-Za-z0-9_-]; a name read from a file is never a path)");
  }
  UCP_ASSIGN_OR_RETURN(m.model.dtype, GetDType(model, "dtype", file, "$.model"));
  if (!model.at("hyper").is_object()) {
    return DataLossError(file + ": $.model.hyper: expected an object");
  }
  for (const auto& [k, v] : model.at("hyper").items()) {
    if (!v.is_number_integer()) {
      return DataLossError(file + ": $.model.hyper." + k + ": expected an integer");
    }
    m.model.hyper[k] = v.get<int64_t>();
  }
  UCP_ASSIGN_OR_RETURN(m.layout, GetString(j, "layout", file, "$"));
  UCP_ASSIGN_OR_RETURN(m.step, GetInt(j, "step", file, "$"));
  if (m.step < 0) return DataLossError(file + ": $.step: must be >= 0");
  const json& opt = j.at("optimizer");
  UCP_RETURN_IF_ERROR(CheckKeys(opt, file, "$.optimizer", {"kind", "hyper", "states"}));
  UCP_ASSIGN_OR_RETURN(m.optimizer_kind, GetString(opt, "kind", file, "$.optimizer"));
  if (!opt.at("hyper").is_object()) {
    return DataLossError(file + ": $.optimizer.hyper: expected an object");
  }
  for (const auto& [k, v] : opt.at("hyper").items()) {
    if (!v.is_number()) {
      return DataLossError(file + ": $.optimizer.hyper." + k + ": expected a number");
    }
    m.optimizer_hyper[k] = v.get<double>();
  }
  if (!opt.at("states").is_array()) {
    return DataLossError(file + ": $.optimizer.states: expected an array");
  }
  for (const json& s : opt.at("states")) {
    if (!s.is_string()) return DataLossError(file + ": $.optimizer.states: expected strings");
    m.optimizer_states.push_back(s.get<std::string>());
  }
  if (!j.at("params").is_array()) return DataLossError(file + ": $.params: expected an array");
  std::set<std::string> names;
  for (size_t i = 0; i < j.at("params").size(); ++i) {
    const json& p = j.at("params")[i];
    const std::string path = "$.params[" + std::to_string(i) + "]";
    UCP_RETURN_IF_ERROR(CheckKeys(p, file, path, {"name", "shape", "dtype"}));
    DistParam dp;
    UCP_ASSIGN_OR_RETURN(dp.name, GetString(p, "name", file, path));
    UCP_ASSIGN_OR_RETURN(dp.shape, GetShape(p, "shape", file, path));
    UCP_ASSIGN_OR_RETURN(dp.dtype, GetDType(p, "dtype", file, path));
    if (!names.insert(dp.name).second) {
      return DataLossError(file + ": " + path + ".name: duplicate parameter \"" + dp.name + "\"");
    }
    m.params.push_back(std::move(dp));
  }
  if (!j.at("ranks").is_array()) return DataLossError(file + ": $.ranks: expected an array");
  for (size_t i = 0; i < j.at("ranks").size(); ++i) {
    const json& r = j.at("ranks")[i];
    const std::string path = "$.ranks[" + std::to_string(i) + "]";
    UCP_RETURN_IF_ERROR(CheckKeys(r, file, path, {"rank", "file", "tensors"}));
    DistRankFile rf;
    UCP_ASSIGN_OR_RETURN(rf.rank, GetInt(r, "rank", file, path));
    if (rf.rank != static_cast<int64_t>(i)) {
      return DataLossError(file + ": " + path + ".rank: expected " + std::to_string(i) +
                           ", found " + std::to_string(rf.rank));
    }
    UCP_ASSIGN_OR_RETURN(rf.file, GetString(r, "file", file, path));
    if (rf.file != RankFileName(rf.rank)) {
      return DataLossError(file + ": " + path + ".file: expected \"" + RankFileName(rf.rank) +
                           "\", found \"" + rf.file + "\"");
    }
    if (!r.at("tensors").is_array()) {
      return DataLossError(file + ": " + path + ".tensors: expected an array");
    }
    std::set<std::string> tnames;
    for (size_t t = 0; t < r.at("tensors").size(); ++t) {
      const json& tj = r.at("tensors")[t];
      const std::string tpath = path + ".tensors[" + std::to_string(t) + "]";
      UCP_RETURN_IF_ERROR(CheckKeys(tj, file, tpath, {"name", "dtype", "shape", "checksum"}));
      DistTensor dt;
      UCP_ASSIGN_OR_RETURN(dt.name, GetString(tj, "name", file, tpath));
      UCP_ASSIGN_OR_RETURN(dt.dtype, GetDType(tj, "dtype", file, tpath));
      UCP_ASSIGN_OR_RETURN(dt.shape, GetShape(tj, "shape", file, tpath));
      UCP_ASSIGN_OR_RETURN(dt.checksum, GetString(tj, "checksum", file, tpath));
      UCP_RETURN_IF_ERROR(io::ParseXxh3(dt.checksum, file + ": " + tpath + ".checksum").status());
      if (!tnames.insert(dt.name).second) {
        return DataLossError(file + ": " + tpath + ".name: duplicate tensor \"" + dt.name + "\"");
      }
      rf.tensors.push_back(std::move(dt));
    }
    m.ranks.push_back(std::move(rf));
  }
  return m;
}

}  // namespace

std::string RankFileName(int64_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05lld.h5", static_cast<long long>(rank));
  return buf;
}

Result<std::string> SerializeDistManifest(const DistManifest& m) {
  json j;
  j["format"] = kDistFormatName;
  j["version"] = kDistFormatVersion;
  json hyper = json::object();
  for (const auto& [k, v] : m.model.hyper) hyper[k] = v;
  j["model"] = {{"name", m.model.name},
                {"family", m.model.family},
                {"dtype", std::string(DTypeName(m.model.dtype))},
                {"hyper", hyper}};
  j["layout"] = m.layout;
  j["step"] = m.step;
  json oh = json::object();
  for (const auto& [k, v] : m.optimizer_hyper) {
    if (!std::isfinite(v)) {
      return InvalidArgumentError("optimizer hyper-parameter \"" + k + "\" is not finite");
    }
    oh[k] = v;
  }
  j["optimizer"] = {{"kind", m.optimizer_kind}, {"hyper", oh}, {"states", m.optimizer_states}};
  json params = json::array();
  for (const DistParam& p : m.params) {
    params.push_back({{"name", p.name},
                      {"shape", ShapeJson(p.shape)},
                      {"dtype", std::string(DTypeName(p.dtype))}});
  }
  j["params"] = std::move(params);
  json ranks = json::array();
  for (const DistRankFile& r : m.ranks) {
    json tensors = json::array();
    for (const DistTensor& t : r.tensors) {
      tensors.push_back({{"name", t.name},
                         {"dtype", std::string(DTypeName(t.dtype))},
                         {"shape", ShapeJson(t.shape)},
                         {"checksum", t.checksum}});
    }
    ranks.push_back({{"rank", r.rank}, {"file", r.file}, {"tensors", std::move(tensors)}});
  }
  j["ranks"] = std::move(ranks);
  if (!m.client_state_json.empty()) {
    UCP_ASSIGN_OR_RETURN(json cs, ucp::json::ParseStrict(m.client_state_json, "client state",
                                                         StatusCode::kInvalidArgument, kMaxDepth));
    if (!cs.is_object()) return InvalidArgumentError("client state is not a JSON object");
    cs.erase("ucp_model");
    if (!cs.empty()) j["client_state"] = std::move(cs);
  }
  return j.dump(2) + "\n";
}

Result<DistManifest> ParseDistManifest(std::string_view text, const std::string& file) {
  UCP_ASSIGN_OR_RETURN(json j, ParseStrict(text, file));
  try {
    return ParseImpl(j, file);
  } catch (const json::exception& e) {
    return DataLossError(file + ": invalid manifest: " + e.what());
  }
}

}  // namespace ucp::dist
