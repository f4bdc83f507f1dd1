// CheckpointSource implementations (universal, distributed, generated) and the operations.
#include "ucp/api/checkpoint.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "ucp/api/deepspeed_source.h"
#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/dist/dist_checkpoint.h"
#include "ucp/io/manifest/universal_manifest.h"
#include "ucp/io/universal/universal_checkpoint.h"
#include "ucp/tensor/cast.h"

#ifndef UCP_DATA_DIR
#define UCP_DATA_DIR "."
#endif

namespace ucp::api {

namespace fs = std::filesystem;
using convert::TensorInfo;

std::string_view FormatName(Format f) {
  switch (f) {
    case Format::kUniversal:
      return "ucp-universal";
    case Format::kDistributed:
      return "ucp-distributed";
    case Format::kDeepSpeed:
      return "deepspeed";
  }
  return "?";
}

convert::PlanOptions CheckpointMeta::plan_options() const {
  convert::PlanOptions o;
  o.optimizer_states = optimizer_states;
  o.model_slices = true;
  return o;
}

fs::path UcpDataDir() {
  const char* env = std::getenv("UCP_DATA_DIR");
  return fs::path(env != nullptr && *env != '\0' ? env : UCP_DATA_DIR) / "patterns";
}

namespace {

Status ApplyDType(patterns::ModelSpec& spec, patterns::ResolvedModel& model, DType dtype) {
  spec.dtype = dtype;
  model.spec.dtype = dtype;
  for (auto& p : model.params) p.dtype = dtype;
  return Status::Ok();
}

// Rebuilds and resolves a model from its inline description (what a checkpoint records).
Result<std::pair<patterns::ModelSpec, patterns::ResolvedModel>> ModelFromDescription(
    const fs::path& data_dir, const dist::DistModel& d, const std::string& where) {
  patterns::ModelSpec spec;
  spec.name = d.name;
  spec.family = d.family;
  spec.dtype = d.dtype;
  spec.hyper = d.hyper;
  UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules, patterns::LoadRuleSet(data_dir, d.family),
                       "rule set of the model in " + where);
  spec.templates = rules.templates;
  UCP_ASSIGN_OR_RETURN(patterns::ResolvedModel model, patterns::Resolve(spec, rules),
                       "model in " + where);
  UCP_RETURN_IF_ERROR(ApplyDType(spec, model, d.dtype));
  return std::make_pair(std::move(spec), std::move(model));
}

dist::DistModel DescribeModel(const patterns::ModelSpec& spec) {
  return {spec.name, spec.family, spec.dtype, spec.hyper};
}

// {"ucp_model": {...}} plus the members of the source's own client state (`extra`, a JSON
// object or empty).
Result<std::string> ModelJson(const patterns::ModelSpec& spec, const std::string& extra) {
  nlohmann::json hyper = nlohmann::json::object();
  for (const auto& [k, v] : spec.hyper) hyper[k] = v;
  nlohmann::json j = {{"ucp_model",
                       {{"name", spec.name},
                        {"family", spec.family},
                        {"dtype", std::string(DTypeName(spec.dtype))},
                        {"hyper", hyper}}}};
  if (!extra.empty()) {
    try {
      nlohmann::json e = nlohmann::json::parse(extra);
      if (!e.is_object()) return InternalError("source client state is not a JSON object");
      for (auto& [k, v] : e.items()) {
        if (k != "ucp_model") j[k] = std::move(v);
      }
    } catch (const nlohmann::json::exception& e) {
      return InternalError(std::string("source client state is not JSON: ") + e.what());
    }
  }
  return j.dump();
}

Result<dist::DistModel> ParseModelJson(const std::string& text, const std::string& where) {
  const std::string err = where + ": client_state has no valid \"ucp_model\" description";
  try {
    nlohmann::json j = nlohmann::json::parse(text);
    if (!j.is_object() || !j.contains("ucp_model")) return FailedPreconditionError(err);
    const auto& m = j.at("ucp_model");
    dist::DistModel d;
    d.name = m.at("name").get<std::string>();
    d.family = m.at("family").get<std::string>();
    UCP_ASSIGN_OR_RETURN(d.dtype, DTypeFromName(m.at("dtype").get<std::string>()), where);
    for (const auto& [k, v] : m.at("hyper").items()) d.hyper[k] = v.get<int64_t>();
    return d;
  } catch (const nlohmann::json::exception& e) {
    return FailedPreconditionError(err + " (" + e.what() + ")");
  }
}

class DistSource final : public CheckpointSource {
 public:
  DistSource(dist::DistReader reader, CheckpointMeta meta)
      : reader_(std::move(reader)), meta_(std::move(meta)) {}
  const CheckpointMeta& meta() const override { return meta_; }
  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    return reader_.ReadFlatRange(t.rank, t.name, begin, end, out);
  }
  std::vector<TensorInfo> StoredTensors() const override {
    std::vector<TensorInfo> out;
    for (const auto& r : reader_.manifest().ranks) {
      for (const auto& t : r.tensors) {
        TensorInfo i;
        i.name = t.name;
        i.dtype = t.dtype;
        i.shape = t.shape;
        i.rank = r.rank;
        out.push_back(std::move(i));
      }
    }
    return out;
  }
  Status VerifyChecksums() const override { return reader_.Verify(); }

 private:
  dist::DistReader reader_;
  CheckpointMeta meta_;
};

class UniversalSource final : public CheckpointSource {
 public:
  UniversalSource(io::UniversalReader reader, CheckpointMeta meta)
      : reader_(std::move(reader)), meta_(std::move(meta)) {}
  const CheckpointMeta& meta() const override { return meta_; }
  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    return reader_.ReadStateFlatRange(t.param, t.state, begin, end, out);
  }
  std::vector<TensorInfo> StoredTensors() const override {
    std::vector<TensorInfo> out;
    for (const auto& p : reader_.manifest().params) {
      for (const auto& s : p.states) {
        TensorInfo i;
        i.name = p.name + "/" + s.name;
        i.dtype = s.dtype;
        i.shape = p.shape;
        out.push_back(std::move(i));
      }
    }
    return out;
  }
  Status VerifyChecksums() const override { return reader_.Verify(); }

 private:
  io::UniversalReader reader_;
  CheckpointMeta meta_;
};

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The universal tensors of a seeded random checkpoint, computed on demand from the element
// index, so generating a large model needs no full tensor in memory. The model state is the
// master weight rounded to the training dtype, as after a real optimizer step.
class GeneratedSource final : public CheckpointSource {
 public:
  GeneratedSource(CheckpointMeta meta, uint64_t seed) : meta_(std::move(meta)), seed_(seed) {}
  const CheckpointMeta& meta() const override { return meta_; }
  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    const std::string& state = t.state == "model" ? std::string("fp32") : t.state;
    const uint64_t key =
        SplitMix64(seed_ ^ Fnv1a(t.param)) ^ (Fnv1a(state) * 0x9e3779b97f4a7c15ull);
    std::vector<float> v(static_cast<size_t>(end - begin));
    for (int64_t i = begin; i < end; ++i) {
      const double u = static_cast<double>(SplitMix64(key + static_cast<uint64_t>(i)) >> 40) /
                           static_cast<double>(1 << 24) -
                       0.5;
      float x;
      if (state == "fp32") {
        x = static_cast<float>(u * 0.1);
      } else if (state == "exp_avg") {
        x = static_cast<float>(u * 0.01);
      } else if (state == "exp_avg_sq") {
        x = static_cast<float>(u * u * 1e-4);
      } else {
        x = static_cast<float>(u);
      }
      v[i - begin] = x;
    }
    return CastElements(DType::kFp32, std::as_bytes(std::span<const float>(v)), t.dtype, out,
                        end - begin);
  }
  std::vector<TensorInfo> StoredTensors() const override { return {}; }
  Status VerifyChecksums() const override { return Status::Ok(); }

 private:
  CheckpointMeta meta_;
  uint64_t seed_;
};

class DistSink final : public exec::TensorSink {
 public:
  explicit DistSink(dist::DistWriter& w) : w_(w) {}
  Status Write(const TensorInfo& t, Tensor data) override {
    return w_.WriteTensor(t.rank, t.name, data.view());
  }

 private:
  dist::DistWriter& w_;
};

// Collects the states of each parameter and writes its file once all have arrived, so at most
// the parameters in flight are buffered.
class UniversalSink final : public exec::TensorSink {
 public:
  UniversalSink(io::UniversalWriter& w, const convert::Plan& plan,
                const patterns::ResolvedModel& model)
      : w_(w) {
    for (const TensorInfo& t : plan.targets) expected_[t.param]++;
    for (const auto& p : model.params) params_[p.name] = &p;
  }
  Status Write(const TensorInfo& t, Tensor data) override {
    std::vector<std::pair<std::string, Tensor>> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& pending = pending_[t.param];
      pending.emplace_back(t.state, std::move(data));
      if (static_cast<int>(pending.size()) < expected_[t.param]) return Status::Ok();
      ready = std::move(pending);
      pending_.erase(t.param);
    }
    std::sort(ready.begin(), ready.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    auto it = params_.find(t.param);
    if (it == params_.end()) return InternalError("plan target of unknown parameter " + t.param);
    io::UniversalParamInfo info;
    info.name = t.param;
    info.shape = it->second->shape;
    info.dtype = it->second->dtype;
    std::vector<io::NamedState> states;
    for (auto& [name, tensor] : ready) states.emplace_back(name, tensor.view());
    return w_.WriteParameter(info, states);
  }

 private:
  io::UniversalWriter& w_;
  std::mutex mu_;
  std::map<std::string, int> expected_;
  std::map<std::string, const patterns::ResolvedParam*> params_;
  std::map<std::string, std::vector<std::pair<std::string, Tensor>>> pending_;
};

class DiscardSink final : public exec::TensorSink {
 public:
  Status Write(const TensorInfo&, Tensor) override { return Status::Ok(); }
};

exec::ExecOptions ExecOpts(const RunOptions& o) {
  exec::ExecOptions e;
  e.memory_limit_bytes = o.memory_limit_bytes;
  e.progress = o.progress;
  return e;
}

}  // namespace

Result<std::unique_ptr<CheckpointSource>> CheckpointSource::Open(const fs::path& dir,
                                                                 const fs::path& data_dir,
                                                                 const SourceOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NotFoundError("no checkpoint folder " + dir.string());
  if (!fs::exists(dir / dist::kLayoutFileName, ec) &&
      !fs::exists(dir / io::kManifestFileName, ec) &&
      deepspeed::LooksLikeDeepSpeedCheckpoint(dir)) {
    return OpenDeepSpeedSource(dir, data_dir, options.model);
  }
  if (fs::exists(dir / dist::kLayoutFileName, ec)) {
    UCP_ASSIGN_OR_RETURN(dist::DistReader reader, dist::DistReader::Open(dir));
    const dist::DistManifest& m = reader.manifest();
    const std::string where = (dir / dist::kLayoutFileName).string();
    CheckpointMeta meta;
    meta.format = Format::kDistributed;
    Result<layout::Layout> l = layout::ParseLayout(m.layout);
    if (!l.ok()) return DataLossError(where + ": $.layout: " + l.status().message());
    meta.layout = *l;
    UCP_ASSIGN_OR_RETURN(auto model, ModelFromDescription(data_dir, m.model, where));
    meta.spec = std::move(model.first);
    meta.model = std::move(model.second);
    meta.step = m.step;
    meta.optimizer_kind = m.optimizer_kind;
    meta.optimizer_hyper = m.optimizer_hyper;
    meta.optimizer_states = m.optimizer_states;
    if (static_cast<int64_t>(m.ranks.size()) != layout::WorldSize(meta.layout)) {
      return DataLossError(where + ": " + std::to_string(m.ranks.size()) + " rank files for " +
                           m.layout + " (" + std::to_string(layout::WorldSize(meta.layout)) +
                           " ranks)");
    }
    return std::unique_ptr<CheckpointSource>(new DistSource(std::move(reader), std::move(meta)));
  }
  if (fs::exists(dir / io::kManifestFileName, ec)) {
    UCP_ASSIGN_OR_RETURN(io::UniversalReader reader, io::UniversalReader::Open(dir));
    const io::UniversalManifest& m = reader.manifest();
    const std::string where = (dir / io::kManifestFileName).string();
    CheckpointMeta meta;
    meta.format = Format::kUniversal;
    meta.layout = layout::UniversalLayout();
    UCP_ASSIGN_OR_RETURN(dist::DistModel d, ParseModelJson(m.client_state_json, where));
    UCP_ASSIGN_OR_RETURN(auto model, ModelFromDescription(data_dir, d, where));
    meta.spec = std::move(model.first);
    meta.model = std::move(model.second);
    meta.step = m.step;
    meta.optimizer_kind = m.optimizer_kind;
    meta.optimizer_hyper = m.hyper;
    meta.optimizer_states = m.optimizer_states;
    return std::unique_ptr<CheckpointSource>(
        new UniversalSource(std::move(reader), std::move(meta)));
  }
  return NotFoundError(dir.string() + " has neither " + std::string(dist::kLayoutFileName) +
                       " nor " + std::string(io::kManifestFileName) +
                       " nor DeepSpeed's mp_rank_*_model_states.pt: not a complete checkpoint");
}

Result<std::pair<patterns::ModelSpec, patterns::ResolvedModel>> LoadResolvedModel(
    const fs::path& data_dir, const std::string& model, const std::string& dtype) {
  UCP_ASSIGN_OR_RETURN(patterns::ModelSpec spec, patterns::LoadModel(data_dir, model), "--model");
  if (!dtype.empty()) {
    Result<DType> d = DTypeFromName(dtype);
    if (!d.ok()) return InvalidArgumentError("--dtype: unknown dtype \"" + dtype + "\"");
    spec.dtype = *d;
  }
  UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules, patterns::LoadRuleSet(data_dir, spec.family),
                       "--model");
  UCP_ASSIGN_OR_RETURN(patterns::ResolvedModel resolved, patterns::Resolve(spec, rules), "--model");
  UCP_RETURN_IF_ERROR(ApplyDType(spec, resolved, spec.dtype));
  return std::make_pair(std::move(spec), std::move(resolved));
}

Result<exec::ExecStats> Extract(const CheckpointSource& src, const fs::path& dst,
                                const RunOptions& options) {
  const CheckpointMeta& meta = src.meta();
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, layout::UniversalLayout(),
                                               meta.plan_options()));
  std::error_code ec;
  if (fs::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  if (options.verify_source_checksums) UCP_RETURN_IF_ERROR(src.VerifyChecksums());
  io::UniversalWriteOptions wo;
  wo.step = meta.step;
  UCP_ASSIGN_OR_RETURN(io::UniversalWriter writer, io::UniversalWriter::Create(dst, wo));
  UniversalSink sink(writer, plan, meta.model);
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats,
                       exec::ExecutePlan(plan, src, sink, ExecOpts(options)));
  io::UniversalManifest header;
  header.step = meta.step;
  header.optimizer_kind = meta.optimizer_kind;
  header.hyper = meta.optimizer_hyper;
  header.optimizer_states = meta.optimizer_states;
  header.source_layout =
      meta.source_layout.empty() ? layout::ToString(meta.layout) : meta.source_layout;
  header.source_model = meta.spec.family;
  header.source_framework = meta.framework.empty() ? "ucp" : meta.framework;
  UCP_ASSIGN_OR_RETURN(header.client_state_json, ModelJson(meta.spec, meta.client_state_json));
  UCP_RETURN_IF_ERROR(writer.Commit(header));
  return stats;
}

Result<exec::ExecStats> ToLayout(const CheckpointSource& src, const layout::Layout& to,
                                 const fs::path& dst, const RunOptions& options) {
  const CheckpointMeta& meta = src.meta();
  if (to.universal) return Extract(src, dst, options);
  std::error_code ec;
  if (fs::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, to, meta.plan_options()),
                       "--layout " + layout::ToString(to));
  if (options.verify_source_checksums) UCP_RETURN_IF_ERROR(src.VerifyChecksums());
  UCP_ASSIGN_OR_RETURN(dist::DistWriter writer,
                       dist::DistWriter::Create(dst, layout::WorldSize(to)));
  DistSink sink(writer);
  UCP_ASSIGN_OR_RETURN(exec::ExecStats stats,
                       exec::ExecutePlan(plan, src, sink, ExecOpts(options)));
  dist::DistManifest header;
  header.model = DescribeModel(meta.spec);
  header.layout = layout::ToString(to);
  header.step = meta.step;
  header.optimizer_kind = meta.optimizer_kind;
  header.optimizer_hyper = meta.optimizer_hyper;
  header.optimizer_states = meta.optimizer_states;
  for (const auto& p : meta.model.params) header.params.push_back({p.name, p.shape, p.dtype});
  UCP_RETURN_IF_ERROR(writer.Commit(header));
  return stats;
}

Result<exec::ExecStats> Generate(const patterns::ModelSpec& spec,
                                 const patterns::ResolvedModel& model, const layout::Layout& to,
                                 uint64_t seed, const fs::path& dst, const RunOptions& options) {
  CheckpointMeta meta;
  meta.format = Format::kUniversal;
  meta.layout = layout::UniversalLayout();
  meta.spec = spec;
  meta.model = model;
  meta.optimizer_hyper = {
      {"lr", 3e-4}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}};
  GeneratedSource src(std::move(meta), seed);
  return ToLayout(src, to, dst, options);
}

Status Verify(const CheckpointSource& src) {
  const CheckpointMeta& meta = src.meta();
  UCP_RETURN_IF_ERROR(src.VerifyChecksums());
  UCP_ASSIGN_OR_RETURN(std::vector<TensorInfo> expected,
                       convert::DescribeLayout(meta.model, meta.layout, meta.plan_options()));
  std::map<std::pair<int64_t, std::string>, const TensorInfo*> stored;
  const std::vector<TensorInfo> on_disk = src.StoredTensors();
  for (const TensorInfo& t : on_disk) stored[{t.rank, t.name}] = &t;
  for (const TensorInfo& e : expected) {
    const int64_t rank = meta.layout.universal ? 0 : e.rank;
    auto it = stored.find({rank, e.name});
    if (it == stored.end()) {
      return DataLossError("tensor \"" + e.name + "\" of rank " + std::to_string(rank) +
                           " is missing (layout " + layout::ToString(meta.layout) + ")");
    }
    if (it->second->dtype != e.dtype || it->second->shape != e.shape) {
      return DataLossError("tensor \"" + e.name + "\" of rank " + std::to_string(rank) + " is " +
                           std::string(DTypeName(it->second->dtype)) +
                           ShapeToString(it->second->shape) + ", the layout needs " +
                           std::string(DTypeName(e.dtype)) + ShapeToString(e.shape));
    }
    stored.erase(it);
  }
  if (!stored.empty()) {
    return DataLossError("tensor \"" + stored.begin()->first.second + "\" of rank " +
                         std::to_string(stored.begin()->first.first) +
                         " is not part of the layout " + layout::ToString(meta.layout));
  }
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, layout::UniversalLayout(),
                                               meta.plan_options()));
  UCP_RETURN_IF_ERROR(convert::CheckCoverage(plan));
  if (!meta.layout.universal) {
    // Replicated copies must agree: run only the plan's check ops.
    convert::Plan checks = plan;
    std::erase_if(checks.ops,
                  [](const convert::Op& op) { return op.kind != convert::OpKind::kCheckEqual; });
    checks.targets.clear();
    DiscardSink sink;
    UCP_RETURN_IF_ERROR(exec::ExecutePlan(checks, src, sink).status());
  }
  return Status::Ok();
}

namespace {

std::string ValueText(DType dtype, const std::byte* p) {
  double v = 0;
  if (!CastElements(dtype, {p, static_cast<size_t>(DTypeSizeBytes(dtype))}, DType::kFp64,
                    std::as_writable_bytes(std::span<double>(&v, 1)), 1)
           .ok()) {
    return "?";
  }
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

// "" when equal, else the first difference.
std::string CompareTensors(const TensorInfo& t, const Tensor& a, const Tensor& b, double atol) {
  const int64_t size = DTypeSizeBytes(t.dtype);
  const int64_t n = a.num_elements();
  if (std::memcmp(a.data(), b.data(), a.num_bytes()) == 0) return "";
  for (int64_t i = 0; i < n; ++i) {
    const std::byte* pa = a.data() + i * size;
    const std::byte* pb = b.data() + i * size;
    if (std::memcmp(pa, pb, size) == 0) continue;
    if (atol > 0 && IsFloating(t.dtype)) {
      double x = 0, y = 0;
      (void)CastElements(t.dtype, {pa, static_cast<size_t>(size)}, DType::kFp64,
                         std::as_writable_bytes(std::span<double>(&x, 1)), 1);
      (void)CastElements(t.dtype, {pb, static_cast<size_t>(size)}, DType::kFp64,
                         std::as_writable_bytes(std::span<double>(&y, 1)), 1);
      if (std::fabs(x - y) <= atol) continue;
    }
    return "parameter \"" + t.param + "\" state \"" + t.state + "\": element " + std::to_string(i) +
           ": " + ValueText(t.dtype, pa) + " vs " + ValueText(t.dtype, pb);
  }
  return "";
}

}  // namespace

Result<DiffResult> Diff(const CheckpointSource& a, const CheckpointSource& b, double atol,
                        const RunOptions& options) {
  const CheckpointMeta& ma = a.meta();
  const CheckpointMeta& mb = b.meta();
  UCP_ASSIGN_OR_RETURN(
      convert::Plan pa,
      convert::PlanConversion(ma.model, ma.layout, layout::UniversalLayout(), ma.plan_options()),
      "first checkpoint");
  UCP_ASSIGN_OR_RETURN(
      convert::Plan pb,
      convert::PlanConversion(mb.model, mb.layout, layout::UniversalLayout(), mb.plan_options()),
      "second checkpoint");
  DiffResult result;
  std::map<std::string, int32_t> in_b;
  for (int32_t i = 0; i < static_cast<int32_t>(pb.targets.size()); ++i)
    in_b[pb.targets[i].name] = i;
  std::vector<int32_t> pair(pa.targets.size(), -1);
  for (int32_t i = 0; i < static_cast<int32_t>(pa.targets.size()); ++i) {
    const TensorInfo& t = pa.targets[i];
    auto it = in_b.find(t.name);
    if (it == in_b.end()) {
      result.equal = false;
      result.first_difference =
          "parameter \"" + t.param + "\" state \"" + t.state + "\" only in the first checkpoint";
      return result;
    }
    const TensorInfo& u = pb.targets[it->second];
    if (u.dtype != t.dtype || u.shape != t.shape) {
      result.equal = false;
      result.first_difference = "parameter \"" + t.param + "\" state \"" + t.state +
                                "\": " + std::string(DTypeName(t.dtype)) + ShapeToString(t.shape) +
                                " vs " + std::string(DTypeName(u.dtype)) + ShapeToString(u.shape);
      return result;
    }
    pair[i] = it->second;
    in_b.erase(it);
  }
  if (!in_b.empty()) {
    const TensorInfo& u = pb.targets[in_b.begin()->second];
    result.equal = false;
    result.first_difference =
        "parameter \"" + u.param + "\" state \"" + u.state + "\" only in the second checkpoint";
    return result;
  }
  std::vector<std::string> diffs(pa.targets.size());
  std::vector<Status> errors(pa.targets.size());
  std::atomic<int64_t> done{0};
  tbb::parallel_for(
      size_t{0}, pa.targets.size(),
      [&](size_t i) {
        Result<Tensor> x = exec::MaterializeTarget(pa, static_cast<int32_t>(i), a);
        if (!x.ok()) {
          errors[i] = x.status();
          return;
        }
        Result<Tensor> y = exec::MaterializeTarget(pb, pair[i], b);
        if (!y.ok()) {
          errors[i] = y.status();
          return;
        }
        diffs[i] = CompareTensors(pa.targets[i], *x, *y, atol);
        const int64_t d = ++done;
        if (options.progress) options.progress(d, static_cast<int64_t>(pa.targets.size()));
      },
      tbb::simple_partitioner());
  for (size_t i = 0; i < diffs.size(); ++i) {
    UCP_RETURN_IF_ERROR(errors[i]);
    if (!diffs[i].empty()) {
      result.equal = false;
      result.first_difference = diffs[i];
      return result;
    }
  }
  result.tensors_compared = static_cast<int64_t>(pa.targets.size());
  return result;
}

}  // namespace ucp::api
