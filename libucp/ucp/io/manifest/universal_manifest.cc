// The universal manifest over ucp/json: a strict walk of the parsed document.
#include "ucp/io/manifest/universal_manifest.h"

#include <cmath>
#include <set>
#include <utility>

#include "ucp/base/status_macros.h"
#include "ucp/io/checksum.h"
#include "ucp/io/safe_name.h"
#include "ucp/json/strict_json.h"

namespace ucp::io {
namespace {

using json = ucp::json::Json;

// The strict walk: each accessor names the file and the JSON path in its errors.
class Walker {
 public:
  explicit Walker(const std::string& file) : file_(file) {}

  Status Err(const std::string& path, const std::string& msg) const {
    return DataLossError(file_ + ": " + msg + " at " + (path.empty() ? "/" : path));
  }

  // Checks that `j` is an object holding all `required` keys, any of `optional`, and nothing else.
  Status Keys(const json& j, const std::string& path,
              std::initializer_list<std::string_view> required,
              std::initializer_list<std::string_view> optional = {}) const {
    if (!j.is_object()) return Err(path, "expected an object, found " + std::string(j.type_name()));
    for (auto& [k, v] : j.items()) {
      (void)v;
      bool known = false;
      for (auto r : required) known |= (k == r);
      for (auto o : optional) known |= (k == o);
      if (!known) return Err(path, "unknown key '" + k + "'");
    }
    for (auto r : required) {
      if (!j.contains(std::string(r))) return Err(path, "missing key '" + std::string(r) + "'");
    }
    return Status::Ok();
  }

  Result<std::string> Str(const json& j, const std::string& path, std::string_view key) const {
    const json& v = j.at(std::string(key));
    if (!v.is_string())
      return Err(path + "/" + std::string(key),
                 "expected a string, found " + std::string(v.type_name()));
    return v.get<std::string>();
  }
  Result<int64_t> Int(const json& j, const std::string& path, std::string_view key) const {
    const json& v = j.at(std::string(key));
    if (!v.is_number_integer())
      return Err(path + "/" + std::string(key),
                 "expected an integer, found " + std::string(v.type_name()));
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Err(path + "/" + std::string(key), "integer does not fit in int64");
    }
    return v.get<int64_t>();
  }
  Result<DType> Dt(const json& j, const std::string& path, std::string_view key) const {
    UCP_ASSIGN_OR_RETURN(std::string s, Str(j, path, key));
    auto d = DTypeFromName(s);
    // Only canonical names: aliases accepted on command lines are not part of the format.
    if (!d.ok() || DTypeName(*d) != s)
      return Err(path + "/" + std::string(key), "unknown dtype '" + s + "'");
    return *d;
  }

 private:
  const std::string& file_;
};

Result<UniversalParamInfo> ParseParam(const Walker& w, const json& j, const std::string& path) {
  UniversalParamInfo p;
  UCP_RETURN_IF_ERROR(w.Keys(j, path, {"name", "shape", "dtype", "pattern", "states", "file"}));
  UCP_ASSIGN_OR_RETURN(p.name, w.Str(j, path, "name"));
  if (p.name.empty()) return w.Err(path + "/name", "parameter name is empty");
  const std::string where = path + " (parameter '" + p.name + "')";
  const json& shape = j.at("shape");
  if (!shape.is_array()) return w.Err(where + "/shape", "expected an array of dims");
  for (size_t i = 0; i < shape.size(); ++i) {
    const json& d = shape[i];
    if (!d.is_number_integer() || d.get<int64_t>() < 0 ||
        (d.is_number_unsigned() && d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
      return w.Err(where + "/shape/" + std::to_string(i), "dim is not an integer >= 0");
    }
    p.shape.push_back(d.get<int64_t>());
  }
  if (!NumElements(p.shape).ok()) {
    return w.Err(where + "/shape", "shape " + ShapeToString(p.shape) + " overflows int64 elements");
  }
  UCP_ASSIGN_OR_RETURN(p.dtype, w.Dt(j, where, "dtype"));
  if (!j.at("pattern").is_object()) return w.Err(where + "/pattern", "expected an object");
  p.pattern_json = j.at("pattern").dump();
  UCP_ASSIGN_OR_RETURN(p.file, w.Str(j, where, "file"));
  {
    Status st = ValidateRelativePath(p.file, "field file");
    if (!st.ok()) return w.Err(where + "/file", st.message());
  }
  const json& states = j.at("states");
  if (!states.is_array() || states.empty()) {
    return w.Err(where + "/states", "expected a non-empty array of states");
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < states.size(); ++i) {
    const std::string sp = where + "/states/" + std::to_string(i);
    const json& s = states[i];
    UniversalStateInfo st;
    UCP_RETURN_IF_ERROR(w.Keys(s, sp, {"name", "dtype", "checksum"}));
    UCP_ASSIGN_OR_RETURN(st.name, w.Str(s, sp, "name"));
    if (st.name.empty()) return w.Err(sp + "/name", "state name is empty");
    if (!seen.insert(st.name).second)
      return w.Err(sp + "/name", "duplicate state '" + st.name + "'");
    UCP_ASSIGN_OR_RETURN(st.dtype, w.Dt(s, sp, "dtype"));
    UCP_ASSIGN_OR_RETURN(st.checksum, w.Str(s, sp, "checksum"));
    {
      auto c = ParseXxh3(st.checksum, "checksum");
      if (!c.ok()) return w.Err(sp + "/checksum", c.status().message());
    }
    p.states.push_back(std::move(st));
  }
  return p;
}

}  // namespace

Status ValidateJsonObject(std::string_view text, const std::string& what) {
  UCP_ASSIGN_OR_RETURN(json j, ucp::json::ParseStrict(text, what, StatusCode::kInvalidArgument));
  if (!j.is_object())
    return InvalidArgumentError(what + " is a json " + std::string(j.type_name()) +
                                ", not an object");
  return Status::Ok();
}

Result<std::string> SerializeUniversalManifest(const UniversalManifest& m) {
  json j = json::object();
  j["format"] = kUniversalFormatName;
  j["version"] = kUniversalFormatVersion;
  j["step"] = m.step;
  json hyper = json::object();
  for (const auto& [k, v] : m.hyper) {
    if (!std::isfinite(v)) {
      return InvalidArgumentError("optimizer hyper-parameter '" + k + "' is not finite");
    }
    hyper[k] = v;
  }
  j["optimizer"] = {{"kind", m.optimizer_kind}, {"hyper", hyper}, {"states", m.optimizer_states}};
  j["source"] = {
      {"layout", m.source_layout}, {"model", m.source_model}, {"framework", m.source_framework}};
  if (!m.source_qkv_layout.empty()) {
    if (m.source_qkv_layout != "per-group" && m.source_qkv_layout != "per-rank-blocks") {
      return InvalidArgumentError("source_qkv_layout is '" + m.source_qkv_layout +
                                  "', not per-group or per-rank-blocks");
    }
    j["source"]["qkv_layout"] = m.source_qkv_layout;
  }
  if (!m.client_state_json.empty()) {
    UCP_RETURN_IF_ERROR(ValidateJsonObject(m.client_state_json, "client_state_json"));
    j["client_state"] = json::parse(m.client_state_json);
  }
  json params = json::array();
  for (const auto& p : m.params) {
    UCP_RETURN_IF_ERROR(
        ValidateJsonObject(p.pattern_json, "pattern_json of parameter '" + p.name + "'"));
    for (int64_t d : p.shape) {
      if (d < 0) return InvalidArgumentError("parameter '" + p.name + "' has a negative dim");
    }
    json states = json::array();
    for (const auto& s : p.states) {
      states.push_back({{"name", s.name}, {"dtype", DTypeName(s.dtype)}, {"checksum", s.checksum}});
    }
    params.push_back({{"name", p.name},
                      {"shape", p.shape},
                      {"dtype", DTypeName(p.dtype)},
                      {"pattern", json::parse(p.pattern_json)},
                      {"states", std::move(states)},
                      {"file", p.file}});
  }
  j["params"] = std::move(params);
  return j.dump(2) + "\n";
}

Result<UniversalManifest> ParseUniversalManifest(std::string_view text, const std::string& file) {
  UCP_ASSIGN_OR_RETURN(json j, ucp::json::ParseStrict(text, file, StatusCode::kDataLoss));
  Walker w(file);
  UniversalManifest m;
  // Format and version first, so a future version gets kUnimplemented, not a key complaint.
  if (!j.is_object()) return w.Err("", "expected an object, found " + std::string(j.type_name()));
  if (!j.contains("format")) return w.Err("", "missing key 'format'");
  UCP_ASSIGN_OR_RETURN(std::string format, w.Str(j, "", "format"));
  if (format != kUniversalFormatName) {
    return w.Err("/format", "format is '" + format + "', expected '" +
                                std::string(kUniversalFormatName) + "'");
  }
  if (!j.contains("version")) return w.Err("", "missing key 'version'");
  UCP_ASSIGN_OR_RETURN(int64_t version, w.Int(j, "", "version"));
  if (version != kUniversalFormatVersion) {
    return UnimplementedError(file + ": format version " + std::to_string(version) +
                              " is not supported; this ucp reads version " +
                              std::to_string(kUniversalFormatVersion));
  }
  UCP_RETURN_IF_ERROR(w.Keys(j, "", {"format", "version", "step", "optimizer", "source", "params"},
                             {"client_state"}));
  UCP_ASSIGN_OR_RETURN(m.step, w.Int(j, "", "step"));
  const json& opt = j.at("optimizer");
  UCP_RETURN_IF_ERROR(w.Keys(opt, "/optimizer", {"kind", "hyper", "states"}));
  UCP_ASSIGN_OR_RETURN(m.optimizer_kind, w.Str(opt, "/optimizer", "kind"));
  const json& hyper = opt.at("hyper");
  if (!hyper.is_object()) return w.Err("/optimizer/hyper", "expected an object of numbers");
  for (auto& [k, v] : hyper.items()) {
    if (!v.is_number()) return w.Err("/optimizer/hyper/" + k, "expected a number");
    m.hyper[k] = v.get<double>();
  }
  const json& ostates = opt.at("states");
  if (!ostates.is_array()) return w.Err("/optimizer/states", "expected an array of names");
  for (size_t i = 0; i < ostates.size(); ++i) {
    if (!ostates[i].is_string())
      return w.Err("/optimizer/states/" + std::to_string(i), "expected a string");
    m.optimizer_states.push_back(ostates[i].get<std::string>());
  }
  const json& src = j.at("source");
  UCP_RETURN_IF_ERROR(w.Keys(src, "/source", {"layout", "model", "framework"}, {"qkv_layout"}));
  UCP_ASSIGN_OR_RETURN(m.source_layout, w.Str(src, "/source", "layout"));
  UCP_ASSIGN_OR_RETURN(m.source_model, w.Str(src, "/source", "model"));
  UCP_ASSIGN_OR_RETURN(m.source_framework, w.Str(src, "/source", "framework"));
  if (src.contains("qkv_layout")) {
    UCP_ASSIGN_OR_RETURN(m.source_qkv_layout, w.Str(src, "/source", "qkv_layout"));
    if (m.source_qkv_layout != "per-group" && m.source_qkv_layout != "per-rank-blocks") {
      return w.Err("/source/qkv_layout", "'" + m.source_qkv_layout +
                                             "' is not per-group or per-rank-blocks");
    }
  }
  if (j.contains("client_state")) {
    if (!j.at("client_state").is_object()) return w.Err("/client_state", "expected an object");
    m.client_state_json = j.at("client_state").dump();
  }
  const json& params = j.at("params");
  if (!params.is_array()) return w.Err("/params", "expected an array");
  std::set<std::string> names, files;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string path = "/params/" + std::to_string(i);
    UCP_ASSIGN_OR_RETURN(UniversalParamInfo p, ParseParam(w, params[i], path));
    if (!names.insert(p.name).second)
      return w.Err(path + "/name", "duplicate parameter '" + p.name + "'");
    if (!files.insert(p.file).second) {
      return w.Err(path + "/file",
                   "parameter '" + p.name + "' shares file '" + p.file + "' with another");
    }
    m.params.push_back(std::move(p));
  }
  return m;
}

}  // namespace ucp::io
