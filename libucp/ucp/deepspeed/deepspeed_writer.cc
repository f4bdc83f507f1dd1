// The DeepSpeed checkpoint writer (see deepspeed_writer.h): the files' Python values, laid out
// up front with deferred tensors, and the sink that places view slices into them.
#include "ucp/deepspeed/deepspeed_writer.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/deepspeed_checkpoint.h"
#include "ucp/deepspeed/pickle_values.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/torch/torch_writer.h"
#include "ucp/json/strict_json.h"
#include "ucp/tensor/cast.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using convert::TensorInfo;
using convert::TensorKind;
using json = ::ucp::json::OrderedJson;
using torch::PyArena;
using torch::PyKind;
using torch::PyValue;
using torch::TorchFile;
using torch::TorchWriter;

// "fp32", then the torch optimizer's states (DeepSpeedWriteOptions::optimizer_states).
std::vector<std::string> StateNames(const DeepSpeedWriteOptions& o) {
  std::vector<std::string> names = {"fp32"};
  for (const std::string& s : o.optimizer_states) names.push_back(s);
  return names;
}
// The DeepSpeed release whose file format this writer follows (and the peer tests load with);
// a source DeepSpeed checkpoint's own version is carried instead when there is one.
constexpr const char* kDeepSpeedVersion = "0.14.4";
// deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE of that release.
constexpr double kUniversalCheckpointVersion = 0.2;

// DeepSpeed's engine keys in mp_rank files (engine._save_checkpoint); every other key is the
// client's (Megatron: args, iteration, rng_state, ...), carried over from a source as it is.
const std::set<std::string>& EngineKeys() {
  static const std::set<std::string> keys = {"module",
                                             "buffer_names",
                                             "optimizer",
                                             "param_shapes",
                                             "frozen_param_shapes",
                                             "shared_params",
                                             "frozen_param_fragments",
                                             "lr_scheduler",
                                             "data_sampler",
                                             "random_ltd",
                                             "sparse_tensor_module_names",
                                             "csr_tensor_module_names",
                                             "skipped_steps",
                                             "global_steps",
                                             "global_samples",
                                             "dp_world_size",
                                             "mp_world_size",
                                             "checkpoint_parallel_dimensions",
                                             "ds_config",
                                             "ds_version",
                                             "num_experts"};
  return keys;
}

// A JSON value as the Python value json.load would give (objects become dicts).
const PyValue* FromJson(PyArena& a, const json& j) {
  switch (j.type()) {
    case json::value_t::null:
      return a.None();
    case json::value_t::boolean:
      return a.Bool(j.get<bool>());
    case json::value_t::number_integer:
      return a.Int(j.get<int64_t>());
    case json::value_t::number_unsigned:
      return j.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                 ? a.Float(static_cast<double>(j.get<uint64_t>()))
                 : a.Int(static_cast<int64_t>(j.get<uint64_t>()));
    case json::value_t::number_float:
      return a.Float(j.get<double>());
    case json::value_t::string:
      return a.Str(j.get<std::string>());
    case json::value_t::array: {
      PyValue* l = a.List();
      for (const json& x : j) l->Append(FromJson(a, x));
      return l;
    }
    case json::value_t::object: {
      // AppendJson's lossless escapes (pickle_values.h) turn back into what was pickled.
      if (j.size() == 1) {
        for (const char* kind : {"py/str", "py/bytes"}) {
          if (!j.contains(kind) || !j[kind].is_string()) continue;
          if (std::optional<std::string> b = UnescapeHex(j[kind].get<std::string>())) {
            return kind[3] == 's' ? a.Str(std::move(*b)) : a.Bytes(std::move(*b));
          }
        }
      }
      PyValue* d = a.Dict();
      for (const auto& [k, v] : j.items()) {
        std::optional<std::string> key = UnescapeJsonKey(k);
        d->SetItem(a.Str(key ? std::move(*key) : k), FromJson(a, v));
      }
      return d;
    }
    default:
      return a.None();
  }
}

// A Python value as JSON, where JSON can hold it (pickle_values.h AppendJson: strings JSON
// cannot hold are escaped, so the text always parses).
Result<json> ToJson(const PyValue* v) {
  std::string s;
  UCP_RETURN_IF_ERROR(AppendJson(v, s));
  return ::ucp::json::ParseStrictOrdered(s, "a pickled value", StatusCode::kInternal);
}

const PyValue* Namespace(PyArena& a, const PyValue* state) {
  // argparse.Namespace pickles (protocol 2) as copyreg.__newobj__: cls.__new__(cls) + BUILD.
  PyValue* o = a.Object(a.Global("argparse", "Namespace"), a.Tuple(), /*newobj=*/true);
  o->SetState(state);
  return o;
}

std::string EscapeRegex(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\.^$|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

// The client state to carry over: from a DeepSpeed folder (its pickled values, exactly), or
// from the JSON an extraction recorded.
struct Carried {
  std::optional<DeepSpeedCheckpoint> ck;
  std::vector<std::unique_ptr<TorchFile>> mp;  // per source (pp, tp), opened on first use
  std::optional<TorchFile> optim0;
  const PyValue* osd = nullptr;  // optim0's optimizer_state_dict
  json js;                       // the "deepspeed" object, or null

  bool from_folder() const { return ck.has_value(); }
  // The source's model-state file nearest to target rank (pp, tp): the same (pp, tp) when the
  // source has it, else rank 0's.
  Result<const TorchFile*> ModelStates(int pp, int tp) {
    int s = 0, r = 0;
    if (pp < ck->pp() && tp < ck->tp()) s = pp, r = tp;
    const size_t i = static_cast<size_t>(s) * ck->tp() + r;
    if (mp[i] == nullptr) {
      UCP_ASSIGN_OR_RETURN(TorchFile f, TorchFile::Open(ck->dir() / ck->ModelStatesFile(s, r)));
      mp[i] = std::make_unique<TorchFile>(std::move(f));
    }
    return mp[i].get();
  }
};

Result<Carried> LoadCarried(const DeepSpeedWriteOptions& o) {
  Carried c;
  if (!o.model_states_from.empty()) {
    OpenOptions open;
    open.bind_model = false;
    UCP_ASSIGN_OR_RETURN(c.ck, DeepSpeedCheckpoint::Open(o.model_states_from, open),
                         "model states from " + o.model_states_from.string());
    c.mp.resize(static_cast<size_t>(c.ck->pp()) * c.ck->tp());
    const std::string name = c.ck->OptimStatesFile(0, 0, 0);
    UCP_ASSIGN_OR_RETURN(TorchFile f, TorchFile::Open(c.ck->dir() / name));
    c.optim0.emplace(std::move(f));
    UCP_ASSIGN_OR_RETURN(c.osd, c.optim0->root().Find("optimizer_state_dict", name));
    return c;
  }
  if (!o.client_state_json.empty()) {
    UCP_ASSIGN_OR_RETURN(
        c.js, ::ucp::json::ParseStrictOrdered(o.client_state_json, "the source's client state",
                                              StatusCode::kInvalidArgument));
    if (!c.js.is_object()) {
      return InvalidArgumentError("the source's client state \"deepspeed\" is not an object");
    }
  }
  return c;
}

// One output file being written.
struct OutFile {
  std::unique_ptr<TorchWriter> writer;  // owns the values the file's pickle references
  std::optional<torch::StreamedTorchFile> file;
};

// Where a view slice goes: the flat buffers of one or more (pp, tp) ranks (the tied module's
// copy on the last stage takes stage 0's values too), or one module record.
struct OptimPlace {
  int32_t rank = 0;   // index into target.ranks
  int32_t param = 0;  // index into TargetRank::params
};
struct Destination {
  int state = -1;  // >= 0: StateNames' index; -1: the model weight
  std::vector<OptimPlace> optim;
  int32_t file = -1;     // model: index into files
  int32_t storage = -1;  // model: the deferred tensor id
  int64_t item = 4;      // bytes per element
  // A fused QKV written per-rank-blocks: where the view's per-group rows go (qkv_layout.h).
  std::vector<RowBlock> qkv_blocks;
};

}  // namespace

struct DeepSpeedWriter::Impl {
  fs::path dst, tmp;
  std::string tag;
  DeepSpeedWriteOptions options;
  DeepSpeedTarget target;
  std::vector<OutFile> files;
  // Per rank, per dp partition: the optim file; per group and state: its deferred storage.
  struct RankFiles {
    std::vector<int32_t> optim;                              // per d: index into files
    std::vector<std::vector<std::vector<int32_t>>> storage;  // [d][g][state]
  };
  std::vector<RankFiles> rank_files;
  std::unordered_map<std::string, Destination> by_name;
  std::vector<int32_t> targets;
  bool committed = false;

  Status Place(const Destination& d, int64_t begin, std::span<const std::byte> data);
};

DeepSpeedWriter::DeepSpeedWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DeepSpeedWriter::~DeepSpeedWriter() {
  if (impl_ != nullptr && !impl_->committed && !impl_->tmp.empty()) {
    impl_->files.clear();  // unfinished files unlink their temporaries first
    io::RemoveTreeBestEffort(impl_->tmp);
  }
}

const std::vector<int32_t>& DeepSpeedWriter::targets() const { return impl_->targets; }
const DeepSpeedTarget& DeepSpeedWriter::target() const { return impl_->target; }
const fs::path& DeepSpeedWriter::temp_dir() const { return impl_->tmp; }

namespace {

// Builds the Python values of one checkpoint's files.
class Builder {
 public:
  Builder(const patterns::ResolvedModel& model, const DeepSpeedTarget& target,
          const DeepSpeedWriteOptions& options, Carried& carried)
      : model_(model), target_(target), o_(options), c_(carried) {}

  int64_t Iteration() const {
    if (c_.from_folder()) return c_.ck->iteration();
    if (c_.js.contains("iteration") && c_.js["iteration"].is_number_integer()) {
      return c_.js["iteration"].get<int64_t>();
    }
    return o_.step;
  }
  bool Megatron() const { return target_.layout.naming != Naming::kPlain; }
  DType dtype() const { return model_.spec.dtype; }

  // ds_config: the source's, with the ZeRO stage (and for BF16_Optimizer the gradient
  // accumulation dtype that selects it) set to what is written; a minimal one otherwise. The
  // reader takes the training dtype from it, so bf16 / fp16 are always stated.
  Result<const PyValue*> DsConfig(PyArena& a) {
    json cfg = json::object();
    if (c_.from_folder()) {
      UCP_ASSIGN_OR_RETURN(const TorchFile* f, c_.ModelStates(0, 0));
      const PyValue* v = f->root().Get("ds_config");
      if ((v == nullptr || v->is_none()) && c_.optim0.has_value()) {
        // DeepSpeed-MoE's model states hold none; its optimizer files do.
        v = c_.optim0->root().Get("ds_config");
      }
      if (v != nullptr && !v->is_none()) {
        UCP_ASSIGN_OR_RETURN(cfg, ToJson(v), "ds_config");
      }
    } else if (c_.js.contains("ds_config") && c_.js["ds_config"].is_object()) {
      cfg = c_.js["ds_config"];
    }
    if (!cfg.is_object()) cfg = json::object();
    if (!cfg.contains("zero_optimization") || !cfg["zero_optimization"].is_object()) {
      cfg["zero_optimization"] = json::object();
    }
    cfg["zero_optimization"]["stage"] = target_.layout.zero_stage;
    for (const char* k : {"bf16", "fp16"}) {
      const bool on = (dtype() == DType::kBf16 && k == std::string("bf16")) ||
                      (dtype() == DType::kFp16 && k == std::string("fp16"));
      if (cfg.contains(k) && cfg[k].is_object()) {
        cfg[k]["enabled"] = on;
      } else if (on) {
        cfg[k] = {{"enabled", true}};
      }
    }
    if (o_.bf16_optimizer) {
      if (!cfg.contains("data_types") || !cfg["data_types"].is_object()) {
        cfg["data_types"] = json::object();
      }
      cfg["data_types"]["grad_accum_dtype"] = "fp32";
    }
    return FromJson(a, cfg);
  }

  const PyValue* DsVersion(PyArena& a) {
    if (c_.from_folder() && c_.osd != nullptr) {
      if (const PyValue* v = c_.osd->Get("ds_version"); v && v->kind() == PyKind::kStr) return v;
    }
    if (c_.js.contains("ds_version") && c_.js["ds_version"].is_string()) {
      return a.Str(c_.js["ds_version"].get<std::string>());
    }
    return a.Str(kDeepSpeedVersion);
  }

  // The value of engine key `key` in the source's model states, copied, or nullptr.
  Result<const PyValue*> CarriedKey(TorchWriter& w, int pp, int tp, const char* key) {
    if (c_.from_folder()) {
      UCP_ASSIGN_OR_RETURN(const TorchFile* f, c_.ModelStates(pp, tp));
      if (const PyValue* v = f->root().Get(key); v != nullptr) return w.CopyFrom(*f, *v);
      return static_cast<const PyValue*>(nullptr);
    }
    if (c_.js.contains(key)) return FromJson(w.arena(), c_.js[key]);
    return static_cast<const PyValue*>(nullptr);
  }

  // Megatron's args with the parallel sizes (and the padded vocabulary) of the new layout.
  std::map<std::string, int64_t> ArgUpdates() const {
    const DeepSpeedLayout& l = target_.layout;
    std::map<std::string, int64_t> u = {
        {"tensor_model_parallel_size", l.tp},
        {"pipeline_model_parallel_size", l.pp},
        {"transformer_pipeline_model_parallel_size", l.pp},
        {"data_parallel_size", l.dp},
        {"ds_sequence_parallel_size", l.sp},
        {"world_size", static_cast<int64_t>(l.tp) * l.pp * l.dp * l.sp},
        {"zero_stage", l.zero_stage}};
    for (const patterns::ResolvedParam& p : model_.params) {
      if (p.rule.kind != patterns::RuleKind::kPadStrip) continue;
      Result<patterns::Slice> s = patterns::SliceParam(p, l.tp, 0, 1, 0);
      if (s.ok()) u["padded_vocab_size"] = s->local_shape[p.rule.dim] * l.tp;
      break;
    }
    return u;
  }

  // args: the source's Namespace (values kept exactly) with ArgUpdates applied to the keys it
  // has; from JSON, a Namespace of the recorded attributes.
  Result<const PyValue*> Args(TorchWriter& w, int pp, int tp) {
    PyArena& a = w.arena();
    const std::map<std::string, int64_t> updates = ArgUpdates();
    const PyValue* bool_keys_value = a.Bool(target_.layout.naming != Naming::kMegatronPipe);
    PyValue* state = a.Dict();
    if (c_.from_folder()) {
      UCP_ASSIGN_OR_RETURN(const TorchFile* f, c_.ModelStates(pp, tp));
      const PyValue* args = f->root().Get("args");
      const PyValue* src = ObjectState(args);
      if (src == nullptr) return static_cast<const PyValue*>(nullptr);
      for (const auto& [k, v] : src->entries()) {
        UCP_ASSIGN_OR_RETURN(const PyValue* kc, w.CopyFrom(*f, *k));
        const PyValue* vc = nullptr;
        if (k->kind() == PyKind::kStr && updates.contains(k->str()) && v->kind() == PyKind::kInt) {
          vc = a.Int(updates.at(k->str()));
        } else if (k->kind() == PyKind::kStr && k->str() == "no_pipeline_parallel" &&
                   v->kind() == PyKind::kBool) {
          vc = bool_keys_value;
        } else {
          UCP_ASSIGN_OR_RETURN(vc, w.CopyFrom(*f, *v));
        }
        state->SetItem(kc, vc);
      }
      PyValue* o = a.Object(args->callable(), a.Tuple(), args->is_newobj());
      o->SetState(state);
      return static_cast<const PyValue*>(o);
    }
    if (!c_.js.contains("args") || !c_.js["args"].is_object()) {
      return static_cast<const PyValue*>(nullptr);
    }
    for (const auto& [k, v] : c_.js["args"].items()) {
      const PyValue* value = FromJson(a, v);
      if (updates.contains(k) && v.is_number_integer()) value = a.Int(updates.at(k));
      if (k == "no_pipeline_parallel" && v.is_boolean()) value = bool_keys_value;
      state->SetItem(a.Str(k), value);
    }
    return Namespace(a, state);
  }

  // Megatron-DeepSpeed's universal_checkpoint_info, made from ucp's rules for the written
  // layout (exact engine names), so DeepSpeed's ds_to_universal merges the TP slices right
  // whatever the source saved (deepspeed_ucp.md 9: a TP=1 source saves no row-parallel list).
  const PyValue* UniversalInfo(PyArena& a) {
    const DeepSpeedLayout& l = target_.layout;
    json version = kUniversalCheckpointVersion;
    if (c_.from_folder()) {
      Result<const TorchFile*> f = c_.ModelStates(0, 0);
      if (f.ok()) {
        const PyValue* info = (*f)->root().Get("universal_checkpoint_info");
        if (const PyValue* v = info ? info->Get("universal_checkpoint_version") : nullptr) {
          // A scalar: its JSON cannot fail; a malformed one keeps the default version.
          if (Result<json> j = ToJson(v); j.ok()) version = std::move(*j);
        }
      }
    } else if (c_.js.contains("universal_checkpoint_info") &&
               c_.js["universal_checkpoint_info"].is_object() &&
               c_.js["universal_checkpoint_info"].contains("universal_checkpoint_version")) {
      version = c_.js["universal_checkpoint_info"]["universal_checkpoint_version"];
    }
    json vocab = json::array(), pipe = json::array(), replicated = json::array(),
         average = json::array(), row = json::array(), two = json::array();
    const EngineNameContext names{target_.num_layers, target_.tied_embeddings};
    int64_t padded = 0;
    for (const patterns::ResolvedParam& p : model_.params) {
      Result<std::string> engine = EngineName(p.name, l.naming, names);
      if (!engine.ok()) continue;  // DescribeDeepSpeedTarget already refused such names
      const std::string pattern = EscapeRegex(*engine) + "$";
      const patterns::ResolvedRule& r = p.rule;
      if (l.naming == Naming::kMegatronPipe && target_.tied_embeddings &&
          engine->starts_with("tied_modules.")) {
        pipe.push_back(pattern);
      }
      if (r.axis != patterns::Axis::kTp) continue;
      switch (r.kind) {
        case patterns::RuleKind::kReplicate:
          if (l.tp > 1) replicated.push_back(pattern);
          break;
        case patterns::RuleKind::kAverage:
          average.push_back(pattern);
          break;
        case patterns::RuleKind::kShard:
          if (r.dim == 1 && l.tp > 1) row.push_back(pattern);
          break;
        case patterns::RuleKind::kFuse:
          // interleaved_groups: the TP slices are whole groups, so their dim-0 concatenation is
          // the tensor (the default merge). concat order with two parts ([gate; up]): DeepSpeed's
          // two-sub-parameter merge.
          if (r.order == patterns::FuseOrder::kConcat && r.dim == 0 && r.part_sizes.size() == 2) {
            two.push_back(pattern);
          }
          break;
        case patterns::RuleKind::kPadStrip:
          if (r.dim == 0) {
            vocab.push_back(pattern);
            Result<patterns::Slice> s = patterns::SliceParam(p, l.tp, 0, 1, 0);
            if (s.ok()) padded = s->local_shape[0] * l.tp;
          }
          break;
      }
    }
    json info = json::object();
    info["universal_checkpoint_version"] = version;
    if (model_.spec.hyper.contains("vocab")) {
      info["original_vocab_size"] = model_.spec.hyper.at("vocab");
      if (padded > 0) info["padded_vocab_size"] = padded;
    }
    info["vocabulary_parameter_patterns"] = vocab;
    if (l.naming == Naming::kMegatronPipe) info["pipeline_replicated_parameter_patterns"] = pipe;
    if (!replicated.empty()) info["tp_replicated_parameter_patterns"] = replicated;
    if (!average.empty()) info["parameter_to_average_patterns"] = average;
    if (!row.empty()) info["parameter_with_row_parallelism_patterns"] = row;
    info["parameter_with_2_sub_params_cat_dim_0"] = two;
    return FromJson(a, info);
  }

  // mp_rank_XX_model_states.pt of rank (pp, tp); module weights are deferred tensors whose ids
  // go to `model_ids` (per TargetRank::model entry saved in this file, else -1).
  Result<const PyValue*> ModelStates(TorchWriter& w, const TargetRank& rank,
                                     std::vector<int32_t>& model_ids) {
    PyArena& a = w.arena();
    const DeepSpeedLayout& l = target_.layout;
    const bool zero2 = l.zero_stage >= 2;  // frozen-parameter entries: ZeRO-2 and ZeRO-3
    PyValue* root = a.Dict();
    auto carried_or = [&](const char* key, const PyValue* fallback) -> Result<const PyValue*> {
      UCP_ASSIGN_OR_RETURN(const PyValue* v, CarriedKey(w, rank.pp, rank.tp, key));
      return v != nullptr ? v : fallback;
    };
    if (l.naming == Naming::kMegatronPipe) {
      root->SetItem(a.Str("module"), a.None());  // the weights are in the layer files
    } else if (l.zero_stage == 3) {
      // ZeRO-3's module_state_dict holds each partitioned parameter's placeholder: an empty
      // tensor of the training dtype, in module order; load_state_dict copies them onto the
      // engine's (equally empty) parameters.
      std::vector<const TargetParam*> order;
      for (const TargetParam& p : rank.params) order.push_back(&p);
      std::sort(order.begin(), order.end(), [](const TargetParam* x, const TargetParam* y) {
        return x->model_index < y->model_index;
      });
      PyValue* module = a.Dict(/*ordered=*/true);
      for (const TargetParam* p : order) {
        UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Zeros(dtype(), {0}));
        UCP_ASSIGN_OR_RETURN(const PyValue* v, w.AddOwnedTensor(std::move(t)));
        module->SetItem(a.Str(p->engine_name), v);
      }
      root->SetItem(a.Str("module"), module);
    } else {
      PyValue* module = a.Dict(/*ordered=*/true);
      // GPTModel's module nests as Megatron-DeepSpeed's save writes it (its
      // state_dict_for_save_checkpoint): language_model -> embedding -> word_embeddings ->
      // weight, encoder -> flat "layers.N.<rest>" keys, output_layer -> weight.
      std::map<std::string, PyValue*> nested;  // dotted path -> its OrderedDict
      auto dict_at = [&](const std::vector<std::string>& path) {
        PyValue* d = module;
        std::string at;
        for (const std::string& part : path) {
          at += (at.empty() ? "" : ".") + part;
          auto [it, inserted] = nested.try_emplace(at, nullptr);
          if (inserted) {
            it->second = a.Dict(/*ordered=*/true);
            d->SetItem(a.Str(part), it->second);
          }
          d = it->second;
        }
        return d;
      };
      const std::string file = target_.ModelStatesFile(rank.pp, rank.tp);
      for (size_t i = 0; i < rank.model.size(); ++i) {
        const ModelRecord& m = rank.model[i];
        if (m.file != file) continue;
        const TargetParam& p = rank.params[static_cast<size_t>(m.param)];
        UCP_ASSIGN_OR_RETURN(torch::DeferredTensor t,
                             w.AddDeferredTensor(dtype(), p.local_shape, p.numel));
        PyValue* d = module;
        std::string key = m.key;
        if (l.naming == Naming::kMegatronGpt) {
          static constexpr std::string_view kLm = "language_model.";
          if (key.starts_with("language_model.encoder.")) {
            d = dict_at({"language_model", "encoder"});
            key = key.substr(std::string_view("language_model.encoder.").size());
          } else if (key.starts_with(kLm) && key.find('.', kLm.size()) != std::string::npos) {
            // embedding.<sub>.<leaf>, output_layer.<leaf>: one dict per module level.
            std::vector<std::string> path = {"language_model"};
            std::string rest = key.substr(kLm.size());
            for (size_t dot; (dot = rest.find('.')) != std::string::npos;) {
              path.push_back(rest.substr(0, dot));
              rest = rest.substr(dot + 1);
            }
            d = dict_at(path);
            key = rest;
          }
        }
        d->SetItem(a.Str(key), t.node);
        model_ids[i] = t.id;
      }
      root->SetItem(a.Str("module"), module);
    }
    const bool moe = l.deepspeed_moe;
    // The engine's run keys, in its order (both savers write them; the MoE one first).
    auto set_run_keys = [&]() -> Status {
      for (const char* key : {"lr_scheduler", "data_sampler", "random_ltd"}) {
        UCP_ASSIGN_OR_RETURN(const PyValue* v, carried_or(key, a.None()));
        root->SetItem(a.Str(key), v);
      }
      UCP_ASSIGN_OR_RETURN(const PyValue* sparse,
                           carried_or("sparse_tensor_module_names", a.Set()));
      root->SetItem(a.Str("sparse_tensor_module_names"), sparse);
      UCP_ASSIGN_OR_RETURN(const PyValue* skipped, carried_or("skipped_steps", a.Int(0)));
      root->SetItem(a.Str("skipped_steps"), skipped);
      UCP_ASSIGN_OR_RETURN(const PyValue* steps, carried_or("global_steps", a.Int(Iteration())));
      root->SetItem(a.Str("global_steps"), steps);
      // Unknown without a source; DeepSpeed then takes global_steps * train_batch_size.
      UCP_ASSIGN_OR_RETURN(const PyValue* samples, carried_or("global_samples", nullptr));
      if (samples != nullptr) root->SetItem(a.Str("global_samples"), samples);
      root->SetItem(a.Str("dp_world_size"), a.Int(target_.DpWorldSize()));
      root->SetItem(a.Str("mp_world_size"), a.Int(target_.MpWorldSize()));
      return Status::Ok();
    };
    if (moe) {
      // engine.py _save_moe_checkpoint: the module without the experts (saved in their own
      // files), then its own keys, with num_experts and without param_shapes, buffer names,
      // frozen parameters, ds_config and ds_version.
      UCP_RETURN_IF_ERROR(set_run_keys());
      PyValue* experts = a.List();
      for (int64_t n : target_.num_experts) experts->Append(a.Int(n));
      root->SetItem(a.Str("num_experts"), experts);
    } else {
      UCP_ASSIGN_OR_RETURN(const PyValue* buffers, carried_or("buffer_names", a.List()));
      root->SetItem(a.Str("buffer_names"), buffers);
      root->SetItem(a.Str("optimizer"), a.None());
      PyValue* shapes = a.List();
      for (const TargetGroup& g : rank.groups) {
        PyValue* d = a.Dict(/*ordered=*/true);
        for (int32_t i : g.params) {
          const TargetParam& p = rank.params[static_cast<size_t>(i)];
          d->SetItem(a.Str(p.engine_name), a.TorchSize(p.local_shape));
        }
        shapes->Append(d);
      }
      root->SetItem(a.Str("param_shapes"), shapes);
      // ZeRO-2 saves the (here empty) frozen parameters' shapes and fragments; ZeRO-1 None.
      root->SetItem(a.Str("frozen_param_shapes"), zero2 ? a.Dict(true) : a.None());
      root->SetItem(a.Str("shared_params"), a.Dict());
      root->SetItem(a.Str("frozen_param_fragments"), zero2 ? a.Dict(true) : a.None());
      UCP_RETURN_IF_ERROR(set_run_keys());
      PyValue* dims = a.Dict();
      dims->SetItem(a.Str("pp_degree"), a.Int(l.pp));
      dims->SetItem(a.Str("tp_degree"), a.Int(l.tp));
      root->SetItem(a.Str("checkpoint_parallel_dimensions"), dims);
      UCP_ASSIGN_OR_RETURN(const PyValue* cfg, DsConfig(a));
      root->SetItem(a.Str("ds_config"), cfg);
      root->SetItem(a.Str("ds_version"), DsVersion(a));
    }

    // Client state: the source's keys in its order (args and universal_checkpoint_info
    // rewritten for the new layout), or what JSON kept; Megatron namings always get the
    // iteration, checkpoint version and universal_checkpoint_info Megatron's loader reads.
    std::set<std::string> done;
    auto put = [&](const std::string& k, const PyValue* v) {
      root->SetItem(a.Str(k), v);
      done.insert(k);
    };
    if (c_.from_folder()) {
      UCP_ASSIGN_OR_RETURN(const TorchFile* f, c_.ModelStates(rank.pp, rank.tp));
      for (const auto& [k, v] : f->root().entries()) {
        if (k->kind() != PyKind::kStr || EngineKeys().contains(k->str())) continue;
        if (k->str() == "args") {
          UCP_ASSIGN_OR_RETURN(const PyValue* args, Args(w, rank.pp, rank.tp));
          if (args != nullptr) put("args", args);
        } else if (k->str() == "universal_checkpoint_info") {
          put(k->str(), UniversalInfo(a));
        } else {
          UCP_ASSIGN_OR_RETURN(const PyValue* vc, w.CopyFrom(*f, *v));
          put(k->str(), vc);
        }
      }
    } else {
      UCP_ASSIGN_OR_RETURN(const PyValue* args, Args(w, rank.pp, rank.tp));
      if (args != nullptr) put("args", args);
      for (const char* k : {"checkpoint_version", "iteration", "tokens"}) {
        if (c_.js.contains(k) && !c_.js[k].is_null()) put(k, FromJson(a, c_.js[k]));
      }
    }
    if (!o_.ucp_client_state_json.empty() && !done.contains("ucp_client_state")) {
      put("ucp_client_state", a.Str(o_.ucp_client_state_json));
    }
    if (Megatron()) {
      if (!done.contains("checkpoint_version")) put("checkpoint_version", a.Float(3.0));
      if (!done.contains("iteration")) put("iteration", a.Int(Iteration()));
    }
    // Written for every naming (plain DeepSpeed clients save none): with it DeepSpeed's own
    // ds_to_universal converts what ucp wrote, at any tp, without --inject_missing_state.
    if (!done.contains("universal_checkpoint_info")) {
      put("universal_checkpoint_info", UniversalInfo(a));
    }
    // ucp's model, so that ucp reads the checkpoint back without --model (head counts are not
    // in the shapes); DeepSpeed hands unknown keys to the client, which ignores them.
    PyValue* ucp = a.Dict();
    ucp->SetItem(a.Str("name"), a.Str(model_.spec.name));
    ucp->SetItem(a.Str("family"), a.Str(model_.spec.family));
    ucp->SetItem(a.Str("dtype"), a.Str(std::string(DTypeName(model_.spec.dtype))));
    PyValue* hyper = a.Dict();
    for (const auto& [k, v] : model_.spec.hyper) hyper->SetItem(a.Str(k), a.Int(v));
    ucp->SetItem(a.Str("hyper"), hyper);
    put("ucp_model", ucp);
    // The fused QKV's row order, so that a reader need not infer it from the args (a post-#441
    // source's args are carried whatever order is written).
    if (HasFusedQkv(model_)) {
      put("ucp_qkv_layout", a.Str(std::string(QkvLayoutName(o_.qkv_layout))));
    }
    return root;
  }

  bool Adam() const {
    return o_.optimizer_states == std::vector<std::string>{"exp_avg", "exp_avg_sq"};
  }

  // The source's torch optimizer state_dict: base_optimizer_state (ZeRO-1/2, BF16_Optimizer) or
  // ZeRO-3's optimizer_state_dict.
  const PyValue* SourceBase() const {
    if (const PyValue* b = c_.osd->Get("base_optimizer_state"); b != nullptr) return b;
    return c_.osd->Get("optimizer_state_dict");
  }

  // The source's value of optimizer_state_dict key `key`, copied, or from the JSON record.
  Result<const PyValue*> CarriedOptim(TorchWriter& w, const char* key) {
    if (c_.from_folder()) {
      if (const PyValue* v = c_.osd->Get(key); v != nullptr) return w.CopyFrom(*c_.optim0, *v);
      return static_cast<const PyValue*>(nullptr);
    }
    if (c_.js.contains("optimizer_state") && c_.js["optimizer_state"].is_object() &&
        c_.js["optimizer_state"].contains(key)) {
      const json& v = c_.js["optimizer_state"][key];
      if (std::string(key) == "loss_scaler") {
        // {"class": "module.Name", "state": {...}}: the scaler object, its dtype restored (JSON
        // has no torch dtypes; only fp16 training uses a dynamic scaler). The class becomes a
        // global that torch.load imports, so only DeepSpeed's two scalers are accepted from a
        // manifest (anything else is left to the engine).
        static const std::set<std::string> kScalers = {
            "deepspeed.runtime.fp16.loss_scaler.LossScaler",
            "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"};
        if (!v.is_object() || !v.contains("class") || !v["class"].is_string() ||
            !kScalers.contains(v["class"].get<std::string>()) || !v.contains("state") ||
            !v["state"].is_object()) {
          return static_cast<const PyValue*>(nullptr);
        }
        PyArena& a = w.arena();
        PyValue* state = a.Dict();
        for (const auto& [k, x] : v["state"].items()) {
          state->SetItem(a.Str(k), k == "dtype" ? a.DTypeGlobal(DType::kFp16) : FromJson(a, x));
        }
        PyValue* o = a.Object(a.Global(v["class"].get<std::string>()), a.Tuple(), true);
        o->SetState(state);
        return static_cast<const PyValue*>(o);
      }
      return FromJson(w.arena(), v);
    }
    return static_cast<const PyValue*>(nullptr);
  }

  // Which of the source's `n` param groups stands for a group of `kind`: among its groups of
  // the same sort (DeepSpeed-MoE expert groups, marked `moe`, or the others) the one of that
  // kind, or the last; the dense ones when it has no expert group. `is_moe(i)` says which are.
  template <typename IsMoe>
  static size_t SourceGroup(size_t n, int kind, bool expert, IsMoe is_moe) {
    std::vector<size_t> same, dense;
    for (size_t i = 0; i < n; ++i) {
      (is_moe(i) ? same : dense).push_back(i);
    }
    if (!expert) same.swap(dense);
    if (same.empty()) same = dense.empty() ? std::vector<size_t>{0} : dense;
    return same[std::min(static_cast<size_t>(kind), same.size() - 1)];
  }

  // The hyper-parameters of param group `kind` (an expert group of DeepSpeed-MoE when `expert`):
  // the source's (its group of the same sort and kind, or its last), without `params`; torch
  // AdamW's otherwise. An expert group is marked as split_params_into_different_moe_groups_-
  // for_optimizer marks it (`name` ep_size_<ep>, `moe` True): torch's load_state_dict replaces
  // the engine's groups with these, and DeepSpeed finds its expert groups by the flag.
  Result<std::vector<std::pair<const PyValue*, const PyValue*>>> GroupHyper(TorchWriter& w,
                                                                            int kind, bool expert) {
    UCP_ASSIGN_OR_RETURN(auto out, SourceGroupHyper(w, kind, expert));
    if (!expert) return out;
    PyArena& a = w.arena();
    std::vector<std::pair<const PyValue*, const PyValue*>> marked;
    marked.emplace_back(a.Str("name"), a.Str("ep_size_" + std::to_string(target_.layout.ep)));
    marked.emplace_back(a.Str("moe"), a.Bool(true));
    for (const auto& [k, v] : out) {
      if (k->kind() == PyKind::kStr && (k->str() == "name" || k->str() == "moe")) continue;
      marked.emplace_back(k, v);
    }
    // DeepSpeed's split keeps the dense group's keys in their order with `name` replaced and
    // `moe` after it; the order does not matter to torch.
    return marked;
  }

  Result<std::vector<std::pair<const PyValue*, const PyValue*>>> SourceGroupHyper(TorchWriter& w,
                                                                                  int kind,
                                                                                  bool expert) {
    PyArena& a = w.arena();
    std::vector<std::pair<const PyValue*, const PyValue*>> out;
    if (c_.from_folder()) {
      const PyValue* base = SourceBase();
      const PyValue* groups = base ? base->Get("param_groups") : nullptr;
      if (groups != nullptr && groups->kind() == PyKind::kList && !groups->items().empty()) {
        const auto& items = groups->items();
        const size_t g = SourceGroup(items.size(), kind, expert, [&](size_t i) {
          const PyValue* m = items[i]->Get("moe");
          return m != nullptr && m->kind() == PyKind::kBool && m->bool_value();
        });
        const PyValue* src = items[g];
        for (const auto& [k, v] : src->entries()) {
          if (k->kind() == PyKind::kStr && k->str() == "params") continue;
          UCP_ASSIGN_OR_RETURN(const PyValue* kc, w.CopyFrom(*c_.optim0, *k));
          UCP_ASSIGN_OR_RETURN(const PyValue* vc, w.CopyFrom(*c_.optim0, *v));
          out.emplace_back(kc, vc);
        }
        return out;
      }
    } else if (c_.js.contains("optimizer_state") && c_.js["optimizer_state"].is_object() &&
               c_.js["optimizer_state"].contains("param_groups") &&
               c_.js["optimizer_state"]["param_groups"].is_array() &&
               !c_.js["optimizer_state"]["param_groups"].empty()) {
      const json& groups = c_.js["optimizer_state"]["param_groups"];
      const size_t g = SourceGroup(groups.size(), kind, expert, [&](size_t i) {
        return groups[i].is_object() && groups[i].contains("moe") && groups[i]["moe"] == true;
      });
      for (const auto& [k, v] : groups[g].items()) {
        if (k != "params") out.emplace_back(a.Str(k), FromJson(a, v));
      }
      return out;
    }
    if (!Adam()) {
      // torch's optimizers take their whole group back from the file (Optimizer.load_state_dict),
      // so each key the optimizer class reads must be there with its Python type; ucp's own
      // manifest keeps Adam's only.
      std::string have;
      for (const std::string& s : o_.optimizer_states) have += (have.empty() ? "" : ", ") + s;
      return UnimplementedError(
          "--format deepspeed: the param groups of an optimizer with states " + have +
          " come only from a DeepSpeed source (--model-states-from, or a universal or ucp "
          "checkpoint extracted from DeepSpeed, whose client state records them); the missing "
          "piece: the optimizer's own group keys and types in ucp's manifest");
    }
    auto h = [&](const char* k, double d) {
      auto it = o_.hyper.find(k);
      return it == o_.hyper.end() ? d : it->second;
    };
    // Megatron's second group, and ucp's group 1, has no weight decay.
    out.emplace_back(a.Str("weight_decay"), a.Float(kind == 0 ? h("weight_decay", 0) : 0.0));
    out.emplace_back(a.Str("lr"), a.Float(h("lr", 0)));
    out.emplace_back(a.Str("betas"),
                     a.Tuple({a.Float(h("beta1", 0.9)), a.Float(h("beta2", 0.999))}));
    out.emplace_back(a.Str("eps"), a.Float(h("eps", 1e-8)));
    out.emplace_back(a.Str("amsgrad"), a.Bool(false));
    out.emplace_back(a.Str("foreach"), a.None());
    out.emplace_back(a.Str("maximize"), a.Bool(false));
    out.emplace_back(a.Str("capturable"), a.Bool(false));
    return out;
  }

  // How the source's optimizer keeps Adam's step: a tensor of this dtype in each group's state
  // (torch Adam), an int there, or an int in the param groups (apex / DeepSpeed FusedAdam).
  enum class StepForm { kTensor, kInt, kInGroups, kNone };
  std::pair<StepForm, DType> Step() const {
    if (c_.from_folder()) {
      const PyValue* base = SourceBase();
      const PyValue* state = base ? base->Get("state") : nullptr;
      const PyValue* s0 = state ? state->Get(int64_t{0}) : nullptr;
      const PyValue* step = s0 ? s0->Get("step") : nullptr;
      if (step != nullptr && step->kind() == PyKind::kTensor) {
        return {StepForm::kTensor, step->tensor().dtype};
      }
      if (step != nullptr) return {StepForm::kInt, DType::kInt64};
      const PyValue* groups = base ? base->Get("param_groups") : nullptr;
      if (groups != nullptr && !groups->items().empty() && groups->items()[0]->Get("step")) {
        return {StepForm::kInGroups, DType::kInt64};
      }
      if (!Adam()) return {StepForm::kNone, DType::kInt64};  // SGD keeps no step
    } else if (c_.js.contains("optimizer_state") && c_.js["optimizer_state"].is_object() &&
               c_.js["optimizer_state"].contains("step")) {
      const json& s = c_.js["optimizer_state"]["step"];
      if (s == "int") return {StepForm::kInt, DType::kInt64};
      if (s == "param_groups") return {StepForm::kInGroups, DType::kInt64};
      if (s.is_string()) {
        Result<DType> d = DTypeFromName(s.get<std::string>());
        if (d.ok()) return {StepForm::kTensor, *d};
      }
    }
    if (!Adam()) return {StepForm::kNone, DType::kInt64};
    return {StepForm::kTensor, DType::kFp32};  // torch >= 1.12 Adam / AdamW
  }

  // [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt of rank `rank`, partition d; the deferred
  // ids of each group's fp32, exp_avg and exp_avg_sq partitions go to `ids`.
  Result<const PyValue*> OptimStates(TorchWriter& w, const TargetRank& rank, int d,
                                     std::vector<std::vector<int32_t>>& ids) {
    PyArena& a = w.arena();
    const DeepSpeedLayout& l = target_.layout;
    const bool bf16 = o_.bf16_optimizer;
    const bool zero3 = l.zero_stage == 3;
    PyValue* osd = a.Dict();
    auto carried = [&](const char* key, const PyValue* fallback) -> Result<const PyValue*> {
      UCP_ASSIGN_OR_RETURN(const PyValue* v, CarriedOptim(w, key));
      return v != nullptr ? v : fallback;
    };
    if (!bf16) {
      // A loss scaler replaces the engine's on load. Without fp16 it is the static scale 1
      // DeepSpeed creates; an fp16 run's dynamic scale is left to the engine unless carried.
      const PyValue* static_scaler = nullptr;
      if (dtype() != DType::kFp16) {
        PyValue* s = a.Object(a.Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                              a.Tuple(), /*newobj=*/true);
        PyValue* st = a.Dict();
        st->SetItem(a.Str("cur_scale"), a.Float(1.0));
        st->SetItem(a.Str("dynamic"), a.Bool(false));
        s->SetState(st);
        static_scaler = s;
      }
      UCP_ASSIGN_OR_RETURN(const PyValue* scaler, carried("loss_scaler", static_scaler));
      if (scaler != nullptr) {
        osd->SetItem(a.Str("loss_scaler"), scaler);
        UCP_ASSIGN_OR_RETURN(const PyValue* dyn, carried("dynamic_loss_scale", a.Bool(false)));
        osd->SetItem(a.Str("dynamic_loss_scale"), dyn);
        UCP_ASSIGN_OR_RETURN(const PyValue* overflow, carried("overflow", a.Bool(false)));
        osd->SetItem(a.Str("overflow"), overflow);
      }
    }
    // Without a source the engine keeps its configured gradient clipping (ZeRO-3 saves none).
    UCP_ASSIGN_OR_RETURN(const PyValue* clip, carried("clip_grad", nullptr));
    if (clip != nullptr && !zero3) osd->SetItem(a.Str("clip_grad"), clip);

    const auto [step_form, step_dtype] = Step();
    PyValue* base = a.Dict();
    PyValue* state = a.Dict();
    PyValue* groups = a.List();
    PyValue* fp32 = a.List();
    PyValue* paddings = a.List();
    PyValue* counts = a.List();
    PyValue* mappings = a.List();
    const std::vector<std::string> names = StateNames(o_);
    ids.assign(rank.groups.size(), std::vector<int32_t>(names.size(), -1));
    // The file's groups (DeepSpeed-MoE: the dense ones, then the experts of ep rank d % ep),
    // numbered from 0 in the file; `part` is the partition of each this file holds.
    const std::vector<int> in_file = rank.FileGroups(d, l.deepspeed_moe ? l.ep : 1);
    for (size_t j = 0; j < in_file.size(); ++j) {
      const int g = in_file[j];
      const TargetGroup& group = rank.groups[static_cast<size_t>(g)];
      const int part = target_.PartitionInFile(group, d);
      const int64_t size = group.partition.fragment_size;
      const int64_t padding = zero3 ? 0 : rank.GroupPadding(g, part);
      PyValue* s = a.Dict();
      if (step_form == StepForm::kTensor) {
        const double step = static_cast<double>(o_.step);
        UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Zeros(step_dtype, {}));
        UCP_RETURN_IF_ERROR(
            CastElements(DType::kFp64, std::as_bytes(std::span<const double>(&step, 1)), step_dtype,
                         t.view().bytes, 1),
            "Adam step");
        UCP_ASSIGN_OR_RETURN(const PyValue* st, w.AddOwnedTensor(std::move(t)));
        s->SetItem(a.Str("step"), st);
      } else if (step_form == StepForm::kInt) {
        s->SetItem(a.Str("step"), a.Int(o_.step));
      }
      for (size_t k = 1; k < names.size(); ++k) {
        UCP_ASSIGN_OR_RETURN(torch::DeferredTensor t,
                             w.AddDeferredTensor(DType::kFp32, {size}, size));
        s->SetItem(a.Str(names[k]), t.node);
        ids[static_cast<size_t>(g)][k] = t.id;
      }
      state->SetItem(a.Int(static_cast<int64_t>(j)), s);
      PyValue* pg = a.Dict();
      UCP_ASSIGN_OR_RETURN(auto hyper, GroupHyper(w, group.kind, group.ep_rank >= 0));
      for (const auto& [k, v] : hyper) {
        if (step_form == StepForm::kInGroups && k->kind() == PyKind::kStr && k->str() == "step") {
          continue;
        }
        pg->SetItem(k, v);
      }
      if (step_form == StepForm::kInGroups) pg->SetItem(a.Str("step"), a.Int(o_.step));
      PyValue* params = a.List();
      params->Append(a.Int(static_cast<int64_t>(j)));
      pg->SetItem(a.Str("params"), params);
      groups->Append(pg);
      // ZeRO saves the fp32 partition without its padding, as a view of the whole storage;
      // BF16_Optimizer saves it whole.
      const int64_t view = bf16 ? size : std::max<int64_t>(0, size - padding);
      UCP_ASSIGN_OR_RETURN(torch::DeferredTensor t, w.AddDeferredTensor(DType::kFp32, {view}, size,
                                                                        /*requires_grad=*/true));
      fp32->Append(t.node);
      ids[static_cast<size_t>(g)][0] = t.id;
      paddings->Append(a.Int(padding));
      counts->Append(a.Int(group.partition.num_fragments));
      if (zero3) continue;  // ZeRO-3 records no param_slice_mappings
      PyValue* m = a.Dict(/*ordered=*/true);
      // An expert group's fragments are where its partition (of its expert data-parallel group)
      // holds them, under the engine's local expert names. DeepSpeed 0.14.4 itself records them
      // cut by the dense dp size (docs/deepspeed.md); its loader does not read them.
      for (const TargetFragment& f : rank.Fragments(g, part)) {
        const TargetParam& fp = rank.params[static_cast<size_t>(f.param)];
        std::string name = fp.engine_name;
        if (fp.expert >= 0) {
          const int64_t local =
              target_.num_experts[static_cast<size_t>(fp.moe_layer)] / target_.layout.ep;
          UCP_ASSIGN_OR_RETURN(name, WithDeepSpeedExpertIndex(name, fp.expert % local));
        }
        PyValue* addr = a.Object(a.Global("deepspeed.utils.tensor_fragment", "fragment_address"),
                                 a.Tuple(), /*newobj=*/true);
        PyValue* fields = a.Dict();
        fields->SetItem(a.Str("numel"), a.Int(f.numel));
        fields->SetItem(a.Str("start"), a.Int(f.start));
        addr->SetState(fields);
        m->SetItem(a.Str(name), addr);
      }
      mappings->Append(m);
    }
    base->SetItem(a.Str("state"), state);
    base->SetItem(a.Str("param_groups"), groups);
    if (zero3) {
      // stage3.py _rigid_state_dict: the torch optimizer's state_dict over the sub-groups' flat
      // fp32 partitions, and those partitions.
      osd->SetItem(a.Str("zero_stage"),
                   a.Object(a.Global("builtins", "getattr"),
                            a.Tuple({a.Global("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                                     a.Str("weights")}),
                            /*newobj=*/false));
      osd->SetItem(a.Str("partition_count"), a.Int(target_.DpWorldSize()));
      osd->SetItem(a.Str("optimizer_state_dict"), base);
      osd->SetItem(a.Str("fp32_flat_groups"), fp32);
      PyValue* root = a.Dict();
      root->SetItem(a.Str("optimizer_state_dict"), osd);
      UCP_ASSIGN_OR_RETURN(const PyValue* cfg, DsConfig(a));
      root->SetItem(a.Str("ds_config"), cfg);
      root->SetItem(a.Str("ds_version"), DsVersion(a));
      return static_cast<const PyValue*>(root);
    }
    osd->SetItem(a.Str("base_optimizer_state"), base);
    osd->SetItem(a.Str("single_partition_of_fp32_groups"), fp32);
    if (!bf16) {
      // ZeroStageEnum as Python >= 3.11 pickles an enum member: getattr(ZeroStageEnum, name).
      osd->SetItem(a.Str("zero_stage"),
                   a.Object(a.Global("builtins", "getattr"),
                            a.Tuple({a.Global("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                                     a.Str(l.zero_stage == 2 ? "gradients" : "optimizer_states")}),
                            /*newobj=*/false));
    }
    osd->SetItem(a.Str("group_paddings"), paddings);
    osd->SetItem(a.Str("partition_count"), counts);
    osd->SetItem(a.Str("ds_version"), DsVersion(a));
    osd->SetItem(a.Str("param_slice_mappings"), mappings);
    PyValue* root = a.Dict();
    root->SetItem(a.Str("optimizer_state_dict"), osd);
    UCP_ASSIGN_OR_RETURN(const PyValue* cfg, DsConfig(a));
    root->SetItem(a.Str("ds_config"), cfg);
    root->SetItem(a.Str("ds_version"), DsVersion(a));
    return root;
  }

 private:
  const patterns::ResolvedModel& model_;
  const DeepSpeedTarget& target_;
  const DeepSpeedWriteOptions& o_;
  Carried& c_;
};

std::string Stem(const std::string& file) {
  return file.substr(0, file.size() - (file.ends_with(".pt") ? 3 : 0));
}

}  // namespace

Result<std::unique_ptr<DeepSpeedWriter>> DeepSpeedWriter::Create(
    const fs::path& dst, const patterns::ResolvedModel& model, const convert::Plan& plan,
    const DeepSpeedWriteOptions& options) {
  std::error_code ec;
  if (fs::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  if (options.bf16_optimizer &&
      (model.spec.dtype != DType::kBf16 || options.layout.zero_stage != 1)) {
    return InvalidArgumentError(
        "BF16_Optimizer files are written for bf16 training at ZeRO stage 1, not " +
        std::string(DTypeName(model.spec.dtype)) + " at ZeRO stage " +
        std::to_string(options.layout.zero_stage) + "; use the ZeRO optimizer");
  }
  auto impl = std::make_unique<Impl>();
  impl->dst = dst;
  impl->options = options;
  UCP_ASSIGN_OR_RETURN(impl->target, DescribeDeepSpeedTarget(model, options.layout));
  UCP_RETURN_IF_ERROR(
      CheckQkvLayout(model, options.qkv_layout, options.layout.tp,
                     "QKV order " + std::string(QkvLayoutName(options.qkv_layout))));
  UCP_ASSIGN_OR_RETURN(Carried carried, LoadCarried(options));
  Builder builder(model, impl->target, options, carried);
  impl->tag =
      options.tag.empty() ? "global_step" + std::to_string(builder.Iteration()) : options.tag;
  if (impl->tag.find('/') != std::string::npos || impl->tag == "." || impl->tag == ".." ||
      io::IsTempName(impl->tag)) {
    return InvalidArgumentError("tag \"" + impl->tag + "\" is not a folder name");
  }
  // Every file stays open until Commit: pp * tp model-state files, their dp * sp optimizer
  // files each, and GPTModelPipe's layer files.
  int64_t num_files = 0;
  for (const TargetRank& r : impl->target.ranks) {
    std::set<std::string> files;
    for (const ModelRecord& m : r.model) files.insert(m.file);
    num_files += 1 + 2 * impl->target.DpWorldSize() + static_cast<int64_t>(files.size());
    if (impl->target.layout.deepspeed_moe) num_files += impl->target.layout.ep;
  }
  UCP_RETURN_IF_ERROR(io::EnsureOpenFileLimit(num_files), "DeepSpeed output " + dst.string());
  UCP_ASSIGN_OR_RETURN(impl->tmp, io::MakeTempSiblingDir(dst));
  std::unique_ptr<DeepSpeedWriter> writer(new DeepSpeedWriter(std::move(impl)));
  Impl& m = *writer->impl_;
  const fs::path tag_dir = m.tmp / m.tag;
  fs::create_directory(tag_dir, ec);
  if (ec) return IoError("cannot create " + tag_dir.string() + ": " + ec.message());

  const DeepSpeedTarget& target = m.target;
  const std::string prefix = model.spec.dtype == DType::kBf16 ? "bf16_" : "";
  auto open =
      [&](const std::string& name,
          const std::function<Result<const PyValue*>(TorchWriter&)>& build) -> Result<int32_t> {
    torch::TorchWriteOptions wo;
    wo.archive_name = Stem(name);  // as torch.save names the records of a file
    wo.zip.sync = false;           // Commit fsyncs the whole folder
    OutFile f;
    f.writer = std::make_unique<TorchWriter>(wo);
    UCP_ASSIGN_OR_RETURN(const PyValue* root, build(*f.writer), name);
    UCP_ASSIGN_OR_RETURN(torch::StreamedTorchFile sf,
                         f.writer->WriteStreamed(tag_dir / name, *root));
    f.file.emplace(std::move(sf));
    m.files.push_back(std::move(f));
    return static_cast<int32_t>(m.files.size() - 1);
  };

  // Model weights: (rank, model entry) -> (file, deferred id).
  std::map<std::pair<size_t, size_t>, std::pair<int32_t, int32_t>> model_place;
  m.rank_files.resize(target.ranks.size());
  for (size_t ri = 0; ri < target.ranks.size(); ++ri) {
    const TargetRank& rank = target.ranks[ri];
    std::vector<int32_t> ids(rank.model.size(), -1);
    if (target.layout.zero_stage == 3) {
      // One model-states file per data-parallel rank (no weights in them: rank.model is empty).
      for (int d = 0; d < target.DpWorldSize(); ++d) {
        UCP_RETURN_IF_ERROR(open(target.Zero3ModelStatesFile(rank.tp, d), [&](TorchWriter& w) {
                              return builder.ModelStates(w, rank, ids);
                            }).status());
      }
    }
    UCP_ASSIGN_OR_RETURN(const int32_t mp,
                         target.layout.zero_stage == 3
                             ? Result<int32_t>(-1)
                             : open(target.ModelStatesFile(rank.pp, rank.tp), [&](TorchWriter& w) {
                                 return builder.ModelStates(w, rank, ids);
                               }));
    for (size_t i = 0; i < rank.model.size(); ++i) {
      if (ids[i] >= 0) model_place[{ri, i}] = {mp, ids[i]};
    }
    // GPTModelPipe's layer files, each an OrderedDict of its module's weights.
    for (size_t i = 0; i < rank.model.size();) {
      const std::string& file = rank.model[i].file;
      size_t end = i;
      while (end < rank.model.size() && rank.model[end].file == file) ++end;
      if (file != target.ModelStatesFile(rank.pp, rank.tp)) {
        std::vector<int32_t> layer_ids(end - i, -1);
        UCP_ASSIGN_OR_RETURN(
            const int32_t lf, open(file, [&](TorchWriter& w) -> Result<const PyValue*> {
              PyValue* d = w.arena().Dict(/*ordered=*/true);
              for (size_t k = i; k < end; ++k) {
                const TargetParam& p = rank.params[static_cast<size_t>(rank.model[k].param)];
                UCP_ASSIGN_OR_RETURN(torch::DeferredTensor t,
                                     w.AddDeferredTensor(model.spec.dtype, p.local_shape, p.numel));
                d->SetItem(w.arena().Str(rank.model[k].key), t.node);
                layer_ids[k - i] = t.id;
              }
              return static_cast<const PyValue*>(d);
            }));
        for (size_t k = i; k < end; ++k) model_place[{ri, k}] = {lf, layer_ids[k - i]};
      }
      i = end;
    }
    // DeepSpeed-MoE: one expp_rank file per expert-parallel rank. Under ZeRO the engine saves
    // {'optimizer': None} there (its state is in the ZeRO files) and loads nothing from it.
    if (target.layout.deepspeed_moe) {
      for (int e = 0; e < target.layout.ep; ++e) {
        UCP_RETURN_IF_ERROR(
            open(target.ExpertOptimFile(e, rank.tp), [&](TorchWriter& w) -> Result<const PyValue*> {
              PyValue* d = w.arena().Dict();
              d->SetItem(w.arena().Str("optimizer"), w.arena().None());
              return static_cast<const PyValue*>(d);
            }).status());
      }
    }
    // The optimizer files, one per data-parallel partition.
    Impl::RankFiles& rf = m.rank_files[ri];
    for (int d = 0; d < target.DpWorldSize(); ++d) {
      std::vector<std::vector<int32_t>> storage;
      UCP_ASSIGN_OR_RETURN(
          const int32_t of,
          open(target.OptimStatesFile(rank.pp, rank.tp, d, prefix),
               [&](TorchWriter& w) { return builder.OptimStates(w, rank, d, storage); }));
      rf.optim.push_back(of);
      rf.storage.push_back(std::move(storage));
      // Alignment padding (past the last parameter of a group; ZeRO-3: past each parameter's
      // end in its last pieces) holds zeros, as DeepSpeed's padded buffers do; the parameters'
      // elements are written by the plan.
      if (target.layout.zero_stage == 3) {
        for (size_t g = 0; g < rank.groups.size(); ++g) {
          for (int32_t i : rank.groups[g].params) {
            const TargetParam& p = rank.params[static_cast<size_t>(i)];
            const int64_t lo = std::max(p.numel, p.piece * d), hi = p.piece * (d + 1);
            if (lo >= hi) continue;
            const std::vector<std::byte> zeros(static_cast<size_t>(hi - lo) * 4);
            for (int32_t id : rf.storage.back()[g]) {
              UCP_RETURN_IF_ERROR(m.files[static_cast<size_t>(of)].file->WriteStorage(
                  id, (p.offset + lo - p.piece * d) * 4, zeros));
            }
          }
        }
        continue;
      }
      for (int g : rank.FileGroups(d, target.layout.deepspeed_moe ? target.layout.ep : 1)) {
        const TargetGroup& group = rank.groups[static_cast<size_t>(g)];
        const layout::ZeroPartition& part = group.partition;
        const layout::IndexRange mine = part.Fragment(target.PartitionInFile(group, d));
        const layout::IndexRange pad = layout::Intersect({part.total, part.padded_total}, mine);
        if (pad.empty()) continue;
        const std::vector<std::byte> zeros(static_cast<size_t>(pad.size()) * 4);
        for (int32_t id : rf.storage.back()[static_cast<size_t>(g)]) {
          UCP_RETURN_IF_ERROR(m.files[static_cast<size_t>(of)].file->WriteStorage(
              id, (pad.inclusive_min - mine.inclusive_min) * 4, zeros));
        }
      }
    }
  }

  // Bind the plan's targets. Each optimizer slice of (pp, tp, param) fills that rank's copy and
  // any copy taking its values from that stage; each model slice fills its module record.
  std::map<std::tuple<int, int, std::string>, std::vector<OptimPlace>> optim_of;
  std::map<std::tuple<int, int, std::string>, std::pair<int32_t, int32_t>> model_of;
  for (size_t ri = 0; ri < target.ranks.size(); ++ri) {
    const TargetRank& rank = target.ranks[ri];
    for (size_t i = 0; i < rank.params.size(); ++i) {
      const TargetParam& p = rank.params[i];
      optim_of[{p.source_stage, rank.tp, p.name}].push_back(
          {static_cast<int32_t>(ri), static_cast<int32_t>(i)});
    }
    for (size_t i = 0; i < rank.model.size(); ++i) {
      const TargetParam& p = rank.params[static_cast<size_t>(rank.model[i].param)];
      model_of[{rank.pp, rank.tp, p.name}] = model_place.at({ri, i});
    }
  }
  std::set<std::tuple<int, int, std::string, int>> bound;  // (pp, tp, param, state)
  std::map<std::string, const patterns::ResolvedParam*> param_of;
  for (const patterns::ResolvedParam& p : model.params) param_of[p.name] = &p;
  for (size_t ti = 0; ti < plan.targets.size(); ++ti) {
    const TensorInfo& t = plan.targets[ti];
    Destination dest;
    const auto key = std::make_tuple(t.pp, t.tp, t.param);
    if (t.kind == TensorKind::kOptimSlice) {
      const std::vector<std::string> names = StateNames(options);
      dest.state = static_cast<int>(std::find(names.begin(), names.end(), t.state) - names.begin());
      auto it = optim_of.find(key);
      if (dest.state >= static_cast<int>(names.size()) || it == optim_of.end() ||
          t.dtype != DType::kFp32) {
        return InternalError("plan target \"" + t.name + "\" has no place in the DeepSpeed files");
      }
      dest.optim = it->second;
      for (const OptimPlace& o : dest.optim) {
        const TargetParam& p =
            target.ranks[static_cast<size_t>(o.rank)].params[static_cast<size_t>(o.param)];
        if (p.local_shape != t.shape) {
          return InternalError("plan target \"" + t.name + "\" is " + ShapeString(t.shape) +
                               ", the DeepSpeed slice " + ShapeString(p.local_shape));
        }
      }
    } else if (t.kind == TensorKind::kModelSlice) {
      auto it = model_of.find(key);
      if (it == model_of.end()) continue;  // a tied copy DeepSpeed saves no weights for
      dest.file = it->second.first;
      dest.storage = it->second.second;
      dest.item = DTypeSizeBytes(t.dtype);
      if (t.dtype != model.spec.dtype) {
        return InternalError("plan target \"" + t.name + "\" is " +
                             std::string(DTypeName(t.dtype)) + ", the model " +
                             std::string(DTypeName(model.spec.dtype)));
      }
    } else {
      return InternalError("plan target \"" + t.name + "\" is not a tensor of the DeepSpeed view");
    }
    if (auto pi = param_of.find(t.param); pi != param_of.end()) {
      UCP_ASSIGN_OR_RETURN(dest.qkv_blocks, QkvRowBlocks(*pi->second, t.shape, options.layout.tp,
                                                         options.qkv_layout));
    }
    if (!bound.insert({t.pp, t.tp, t.param, dest.state}).second ||
        !m.by_name.emplace(t.name, std::move(dest)).second) {
      return InternalError("plan target \"" + t.name + "\" appears twice");
    }
    m.targets.push_back(static_cast<int32_t>(ti));
  }
  // Every slot of the checkpoint has a source: 3 states per optimizer entry, 1 per record.
  const size_t want = StateNames(options).size() * optim_of.size() + model_of.size();
  if (bound.size() != want) {
    return InternalError("the plan has " + std::to_string(bound.size()) +
                         " targets for the DeepSpeed files' " + std::to_string(want) + " slices");
  }
  return writer;
}

Status DeepSpeedWriter::Impl::Place(const Destination& d, int64_t begin,
                                    std::span<const std::byte> data) {
  if (d.state < 0) {
    return files[static_cast<size_t>(d.file)].file->WriteStorage(d.storage, begin * d.item, data);
  }
  const int64_t n = static_cast<int64_t>(data.size()) / 4;
  for (const OptimPlace& o : d.optim) {
    const TargetRank& rank = target.ranks[static_cast<size_t>(o.rank)];
    const TargetParam& p = rank.params[static_cast<size_t>(o.param)];
    const TargetGroup& group = rank.groups[static_cast<size_t>(p.group)];
    const layout::ZeroPartition& part = group.partition;
    const RankFiles& rf = rank_files[static_cast<size_t>(o.rank)];
    if (target.layout.zero_stage == 3) {
      // Element e of the slice is element offset + e % piece of partition e / piece.
      for (int64_t at = 0; at < n;) {
        const int64_t e = begin + at;
        const int64_t part_index = e / p.piece;
        const int64_t in_piece = e - part_index * p.piece;
        const int64_t len = std::min(n - at, p.piece - in_piece);
        OutFile& f = files[static_cast<size_t>(rf.optim[static_cast<size_t>(part_index)])];
        UCP_RETURN_IF_ERROR(f.file->WriteStorage(
            rf.storage[static_cast<size_t>(part_index)][static_cast<size_t>(p.group)][d.state],
            (p.offset + in_piece) * 4,
            data.subspan(static_cast<size_t>(at) * 4, static_cast<size_t>(len) * 4)));
        at += len;
      }
      continue;
    }
    // Elements [begin, begin + n) of the slice are [offset + begin, ...) of the group's flat
    // buffer, which the partitions cut every fragment_size elements.
    for (int64_t at = 0; at < n;) {
      const int64_t flat = p.offset + begin + at;
      const int64_t part_index = flat / part.fragment_size;
      const int64_t in_part = flat - part_index * part.fragment_size;
      const int64_t len = std::min(n - at, part.fragment_size - in_part);
      const auto file =
          static_cast<size_t>(target.FileOfPartition(group, static_cast<int>(part_index)));
      OutFile& f = files[static_cast<size_t>(rf.optim[file])];
      UCP_RETURN_IF_ERROR(f.file->WriteStorage(
          rf.storage[file][static_cast<size_t>(p.group)][d.state], in_part * 4,
          data.subspan(static_cast<size_t>(at) * 4, static_cast<size_t>(len) * 4)));
      at += len;
    }
  }
  return Status::Ok();
}

Status DeepSpeedWriter::WriteRange(const TensorInfo& t, int64_t begin, int64_t,
                                   std::span<const std::byte> data) {
  auto it = impl_->by_name.find(t.name);
  if (it == impl_->by_name.end()) {
    return InternalError("the DeepSpeed writer has no place for tensor \"" + t.name + "\"");
  }
  const Destination& d = it->second;
  const int64_t item = d.state < 0 ? d.item : 4;
  const int64_t n = static_cast<int64_t>(data.size()) / item;
  // A fused QKV written in another row order is placed block by block where its rows go.
  return ForEachStoredRange(
      d.qkv_blocks, begin, begin + n, [&](int64_t view_begin, int64_t stored, int64_t len) {
        return impl_->Place(d, stored,
                            data.subspan(static_cast<size_t>((view_begin - begin) * item),
                                         static_cast<size_t>(len * item)));
      });
}

Status DeepSpeedWriter::Commit() {
  Impl& m = *impl_;
  // Completing a file combines its pieces' CRCs and writes its directory: cheap, no data read.
  for (OutFile& f : m.files) UCP_RETURN_IF_ERROR(f.file->Finish());
  m.files.clear();
  UCP_RETURN_IF_ERROR(io::WriteFileAtomic(m.tmp / "latest", m.tag));
  if (m.target.layout.naming != Naming::kPlain) {
    // Megatron's tracker file next to DeepSpeed's `latest`.
    const std::string digits = m.tag.starts_with("global_step") ? m.tag.substr(11) : "";
    if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos) {
      UCP_RETURN_IF_ERROR(io::WriteFileAtomic(m.tmp / "latest_checkpointed_iteration.txt", digits));
    }
  }
  UCP_RETURN_IF_ERROR(io::FsyncTree(m.tmp));
  UCP_RETURN_IF_ERROR(io::RenameNoReplace(m.tmp, m.dst));
  m.committed = true;
  return Status::Ok();
}

}  // namespace ucp::deepspeed
