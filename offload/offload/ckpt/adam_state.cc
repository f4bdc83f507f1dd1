// SaveAdamCheckpoint / LoadAdamCheckpoint over UniversalWriter / UniversalReader.
#include "offload/ckpt/adam_state.h"

#include <cstddef>
#include <utility>
#include <vector>

#include "ucp/base/status_macros.h"
#include "ucp/io/universal/universal_checkpoint.h"

namespace ucp::offload {
namespace {

constexpr const char* kMaster = "fp32";
constexpr const char* kFramework = "ucp-offload";

// The states of a parameter, in file order, with their spans.
std::vector<std::pair<std::string, std::span<float>>> States(const AdamParamState& p,
                                                             bool amsgrad) {
  std::vector<std::pair<std::string, std::span<float>>> out = {
      {kMaster, p.param}, {"exp_avg", p.exp_avg}, {"exp_avg_sq", p.exp_avg_sq}};
  if (amsgrad) out.emplace_back("max_exp_avg_sq", p.max_exp_avg_sq);
  return out;
}

Status CheckSizes(const AdamParamState& p, bool amsgrad) {
  UCP_ASSIGN_OR_RETURN(const int64_t n, NumElements(p.shape), "parameter '" + p.name + "'");
  for (const auto& [state, span] : States(p, amsgrad)) {
    if (static_cast<int64_t>(span.size()) != n) {
      return InvalidArgumentError("adam checkpoint: parameter '" + p.name + "' state '" + state +
                                  "' has " + std::to_string(span.size()) +
                                  " elements, its shape has " + std::to_string(n));
    }
  }
  return Status::Ok();
}

Result<double> Hyper(const io::UniversalManifest& m, const std::string& key) {
  auto it = m.hyper.find(key);
  if (it == m.hyper.end()) {
    return DataLossError("adam checkpoint: manifest optimizer.hyper has no '" + key + "'");
  }
  return it->second;
}

Result<bool> Flag(const io::UniversalManifest& m, const std::string& key, bool absent) {
  auto it = m.hyper.find(key);
  if (it == m.hyper.end()) return absent;
  if (it->second != 0.0 && it->second != 1.0) {
    return DataLossError("adam checkpoint: manifest optimizer.hyper '" + key + "' is " +
                         std::to_string(it->second) + ", must be 0 or 1");
  }
  return it->second == 1.0;
}

Result<AdamCheckpointInfo> InfoOf(const io::UniversalManifest& m) {
  AdamCheckpointInfo info;
  if (m.optimizer_kind != "adam" && m.optimizer_kind != "adamw") {
    return FailedPreconditionError("adam checkpoint: optimizer kind is '" + m.optimizer_kind +
                                   "', want adam or adamw");
  }
  AdamConfig& c = info.config;
  c.decoupled = m.optimizer_kind == "adamw";
  UCP_ASSIGN_OR_RETURN(const double lr, Hyper(m, "lr"));
  UCP_ASSIGN_OR_RETURN(const double beta1, Hyper(m, "beta1"));
  UCP_ASSIGN_OR_RETURN(const double beta2, Hyper(m, "beta2"));
  UCP_ASSIGN_OR_RETURN(const double eps, Hyper(m, "eps"));
  UCP_ASSIGN_OR_RETURN(const double wd, Hyper(m, "weight_decay"));
  c.lr = static_cast<decltype(c.lr)>(lr);
  c.beta1 = static_cast<decltype(c.beta1)>(beta1);
  c.beta2 = static_cast<decltype(c.beta2)>(beta2);
  c.eps = static_cast<decltype(c.eps)>(eps);
  c.weight_decay = static_cast<decltype(c.weight_decay)>(wd);
  UCP_ASSIGN_OR_RETURN(c.amsgrad, Flag(m, "amsgrad", false));
  UCP_ASSIGN_OR_RETURN(c.bias_correction, Flag(m, "bias_correction", true));
  UCP_RETURN_IF_ERROR(ValidateAdamConfig(c), "checkpoint hyper-parameters");
  info.step = m.step;
  return info;
}

std::span<std::byte> Bytes(std::span<float> s) {
  return {reinterpret_cast<std::byte*>(s.data()), s.size_bytes()};
}

}  // namespace

Status SaveAdamCheckpoint(const std::filesystem::path& dst, const AdamConfig& config,
                          int64_t step, std::span<const AdamParamState> params) {
  UCP_RETURN_IF_ERROR(ValidateAdamConfig(config));
  if (step < 0) {
    return InvalidArgumentError("adam checkpoint: step is " + std::to_string(step) +
                                ", must be >= 0");
  }
  for (const AdamParamState& p : params) UCP_RETURN_IF_ERROR(CheckSizes(p, config.amsgrad));
  UCP_ASSIGN_OR_RETURN(io::UniversalWriter w, io::UniversalWriter::Create(dst, {.step = step}));
  for (const AdamParamState& p : params) {
    std::vector<io::NamedState> states;
    for (const auto& [name, span] : States(p, config.amsgrad)) {
      states.emplace_back(name, ConstTensorView{DType::kFp32, p.shape, Bytes(span)});
    }
    UCP_RETURN_IF_ERROR(w.WriteParameter({.name = p.name, .shape = p.shape}, states));
  }
  io::UniversalManifest h;
  h.step = step;
  h.optimizer_kind = config.decoupled ? "adamw" : "adam";
  h.hyper = {{"lr", config.lr},
             {"beta1", config.beta1},
             {"beta2", config.beta2},
             {"eps", config.eps},
             {"weight_decay", config.weight_decay},
             {"amsgrad", config.amsgrad ? 1.0 : 0.0},
             {"bias_correction", config.bias_correction ? 1.0 : 0.0}};
  h.optimizer_states = {"exp_avg", "exp_avg_sq"};
  if (config.amsgrad) h.optimizer_states.push_back("max_exp_avg_sq");
  h.source_framework = kFramework;
  return w.Commit(h);
}

Result<AdamCheckpointInfo> ReadAdamCheckpointInfo(const std::filesystem::path& src) {
  UCP_ASSIGN_OR_RETURN(io::UniversalReader r, io::UniversalReader::Open(src));
  return InfoOf(r.manifest());
}

Result<AdamCheckpointInfo> LoadAdamCheckpoint(const std::filesystem::path& src,
                                              std::span<const AdamParamState> params) {
  UCP_ASSIGN_OR_RETURN(io::UniversalReader r, io::UniversalReader::Open(src));
  UCP_ASSIGN_OR_RETURN(AdamCheckpointInfo info, InfoOf(r.manifest()));
  for (const AdamParamState& p : params) {
    UCP_RETURN_IF_ERROR(CheckSizes(p, info.config.amsgrad));
    UCP_ASSIGN_OR_RETURN(const io::UniversalParamInfo* meta, r.FindParam(p.name));
    if (meta->shape != p.shape) {
      return FailedPreconditionError("adam checkpoint: parameter '" + p.name + "' has shape " +
                                     ShapeToString(meta->shape) + " in " + src.string() +
                                     ", the caller's is " + ShapeToString(p.shape));
    }
    for (const auto& [name, span] : States(p, info.config.amsgrad)) {
      UCP_RETURN_IF_ERROR(
          r.ReadStateInto(p.name, name, TensorView{DType::kFp32, p.shape, Bytes(span)}));
    }
  }
  return info;
}

}  // namespace ucp::offload
