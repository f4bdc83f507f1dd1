// Hugging Face folders as a source and a sink (see hf_format.h, docs/hf.md).
#include "ucp/hf/hf_format.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <set>
#include <thread>
#include <unordered_map>

#include "ucp/base/status_macros.h"
#include "ucp/convert/plan.h"
#include "ucp/exec/executor.h"
#include "ucp/hf/hf_map.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/safetensors/safetensors_file.h"
#include "ucp/io/safetensors/safetensors_writer.h"
#include "ucp/json/strict_json.h"
#include "ucp/tensor/shape.h"

namespace ucp::hf {

namespace fs = std::filesystem;
using api::CheckpointMeta;
using api::CheckpointSource;
using convert::Op;
using convert::OpKind;
using convert::Plan;
using convert::StridedRef;
using convert::TensorInfo;
using json::Json;
namespace st = ::ucp::safetensors;

namespace {

constexpr int64_t kMaxJsonBytes = int64_t{64} << 20;

// A copy op over a box; a 2-d box whose source rows are strided is turned around, so the source
// is read in rows (the executor scatters rows into a strided destination, but reads a strided
// source element by element).
Op CopyOp(const std::string& param, const std::string& state, std::vector<int64_t> counts,
          int32_t dst, int64_t dst_offset, std::vector<int64_t> dst_strides, int32_t src,
          int64_t src_offset, std::vector<int64_t> src_strides) {
  if (counts.size() == 2 && src_strides[1] != 1 && src_strides[0] == 1) {
    std::swap(counts[0], counts[1]);
    std::swap(dst_strides[0], dst_strides[1]);
    std::swap(src_strides[0], src_strides[1]);
  }
  Op op;
  op.kind = OpKind::kCopy;
  op.param = param;
  op.state = state;
  op.counts = std::move(counts);
  op.dst = StridedRef{dst, dst_offset, std::move(dst_strides)};
  op.srcs.push_back(StridedRef{src, src_offset, std::move(src_strides)});
  return op;
}

Result<const HfMap*> MapForArchitecture(const std::vector<HfMap>& maps, const std::string& arch,
                                        const std::string& where) {
  std::string known;
  for (const HfMap& m : maps) {
    if (m.architecture == arch) return &m;
    known += (known.empty() ? "" : ", ") + m.architecture;
  }
  return UnimplementedError(where + ": architecture " + arch +
                            " has no map in patterns/hf (mapped: " + known + ")");
}

// The safetensors files of a folder, and where each tensor is.
struct HfFiles {
  std::vector<st::SafetensorsFile> files;
  std::map<std::string, std::pair<int, const st::SafetensorsEntry*>> tensors;
};

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

Result<HfFiles> OpenFiles(const fs::path& dir) {
  HfFiles out;
  std::error_code ec;
  if (fs::exists(dir / kSingleFileName, ec)) {
    UCP_ASSIGN_OR_RETURN(st::SafetensorsFile f, st::SafetensorsFile::Open(dir / kSingleFileName));
    out.files.push_back(std::move(f));
    for (const st::SafetensorsEntry& e : out.files[0].entries()) out.tensors[e.name] = {0, &e};
    return out;
  }
  const fs::path index_path = dir / kIndexFileName;
  const std::string where = index_path.string();
  if (!fs::exists(index_path, ec)) {
    return NotFoundError(dir.string() + " has neither " + std::string(kSingleFileName) + " nor " +
                         std::string(kIndexFileName));
  }
  UCP_ASSIGN_OR_RETURN(std::string text, io::ReadFileToString(index_path, kMaxJsonBytes));
  UCP_ASSIGN_OR_RETURN(Json index, json::ParseStrict(text, where, StatusCode::kDataLoss));
  if (!index.is_object()) return DataLossError(where + ": not a JSON object");
  // transformers 4.x reads index["metadata"] unconditionally (hf.md §3).
  if (!index.contains("metadata") || !index["metadata"].is_object()) {
    return DataLossError(where + ": field metadata is missing or not an object");
  }
  if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
    return DataLossError(where + ": field weight_map is missing or not an object");
  }
  std::map<std::string, int> shard_of_name;
  std::vector<std::string> names;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!file.is_string() || !IsPlainFileName(file.get<std::string>())) {
      return DataLossError(where + ": weight_map[\"" + tensor + "\"] is " + file.dump() +
                           ", not a file name in the folder");
    }
    const std::string f = file.get<std::string>();
    if (shard_of_name.try_emplace(f, static_cast<int>(names.size())).second) names.push_back(f);
  }
  for (const std::string& name : names) {
    if (!fs::exists(dir / name, ec)) {
      return NotFoundError(where + ": shard " + name + " is missing from " + dir.string());
    }
    UCP_ASSIGN_OR_RETURN(st::SafetensorsFile f, st::SafetensorsFile::Open(dir / name));
    out.files.push_back(std::move(f));
  }
  for (size_t i = 0; i < out.files.size(); ++i) {
    for (const st::SafetensorsEntry& e : out.files[i].entries()) {
      if (!index["weight_map"].contains(e.name)) {
        return DataLossError(out.files[i].name() + ": tensor " + e.name + " is not in the index " +
                             where);
      }
      if (index["weight_map"][e.name].get<std::string>() != names[i]) {
        return DataLossError(out.files[i].name() + ": tensor " + e.name + " is in the index as " +
                             index["weight_map"][e.name].get<std::string>());
      }
      out.tensors[e.name] = {static_cast<int>(i), &e};
    }
  }
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!out.tensors.contains(tensor)) {
      return DataLossError(where + ": tensor " + tensor + " is not in its shard " +
                           file.get<std::string>());
    }
  }
  // A shard in the folder that the index does not name: the folder is not what the index says.
  static const std::regex kShard("model-\\d{5}-of-\\d{5}\\.safetensors");
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (std::regex_match(n, kShard) && !shard_of_name.contains(n)) {
      return DataLossError(where + ": shard " + n + " in the folder is not in the index");
    }
  }
  return out;
}

// Whole HF tensors held in memory while short pieces of them are read. A transposed weight
// (GPT-2's Conv1D, stored [in, out]) reaches the import as one short piece per source row and
// window (a head's 64 columns: 256 bytes at a 12 KiB stride), read anew for each of the model
// and fp32 states and each tp rank: 8 million preads for gpt2-medium, most of the import's time
// (strace -c; docs/PERFORMANCE.md "Hugging Face import/export"). Read whole into a small shared
// LRU, the same pieces are memcpys. The LRU holds kCacheBytes (one of the executor's wide
// windows; 64 MiB saved gpt2-medium's import 10% of its CPU time in reads anew, for 35 MiB more
// peak memory); besides, each thread keeps the tensor it read last, so that a tensor in use is
// not read anew for each tile when the threads read more than the LRU holds. A larger tensor,
// and long pieces of a tensor not held, are read from the file as before.
constexpr int64_t kCacheBytes = int64_t{32} << 20;
// A piece at least this long is worth its syscall: it does not load its tensor (but is served
// from the cache when the tensor is there).
constexpr int64_t kShortReadBytes = int64_t{64} << 10;

// Anonymous pages of its own (not malloc's, which keeps freed 16 MiB blocks in its heap), so
// that the process's peak memory is what the cache holds.
class MappedBytes {
 public:
  MappedBytes() = default;
  MappedBytes(const MappedBytes&) = delete;
  MappedBytes& operator=(const MappedBytes&) = delete;
  ~MappedBytes() {
    if (data_ != nullptr) ::munmap(data_, static_cast<size_t>(size_));
  }
  static Result<std::unique_ptr<MappedBytes>> Allocate(int64_t n) {
    const int64_t size = std::max<int64_t>(n, 1);
    void* p = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return ResourceExhaustedError("cannot map " + std::to_string(n) +
                                    " bytes for a Hugging Face tensor");
    }
    auto b = std::make_unique<MappedBytes>();
    b->data_ = static_cast<std::byte*>(p);
    b->size_ = size;
    return b;
  }
  std::byte* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  int64_t size_ = 0;
};

class TensorCache {
 public:
  struct Entry {
    const st::SafetensorsEntry* tensor = nullptr;
    std::mutex mu;  // held while the tensor is read in
    bool loaded = false;
    Status status;
    std::unique_ptr<MappedBytes> bytes;  // at least tensor->num_bytes()
  };

  // The tensor's bytes, read whole on first use; nullptr when it is too large to hold, or not
  // held and `load` is false.
  Result<std::shared_ptr<Entry>> Get(const st::SafetensorsFile& file,
                                     const st::SafetensorsEntry& tensor, bool load) const {
    const int64_t n = tensor.num_bytes();
    if (n > kCacheBytes) return std::shared_ptr<Entry>();
    std::shared_ptr<Entry> e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::shared_ptr<Entry>& pinned = pinned_[std::this_thread::get_id()];
      if (pinned && pinned->tensor == &tensor) e = pinned;
      for (size_t i = lru_.size(); !e && i-- > 0;) {
        if (lru_[i]->tensor == &tensor) {
          e = lru_[i];
          if (i + 1 != lru_.size()) {
            lru_.erase(lru_.begin() + static_cast<std::ptrdiff_t>(i));
            lru_.push_back(e);
          }
        }
      }
      if (!e) {
        if (!load) return std::shared_ptr<Entry>();
        e = std::make_shared<Entry>();
        e->tensor = &tensor;
        // Oldest out first. An entry a thread still holds is freed when the thread lets it go;
        // one no one holds lends its pages to the new entry (no new page faults).
        while (held_ + n > kCacheBytes && !lru_.empty()) {
          std::shared_ptr<Entry>& old = lru_.front();
          held_ -= old->tensor->num_bytes();
          if (old.use_count() == 1 && !e->bytes && old->bytes && old->bytes->size() >= n) {
            e->bytes = std::move(old->bytes);
          }
          lru_.erase(lru_.begin());
        }
        held_ += n;
        lru_.push_back(e);
      }
      pinned = e;
    }
    std::lock_guard<std::mutex> lock(e->mu);
    if (!e->loaded) {
      e->loaded = true;
      if (!e->bytes) {
        Result<std::unique_ptr<MappedBytes>> b = MappedBytes::Allocate(n);
        if (b.ok()) e->bytes = std::move(*b);
        e->status = b.status();
      }
      if (e->status.ok()) {
        e->status = file.ReadRange(tensor, 0, n, {e->bytes->data(), static_cast<size_t>(n)});
      }
    }
    if (!e->status.ok()) return e->status;
    return e;
  }

 private:
  mutable std::mutex mu_;
  mutable std::vector<std::shared_ptr<Entry>> lru_;  // least recently used first
  mutable int64_t held_ = 0;
  // Each thread's last tensor, kept when the LRU lets it go; freed with the cache.
  mutable std::unordered_map<std::thread::id, std::shared_ptr<Entry>> pinned_;
};

// Reads HF tensors: plan sources whose rank is the file index.
class FileReader final : public exec::TensorSource {
 public:
  explicit FileReader(const HfFiles& files) : files_(files) {}
  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    return ReadRows(t, begin, 0, 1, end - begin, out);
  }
  Status ReadRows(const TensorInfo& t, int64_t begin, int64_t stride, int64_t rows, int64_t row_len,
                  std::span<std::byte> out) const override {
    auto it = files_.tensors.find(t.name);
    if (it == files_.tensors.end()) return InternalError("no HF tensor " + t.name);
    const int64_t size = DTypeSizeBytes(t.dtype);
    const int64_t row_bytes = row_len * size;
    const st::SafetensorsFile& file = files_.files[static_cast<size_t>(t.rank)];
    const st::SafetensorsEntry& tensor = *it->second.second;
    if (rows < 0 || row_len < 0 || static_cast<int64_t>(out.size()) != rows * row_bytes) {
      return InvalidArgumentError("reading " + std::to_string(rows) + " rows of " +
                                  std::to_string(row_len) + " elements of HF tensor " + t.name +
                                  " into " + std::to_string(out.size()) + " bytes");
    }
    UCP_ASSIGN_OR_RETURN(std::shared_ptr<TensorCache::Entry> cached,
                         cache_.Get(file, tensor, row_bytes < kShortReadBytes));
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t at = (begin + i * stride) * size;
      std::span<std::byte> piece =
          out.subspan(static_cast<size_t>(i * row_bytes), static_cast<size_t>(row_bytes));
      if (cached && at >= 0 && at + row_bytes <= tensor.num_bytes()) {
        if (row_bytes > 0) std::memcpy(piece.data(), cached->bytes->data() + at, piece.size());
      } else {
        // Not held, or outside the tensor: the file read (and its errors).
        UCP_RETURN_IF_ERROR(file.ReadRange(tensor, at, at + row_bytes, piece));
      }
    }
    return Status::Ok();
  }

 private:
  const HfFiles& files_;
  TensorCache cache_;
};

// A Hugging Face folder as the universal layout: each `<param>/<state>` range is built from the
// HF tensors by the import plan.
// HfFiles::tensors points into the files' headers, which stay put when the vector is moved.
class HfSource final : public CheckpointSource {
 public:
  HfSource(HfFiles files, std::unique_ptr<Plan> plan, CheckpointMeta meta)
      : files_(std::move(files)),
        plan_(std::move(plan)),
        index_(*plan_),
        reader_(files_),
        meta_(std::move(meta)) {
    for (size_t i = 0; i < plan_->targets.size(); ++i) {
      target_of_[plan_->targets[i].name] = static_cast<int32_t>(i);
    }
  }
  const CheckpointMeta& meta() const override { return meta_; }
  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    auto it = target_of_.find(t.name);
    if (it == target_of_.end()) {
      return NotFoundError("tensor \"" + t.name + "\" is not in the Hugging Face folder " +
                           meta_.dir.string());
    }
    return exec::BuildTargetRange(index_, it->second, reader_, begin, end, out);
  }
  std::vector<TensorInfo> StoredTensors() const override { return plan_->targets; }
  // safetensors files carry no checksums; every header was validated at open.
  Status VerifyChecksums() const override { return Status::Ok(); }
  // With no checksums, the identity of each file seen at open is what tells the executor, before
  // it commits, that the folder changed under the run (issue 16 #8).
  Status CheckUnchanged() const override {
    for (const auto& f : files_.files) UCP_RETURN_IF_ERROR(f.CheckUnchanged());
    return Status::Ok();
  }

 private:
  HfFiles files_;
  std::unique_ptr<Plan> plan_;
  exec::PlanIndex index_;
  FileReader reader_;
  CheckpointMeta meta_;
  std::unordered_map<std::string, int32_t> target_of_;
};

std::string TorchDTypeText(DType d) {
  switch (d) {
    case DType::kFp32:
      return "fp32";
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      return "fp16";
    default:
      return std::string(DTypeName(d));
  }
}

}  // namespace

bool LooksLikeHfFolder(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / kConfigFileName, ec) &&
         (fs::exists(dir / kSingleFileName, ec) || fs::exists(dir / kIndexFileName, ec));
}

Result<std::unique_ptr<CheckpointSource>> OpenHfSource(const fs::path& dir,
                                                       const fs::path& data_dir,
                                                       const std::string& rotary_layout) {
  int64_t interleaved = 0;
  if (!rotary_layout.empty()) {
    UCP_ASSIGN_OR_RETURN(interleaved, patterns::ParseRotaryLayout(rotary_layout, "--rotary-layout"));
  }
  const std::string where = (dir / kConfigFileName).string();
  UCP_ASSIGN_OR_RETURN(std::string text,
                       io::ReadFileToString(dir / kConfigFileName, kMaxJsonBytes));
  UCP_ASSIGN_OR_RETURN(Json raw, json::ParseStrict(text, where, StatusCode::kDataLoss));
  if (!raw.is_object()) return DataLossError(where + ": not a JSON object");
  const Json config = NormalizeConfig(raw);
  if (!config.contains("architectures") || !config["architectures"].is_array() ||
      config["architectures"].size() != 1 || !config["architectures"][0].is_string()) {
    return DataLossError(where + ": architectures must be a list of one class name");
  }
  const std::string arch = config["architectures"][0].get<std::string>();
  UCP_ASSIGN_OR_RETURN(std::vector<HfMap> maps, LoadHfMaps(data_dir));
  UCP_ASSIGN_OR_RETURN(const HfMap* map, MapForArchitecture(maps, arch, where));
  UCP_ASSIGN_OR_RETURN(auto hyper, HyperFromConfig(*map, config, where));

  patterns::ModelSpec spec;
  spec.name = map->model_type;
  spec.family = map->family;
  spec.hyper = std::move(hyper);
  // Recorded only when set: absent is half-split, as every model made before it.
  if (interleaved != 0) spec.hyper[std::string(patterns::kRotaryInterleavedHyper)] = 1;
  UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules, patterns::LoadRuleSet(data_dir, map->family),
                       "rule set of " + arch);
  spec.templates = rules.templates;
  UCP_ASSIGN_OR_RETURN(patterns::ResolvedModel model, patterns::Resolve(spec, rules),
                       where + ": model");
  UCP_ASSIGN_OR_RETURN(HfLayout hf, LayOutHf(*map, model));

  UCP_ASSIGN_OR_RETURN(HfFiles files, OpenFiles(dir));
  // Keys are stored with the base-model prefix (save_pretrained) or without it (the hub's GPT-2
  // files): decided by the files, one way for all.
  bool prefixed = map->base_model_prefix.empty();
  for (const auto& [name, at] : files.tensors) {
    if (!map->base_model_prefix.empty() && name.starts_with(map->base_model_prefix)) {
      prefixed = true;
    }
  }
  auto stored_name = [&](const std::string& name) {
    return prefixed ? name : Unprefixed(*map, name);
  };
  std::vector<std::regex> skip;
  for (const std::string& s : map->skip) skip.emplace_back(s);
  std::set<std::string> used;
  int64_t skipped = 0;

  auto plan = std::make_unique<Plan>();
  plan->from = layout::UniversalLayout();
  plan->to = layout::UniversalLayout();
  std::vector<int32_t> source_of(hf.tensors.size(), -1);
  DType dtype = DType::kFp32;
  for (size_t i = 0; i < hf.tensors.size(); ++i) {
    const HfTensor& t = hf.tensors[i];
    const std::string name = stored_name(t.name);
    auto it = files.tensors.find(name);
    if (it == files.tensors.end()) {
      if (!t.when.empty()) {
        return DataLossError(
            dir.string() + ": tensor " + name + " is missing, but config.json" +
            " makes the model " +
            (t.when == "!tied_embeddings" ? std::string("untied") : "\"" + t.when + "\"") +
            " (tie_word_embeddings false): refusing to tie the head silently");
      }
      return DataLossError(dir.string() + ": tensor " + name + " of " + arch +
                           " is missing from the weights");
    }
    const auto& [file, entry] = it->second;
    const std::string& fname = files.files[static_cast<size_t>(file)].name();
    if (entry->shape != t.shape) {
      return DataLossError(fname + ": tensor " + name + " is " + ShapeToString(entry->shape) +
                           ", config.json gives " + ShapeToString(t.shape));
    }
    if (!IsFloating(entry->dtype)) {
      return DataLossError(fname + ": tensor " + name + " is " +
                           std::string(DTypeName(entry->dtype)) + ", not a floating type");
    }
    if (i == 0) dtype = entry->dtype;
    if (entry->dtype != dtype) {
      return DataLossError(fname + ": tensor " + name + " is " +
                           std::string(DTypeName(entry->dtype)) + " where " +
                           stored_name(hf.tensors[0].name) + " is " +
                           std::string(DTypeName(dtype)) + ": mixed dtypes are not read");
    }
    used.insert(name);
    TensorInfo info;
    info.name = name;
    info.dtype = entry->dtype;
    info.shape = entry->shape;
    info.rank = file;
    source_of[i] = static_cast<int32_t>(plan->sources.size());
    plan->sources.push_back(std::move(info));
  }
  std::set<std::string> unused;
  for (const std::string& n : hf.unused) unused.insert(stored_name(n));
  for (const auto& [name, at] : files.tensors) {
    if (used.contains(name) || unused.contains(name)) continue;
    const std::string bare = Unprefixed(*map, name);
    if (std::any_of(skip.begin(), skip.end(),
                    [&](const std::regex& re) { return std::regex_match(bare, re); })) {
      ++skipped;
      continue;
    }
    return DataLossError(files.files[static_cast<size_t>(at.first)].name() + ": tensor " + name +
                         " is not a weight of " + arch + " (" + map->file + ")");
  }

  spec.dtype = dtype;
  model.spec.dtype = dtype;
  for (auto& p : model.params) p.dtype = dtype;
  CheckpointMeta meta;
  meta.format = "hf";
  meta.layout = layout::UniversalLayout();
  meta.spec = spec;
  meta.model = model;
  meta.optimizer_states = {"fp32"};
  meta.rotary_layout_from_options = true;
  meta.dir = dir;
  meta.framework = "transformers";
  meta.source_layout =
      std::to_string(files.files.size()) + (files.files.size() == 1 ? " file" : " shards");
  meta.source_notes =
      arch + ", " + TorchDTypeText(dtype) +
      (spec.hyper["tied_embeddings"] != 0 ? ", tied head" : ", untied head") +
      ", weights only (fp32 = the weights widened; no Adam moments); vocabulary " +
      std::to_string(spec.hyper["vocab"]) + " rows, zero rows added to a multiple of " +
      std::to_string(spec.hyper["make_vocab_size_divisible_by"]) + " * tp at a layout" +
      (skipped > 0 ? "; " + std::to_string(skipped) + " legacy buffers skipped" : std::string()) +
      (interleaved != 0 ? "; q/k rows served in interleaved rotary pairs (--rotary-layout)"
                        : std::string());
  Json client = {{"hf", {{"architecture", arch}, {"config", config}}}};
  meta.client_state_json = client.dump();

  // Targets: every universal state the source serves, each built by the same boxes.
  std::map<std::string, std::vector<int32_t>> targets_of_param;
  for (const auto& p : model.params) {
    for (const std::string state : {"model", "fp32"}) {
      TensorInfo t;
      t.name = p.name + "/" + state;
      t.kind = convert::TensorKind::kUniversal;
      t.dtype = state == "model" ? dtype : DType::kFp32;
      t.shape = p.shape;
      t.param = p.name;
      t.state = state;
      targets_of_param[p.name].push_back(static_cast<int32_t>(plan->targets.size()));
      plan->targets.push_back(std::move(t));
    }
  }
  for (const int32_t target : [&] {
         std::vector<int32_t> all(plan->targets.size());
         for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i);
         return all;
       }()) {
    const TensorInfo& t = plan->targets[static_cast<size_t>(target)];
    for (const HfBlock& b : hf.blocks) {
      if (b.param != t.param) continue;
      plan->ops.push_back(CopyOp(t.param, t.state, b.counts, target, b.param_offset,
                                 b.param_strides, source_of[static_cast<size_t>(b.tensor)],
                                 b.hf_offset, b.hf_strides));
    }
  }
  return std::unique_ptr<CheckpointSource>(
      new HfSource(std::move(files), std::move(plan), std::move(meta)));
}

namespace {

// Universal `<param>/<state>` tensors of any source, built range by range by a plan to the
// universal layout: the source of the export plan.
class UniversalView final : public exec::TensorSource {
 public:
  UniversalView(const Plan& plan, const CheckpointSource& src) : index_(plan), src_(src) {
    for (size_t i = 0; i < plan.targets.size(); ++i) {
      target_of_[plan.targets[i].name] = static_cast<int32_t>(i);
    }
  }
  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    auto it = target_of_.find(t.name);
    if (it == target_of_.end()) return InternalError("no universal tensor " + t.name);
    return exec::BuildTargetRange(index_, it->second, src_, begin, end, out);
  }

 private:
  exec::PlanIndex index_;
  const CheckpointSource& src_;
  std::unordered_map<std::string, int32_t> target_of_;
};

class NullSink final : public exec::TensorSink {
 public:
  Status WriteRange(const TensorInfo&, int64_t, int64_t, std::span<const std::byte>) override {
    return Status::Ok();
  }
};

// Streams each HF tensor into its shard's writer.
class ShardSink final : public exec::TensorSink {
 public:
  ShardSink(std::vector<st::SafetensorsWriter>& writers,
            std::unordered_map<std::string, std::pair<int, size_t>> where)
      : writers_(writers), where_(std::move(where)) {}
  Status WriteRange(const TensorInfo& t, int64_t begin, int64_t,
                    std::span<const std::byte> data) override {
    auto it = where_.find(t.name);
    if (it == where_.end()) return InternalError("no shard for " + t.name);
    return writers_[static_cast<size_t>(it->second.first)].WriteRange(
        it->second.second, begin * DTypeSizeBytes(t.dtype), data);
  }

 private:
  std::vector<st::SafetensorsWriter>& writers_;
  std::unordered_map<std::string, std::pair<int, size_t>> where_;
};

Result<DType> ExportDType(const std::string& text, DType training) {
  if (text.empty()) return training;
  if (text == "fp32") return DType::kFp32;
  if (text == "bf16") return DType::kBf16;
  if (text == "fp16") return DType::kFp16;
  return InvalidArgumentError("--dtype must be fp32, bf16 or fp16 for --format hf, got \"" + text +
                              "\"");
}

}  // namespace

Result<exec::ExecStats> WriteHf(const CheckpointSource& src, const fs::path& dst,
                                const api::RunOptions& run, const HfWriteOptions& options) {
  const CheckpointMeta& meta = src.meta();
  std::error_code ec;
  if (fs::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  UCP_ASSIGN_OR_RETURN(DType dtype, ExportDType(options.dtype, meta.spec.dtype));
  if (options.max_shard_bytes <= 0) return InvalidArgumentError("--max-shard-size must be > 0");

  // The architecture: asked, else recorded by an HF source, else the family's default map.
  Json recorded;
  if (!meta.client_state_json.empty()) {
    UCP_ASSIGN_OR_RETURN(Json cs,
                         json::ParseStrict(meta.client_state_json, "the source's client state",
                                           StatusCode::kDataLoss));
    if (cs.is_object() && cs.contains("hf") && cs["hf"].is_object()) recorded = cs["hf"];
  }
  std::string arch = options.architecture;
  if (arch.empty() && recorded.is_object() && recorded.contains("architecture") &&
      recorded["architecture"].is_string()) {
    arch = recorded["architecture"].get<std::string>();
  }
  UCP_ASSIGN_OR_RETURN(std::vector<HfMap> maps, LoadHfMaps(api::UcpDataDir()));
  const HfMap* map = nullptr;
  for (const HfMap& m : maps) {
    if (m.family != meta.spec.family) continue;
    if (arch.empty() ? m.default_for_family : m.architecture == arch) map = &m;
  }
  if (map == nullptr) {
    return NotFoundError("no Hugging Face map in patterns/hf writes family " + meta.spec.family +
                         (arch.empty() ? std::string() : " as " + arch));
  }
  Json base;
  if (recorded.is_object() && recorded.value("architecture", "") == map->architecture &&
      recorded.contains("config")) {
    base = recorded["config"];
  }
  UCP_ASSIGN_OR_RETURN(Json config, ConfigForModel(*map, meta.model.spec, base, dtype));
  UCP_ASSIGN_OR_RETURN(HfLayout hf, LayOutHf(*map, meta.model));

  // Universal tensors of the state to export: the model weights when they are in the asked
  // dtype, else the fp32 masters when the source has them (rounded to nearest even).
  std::string state = "model";
  if (dtype != meta.spec.dtype &&
      std::find(meta.optimizer_states.begin(), meta.optimizer_states.end(), "fp32") !=
          meta.optimizer_states.end()) {
    state = "fp32";
  }
  convert::PlanOptions po;
  po.model_slices = state == "model";
  if (state != "model")
    po.optimizer_states = {state};
  else
    po.optimizer_states.clear();
  UCP_ASSIGN_OR_RETURN(
      Plan to_universal,
      convert::PlanConversion(meta.model, meta.layout, layout::UniversalLayout(), po),
      "--format hf");
  // One read of the source (issue 14): checksums from the reads below where the source can
  // (checked before the rename), else a pass now.
  const bool streamed = run.verify_source_checksums && src.BeginVerifiedReads();
  if (run.verify_source_checksums && !streamed) UCP_RETURN_IF_ERROR(src.VerifyChecksums());
  // Replicated copies must agree, as in any extraction.
  if (std::any_of(to_universal.ops.begin(), to_universal.ops.end(),
                  [](const Op& op) { return op.kind == OpKind::kCheckEqual; })) {
    Plan checks = to_universal;
    std::erase_if(checks.ops, [](const Op& op) { return op.kind != OpKind::kCheckEqual; });
    checks.targets.clear();
    NullSink null;
    Status checked = exec::ExecutePlan(checks, src, null).status();
    if (!checked.ok() && streamed) checked = api::FinishVerifiedRun(src, checked, 0, 1);
    UCP_RETURN_IF_ERROR(checked);
  }

  // The export plan: HF tensors (rank = shard) from the universal tensors.
  std::vector<int64_t> bytes;
  for (const HfTensor& t : hf.tensors) {
    bytes.push_back(NumElementsOrDie(t.shape) * DTypeSizeBytes(dtype));
  }
  const std::vector<int> shard = SplitShards(bytes, options.max_shard_bytes);
  const int num_shards = hf.tensors.empty() ? 1 : *std::max_element(shard.begin(), shard.end()) + 1;
  Plan out;
  out.from = layout::UniversalLayout();
  out.to = layout::UniversalLayout();
  out.sources = to_universal.targets;
  std::map<std::string, int32_t> source_of_param;
  for (size_t i = 0; i < out.sources.size(); ++i) {
    source_of_param[out.sources[i].param] = static_cast<int32_t>(i);
  }
  for (size_t i = 0; i < hf.tensors.size(); ++i) {
    TensorInfo t;
    t.name = hf.tensors[i].name;
    t.kind = convert::TensorKind::kUniversal;
    t.dtype = dtype;
    t.shape = hf.tensors[i].shape;
    t.rank = shard[i];
    out.targets.push_back(std::move(t));
  }
  for (size_t i = 0; i < hf.tensors.size(); ++i) {
    for (const HfBlock& b : hf.blocks) {
      if (b.tensor != static_cast<int32_t>(i)) continue;
      out.ops.push_back(CopyOp(b.param, state, b.counts, static_cast<int32_t>(i), b.hf_offset,
                               b.hf_strides, source_of_param.at(b.param), b.param_offset,
                               b.param_strides));
    }
  }

  UCP_ASSIGN_OR_RETURN(fs::path temp, io::MakeTempSiblingDir(dst));
  auto fail = [&](Status s) {
    io::RemoveTreeBestEffort(temp);
    return s;
  };
  std::vector<st::SafetensorsWriter> writers;
  std::unordered_map<std::string, std::pair<int, size_t>> where;
  Json weight_map = Json::object();
  int64_t total_bytes = 0;
  for (int s = 0; s < num_shards; ++s) {
    std::vector<st::SafetensorsTensorSpec> specs;
    for (size_t i = 0; i < hf.tensors.size(); ++i) {
      if (shard[i] == s) specs.push_back({hf.tensors[i].name, dtype, hf.tensors[i].shape});
    }
    const std::string file = ShardFileName(s, num_shards);
    Result<st::SafetensorsWriter> w = st::SafetensorsWriter::Create(temp / file, specs);
    if (!w.ok()) return fail(w.status());
    for (const auto& spec : specs) {
      where[spec.name] = {s, *w->IndexOf(spec.name)};
      weight_map[spec.name] = file;
    }
    writers.push_back(std::move(*w));
  }
  for (int64_t b : bytes) total_bytes += b;
  ShardSink sink(writers, std::move(where));
  {
    UniversalView view(to_universal, src);
    exec::ExecOptions eo = api::ExecOptionsOf(run);
    eo.run_checks = false;  // the extraction checks ran above
    Result<exec::ExecStats> stats = exec::ExecutePlan(out, view, sink, eo);
    if (streamed) {
      Status verified = api::FinishVerifiedRun(src, stats.status(), 0, 1);
      if (!verified.ok()) return fail(verified);
    }
    if (!stats.ok()) return fail(stats.status());
    for (st::SafetensorsWriter& w : writers) {
      Status c = w.Commit();
      if (!c.ok()) return fail(c.WithContext("while writing Hugging Face folder " + dst.string()));
    }
    Status c = io::WriteFileAtomic(temp / kConfigFileName, config.dump(2) + "\n");
    if (c.ok() && num_shards > 1) {
      const Json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
      c = io::WriteFileAtomic(temp / kIndexFileName, index.dump(2) + "\n");
    }
    if (c.ok()) c = io::FsyncTree(temp);
    if (c.ok()) c = io::RenameNoReplace(temp, dst);
    if (!c.ok()) return fail(c);
    return *stats;
  }
}

namespace {

class HfFormat final : public api::CheckpointFormat {
 public:
  std::string_view name() const override { return "hf"; }
  std::string_view summary() const override {
    return "Hugging Face model folders: config.json and model.safetensors or sharded "
           "model-0000k-of-0000n.safetensors with model.safetensors.index.json; weights only";
  }
  bool reads() const override { return true; }
  bool Detect(const fs::path& dir) const override { return LooksLikeHfFolder(dir); }
  std::string_view detect_hint() const override {
    return "config.json with model.safetensors or model.safetensors.index.json";
  }
  Result<std::unique_ptr<CheckpointSource>> Open(const fs::path& dir, const fs::path& data_dir,
                                                 const api::SourceOptions& options) const override {
    return OpenHfSource(dir, data_dir, options.rotary_layout);
  }
  bool writes() const override { return true; }
  bool takes_layout() const override { return false; }
  std::vector<api::FormatOption> write_options() const override {
    return {{"dtype",
             "--format hf: fp32, bf16 or fp16 weights (default: the training dtype; other "
             "dtypes from the fp32 masters when present, rounded to nearest even)",
             ""},
            {"max-shard-size",
             "--format hf: cut shards at this size, decimal units as transformers (default "
             "5GB, transformers 4.x's save_pretrained)",
             ""},
            {"architecture",
             "--format hf: the transformers class to write (default: the source's, else the "
             "family's: GPT2LMHeadModel, LlamaForCausalLM)",
             ""}};
  }
  Result<exec::ExecStats> Write(const CheckpointSource& src, const fs::path& dst,
                                const api::WriteRequest& request) const override {
    HfWriteOptions o;
    o.dtype = request.Option("dtype");
    o.architecture = request.Option("architecture");
    if (const std::string size = request.Option("max-shard-size"); !size.empty()) {
      UCP_ASSIGN_OR_RETURN(o.max_shard_bytes, ParseShardSize(size));
    }
    return WriteHf(src, dst, request.run, o);
  }
  std::string_view written_noun() const override { return "Hugging Face folder"; }
};

}  // namespace

std::unique_ptr<api::CheckpointFormat> MakeHfFormat() { return std::make_unique<HfFormat>(); }

}  // namespace ucp::hf
