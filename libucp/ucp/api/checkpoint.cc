// CheckpointSource implementations (universal, distributed, generated) and the operations.
#include "ucp/api/checkpoint.h"

#include <stdlib.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "ucp/api/ucp_format.h"
#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"
#include "ucp/dist/dist_checkpoint.h"
#include "ucp/io/interrupt.h"
#include "ucp/io/manifest/universal_manifest.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/universal/universal_checkpoint.h"
#include "ucp/json/strict_json.h"
#include "ucp/tensor/cast.h"

namespace ucp::api {

namespace fs = std::filesystem;
using convert::TensorInfo;

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
  json::Json hyper = json::Json::object();
  for (const auto& [k, v] : spec.hyper) hyper[k] = v;
  json::Json j = {{"ucp_model",
                   {{"name", spec.name},
                    {"family", spec.family},
                    {"dtype", std::string(DTypeName(spec.dtype))},
                    {"hyper", hyper}}}};
  if (!extra.empty()) {
    UCP_ASSIGN_OR_RETURN(json::Json e,
                         json::ParseStrict(extra, "source client state", StatusCode::kInternal));
    if (!e.is_object()) return InternalError("source client state is not a JSON object");
    for (auto& [k, v] : e.items()) {
      if (k != "ucp_model") j[k] = std::move(v);
    }
  }
  return j.dump();
}

Result<dist::DistModel> ParseModelJson(const std::string& text, const std::string& where) {
  const std::string err = where + ": client_state has no valid \"ucp_model\" description";
  Result<json::Json> parsed =
      json::ParseStrict(text, where + ": client_state", StatusCode::kFailedPrecondition);
  if (!parsed.ok()) return FailedPreconditionError(err + " (" + parsed.status().message() + ")");
  const json::Json& j = *parsed;
  if (!j.is_object() || !j.contains("ucp_model") || !j["ucp_model"].is_object()) {
    return FailedPreconditionError(err);
  }
  const json::Json& m = j["ucp_model"];
  for (const char* key : {"name", "family", "dtype"}) {
    if (!m.contains(key) || !m[key].is_string()) {
      return FailedPreconditionError(err + " (ucp_model." + key + " is not a string)");
    }
  }
  if (!m.contains("hyper") || !m["hyper"].is_object()) {
    return FailedPreconditionError(err + " (ucp_model.hyper is not an object)");
  }
  dist::DistModel d;
  d.name = m["name"].get<std::string>();
  d.family = m["family"].get<std::string>();
  UCP_ASSIGN_OR_RETURN(d.dtype, DTypeFromName(m["dtype"].get<std::string>()), where);
  for (const auto& [k, v] : m["hyper"].items()) {
    if (!v.is_number_integer()) {
      return FailedPreconditionError(err + " (ucp_model.hyper." + k + " is not an integer)");
    }
    d.hyper[k] = v.get<int64_t>();
  }
  return d;
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
  Status VerifyChecksumsPart(int part, int parts) const override {
    return reader_.Verify(part, parts);
  }
  bool BeginVerifiedReads() const override {
    reader_.VerifyReads();
    return true;
  }
  Status FinishVerifiedReads(int part, int parts) const override {
    return reader_.FinishVerifiedReads(part, parts);
  }
  int64_t verify_bytes_reread() const override { return reader_.verify_bytes_reread(); }
  Status CheckUnchanged() const override { return reader_.CheckSourcesUnchanged(); }

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
  Status VerifyChecksumsPart(int part, int parts) const override {
    return reader_.Verify(part, parts);
  }
  bool BeginVerifiedReads() const override {
    reader_.VerifyReads();
    return true;
  }
  Status FinishVerifiedReads(int part, int parts) const override {
    return reader_.FinishVerifiedReads(part, parts);
  }
  int64_t verify_bytes_reread() const override { return reader_.verify_bytes_reread(); }
  Status CheckUnchanged() const override { return reader_.CheckSourcesUnchanged(); }

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

// The per-rank tensors of a plan's targets, as DistWriter declarations (plan order).
std::vector<dist::DistTensorDecl> Declarations(const convert::Plan& plan) {
  std::vector<dist::DistTensorDecl> out;
  out.reserve(plan.targets.size());
  for (const TensorInfo& t : plan.targets) out.push_back({t.rank, t.name, t.dtype, t.shape});
  return out;
}

class DistSink final : public exec::TensorSink {
 public:
  explicit DistSink(dist::DistWriter& w) : w_(w) {}
  Status WriteRange(const TensorInfo& t, int64_t begin, int64_t,
                    std::span<const std::byte> data) override {
    return w_.WriteRange(t.rank, t.name, begin, data);
  }

 private:
  dist::DistWriter& w_;
};

// Streams each target state into its parameter's file; a parameter's file is begun (with all
// the states the plan writes for it, in plan order) when the first of them starts.
class UniversalSink final : public exec::TensorSink {
 public:
  UniversalSink(io::UniversalWriter& w, const convert::Plan& plan,
                const patterns::ResolvedModel& model)
      : w_(w) {
    for (const auto& p : model.params) params_[p.name].param = &p;
    for (const TensorInfo& t : plan.targets) params_[t.param].states.push_back({t.state, t.dtype});
  }
  Status Begin(const TensorInfo& t) override {
    auto it = params_.find(t.param);
    if (it == params_.end() || it->second.param == nullptr) {
      return InternalError("plan target of unknown parameter " + t.param);
    }
    Entry& e = it->second;
    std::call_once(e.once, [&] {
      io::UniversalParamInfo info;
      info.name = t.param;
      info.shape = e.param->shape;
      info.dtype = e.param->dtype;
      e.begin_status = w_.BeginParameter(info, e.states);
    });
    return e.begin_status;
  }
  Status WriteRange(const TensorInfo& t, int64_t begin, int64_t,
                    std::span<const std::byte> data) override {
    return w_.WriteStateRange(t.param, t.state, begin, data);
  }

 private:
  struct Entry {
    const patterns::ResolvedParam* param = nullptr;
    std::vector<io::StateDecl> states;
    std::once_flag once;
    Status begin_status;
  };
  io::UniversalWriter& w_;
  std::map<std::string, Entry> params_;
};

class DiscardSink final : public exec::TensorSink {
 public:
  Status WriteRange(const TensorInfo&, int64_t, int64_t, std::span<const std::byte>) override {
    return Status::Ok();
  }
};

// Which output files each process writes: whole files (a rank file, or a parameter file) go to
// one process each, largest first to the least loaded process (ties to the lower rank), so
// every process computes the same assignment from the same plan. Returns this process's targets
// and, for per-rank output, the ranks whose files it creates.
struct Share {
  std::vector<int32_t> targets;
  std::vector<int64_t> ranks;
};
Share ShareOf(const convert::Plan& plan, int64_t world, bool universal, int rank, int size) {
  std::map<std::string, int64_t> bytes;  // file key -> bytes
  std::vector<std::string> key(plan.targets.size());
  for (size_t i = 0; i < plan.targets.size(); ++i) {
    const TensorInfo& t = plan.targets[i];
    key[i] = universal ? t.param : std::to_string(t.rank);
    bytes[key[i]] += NumElementsOrDie(t.shape) * DTypeSizeBytes(t.dtype);
  }
  if (!universal) {
    for (int64_t r = 0; r < world; ++r) bytes.try_emplace(std::to_string(r), 0);
  }
  std::vector<std::pair<int64_t, std::string>> files;
  for (const auto& [k, b] : bytes) files.emplace_back(-b, k);
  std::sort(files.begin(), files.end());
  std::vector<int64_t> load(size, 0);
  std::map<std::string, int> owner;
  for (const auto& [neg, k] : files) {
    const int p = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[p] -= neg;
    owner[k] = p;
  }
  Share share;
  for (size_t i = 0; i < plan.targets.size(); ++i) {
    if (owner[key[i]] == rank) share.targets.push_back(static_cast<int32_t>(i));
  }
  if (!universal) {
    for (int64_t r = 0; r < world; ++r) {
      if (owner[std::to_string(r)] == rank) share.ranks.push_back(r);
    }
  }
  return share;
}

}  // namespace

Result<std::unique_ptr<CheckpointSource>> CheckpointSource::Open(const fs::path& dir,
                                                                 const fs::path& data_dir,
                                                                 const SourceOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NotFoundError("no checkpoint folder " + dir.string());
  UCP_ASSIGN_OR_RETURN(const CheckpointFormat* format, Formats().Detect(dir));
  return format->Open(dir, data_dir, options);
}

namespace {

// A ucp checkpoint: distributed (ucp_layout.json) or universal (manifest.json).
Result<std::unique_ptr<CheckpointSource>> OpenUcp(const fs::path& dir, const fs::path& data_dir) {
  std::error_code ec;
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
    meta.client_state_json = m.client_state_json;
    meta.dir = dir;
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
    meta.client_state_json = m.client_state_json;
    meta.qkv_layout = m.source_qkv_layout;
    meta.dir = dir;
    return std::unique_ptr<CheckpointSource>(
        new UniversalSource(std::move(reader), std::move(meta)));
  }
  return NotFoundError(dir.string() + " has neither " + std::string(dist::kLayoutFileName) +
                       " nor " + std::string(io::kManifestFileName) +
                       ": not a complete checkpoint");
}

}  // namespace

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

// Runs `plan` from `src` into a new checkpoint at dst with the processes of options.group, each
// writing its share: the root creates the temporary folder, the others join it, parts go back
// to the root, which commits. `Writer` is UniversalWriter or DistWriter; `make` creates it (with
// the folder to join, or none at the root) and `commit` commits it at the root.
template <typename Writer, typename Sink, typename Make, typename MakeSink, typename Commit>
Result<exec::ExecStats> RunShared(const CheckpointSource& src, const convert::Plan& plan,
                                  const fs::path& dst, const RunOptions& options, bool universal,
                                  int64_t world, Make make, MakeSink make_sink, Commit commit) {
  ProcessGroup& group = options.group != nullptr ? *options.group : SingleProcess();
  std::error_code ec;
  Status st;
  if (fs::exists(dst, ec)) {
    st = AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  UCP_RETURN_IF_ERROR(group.Agree(st));
  // One read of the source (issue 14): checksums are checked from the conversion's own reads
  // where the source can, else in a pass before it; either way before the commit below.
  const bool streamed = options.verify_source_checksums && src.BeginVerifiedReads();
  if (options.verify_source_checksums && !streamed) {
    progress::BeginPhase("verify", progress::TreeBytes(src.meta().dir) / group.size());
    UCP_RETURN_IF_ERROR(group.Agree(src.VerifyChecksumsPart(group.rank(), group.size())));
  }
  const Share share = ShareOf(plan, world, universal, group.rank(), group.size());
  std::optional<Writer> writer;
  fs::path temp;
  if (group.is_root()) {
    Result<Writer> w = make(fs::path(), share);
    st = w.status();
    if (w.ok()) {
      temp = w->temp_dir();
      writer.emplace(std::move(*w));
    }
  }
  UCP_RETURN_IF_ERROR(group.Agree(st));
  if (group.size() > 1) {
    UCP_ASSIGN_OR_RETURN(std::string t, group.Broadcast(temp.string()));
    if (!group.is_root()) {
      Result<Writer> w = make(fs::path(t), share);
      st = w.status();
      if (w.ok()) writer.emplace(std::move(*w));
    }
    UCP_RETURN_IF_ERROR(group.Agree(st));
  }
  Sink sink = make_sink(*writer);
  exec::ExecOptions eo = ExecOptionsOf(options);
  eo.targets = share.targets;
  Result<exec::ExecStats> stats = exec::ExecStats{};
  if (!share.targets.empty() || group.size() == 1) stats = exec::ExecutePlan(plan, src, sink, eo);
  if (streamed) {
    // Each process checks its share of the records, reading only what no read of its own
    // covered; the group agrees below before anything is committed.
    Status verified = FinishVerifiedRun(src, stats.status(), group.rank(), group.size());
    if (!verified.ok()) stats = std::move(verified);
    if (stats.ok()) stats->bytes_read += src.verify_bytes_reread();
  }
  UCP_RETURN_IF_ERROR(group.Agree(stats.status()));
  if (group.size() > 1) {
    // The root reports the whole job: every process's counts, added up.
    const exec::ExecStats& mine = *stats;
    UCP_ASSIGN_OR_RETURN(
        std::vector<std::string> counts,
        group.Gather(std::to_string(mine.targets_written) + " " + std::to_string(mine.bytes_read) +
                     " " + std::to_string(mine.bytes_written) + " " +
                     std::to_string(mine.peak_in_flight_bytes)));
    exec::ExecStats total;
    for (const std::string& c : counts) {
      exec::ExecStats one;
      if (std::sscanf(c.c_str(), "%" SCNd64 " %" SCNd64 " %" SCNd64 " %" SCNd64,
                      &one.targets_written, &one.bytes_read, &one.bytes_written,
                      &one.peak_in_flight_bytes) != 4) {
        return InternalError("malformed counts from another process: \"" + c + "\"");
      }
      total.targets_written += one.targets_written;
      total.bytes_read += one.bytes_read;
      total.bytes_written += one.bytes_written;
      total.peak_in_flight_bytes = std::max(total.peak_in_flight_bytes, one.peak_in_flight_bytes);
    }
    if (group.is_root()) stats = total;
  }
  if (group.size() > 1) {
    std::string part;
    st = Status::Ok();
    if (!group.is_root()) {
      Result<std::string> p = writer->LocalPart();
      st = p.status();
      if (p.ok()) part = std::move(*p);
    }
    UCP_RETURN_IF_ERROR(group.Agree(st));
    UCP_ASSIGN_OR_RETURN(std::vector<std::string> parts, group.Gather(part));
    st = Status::Ok();
    for (size_t r = 1; r < parts.size() && st.ok(); ++r) st = writer->AddPart(parts[r]);
  }
  progress::BeginPhase("commit", 0);
  if (group.is_root() && st.ok()) st = commit(*writer);
  UCP_RETURN_IF_ERROR(group.Agree(st));
  return stats;
}

Status FinishVerifiedRun(const CheckpointSource& src, Status run, int part, int parts) {
  if (!run.ok() && run.code() != StatusCode::kDataLoss) return run;
  progress::BeginPhase("verify", 0);
  // After a failed run every process checks every record, so that the error the group agrees on
  // (the lowest process's) names the corrupt record whichever process's share holds it.
  Status verified = run.ok() ? src.FinishVerifiedReads(part, parts) : src.FinishVerifiedReads(0, 1);
  // The final pass read files after the conversion's own identity check: check them again.
  if (verified.ok() && run.ok()) verified = src.CheckUnchanged();
  if (!verified.ok() && (run.ok() || verified.code() == StatusCode::kDataLoss)) return verified;
  return run;
}

Result<exec::ExecStats> Extract(const CheckpointSource& src, const fs::path& dst,
                                const RunOptions& options) {
  const CheckpointMeta& meta = src.meta();
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, layout::UniversalLayout(),
                                               meta.plan_options()));
  io::UniversalManifest header;
  header.step = meta.step;
  header.optimizer_kind = meta.optimizer_kind;
  header.hyper = meta.optimizer_hyper;
  header.optimizer_states = meta.optimizer_states;
  header.source_layout =
      meta.source_layout.empty() ? layout::ToString(meta.layout) : meta.source_layout;
  header.source_model = meta.spec.family;
  header.source_framework = meta.framework.empty() ? "ucp" : meta.framework;
  header.source_qkv_layout = meta.qkv_layout;
  UCP_ASSIGN_OR_RETURN(header.client_state_json, ModelJson(meta.spec, meta.client_state_json));
  // Every parameter file is laid out up front and stays open until its states are complete:
  // raise the soft open-file limit to what that needs, or say what it needs (issue 16 #4).
  UCP_RETURN_IF_ERROR(io::EnsureOpenFileLimit(static_cast<int64_t>(meta.model.params.size())),
                      "universal output " + dst.string());
  return RunShared<io::UniversalWriter, UniversalSink>(
      src, plan, dst, options, /*universal=*/true, 1,
      [&](const fs::path& join, const Share&) {
        io::UniversalWriteOptions wo;
        wo.step = meta.step;
        wo.join_temp = join;
        return io::UniversalWriter::Create(dst, wo);
      },
      [&](io::UniversalWriter& w) { return UniversalSink(w, plan, meta.model); },
      [&](io::UniversalWriter& w) { return w.Commit(header); });
}

Result<exec::ExecStats> ToLayout(const CheckpointSource& src, const layout::Layout& to,
                                 const fs::path& dst, const RunOptions& options) {
  const CheckpointMeta& meta = src.meta();
  if (to.universal) return Extract(src, dst, options);
  UCP_ASSIGN_OR_RETURN(convert::Plan plan,
                       convert::PlanConversion(meta.model, meta.layout, to, meta.plan_options()),
                       "--layout " + layout::ToString(to));
  dist::DistManifest header;
  header.model = DescribeModel(meta.spec);
  header.layout = layout::ToString(to);
  header.step = meta.step;
  header.optimizer_kind = meta.optimizer_kind;
  header.optimizer_hyper = meta.optimizer_hyper;
  header.optimizer_states = meta.optimizer_states;
  header.client_state_json = meta.client_state_json;  // carried, as Extract carries it
  for (const auto& p : meta.model.params) header.params.push_back({p.name, p.shape, p.dtype});
  const int64_t world = layout::WorldSize(to);
  // Each rank file stays open while it is written (as for Extract).
  UCP_RETURN_IF_ERROR(io::EnsureOpenFileLimit(world), "output " + dst.string());
  return RunShared<dist::DistWriter, DistSink>(
      src, plan, dst, options, /*universal=*/false, world,
      [&](const fs::path& join, const Share& share) {
        dist::DistWriteOptions wo;
        wo.join_temp = join;
        if (options.group != nullptr && options.group->size() > 1) wo.owned_ranks = share.ranks;
        return dist::DistWriter::Create(dst, world, Declarations(plan), wo);
      },
      [&](dist::DistWriter& w) { return DistSink(w); },
      [&](dist::DistWriter& w) { return w.Commit(header); });
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

Result<exec::ExecStats> WriteCheckpoint(const CheckpointSource& src, std::string_view format,
                                        const fs::path& dst, const WriteRequest& request) {
  UCP_ASSIGN_OR_RETURN(const CheckpointFormat* f, Formats().Find(format, /*for_writing=*/true));
  if (!f->takes_layout() && request.layout_given && !request.layout.universal) {
    return InvalidArgumentError("--format " + std::string(format) +
                                " holds full tensors and takes no --layout (or --layout "
                                "universal), got " +
                                layout::ToString(request.layout));
  }
  if (request.run.group != nullptr && request.run.group->size() > 1 && !f->writes_in_parallel()) {
    // A format whose files are not split among processes: the root writes them all and the
    // others wait for its outcome, so the job still makes one complete DST (or none) and every
    // process exits with the same code. (Not faster than one process; not N writers either.)
    ProcessGroup& group = *request.run.group;
    Result<exec::ExecStats> mine = exec::ExecStats{};
    if (group.is_root()) {
      WriteRequest alone = request;
      alone.run.group = nullptr;
      mine = WriteCheckpoint(src, format, dst, alone);
    }
    UCP_RETURN_IF_ERROR(group.Agree(mine.status()));
    return mine;
  }
  if (!f->needs_universal_source() || src.meta().format == Format::kUniversal) {
    return f->Write(src, dst, request);
  }
  // The format reads a universal checkpoint from disk: extract one next to dst first.
  std::error_code ec;
  if (fs::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  const fs::path parent = dst.parent_path().empty() ? fs::path(".") : dst.parent_path();
  std::string pattern = (parent / (dst.filename().string() + ".tmp-XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    return IoError("cannot create a temporary folder next to " + dst.string() + ": " +
                   std::strerror(errno));
  }
  const fs::path staging = pattern;
  io::RegisterTempPath(staging);  // an interrupt removes it (io/interrupt.h)
  auto cleanup = [&] {
    fs::remove_all(staging, ec);
    io::UnregisterTempPath(staging);
  };
  RunOptions extract = request.run;
  extract.group = nullptr;
  Result<exec::ExecStats> stats = Extract(src, staging / "universal", extract);
  if (!stats.ok()) {
    cleanup();
    return stats.status().WithContext("extracting to universal for --format " +
                                      std::string(format));
  }
  Result<std::unique_ptr<CheckpointSource>> universal =
      CheckpointSource::Open(staging / "universal", UcpDataDir());
  if (!universal.ok()) {
    cleanup();
    return universal.status();
  }
  WriteRequest again = request;
  again.run.verify_source_checksums = false;  // just written and checked by the extraction
  Result<exec::ExecStats> written = f->Write(**universal, dst, again);
  universal->reset();
  cleanup();
  if (!written.ok()) {
    // The format's errors name the folder it read: here a temporary the user never made (and
    // that is gone now), so they name the source instead.
    std::string message = written.status().message();
    const std::string temp = (staging / "universal").string();
    for (size_t at; (at = message.find(temp)) != std::string::npos;) {
      message.replace(at, temp.size(), src.meta().dir.string());
    }
    return Status(written.status().code(), message);
  }
  written->bytes_read = stats->bytes_read;
  return written;
}

namespace {

// ucp's own format: distributed folders at a layout and universal ones.
class UcpFormat final : public CheckpointFormat {
 public:
  std::string_view name() const override { return "ucp"; }
  std::string_view summary() const override {
    return "ucp's own checkpoints: distributed (ucp_layout.json, per-rank files) at a layout, "
           "or universal (manifest.json) at --layout universal";
  }
  bool reads() const override { return true; }
  bool Detect(const fs::path& dir) const override {
    std::error_code ec;
    return fs::exists(dir / dist::kLayoutFileName, ec) ||
           fs::exists(dir / io::kManifestFileName, ec);
  }
  std::string_view detect_hint() const override { return "ucp_layout.json nor manifest.json"; }
  Result<std::unique_ptr<CheckpointSource>> Open(const fs::path& dir, const fs::path& data_dir,
                                                 const SourceOptions&) const override {
    return OpenUcp(dir, data_dir);
  }
  bool writes() const override { return true; }
  bool writes_in_parallel() const override { return true; }
  Result<exec::ExecStats> Write(const CheckpointSource& src, const fs::path& dst,
                                const WriteRequest& request) const override {
    return ToLayout(src, request.layout, dst, request.run);
  }
};

}  // namespace

std::unique_ptr<CheckpointFormat> MakeUcpFormat() { return std::make_unique<UcpFormat>(); }

Status Verify(const CheckpointSource& src) {
  const CheckpointMeta& meta = src.meta();
  progress::BeginPhase("verify", progress::TreeBytes(meta.dir));
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
    progress::BeginPhase("compare replicas", 0);
    exec::ExecOptions eo;
    eo.phase.clear();
    UCP_RETURN_IF_ERROR(exec::ExecutePlan(checks, src, sink, eo).status());
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

// "" when the elements of `a` and `b` (elements [first, first + n) of tensor t) are equal,
// else the first difference.
std::string CompareRange(const TensorInfo& t, int64_t first, std::span<const std::byte> a,
                         std::span<const std::byte> b, double atol) {
  const int64_t size = DTypeSizeBytes(t.dtype);
  const int64_t n = static_cast<int64_t>(a.size()) / size;
  if (std::memcmp(a.data(), b.data(), a.size()) == 0) return "";
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
    return "parameter \"" + t.param + "\" state \"" + t.state + "\": element " +
           std::to_string(first + i) + ": " + ValueText(t.dtype, pa) + " vs " +
           ValueText(t.dtype, pb);
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
  // Each pair of tensors is built and compared window by window. Each worker holds a window of
  // each side, so with windows of limit / (4 x workers) the windows in flight stay within half
  // of --memory-limit whatever the core count and the tensors' sizes (issue 16 #11).
  const exec::PlanIndex ia(pa), ib(pb);
  const int64_t workers = std::max(1, tbb::this_task_arena::max_concurrency());
  const int64_t window_bytes = std::clamp<int64_t>(options.memory_limit_bytes / (4 * workers),
                                                   int64_t{64} << 10, int64_t{16} << 20);
  std::vector<std::string> diffs(pa.targets.size());
  std::vector<Status> errors(pa.targets.size());
  std::atomic<int64_t> done{0};
  tbb::parallel_for(
      size_t{0}, pa.targets.size(),
      [&](size_t i) {
        const TensorInfo& t = pa.targets[i];
        std::vector<std::byte> other;
        errors[i] = exec::StreamTarget(
            ia, static_cast<int32_t>(i), a, window_bytes,
            [&](int64_t begin, int64_t end, std::span<const std::byte> x) -> Status {
              if (!diffs[i].empty()) return Status::Ok();
              other.resize(x.size());
              UCP_RETURN_IF_ERROR(exec::BuildTargetRange(ib, pair[i], b, begin, end, other));
              diffs[i] = CompareRange(t, begin, x, other, atol);
              return Status::Ok();
            });
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
