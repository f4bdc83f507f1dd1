// offload_model_dump: one ForwardBackward of the engine's model (offload/offload/model/model.h)
// on weights restored from a ucp checkpoint, written out for the PyTorch parity test
// (tests/engine/parity_test.py compares it against torch_ref.py).
//
//   offload_model_dump --ckpt DIR [--state fp32|model] | --model PRESET_OR_JSON --weights FILE
//                      [--weights FILE] --tokens FILE --batch B --seq-len T --out DIR
//                      [--threads N] [--ref]
//
// --ckpt restores rank 0 of tp=1,pp=1,dp=1 from any checkpoint ucp reads: the ZeRO-0 optimizer
// slices `pp0.tp0/optim/<name>/fp32` (the master weights, default) or the model slices
// `pp0.tp0/model/<name>` (--state model, widened to fp32), each a ParamInfo by its plan name.
// --weights replaces the weights with a flat float32 file in params() order (the test's
// well-conditioned variant). --tokens holds int32 little-endian inputs [B, T] then targets [B, T].
//
// Writes to --out: weights.f32 and grads.f32 (flat float32, params() order) and index.json
// {loss_sum, forward_loss_sum, num_targets, grad_scale, config, params [{name, shape, offset,
// numel}], deterministic, accumulate_rel}. The gradients are those of grad_scale * loss_sum with
// grad_scale = 1 / (number of targets >= 0). deterministic: a second call into a zeroed buffer
// gave the same bits and loss; accumulate_rel: ||g after a call into a buffer holding g - 2g|| /
// ||2g|| (the += contract). --ref also runs the
// double-precision oracle (model_ref.h) on the same weights: grads_ref.f64 and ref_loss_sum.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "offload/model/model.h"
#include "offload/model/model_ref.h"
#include "ucp/api/checkpoint.h"
#include "ucp/api/trainer.h"
#include "ucp/base/status_macros.h"
#include "ucp/layout/layout.h"
#include "ucp/tensor/cast.h"
#include "ucp/tensor/tensor.h"

namespace {

namespace fs = std::filesystem;
using ucp::Result;
using ucp::Status;

struct Args {
  std::string ckpt;
  std::string model;
  std::string state = "fp32";
  std::string weights;
  std::string tokens;
  std::string out;
  int64_t batch = 0;
  int64_t seq_len = 0;
  int threads = 1;
  bool ref = false;
};

int Usage(const char* msg) {
  std::fprintf(stderr,
               "offload_model_dump: %s\nusage: offload_model_dump (--ckpt DIR [--state fp32|model]"
               " | --model M --weights FILE) [--weights FILE] --tokens FILE --batch B --seq-len T"
               " --out DIR [--threads N] [--ref]\n",
               msg);
  return 2;
}

int Fail(const Status& s, const char* what) {
  std::fprintf(stderr, "offload_model_dump: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

bool ReadFile(const std::string& path, std::vector<char>& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return true;
}

bool WriteFile(const fs::path& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  return static_cast<bool>(f);
}

// Restores the weights of `model` (rank 0 of tp=1,pp=1,dp=1) from `src` into `weights`.
Status RestoreWeights(const ucp::api::CheckpointSource& src, const std::string& state,
                      const ucp::offload::Model& model, std::vector<float>& weights) {
  UCP_ASSIGN_OR_RETURN(auto layout, ucp::layout::ParseLayout("tp=1,pp=1,dp=1"), "while layout");
  UCP_ASSIGN_OR_RETURN(
      auto infos, ucp::api::RankTensors(src.meta().model, layout, 0, src.meta().plan_options()),
      "while listing rank 0's tensors");
  const auto want = state == "model" ? ucp::convert::TensorKind::kModelSlice
                                     : ucp::convert::TensorKind::kOptimSlice;
  const std::string want_state = state == "model" ? "model" : state;
  std::map<std::string, const ucp::offload::ParamInfo*> by_name;
  for (const auto& p : model.params()) by_name[p.name] = &p;

  std::vector<std::pair<const ucp::offload::ParamInfo*, ucp::Tensor>> bufs;
  std::vector<std::pair<std::string, ucp::TensorView>> views;
  bufs.reserve(infos.size());  // the views point into these tensors
  for (const auto& t : infos) {
    if (t.kind != want || t.state != want_state) continue;
    auto it = by_name.find(t.param);
    if (it == by_name.end()) {
      return ucp::InvalidArgumentError("plan tensor " + t.name + " (parameter " + t.param +
                                       ") is no parameter of the engine's model");
    }
    if (t.shape != it->second->shape) {
      return ucp::InvalidArgumentError("plan tensor " + t.name + ": shape " +
                                       ucp::ShapeToString(t.shape) + " vs engine " +
                                       ucp::ShapeToString(it->second->shape));
    }
    UCP_ASSIGN_OR_RETURN(auto buf, ucp::Tensor::Zeros(t.dtype, t.shape), "while allocating");
    bufs.emplace_back(it->second, std::move(buf));
    by_name.erase(it);
    views.emplace_back(t.name, bufs.back().second.view());
  }
  if (!by_name.empty()) {
    return ucp::NotFoundError("engine parameter " + by_name.begin()->first +
                              " has no plan tensor of state " + want_state + " (" +
                              std::to_string(by_name.size()) + " missing)");
  }
  UCP_RETURN_IF_ERROR(ucp::api::RestoreRank(src, layout, 0, views));
  for (auto& [p, buf] : bufs) {
    auto dst = std::as_writable_bytes(std::span<float>(weights).subspan(
        static_cast<size_t>(p->offset), static_cast<size_t>(p->numel)));
    UCP_RETURN_IF_ERROR(
        ucp::CastElements(buf.dtype(), buf.view().bytes, ucp::DType::kFp32, dst, p->numel));
  }
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--ref") {
      a.ref = true;
      continue;
    }
    if (i + 1 >= argc) return Usage(("missing value for " + k).c_str());
    const std::string v = argv[++i];
    if (k == "--ckpt")
      a.ckpt = v;
    else if (k == "--model")
      a.model = v;
    else if (k == "--state")
      a.state = v;
    else if (k == "--weights")
      a.weights = v;
    else if (k == "--tokens")
      a.tokens = v;
    else if (k == "--out")
      a.out = v;
    else if (k == "--batch")
      a.batch = std::stoll(v);
    else if (k == "--seq-len")
      a.seq_len = std::stoll(v);
    else if (k == "--threads")
      a.threads = std::stoi(v);
    else
      return Usage(("unknown flag " + k).c_str());
  }
  if (a.ckpt.empty() == a.model.empty()) return Usage("give exactly one of --ckpt and --model");
  if (!a.model.empty() && a.weights.empty()) return Usage("--model needs --weights");
  if (a.tokens.empty() || a.out.empty() || a.batch <= 0 || a.seq_len <= 0) {
    return Usage("--tokens, --out, --batch and --seq-len are required");
  }
  if (a.state != "fp32" && a.state != "model") return Usage("--state is fp32 or model");

  const fs::path data = ucp::api::UcpDataDir();
  std::unique_ptr<ucp::api::CheckpointSource> src;
  ucp::patterns::ModelSpec spec;
  if (!a.ckpt.empty()) {
    auto s = ucp::api::CheckpointSource::Open(a.ckpt, data);
    if (!s.ok()) return Fail(s.status(), "open checkpoint");
    src = std::move(*s);
    spec = src->meta().spec;
  } else {
    auto m = ucp::api::LoadResolvedModel(data, a.model, "fp32");
    if (!m.ok()) return Fail(m.status(), "load model");
    spec = m->first;
  }
  auto config = ucp::offload::ModelConfig::FromSpec(spec);
  if (!config.ok()) return Fail(config.status(), "model config");
  auto model = ucp::offload::Model::Create(*config, a.batch, a.seq_len, a.threads);
  if (!model.ok()) return Fail(model.status(), "create model");
  const int64_t n = model->num_params();

  std::vector<float> weights(static_cast<size_t>(n), 0.0f);
  if (src) {
    if (Status s = RestoreWeights(*src, a.state, *model, weights); !s.ok()) {
      return Fail(s, "restore weights");
    }
  }
  if (!a.weights.empty()) {
    std::vector<char> raw;
    if (!ReadFile(a.weights, raw)) return Usage(("cannot read " + a.weights).c_str());
    if (raw.size() != static_cast<size_t>(n) * sizeof(float)) {
      return Usage(
          ("--weights: " + std::to_string(raw.size()) + " bytes, want " + std::to_string(n * 4))
              .c_str());
    }
    std::memcpy(weights.data(), raw.data(), raw.size());
  }

  std::vector<char> raw_tokens;
  if (!ReadFile(a.tokens, raw_tokens)) return Usage(("cannot read " + a.tokens).c_str());
  const size_t bt = static_cast<size_t>(a.batch * a.seq_len);
  if (raw_tokens.size() != 2 * bt * sizeof(int32_t)) {
    return Usage(("--tokens: " + std::to_string(raw_tokens.size()) + " bytes, want " +
                  std::to_string(2 * bt * 4))
                     .c_str());
  }
  std::vector<int32_t> tokens(2 * bt);
  std::memcpy(tokens.data(), raw_tokens.data(), raw_tokens.size());
  ucp::offload::Batch batch;
  batch.inputs = std::span<const int32_t>(tokens).first(bt);
  batch.targets = std::span<const int32_t>(tokens).subspan(bt, bt);
  batch.batch = a.batch;
  batch.seq_len = a.seq_len;
  int64_t num_targets = 0;
  for (int32_t t : batch.targets) num_targets += t >= 0 ? 1 : 0;
  const float grad_scale = 1.0f / static_cast<float>(num_targets > 0 ? num_targets : 1);

  auto fwd = model->Forward(weights, batch);
  if (!fwd.ok()) return Fail(fwd.status(), "forward");
  std::vector<float> grads(static_cast<size_t>(n), 0.0f);
  auto loss = model->ForwardBackward(weights, grads, batch, grad_scale);
  if (!loss.ok()) return Fail(loss.status(), "forward/backward");
  // Determinism: the same call into a fresh buffer gives the same bits. Accumulation: a call
  // into a buffer already holding g adds to it (2g up to the rounding of the += sums; BLAS
  // beta=1 and row sums add into the buffer in their own order, so not bitwise 2g).
  std::vector<float> again(static_cast<size_t>(n), 0.0f);
  auto loss_again = model->ForwardBackward(weights, again, batch, grad_scale);
  if (!loss_again.ok()) return Fail(loss_again.status(), "second forward/backward");
  const bool deterministic = *loss_again == *loss && again == grads;
  std::vector<float> twice = grads;
  auto loss2 = model->ForwardBackward(weights, twice, batch, grad_scale);
  if (!loss2.ok()) return Fail(loss2.status(), "third forward/backward");
  double diff2 = 0, norm2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(twice[i]) - 2.0 * static_cast<double>(grads[i]);
    diff2 += d * d;
    norm2 += 4.0 * static_cast<double>(grads[i]) * static_cast<double>(grads[i]);
  }
  const double accumulate_rel = norm2 > 0 ? std::sqrt(diff2 / norm2) : std::sqrt(diff2);

  fs::create_directories(a.out);
  const fs::path out(a.out);
  double ref_loss = 0;
  if (a.ref) {
    std::vector<double> w64(weights.begin(), weights.end());
    std::vector<double> g64(static_cast<size_t>(n), 0.0);
    auto r = ucp::offload::RefForwardBackward(*config, w64, g64, batch, grad_scale);
    if (!r.ok()) return Fail(r.status(), "reference forward/backward");
    ref_loss = *r;
    if (!WriteFile(out / "grads_ref.f64", g64.data(), g64.size() * sizeof(double))) {
      return Usage(("cannot write into " + a.out).c_str());
    }
  }
  if (!WriteFile(out / "weights.f32", weights.data(), weights.size() * sizeof(float)) ||
      !WriteFile(out / "grads.f32", grads.data(), grads.size() * sizeof(float))) {
    return Usage(("cannot write into " + a.out).c_str());
  }
  nlohmann::ordered_json j;
  j["loss_sum"] = *loss;
  j["forward_loss_sum"] = *fwd;
  j["num_targets"] = num_targets;
  j["grad_scale"] = grad_scale;
  j["deterministic"] = deterministic;
  j["accumulate_rel"] = accumulate_rel;
  if (a.ref) j["ref_loss_sum"] = ref_loss;
  const auto& c = model->config();
  j["config"] = {{"family", c.family == ucp::offload::Family::kGpt ? "gpt" : "llama"},
                 {"vocab", c.vocab},
                 {"padded_vocab", c.padded_vocab},
                 {"hidden", c.hidden},
                 {"layers", c.layers},
                 {"heads", c.heads},
                 {"kv_heads", c.kv_heads},
                 {"head_dim", c.head_dim},
                 {"ffn_hidden", c.ffn_hidden},
                 {"max_positions", c.max_positions},
                 {"tied", c.tied_embeddings},
                 {"norm_eps", c.norm_eps},
                 {"rope_theta", c.rope_theta}};
  nlohmann::ordered_json params = nlohmann::ordered_json::array();
  for (const auto& p : model->params()) {
    params.push_back(
        {{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}, {"numel", p.numel}});
  }
  j["params"] = std::move(params);
  std::ofstream f(out / "index.json");
  f << j.dump(1) << "\n";
  if (!f) return Usage("cannot write index.json");
  std::printf(
      "loss_sum %.17g over %lld targets; %lld parameters; deterministic %s; "
      "||accumulated - 2g|| / ||2g|| = %.3g\n",
      *loss, static_cast<long long>(num_targets), static_cast<long long>(n),
      deterministic ? "yes" : "NO", accumulate_rel);
  return 0;
}
