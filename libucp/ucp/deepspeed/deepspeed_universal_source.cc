// DeepSpeed's universal layout as a ucp universal source (see deepspeed_universal_source.h).
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/deepspeed/deepspeed_universal_source.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <utility>
#include <vector>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_universal.h"
#include "ucp/deepspeed/naming.h"
#include "ucp/deepspeed/pickle_values.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/json/strict_json.h"
#include "ucp/patterns/model.h"
#include "ucp/tensor/cast.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using api::CheckpointMeta;
using convert::TensorInfo;
using torch::PyKind;
using torch::PyValue;
using torch::TorchFile;

constexpr std::array<const char*, 3> kStates = {"fp32", "exp_avg", "exp_avg_sq"};

std::string Q(std::string_view s) { return "\"" + std::string(s) + "\""; }

// One state file: where its tensor's bytes are (a contiguous fp32 view of one storage record),
// so that ranges are read with pread through a shared file cache, not through the pickle again.
struct StateFile {
  fs::path path;
  std::string storage_key;  // for the CRC check of the whole record (VerifyChecksums)
  int64_t data_offset = 0;  // file offset of element 0 of the tensor
};

struct Param {
  std::string name;    // canonical
  std::string engine;  // the folder name under zero/
  Shape shape;
  std::array<StateFile, 3> states;
};

// `v` as the state tensor of a state file: {'param': tensor, ...} (ucp, ds_to_universal) or a
// bare tensor (ds_to_universal's ZeRO-3 path at tp=1 saves the merged 1-dim tensor itself).
Result<const PyValue*> StateTensor(const PyValue& root, const std::string& where) {
  if (root.kind() == PyKind::kTensor) return &root;
  if (root.kind() != PyKind::kDict) {
    return DataLossError(where + ": the file holds a " + std::string(torch::PyKindName(root.kind())) +
                         ", not a dict {'param': tensor, ...} or a tensor");
  }
  const PyValue* p = root.Get("param");
  if (p == nullptr) return NotFoundError(where + ": the dict has no key 'param'");
  if (p->kind() != PyKind::kTensor) {
    return DataLossError(where + ": 'param' is a " + std::string(torch::PyKindName(p->kind())) +
                         ", not a tensor");
  }
  if (const PyValue* c = root.Get("cat_dim"); c != nullptr) {
    UCP_ASSIGN_OR_RETURN(int64_t d, AsInt(c, where + ": 'cat_dim'"));
    const int64_t rank = static_cast<int64_t>(p->tensor().size.size());
    if (d < 0 || (rank > 0 && d >= rank)) {
      return DataLossError(where + ": 'cat_dim' = " + std::to_string(d) + " is not a dim of the " +
                           std::to_string(rank) + "-dim 'param'");
    }
  }
  if (const PyValue* v = root.Get("vocab_tensor"); v != nullptr && v->kind() != PyKind::kBool) {
    return DataLossError(where + ": 'vocab_tensor' is a " +
                         std::string(torch::PyKindName(v->kind())) + ", not a bool");
  }
  return p;
}

struct OpenedState {
  StateFile file;
  Shape shape;        // the tensor's own shape
  bool bare = false;  // a bare tensor, not {'param': tensor, ...}
};

// Opens one state file strictly and locates its tensor. `where` names the parameter.
Result<OpenedState> OpenState(const fs::path& path, const std::string& where) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    return NotFoundError(path.string() + ": missing (" + where + ")");
  }
  const std::string at = path.string() + " (" + where + ")";
  UCP_ASSIGN_OR_RETURN(TorchFile f, TorchFile::Open(path), where);
  UCP_ASSIGN_OR_RETURN(const PyValue* t, StateTensor(f.root(), at));
  const torch::TensorRef& ref = t->tensor();
  if (ref.dtype != DType::kFp32) {
    return UnimplementedError(at + ": 'param' is " + std::string(DTypeName(ref.dtype)) +
                              ", not fp32 (DeepSpeed's universal states are fp32)");
  }
  if (!ref.IsContiguous()) {
    return UnimplementedError(at + ": 'param' is a non-contiguous view of its storage");
  }
  const torch::StorageRecord* rec = nullptr;
  for (const torch::StorageRecord& r : f.storages()) {
    if (r.key == ref.storage.key) rec = &r;
  }
  if (rec == nullptr) {
    return DataLossError(at + ": 'param' storage " + Q(ref.storage.key) + " has no record");
  }
  const int64_t bytes = ref.num_elements() * 4;
  if (ref.storage_offset < 0 || ref.storage_offset * 4 + bytes > rec->num_bytes) {
    return DataLossError(at + ": 'param' (offset " + std::to_string(ref.storage_offset) + ", " +
                         std::to_string(ref.num_elements()) + " elements) reaches past its " +
                         std::to_string(rec->num_bytes) + "-byte storage");
  }
  OpenedState s;
  s.file.path = path;
  s.file.storage_key = rec->key;
  s.file.data_offset = rec->data_offset + ref.storage_offset * 4;
  s.shape = ref.size;
  s.bare = t == &f.root();
  return s;
}

// A step value `v` of the open file `f`: a 0-d (or one-element) tensor or a number. `where`
// names the file and the field.
Result<double> StepValue(const TorchFile& f, const PyValue& v, const std::string& where) {
  if (v.kind() == PyKind::kInt || v.kind() == PyKind::kFloat || v.kind() == PyKind::kBool) {
    return AsDouble(&v, where);
  }
  if (v.kind() != PyKind::kTensor || v.tensor().num_elements() != 1) {
    return DataLossError(where + ": the step is a " + std::string(torch::PyKindName(v.kind())) +
                         ", not a number or a one-element tensor");
  }
  UCP_ASSIGN_OR_RETURN(Tensor t, f.ReadTensor(v.tensor()), where);
  switch (t.dtype()) {
    case DType::kFp32:
      return static_cast<double>(t.as<float>()[0]);
    case DType::kFp64:
      return t.as<double>()[0];
    case DType::kInt64:
      return static_cast<double>(t.as<int64_t>()[0]);
    case DType::kInt32:
      return static_cast<double>(t.as<int32_t>()[0]);
    default:
      return UnimplementedError(where + ": the step tensor is " +
                                std::string(DTypeName(t.dtype())));
  }
}

// A step.pt: a 0-d (or one-element) tensor or a number.
Result<double> ReadStep(const fs::path& path) {
  UCP_ASSIGN_OR_RETURN(TorchFile f, TorchFile::Open(path));
  return StepValue(f, f.root(), path.string());
}

// The Adam step of a ZeRO-3 zero/optimizer_state.pt (ds_to_universal copies rank 0's ZeRO-3
// optimizer state there and writes no step.pt): every sub-group's
// optimizer_state_dict.state[i].step, which must agree; nullopt when the file holds none.
Result<std::optional<double>> OptimizerStateStep(const TorchFile& opt, const std::string& name) {
  const PyValue* osd = opt.root().Get("optimizer_state_dict");
  if (osd == nullptr || osd->kind() != PyKind::kDict) return std::optional<double>();
  const PyValue* state = osd->Get("state");
  if (state == nullptr) return std::optional<double>();
  if (state->kind() != PyKind::kDict) {
    return DataLossError(name + ": optimizer_state_dict.state is a " +
                         std::string(torch::PyKindName(state->kind())) + ", not a dict");
  }
  std::optional<double> step;
  std::string first;
  for (const auto& [k, v] : state->entries()) {
    const std::string field = "optimizer_state_dict.state[" +
                              (k->kind() == PyKind::kInt ? std::to_string(k->int_value())
                                                         : std::string("?")) + "]";
    const std::string at = name + ": " + field;
    if (v->kind() != PyKind::kDict) return DataLossError(at + " is not a dict");
    const PyValue* st = v->Get("step");
    if (st == nullptr) continue;
    UCP_ASSIGN_OR_RETURN(double x, StepValue(opt, *st, at + ".step"));
    if (step && *step != x) {
      return DataLossError(at + ".step " + std::to_string(x) + " differs from " + first + " " +
                           std::to_string(*step) + " (one Adam step for every sub-group)");
    }
    if (!step) first = field + ".step";
    step = x;
  }
  return step;
}

// ZeRO-3's model-state files record each parameter's shape in `param_shapes` (one dict per
// sub-group, name -> torch.Size); ds_to_universal's ZeRO-3 path at tp=1 saves the states flat, so
// their shapes come from there. Names are the folders' (the engine's). Errors: kNotFound (no
// param_shapes), kDataLoss (not a list of dicts of shapes, a name listed twice).
Result<std::map<std::string, Shape>> ParamShapes(const PyValue& root, const std::string& name) {
  const PyValue* shapes = root.Get("param_shapes");
  if (shapes == nullptr) {
    return NotFoundError(name + ": no param_shapes (ZeRO-3's model states record each "
                                "parameter's shape there)");
  }
  std::vector<const PyValue*> groups;
  if (shapes->kind() == PyKind::kDict) {
    groups.push_back(shapes);
  } else if (shapes->kind() == PyKind::kList || shapes->kind() == PyKind::kTuple) {
    for (const PyValue* g : shapes->items()) groups.push_back(g);
  } else {
    return DataLossError(name + ": param_shapes is a " +
                         std::string(torch::PyKindName(shapes->kind())) +
                         ", not a list of dicts");
  }
  std::map<std::string, Shape> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string at = name + ": param_shapes[" + std::to_string(g) + "]";
    if (groups[g]->kind() != PyKind::kDict) return DataLossError(at + " is not a dict");
    for (const auto& [k, v] : groups[g]->entries()) {
      if (k->kind() != PyKind::kStr) return DataLossError(at + " has a key that is not a str");
      UCP_ASSIGN_OR_RETURN(Shape shape, AsShape(v, at + "[" + Q(k->str()) + "]"));
      UCP_RETURN_IF_ERROR(CheckedProduct(shape, at + "[" + Q(k->str()) + "]").status());
      if (!out.emplace(k->str(), std::move(shape)).second) {
        return DataLossError(at + " lists " + Q(k->str()) + " a second time");
      }
    }
  }
  return out;
}

// The dtype of the first tensor in a module state dict (Megatron GPTModel saves its weights in
// mp_rank files; GPTModelPipe saves module None).
std::optional<DType> FirstTensorDType(const PyValue* v, int depth = 0) {
  if (v == nullptr || depth > 8) return std::nullopt;
  if (v->kind() == PyKind::kTensor) return v->tensor().dtype;
  if (v->kind() == PyKind::kDict) {
    for (const auto& [k, x] : v->entries()) {
      if (auto d = FirstTensorDType(x, depth + 1)) return d;
    }
  }
  return std::nullopt;
}


bool IsIdentifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

struct ModelChoice {
  patterns::ModelSpec spec;
  std::string origin;
  bool dtype_known = false;  // recorded, or from the args' bf16 / fp16 flags
};

// The model of the folder (see OpenDeepSpeedUniversalSource): --model, the recorded ucp_model,
// or the Megatron args completed from the shapes.
Result<ModelChoice> ChooseModel(const fs::path& rules_dir, const std::string& model,
                                const PyValue& mp0, const std::string& mp0_name,
                                const std::vector<Param>& params) {
  ModelChoice c;
  const PyValue* args = ObjectState(mp0.Get("args"));
  const PyValue* ucp_model = mp0.Get("ucp_model");
  std::string family;
  if (!model.empty()) {
    std::error_code ec;
    if (!model.ends_with(".json") && model.find_first_of("/\\.") == std::string::npos &&
        fs::is_regular_file(rules_dir / (model + ".json"), ec)) {
      family = model;  // a family: the sizes come from the args and the shapes
    } else {
      UCP_ASSIGN_OR_RETURN(c.spec, patterns::LoadModel(rules_dir, model), "model " + Q(model));
      c.origin = "--model " + model;
      c.dtype_known = true;
      return c;
    }
  } else if (ucp_model != nullptr && !ucp_model->is_none()) {
    const std::string where = mp0_name + ": ucp_model";
    const PyValue* name = ucp_model->Get("name");
    const PyValue* fam = ucp_model->Get("family");
    const PyValue* hyper = ucp_model->Get("hyper");
    if (name == nullptr || name->kind() != PyKind::kStr || fam == nullptr ||
        fam->kind() != PyKind::kStr || hyper == nullptr || hyper->kind() != PyKind::kDict) {
      return DataLossError(where + " is not {name, family, hyper}");
    }
    c.spec.name = name->str();
    c.spec.family = fam->str();
    for (const auto& [k, v] : hyper->entries()) {
      if (k->kind() != PyKind::kStr) return DataLossError(where + ".hyper has a non-str key");
      UCP_ASSIGN_OR_RETURN(c.spec.hyper[k->str()], AsInt(v, where + ".hyper." + k->str()));
    }
    if (const PyValue* d = ucp_model->Get("dtype"); d != nullptr) {
      if (d->kind() != PyKind::kStr) return DataLossError(where + ".dtype is not a str");
      UCP_ASSIGN_OR_RETURN(c.spec.dtype, DTypeFromName(d->str()), where + ".dtype");
      c.dtype_known = true;
    }
    c.origin = "the ucp_model it records";
    return c;
  } else if (args == nullptr) {
    return InvalidArgumentError(mp0_name +
                                " records no model (neither ucp_model nor Megatron args); name "
                                "it with --model PRESET or --model FILE.json");
  }
  // The family named, or the one rule set whose rules the names fit.
  std::vector<std::string> names;
  for (const Param& p : params) names.push_back(p.name);
  UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules, SelectUniversalRuleSet(rules_dir, family, names));
  c.spec.family = rules.family;
  c.spec.name = rules.family;
  if (args != nullptr) {
    for (const auto& [hyper, arg] : kMegatronArgNames) {
      const PyValue* v = args->Get(arg);
      if (v != nullptr && v->kind() == PyKind::kInt && v->int_value() > 0) {
        if (v->int_value() > (int64_t{1} << 31)) {
          return DataLossError(mp0_name + ": args." + arg + " = " +
                               std::to_string(v->int_value()) + " is implausibly large");
        }
        c.spec.hyper[hyper] = v->int_value();
      }
    }
  }
  // What the args leave open, read off the full shapes: a size that is a dimension by itself
  // ("vocab" of the embedding), the number of layers and whether the output layer is tied.
  std::map<std::string, const Param*> by_name;
  int64_t layers = 0;
  bool has_output = false;
  for (const Param& p : params) {
    by_name[p.name] = &p;
    if (p.name.starts_with("output_layer.")) has_output = true;
    if (p.name.starts_with("layers.")) {
      const size_t dot = p.name.find('.', 7);
      if (dot != std::string::npos) {
        layers = std::max<int64_t>(layers, std::atoll(p.name.substr(7, dot - 7).c_str()) + 1);
      }
    }
  }
  c.spec.hyper.try_emplace("layers", layers);
  c.spec.hyper.try_emplace("tied_embeddings", has_output ? 0 : 1);
  for (const patterns::ParamTemplate& t : rules.templates) {
    std::string n = t.name;
    if (const size_t at = n.find("{layer}"); at != std::string::npos) n.replace(at, 7, "0");
    auto it = by_name.find(n);
    if (it == by_name.end() || it->second->shape.size() != t.shape.size()) continue;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (IsIdentifier(t.shape[d])) c.spec.hyper.try_emplace(t.shape[d], it->second->shape[d]);
    }
  }
  // Derived defaults, as patterns::LoadModel applies them to presets.
  std::map<std::string, int64_t>& h = c.spec.hyper;
  if (h.contains("heads") && h.contains("hidden") && h["heads"] > 0 &&
      h["hidden"] % h["heads"] == 0) {
    h.try_emplace("head_dim", h["hidden"] / h["heads"]);
  }
  if (h.contains("heads")) h.try_emplace("kv_heads", h["heads"]);
  h.try_emplace("make_vocab_size_divisible_by", 1);
  h.try_emplace("num_experts", 0);
  c.spec.dtype = DType::kFp32;
  auto flag = [&](const char* k) {
    const PyValue* v = args == nullptr ? nullptr : args->Get(k);
    return v != nullptr && v->kind() == PyKind::kBool && v->bool_value();
  };
  if (flag("bf16")) {
    c.spec.dtype = DType::kBf16;
    c.dtype_known = true;
  } else if (flag("fp16")) {
    c.spec.dtype = DType::kFp16;
    c.dtype_known = true;
  }
  c.origin = args != nullptr ? "Megatron args and shapes" : "family " + family + " and shapes";
  return c;
}

class UniversalFolderSource final : public api::CheckpointSource {
 public:
  UniversalFolderSource(std::vector<Param> params, CheckpointMeta meta)
      : params_(std::move(params)), meta_(std::move(meta)) {
    for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].name] = i;
  }
  const CheckpointMeta& meta() const override { return meta_; }

  Status ReadFlatRange(const TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    auto it = index_.find(t.param);
    if (it == index_.end()) {
      return NotFoundError(meta_.dir.string() + ": no parameter " + Q(t.param));
    }
    const Param& p = params_[it->second];
    // The training-dtype weights ("model") are the fp32 master rounded, as DeepSpeed's loader
    // makes them (update_lp_params) and as ucp's writers stored them.
    const std::string_view state = t.state == "model" ? std::string_view("fp32") : t.state;
    const auto s = std::find(kStates.begin(), kStates.end(), state);
    if (s == kStates.end()) {
      return NotFoundError(meta_.dir.string() + ": parameter " + Q(t.param) + " has no state " +
                           Q(t.state) + " (model, fp32, exp_avg, exp_avg_sq)");
    }
    const int64_t n = NumElementsOrDie(p.shape);
    if (begin < 0 || end < begin || end > n) {
      return OutOfRangeError("elements [" + std::to_string(begin) + ", " + std::to_string(end) +
                             ") of parameter " + Q(t.param) + " (" + std::to_string(n) + ")");
    }
    const StateFile& f = p.states[static_cast<size_t>(s - kStates.begin())];
    UCP_ASSIGN_OR_RETURN(std::shared_ptr<const io::RawFile> file, files_.Get(f.path));
    if (t.dtype == DType::kFp32) {
      if (static_cast<int64_t>(out.size()) != (end - begin) * 4) {
        return InvalidArgumentError("read of " + Q(t.param) + " into " +
                                    std::to_string(out.size()) + " bytes");
      }
      return file->ReadAt(f.data_offset + begin * 4, out);
    }
    std::vector<std::byte> buf(static_cast<size_t>((end - begin) * 4));
    UCP_RETURN_IF_ERROR(file->ReadAt(f.data_offset + begin * 4, buf));
    return CastElements(DType::kFp32, buf, t.dtype, out, end - begin);
  }

  std::vector<TensorInfo> StoredTensors() const override {
    std::vector<TensorInfo> out;
    for (const Param& p : params_) {
      TensorInfo m;
      m.name = p.name + "/model";
      m.param = p.name;
      m.state = "model";
      m.dtype = meta_.model.spec.dtype;
      m.shape = p.shape;
      out.push_back(std::move(m));
      for (const char* s : kStates) {
        TensorInfo i;
        i.name = p.name + "/" + s;
        i.param = p.name;
        i.state = s;
        i.dtype = DType::kFp32;
        i.shape = p.shape;
        out.push_back(std::move(i));
      }
    }
    return out;
  }

  Status VerifyChecksums() const override { return VerifyChecksumsPart(0, 1); }
  // Each state file's tensor record against its zip CRC-32 (files dealt round-robin), in
  // parallel; the first failure in file order is reported.
  Status VerifyChecksumsPart(int part, int parts) const override {
    std::vector<const StateFile*> mine;
    size_t k = 0;
    for (const Param& p : params_) {
      for (const StateFile& f : p.states) {
        if (static_cast<int>(k++ % static_cast<size_t>(parts)) == part) mine.push_back(&f);
      }
    }
    std::vector<Status> status(mine.size());
    std::atomic<bool> failed{false};
    tbb::parallel_for(size_t{0}, mine.size(), [&](size_t i) {
      if (failed.load(std::memory_order_relaxed)) return;
      status[i] = VerifyFile(*mine[i]);
      if (!status[i].ok()) failed = true;
    });
    for (Status& s : status) UCP_RETURN_IF_ERROR(std::move(s));
    return Status::Ok();
  }

  Status CheckUnchanged() const override { return files_.CheckUnchanged(); }

 private:
  Status VerifyFile(const StateFile& f) const {
    UCP_RETURN_IF_ERROR(files_.Note(f.path));
    UCP_ASSIGN_OR_RETURN(TorchFile t, TorchFile::Open(f.path));
    for (const torch::StorageRecord& r : t.storages()) {
      if (r.key == f.storage_key) return t.VerifyStorageCrc32(r);
    }
    return DataLossError(f.path.string() + ": storage " + Q(f.storage_key) + " is gone");
  }

  std::vector<Param> params_;
  std::map<std::string, size_t> index_;
  CheckpointMeta meta_;
  mutable io::RawFileCache files_;
};

}  // namespace

Result<std::unique_ptr<api::CheckpointSource>> OpenDeepSpeedUniversalSource(
    const fs::path& dir_in, const fs::path& data_dir, const std::string& model) {
  const fs::path dir = io::WithoutTrailingSlash(dir_in);
  const fs::path zero = dir / "zero";
  std::error_code ec;
  if (!fs::is_directory(zero, ec)) {
    return NotFoundError(dir.string() + " has no zero/ folder (DeepSpeed's universal layout)");
  }
  CheckpointMeta meta;
  meta.format = "deepspeed-universal";
  meta.layout = layout::UniversalLayout();
  meta.dir = dir;
  meta.model_from_options = true;
  meta.optimizer_states = {"fp32", "exp_avg", "exp_avg_sq"};

  // zero/optimizer_state.pt: the hyper-parameters of param group 0.
  const fs::path opt_path = zero / "optimizer_state.pt";
  if (!fs::is_regular_file(opt_path, ec)) return NotFoundError(opt_path.string() + ": missing");
  UCP_ASSIGN_OR_RETURN(TorchFile opt, TorchFile::Open(opt_path));
  if (opt.root().kind() != PyKind::kDict) {
    return DataLossError(opt_path.string() + ": holds a " +
                         std::string(torch::PyKindName(opt.root().kind())) + ", not a dict");
  }
  double wd = 0;
  if (const PyValue* groups = opt.root().Get("param_groups"); groups != nullptr) {
    if (groups->kind() != PyKind::kList || groups->items().empty() ||
        groups->items()[0]->kind() != PyKind::kDict) {
      return DataLossError(opt_path.string() + ": 'param_groups' is not a list of dicts");
    }
    const PyValue& g = *groups->items()[0];
    const std::string at = opt_path.string() + ": param_groups[0]";
    for (const char* k : {"lr", "eps", "weight_decay"}) {
      if (const PyValue* v = g.Get(k); v != nullptr) {
        UCP_ASSIGN_OR_RETURN(meta.optimizer_hyper[k], AsDouble(v, at + "." + k));
      }
    }
    if (const PyValue* b = g.Get("betas"); b != nullptr) {
      if ((b->kind() != PyKind::kTuple && b->kind() != PyKind::kList) || b->items().size() != 2) {
        return DataLossError(at + ".betas is not a pair");
      }
      UCP_ASSIGN_OR_RETURN(meta.optimizer_hyper["beta1"], AsDouble(b->items()[0], at + ".betas[0]"));
      UCP_ASSIGN_OR_RETURN(meta.optimizer_hyper["beta2"], AsDouble(b->items()[1], at + ".betas[1]"));
    }
    wd = meta.optimizer_hyper.contains("weight_decay") ? meta.optimizer_hyper["weight_decay"] : 0;
  }
  meta.optimizer_kind = wd != 0 ? "adamw" : "adam";

  // The model-state files: every one parsed (strict), rank 0's read for the model. ZeRO-1/2
  // folders (and ucp's) keep mp_rank_TT_model_states.pt; ds_to_universal's ZeRO-3 path copies
  // the source's zero_pp_rank_D_mp_rank_TT_model_states.pt instead (each with the client state
  // and args, and param_shapes), with no mp_rank file.
  std::vector<std::string> mp_files;
  std::map<std::pair<int64_t, int64_t>, std::string> zero3_files;  // (dp, tp) -> name
  static const std::regex kMp(R"(mp_rank_\d\d+_model_states\.pt)");
  static const std::regex kZero3(
      R"(zero_pp_rank_(0|[1-9]\d{0,8})_mp_rank_(\d{2,9})_model_states\.pt)");
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    std::smatch m;
    if (std::regex_match(n, kMp)) {
      mp_files.push_back(n);
    } else if (std::regex_match(n, m, kZero3)) {
      zero3_files[{std::stoll(m[1].str()), std::stoll(m[2].str())}] = n;
    }
  }
  if (ec) return IoError("cannot list " + dir.string() + ": " + ec.message());
  std::sort(mp_files.begin(), mp_files.end());
  const bool zero3 = mp_files.empty() && !zero3_files.empty();
  int64_t zero3_tp = 0;
  if (!mp_files.empty() && !zero3_files.empty()) {
    return DataLossError(dir.string() + ": holds both " + mp_files[0] + " and ZeRO-3's " +
                         zero3_files.begin()->second +
                         " (DeepSpeed's universal layout keeps the model-state files of one kind)");
  }
  if (zero3) {
    // A full dp x tp grid, as ds_to_universal copies it: the ranks found, and the world sizes
    // rank 0 records (so that a missing last rank is noticed too).
    int64_t dp = 0;
    for (const auto& [rank, n] : zero3_files) {
      dp = std::max(dp, rank.first + 1);
      zero3_tp = std::max(zero3_tp, rank.second + 1);
    }
    if (auto r0 = zero3_files.find({0, 0}); r0 != zero3_files.end()) {
      UCP_ASSIGN_OR_RETURN(TorchFile f, TorchFile::Open(dir / r0->second));
      for (auto [key, size] :
           {std::pair{"dp_world_size", &dp}, std::pair{"mp_world_size", &zero3_tp}}) {
        const PyValue* v = f.root().Get(key);
        if (v == nullptr || v->is_none()) continue;
        UCP_ASSIGN_OR_RETURN(int64_t n, AsInt(v, (dir / r0->second).string() + ": " + key));
        if (n < 1 || n < *size) {
          return DataLossError((dir / r0->second).string() + ": " + key + " = " +
                               std::to_string(n) + ", but the folder holds ZeRO-3 model-state " +
                               "files of " + std::to_string(*size) +
                               (key[0] == 'd' ? " dp" : " tp") + " ranks");
        }
        *size = n;
      }
    }
    for (int64_t d = 0; d < dp; ++d) {
      for (int64_t t = 0; t < zero3_tp; ++t) {
        if (zero3_files.contains({d, t})) continue;
        char name[96];
        std::snprintf(name, sizeof name, "zero_pp_rank_%lld_mp_rank_%02lld_model_states.pt",
                      static_cast<long long>(d), static_cast<long long>(t));
        return NotFoundError((dir / name).string() + ": missing (the ZeRO-3 model-state files " +
                             "of " + std::to_string(dp) + " dp x " + std::to_string(zero3_tp) +
                             " tp ranks are there but this one)");
      }
    }
    for (const auto& [rank, n] : zero3_files) mp_files.push_back(n);  // (0, 0) first
  } else if (mp_files.empty() || mp_files[0] != "mp_rank_00_model_states.pt") {
    return NotFoundError((dir / "mp_rank_00_model_states.pt").string() +
                         ": missing (DeepSpeed's universal layout keeps the model-state files: "
                         "mp_rank_TT_model_states.pt, or ZeRO-3's "
                         "zero_pp_rank_D_mp_rank_TT_model_states.pt)");
  }
  for (size_t i = 1; i < mp_files.size(); ++i) {
    UCP_RETURN_IF_ERROR(TorchFile::Open(dir / mp_files[i]).status());
  }
  const std::string mp0_name = (dir / mp_files[0]).string();
  UCP_ASSIGN_OR_RETURN(TorchFile mp0, TorchFile::Open(dir / mp_files[0]));
  if (mp0.root().kind() != PyKind::kDict) {
    return DataLossError(mp0_name + ": holds a " +
                         std::string(torch::PyKindName(mp0.root().kind())) + ", not a dict");
  }
  // At tp=1 ZeRO-3's param_shapes are the full shapes the flat state files lack; at tp > 1
  // they are rank 0's slices (the converter then writes {'param': full tensor, ...}).
  std::map<std::string, Shape> param_shapes;
  bool shaped_by_param_shapes = false;  // a flat state took its shape from there
  if (zero3 && zero3_tp == 1) {
    UCP_ASSIGN_OR_RETURN(param_shapes, ParamShapes(mp0.root(), mp0_name));
  }
  int64_t iteration = 0;
  if (const PyValue* v = mp0.root().Get("iteration"); v != nullptr && !v->is_none()) {
    UCP_ASSIGN_OR_RETURN(iteration, AsInt(v, mp0_name + ": iteration"));
  } else if (const PyValue* g = mp0.root().Get("global_steps"); g != nullptr && !g->is_none()) {
    // DeepSpeed's own engine records no iteration (Megatron's key), only its global_steps.
    UCP_ASSIGN_OR_RETURN(iteration, AsInt(g, mp0_name + ": global_steps"));
  }

  // The parameter folders, their names and their state files.
  std::vector<std::string> engines;
  for (fs::directory_iterator it(zero, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_directory()) engines.push_back(it->path().filename().string());
  }
  if (ec) return IoError("cannot list " + zero.string() + ": " + ec.message());
  if (engines.empty()) return NotFoundError(zero.string() + " holds no parameter folder");
  std::sort(engines.begin(), engines.end());
  // Megatron names carry the flavour (tied_modules.* / digits: GPTModelPipe; language_model.*:
  // GPTModel); a folder of plain names may hold names of neither.
  Naming naming = Naming::kPlain;
  for (const std::string& e : engines) {
    const Naming n = DetectNaming(e);
    if (n == Naming::kPlain) continue;
    if (naming != Naming::kPlain && n != naming) {
      return InvalidArgumentError(zero.string() + ": parameter folders of two namings (" +
                                  std::string(NamingName(naming)) + " and " +
                                  std::string(NamingName(n)) + ", " + Q(e) + ")");
    }
    naming = n;
  }
  std::vector<Param> params;
  std::set<std::string> seen;
  std::optional<double> step;
  std::string step_file;
  for (const std::string& e : engines) {
    Param p;
    p.engine = e;
    UCP_ASSIGN_OR_RETURN(p.name, CanonicalName(e, naming), (zero / e).string());
    if (!seen.insert(p.name).second) {
      return InvalidArgumentError(zero.string() + ": two folders are parameter " + Q(p.name));
    }
    for (size_t s = 0; s < kStates.size(); ++s) {
      const fs::path path = zero / e / (std::string(kStates[s]) + ".pt");
      const std::string where = "parameter " + Q(p.name) + ", state " + kStates[s];
      UCP_ASSIGN_OR_RETURN(OpenedState opened, OpenState(path, where));
      if (opened.bare && zero3) {
        // ds_to_universal's ZeRO-3 path at tp=1: the merged flat tensor, its shape in
        // param_shapes. At tp > 1 it writes dicts at the full shape, which param_shapes (each
        // rank's slice) cannot give.
        const std::string at = path.string() + " (" + where + ")";
        if (zero3_tp != 1) {
          return UnimplementedError(at + ": a bare tensor in a ZeRO-3 folder of tp=" +
                                    std::to_string(zero3_tp) + " ranks: its full shape is "
                                    "not recorded (param_shapes hold each tp rank's slice)");
        }
        auto ps = param_shapes.find(e);
        if (ps == param_shapes.end()) {
          return NotFoundError(at + ": a bare tensor, and " + mp0_name +
                               ": param_shapes has no " + Q(e) + " to give its shape");
        }
        const int64_t n = NumElementsOrDie(opened.shape);
        const int64_t want = NumElementsOrDie(ps->second);
        if (n != want || (opened.shape.size() != 1 && opened.shape != ps->second)) {
          return DataLossError(at + ": a bare " + ShapeString(opened.shape) + " tensor of " +
                               std::to_string(n) + " elements, but " + mp0_name +
                               ": param_shapes[" + Q(e) + "] is " + ShapeString(ps->second) +
                               " (" + std::to_string(want) + " elements)");
        }
        opened.shape = ps->second;  // row-major: the flat elements in the same order
        shaped_by_param_shapes = true;
      }
      if (s == 0) {
        p.shape = opened.shape;
      } else if (opened.shape != p.shape) {
        return DataLossError(path.string() + " (" + where + "): 'param' shape " +
                             ShapeString(opened.shape) + " differs from fp32.pt's " +
                             ShapeString(p.shape));
      }
      p.states[s] = std::move(opened.file);
    }
    const fs::path sp = zero / e / "step.pt";
    if (fs::exists(sp, ec)) {
      UCP_ASSIGN_OR_RETURN(double v, ReadStep(sp));
      if (step && *step != v) {
        return DataLossError(sp.string() + ": step " + std::to_string(v) + " differs from " +
                             step_file + "'s " + std::to_string(*step));
      }
      step = v;
      step_file = sp.string();
    }
    params.push_back(std::move(p));
  }
  if (!step) {
    // No step.pt (ds_to_universal's ZeRO-3 path): the Adam step of its optimizer_state.pt.
    UCP_ASSIGN_OR_RETURN(step, OptimizerStateStep(opt, opt_path.string()));
    if (step) step_file = opt_path.string();
  }
  if (step && (*step < 0 || *step != std::floor(*step) || *step > 1e15)) {
    return DataLossError(step_file + ": step " + std::to_string(*step) + " is not a count");
  }
  meta.step = step ? static_cast<int64_t>(*step) : iteration;
  // Layer indices checked now that the number of layers is known: the engine name of each
  // canonical name is the folder's.
  EngineNameContext context;
  for (const Param& p : params) {
    if (p.name.starts_with("output_layer.")) context.tied_embeddings = false;
    if (p.name.starts_with("layers.")) {
      const size_t dot = p.name.find('.', 7);
      if (dot != std::string::npos) {
        context.num_layers =
            std::max<int64_t>(context.num_layers, std::atoll(p.name.substr(7, dot - 7).c_str()) + 1);
      }
    }
  }
  for (const Param& p : params) {
    UCP_ASSIGN_OR_RETURN(std::string back, EngineName(p.name, naming, context),
                         (zero / p.engine).string());
    if (back != p.engine) {
      return InvalidArgumentError((zero / p.engine).string() + ": parameter " + Q(p.name) +
                                  " is " + Q(back) + " in a " + std::string(NamingName(naming)) +
                                  " model of " + std::to_string(context.num_layers) + " layers");
    }
  }

  // The model, and the folder checked against it.
  const fs::path rules_dir = RuleSetDir(data_dir);
  UCP_ASSIGN_OR_RETURN(ModelChoice choice,
                       ChooseModel(rules_dir, model, mp0.root(), mp0_name, params),
                       dir.string());
  patterns::ModelSpec spec = std::move(choice.spec);
  if (std::optional<DType> d = FirstTensorDType(mp0.root().Get("module"));
      d && !choice.dtype_known) {
    spec.dtype = *d;  // the training dtype of the weights Megatron saved
  }
  UCP_ASSIGN_OR_RETURN(patterns::RuleSet rules, patterns::LoadRuleSet(rules_dir, spec.family),
                       "model " + Q(spec.name));
  spec.templates = rules.templates;
  UCP_ASSIGN_OR_RETURN(patterns::ResolvedModel resolved, patterns::Resolve(spec, rules),
                       dir.string() + ": model " + Q(spec.name) + " (from " + choice.origin + ")");
  for (auto& p : resolved.params) p.dtype = spec.dtype;
  resolved.spec.dtype = spec.dtype;
  std::map<std::string, const Param*> by_name;
  for (const Param& p : params) by_name[p.name] = &p;
  for (const patterns::ResolvedParam& rp : resolved.params) {
    auto it = by_name.find(rp.name);
    if (it == by_name.end()) {
      std::string engine = rp.name;
      if (Result<std::string> e = EngineName(rp.name, naming, context); e.ok()) engine = *e;
      return NotFoundError((zero / engine).string() + ": missing: no folder for parameter " +
                           Q(rp.name) + " of model " + Q(spec.name) + " (from " + choice.origin +
                           ")");
    }
    if (it->second->shape != rp.shape) {
      return FailedPreconditionError((zero / it->second->engine / "fp32.pt").string() +
                                     ": parameter " + Q(rp.name) + " 'param' shape " +
                                     ShapeString(it->second->shape) + " is not model " +
                                     Q(spec.name) + "'s " + ShapeString(rp.shape) + " (from " +
                                     choice.origin + ")");
    }
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return FailedPreconditionError((zero / by_name.begin()->second->engine).string() +
                                   ": parameter " + Q(by_name.begin()->first) +
                                   " is not one of model " + Q(spec.name) + " (from " +
                                   choice.origin + ")");
  }
  meta.spec = spec;
  meta.model = std::move(resolved);
  meta.framework = naming == Naming::kPlain ? "deepspeed" : "megatron-deepspeed";
  meta.source_layout = "universal";
  meta.source_notes = dir.filename().string() + ", DeepSpeed universal layout, " +
                      std::to_string(params.size()) + " parameter folders, " +
                      std::string(NamingName(naming)) + " names, " +
                      std::to_string(mp_files.size()) +
                      (zero3 ? " ZeRO-3 model-state files" : " model-state files") +
                      (shaped_by_param_shapes ? " (shapes from param_shapes)" : "") +
                      ", model from " + choice.origin;
  std::string naming_json;
  AppendJsonString(NamingName(naming), naming_json);
  meta.client_state_json = "{\"deepspeed\":{\"naming\":" + naming_json + "}}";
  return std::unique_ptr<api::CheckpointSource>(
      new UniversalFolderSource(std::move(params), std::move(meta)));
}

}  // namespace ucp::deepspeed
