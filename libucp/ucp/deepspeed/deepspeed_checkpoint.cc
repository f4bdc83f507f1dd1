// DeepSpeed checkpoint reader: folder, topology, parameters, optimizer metadata and client state.
// The model binding is in deepspeed_model.cc. See deepspeed_checkpoint.h and docs/deepspeed.md.
#include "ucp/deepspeed/deepspeed_checkpoint.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <utility>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/pickle_values.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/torch/torch_file.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using torch::PyKind;
using torch::PyValue;
using torch::TorchFile;

// ZeroStageEnum pickled as getattr(ZeroStageEnum, 'name') (Python >= 3.11) or ZeroStageEnum(v).
Result<int64_t> ZeroStage(const PyValue* v, const std::string& file) {
  if (v->kind() == PyKind::kInt) return v->int_value();
  if (v->kind() == PyKind::kObject) {
    for (const PyValue* a : v->items()) {
      if (a->kind() == PyKind::kInt) return a->int_value();
      if (a->kind() == PyKind::kStr) {
        if (a->str() == "optimizer_states") return 1;
        if (a->str() == "gradients") return 2;
        if (a->str() == "weights") return 3;
        if (a->str() == "disabled") return 0;
      }
    }
  }
  return DataLossError(file + ": optimizer_state_dict.zero_stage is not a ZeroStageEnum");
}

// A rank index out of a file name; the regexes allow only digits, and more than 9 of them is no
// rank DeepSpeed writes.
std::optional<int> RankIndex(const std::string& digits) {
  int v = 0;
  if (digits.size() > 9) return std::nullopt;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || p != digits.data() + digits.size()) return std::nullopt;
  return v;
}

struct FileNames {
  std::map<int, std::string> mp;                     // mp rank -> name
  std::map<std::pair<int, int>, std::string> optim;  // (dp, mp) -> name
  std::string optim_prefix;
  std::map<int, int> layer_files_per_index;  // layer index -> count
  // layer_XX-model_states.pt: a PipelineModule whose topology has no `model` axis (DeepSpeed's
  // PipeDataParallelTopology; get_rank_repr leaves out pipe and data) names no tp rank.
  std::set<int> layer_files_without_model;
  std::map<std::pair<int, int>, std::string> zero3;  // ZeRO-3 model states: (dp, mp) -> name
  // DeepSpeed-MoE (engine.py _save_moe_checkpoint): (moe layer, global expert, mp) -> name, and
  // the expert-parallel optimizer files (ep rank, mp) -> name.
  std::map<std::tuple<int, int, int>, std::string> experts;
  std::map<std::pair<int, int>, std::string> expp;
};

Result<FileNames> ListFiles(const fs::path& dir) {
  static const std::regex mp_re(R"(mp_rank_(\d+)_model_states\.pt)");
  static const std::regex optim_re(
      R"((bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  static const std::regex layer_re(R"(layer_(\d+)-model_(\d+)-model_states\.pt)");
  static const std::regex plain_layer_re(R"(layer_(\d+)-model_states\.pt)");
  static const std::regex zero3_re(R"(zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  // DeepSpeed's MoE layer saves its experts apart from the module (deepspeed_ucp.md 8), one file
  // per (MoE layer, global expert, mp rank), and one expp_rank file per expert-parallel rank.
  static const std::regex expert_re(R"(layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  static const std::regex expp_re(
      R"((bf16_|fp16_)?expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  // Before `num_experts` became a list, DeepSpeed saved expert_E_mp_rank_TT files without the
  // MoE layer (load_moe_state_dict's old_moe_load).
  static const std::regex legacy_expert_re(R"(expert_\d+_mp_rank_\d+_model_states\.pt)");
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) return IoError("cannot list checkpoint folder " + dir.string() + ": " + ec.message());
  std::sort(names.begin(), names.end());
  FileNames f;
  auto bad_index = [&](const std::string& n) {
    return DataLossError("checkpoint folder " + dir.string() + ": file " + n +
                         " has a rank index out of range");
  };
  for (const std::string& n : names) {
    std::smatch m;
    if (std::regex_match(n, legacy_expert_re)) {
      return UnimplementedError(
          "checkpoint folder " + dir.string() + " holds " + n +
          ", a DeepSpeed-MoE expert file of the legacy form without the MoE layer index; ucp "
          "reads layer_L_expert_E_mp_rank_TT_model_states.pt (the missing piece is the legacy "
          "form's layer-less expert numbering)");
    }
    if (std::regex_match(n, m, expert_re)) {
      const std::optional<int> l = RankIndex(m[1]), e = RankIndex(m[2]), mp = RankIndex(m[3]);
      if (!l || !e || !mp) return bad_index(n);
      f.experts[{*l, *e, *mp}] = n;
    } else if (std::regex_match(n, m, expp_re)) {
      const std::optional<int> e = RankIndex(m[2]), mp = RankIndex(m[3]);
      if (!e || !mp) return bad_index(n);
      f.expp[{*e, *mp}] = n;
    } else if (std::regex_match(n, m, mp_re)) {
      const std::optional<int> i = RankIndex(m[1]);
      if (!i) return bad_index(n);
      f.mp[*i] = n;
    } else if (std::regex_match(n, m, optim_re)) {
      if (!f.optim.empty() && f.optim_prefix != m[1].str()) {
        return DataLossError("checkpoint folder " + dir.string() + " mixes optim file prefixes \"" +
                             f.optim_prefix + "\" and \"" + m[1].str() + "\"");
      }
      const std::optional<int> d = RankIndex(m[2]), mp = RankIndex(m[3]);
      if (!d || !mp) return bad_index(n);
      f.optim_prefix = m[1];
      f.optim[{*d, *mp}] = n;
    } else if (std::regex_match(n, m, layer_re)) {
      const std::optional<int> i = RankIndex(m[1]);
      if (!i) return bad_index(n);
      ++f.layer_files_per_index[*i];
    } else if (std::regex_match(n, m, plain_layer_re)) {
      const std::optional<int> i = RankIndex(m[1]);
      if (!i) return bad_index(n);
      f.layer_files_without_model.insert(*i);
    } else if (std::regex_match(n, m, zero3_re)) {
      const std::optional<int> d = RankIndex(m[1]), mp = RankIndex(m[2]);
      if (!d || !mp) return bad_index(n);
      f.zero3[{*d, *mp}] = n;
    }
  }
  if (!f.zero3.empty()) {
    if (!f.mp.empty()) {
      return DataLossError("checkpoint folder " + dir.string() + " mixes ZeRO-3 (" +
                           f.zero3.begin()->second + ") and ZeRO-1/2 (" + f.mp.begin()->second +
                           ") model-states files");
    }
    // ZeRO-3 saves model states per data-parallel rank; data-parallel rank 0's stand for the
    // model-parallel rank (param_shapes are the same on every dp rank; Open checks the grid).
    for (const auto& [key, name] : f.zero3) {
      if (key.first == 0) f.mp[key.second] = name;
    }
  }
  if (f.mp.empty()) {
    return NotFoundError("checkpoint folder " + dir.string() + " has no mp_rank_*_model_states.pt");
  }
  if (f.optim.empty()) {
    return NotFoundError("checkpoint folder " + dir.string() +
                         " has no *zero_pp_rank_*_optim_states.pt");
  }
  return f;
}

// The tag folder: `path` itself, or the folder its `latest` file names.
Result<fs::path> ResolveTagDir(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return NotFoundError("no checkpoint folder " + path.string());
  const fs::path latest = path / "latest";
  if (fs::is_regular_file(latest, ec)) {
    UCP_ASSIGN_OR_RETURN(std::string tag, io::ReadFileToString(latest, 4096), "reading `latest`");
    while (!tag.empty() && (tag.back() == '\n' || tag.back() == ' ' || tag.back() == '\r')) {
      tag.pop_back();
    }
    if (tag.empty() || tag.find('/') != std::string::npos || tag == "..") {
      return DataLossError(latest.string() + " does not hold a tag folder name");
    }
    if (!fs::is_directory(path / tag, ec)) {
      return NotFoundError(latest.string() + " names tag \"" + tag + "\" but " +
                           (path / tag).string() + " is not a folder");
    }
    return path / tag;
  }
  return path;
}

}  // namespace

bool LooksLikeDeepSpeedCheckpoint(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  // A DeepSpeed save_dir: its `latest` names the tag, and Open reports what is wrong with it.
  if (fs::is_regular_file(path / "latest", ec)) return true;
  static const std::regex ds_re(
      R"(mp_rank_\d+_model_states\.pt|(bf16_|fp16_)?zero_pp_rank_\d+_mp_rank_\d+_(optim|model)_states\.pt|layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt|(bf16_|fp16_)?expp_rank_\d+_mp_rank_\d+_optim_states\.pt)");
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    if (std::regex_match(it->path().filename().string(), ds_re)) return true;
  }
  return false;
}

layout::Layout DeepSpeedCheckpoint::view() const {
  layout::Layout l;
  l.tp = tp_;
  l.pp = pp_;
  l.stages = stages_;
  return l;  // dp = sp = ep = 1, zero 0
}

std::string DeepSpeedCheckpoint::LayoutString() const {
  const std::string zero = optimizer_ == "zero2" ? "2" : optimizer_ == "zero3" ? "3" : "1";
  return "tp=" + std::to_string(tp_) + ",pp=" + std::to_string(pp_) + ",dp=" + std::to_string(dp_) +
         ",sp=" + std::to_string(sp_) + (ep_ > 1 ? ",ep=" + std::to_string(ep_) : "") +
         ",zero=" + zero + (stages_.empty() ? "" : ",stages=" + layout::StagesToString(stages_));
}

std::string DeepSpeedCheckpoint::ExpertFile(int moe_layer, int64_t expert, int mp_rank) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "layer_%d_expert_%lld_mp_rank_%02d_model_states.pt", moe_layer,
                static_cast<long long>(expert), mp_rank);
  return buf;
}

std::string DeepSpeedCheckpoint::ModelStatesFile(int pp_rank, int tp_rank) const {
  if (zero3_files_) return Zero3ModelStatesFile(tp_rank, 0);
  const int mp = naming_ == Naming::kMegatronPipe || pp_ > 1 ? pp_rank * tp_ + tp_rank : tp_rank;
  char buf[64];
  std::snprintf(buf, sizeof buf, "mp_rank_%02d_model_states.pt", mp);
  return buf;
}

std::string DeepSpeedCheckpoint::Zero3ModelStatesFile(int tp_rank, int dp_rank) const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "zero_pp_rank_%d_mp_rank_%02d_model_states.pt", dp_rank, tp_rank);
  return buf;
}

std::string DeepSpeedCheckpoint::OptimStatesFile(int pp_rank, int tp_rank, int dp_rank) const {
  const int mp = naming_ == Naming::kMegatronPipe || pp_ > 1 ? pp_rank * tp_ + tp_rank : tp_rank;
  char buf[96];
  std::snprintf(buf, sizeof buf, "%szero_pp_rank_%d_mp_rank_%02d_optim_states.pt",
                optim_prefix_.c_str(), dp_rank, mp);
  return buf;
}

std::string DeepSpeedCheckpoint::LayerFileOf(int64_t layer_index, int tp_rank) const {
  if (!layer_files_without_model_) return LayerFile(layer_index, tp_rank);
  char buf[64];
  std::snprintf(buf, sizeof buf, "layer_%02lld-model_states.pt",
                static_cast<long long>(layer_index));
  return buf;
}

std::string DeepSpeedCheckpoint::LayerFile(int64_t layer_index, int tp_rank) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "layer_%02lld-model_%02d-model_states.pt",
                static_cast<long long>(layer_index), tp_rank);
  return buf;
}

Result<DeepSpeedCheckpoint> DeepSpeedCheckpoint::Open(const fs::path& path,
                                                      const OpenOptions& options) {
  DeepSpeedCheckpoint ck;
  UCP_ASSIGN_OR_RETURN(ck.dir_, ResolveTagDir(path));
  UCP_ASSIGN_OR_RETURN(FileNames files, ListFiles(ck.dir_));
  ck.optim_prefix_ = files.optim_prefix;
  ck.zero3_files_ = !files.zero3.empty();
  const int num_mp = static_cast<int>(files.mp.size());
  for (int i = 0; i < num_mp; ++i) {
    if (!files.mp.contains(i)) {
      return NotFoundError("checkpoint folder " + ck.dir_.string() + " has " +
                           std::to_string(num_mp) + " mp_rank files but no mp_rank_" +
                           (i < 10 ? "0" : "") + std::to_string(i) + "_model_states.pt");
    }
  }
  if (!files.layer_files_without_model.empty()) {
    if (!files.layer_files_per_index.empty()) {
      return DataLossError("checkpoint folder " + ck.dir_.string() +
                           " mixes layer_XX-model_TT-model_states.pt and layer_XX-model_states.pt "
                           "files (layer_" +
                           std::to_string(*files.layer_files_without_model.begin()) + ")");
    }
  }
  // Rank 0's model states: topology, client state.
  UCP_ASSIGN_OR_RETURN(TorchFile mp0, TorchFile::Open(ck.dir_ / files.mp.at(0)));
  const PyValue& root = mp0.root();
  if (const PyValue* dims = root.Get("checkpoint_parallel_dimensions");
      dims != nullptr && !dims->is_none()) {
    UCP_ASSIGN_OR_RETURN(int64_t pp,
                         AsInt(dims->Get("pp_degree"), "checkpoint_parallel_dimensions.pp_degree"));
    UCP_ASSIGN_OR_RETURN(int64_t tp,
                         AsInt(dims->Get("tp_degree"), "checkpoint_parallel_dimensions.tp_degree"));
    if (pp < 1 || tp < 1 || pp * tp != num_mp) {
      return DataLossError(files.mp.at(0) + ": checkpoint_parallel_dimensions pp_degree=" +
                           std::to_string(pp) + ", tp_degree=" + std::to_string(tp) +
                           " do not fit the " + std::to_string(num_mp) + " mp_rank files");
    }
    ck.pp_ = static_cast<int>(pp);
    ck.tp_ = static_cast<int>(tp);
  } else if (files.layer_files_per_index.empty() && !files.layer_files_without_model.empty()) {
    // No model axis in the pipeline topology: every mp_rank file is a pipeline stage.
    ck.tp_ = 1;
    ck.pp_ = num_mp;
  } else if (!files.layer_files_per_index.empty()) {
    if (!files.layer_files_per_index.contains(1)) {
      return NotFoundError("checkpoint folder " + ck.dir_.string() +
                           " has layer_* files but no layer_01-model_*-model_states.pt");
    }
    ck.tp_ = files.layer_files_per_index.at(1);
    ck.pp_ = num_mp / ck.tp_;
  } else {
    ck.tp_ = num_mp;
    ck.pp_ = 1;
  }
  if (!files.layer_files_without_model.empty()) {
    if (ck.tp_ != 1) {
      return DataLossError("checkpoint folder " + ck.dir_.string() +
                           ": layer_XX-model_states.pt files name no tensor-parallel rank, but "
                           "checkpoint_parallel_dimensions says tp_degree=" +
                           std::to_string(ck.tp_));
    }
    ck.layer_files_without_model_ = true;
  }
  if (ck.tp_ < 1 || ck.pp_ < 1 || ck.tp_ * ck.pp_ != num_mp) {
    return DataLossError("checkpoint folder " + ck.dir_.string() + ": " + std::to_string(num_mp) +
                         " mp_rank files do not form tp=" + std::to_string(ck.tp_) +
                         " x pp=" + std::to_string(ck.pp_));
  }
  // The partition count is the largest dp index + 1, so a missing file is named below.
  const int dp_sp = files.optim.rbegin()->first.first + 1;
  for (int d = 0; d < dp_sp; ++d) {
    for (int m = 0; m < num_mp; ++m) {
      if (!files.optim.contains({d, m})) {
        char buf[96];
        std::snprintf(buf, sizeof buf, "%szero_pp_rank_%d_mp_rank_%02d_optim_states.pt",
                      files.optim_prefix.c_str(), d, m);
        return NotFoundError("checkpoint folder " + ck.dir_.string() + " lacks " + buf +
                             " (tp=" + std::to_string(ck.tp_) + ", pp=" + std::to_string(ck.pp_) +
                             ", " + std::to_string(dp_sp) + " data-parallel partitions)");
      }
    }
  }
  if (files.optim.size() != static_cast<size_t>(dp_sp) * num_mp) {
    return DataLossError("checkpoint folder " + ck.dir_.string() + " has " +
                         std::to_string(files.optim.size()) + " optim files, more than " +
                         std::to_string(dp_sp) + " partitions x " + std::to_string(num_mp) +
                         " model-parallel ranks");
  }
  if (ck.zero3_files_) {
    if (ck.pp_ != 1) {
      return UnimplementedError(
          "checkpoint folder " + ck.dir_.string() +
          " is a ZeRO-3 checkpoint with pipeline stages (pp=" + std::to_string(ck.pp_) +
          "), which DeepSpeed does not train and ucp does not read");
    }
    for (int d = 0; d < dp_sp; ++d) {
      for (int m = 0; m < num_mp; ++m) {
        if (!files.zero3.contains({d, m})) {
          return NotFoundError("checkpoint folder " + ck.dir_.string() + " lacks " +
                               ck.Zero3ModelStatesFile(m, d) +
                               " (ZeRO-3, tp=" + std::to_string(ck.tp_) + ", " +
                               std::to_string(dp_sp) + " data-parallel partitions)");
        }
      }
    }
    if (files.zero3.size() != static_cast<size_t>(dp_sp) * num_mp) {
      return DataLossError("checkpoint folder " + ck.dir_.string() + " has " +
                           std::to_string(files.zero3.size()) +
                           " ZeRO-3 model-states files, more than " + std::to_string(dp_sp) +
                           " partitions x " + std::to_string(num_mp) + " model-parallel ranks");
    }
  }
  // DeepSpeed-MoE: expert files per (MoE layer, expert, mp rank), one expp_rank file per
  // expert-parallel rank and mp rank (engine.py _save_moe_checkpoint; the expp files hold
  // {'optimizer': None} under ZeRO, whose partitions are in the zero_pp_rank files).
  ck.moe_ = !files.experts.empty();
  if (!ck.moe_ && !files.expp.empty()) {
    return NotFoundError("checkpoint folder " + ck.dir_.string() + " holds " +
                         files.expp.begin()->second +
                         " (DeepSpeed-MoE) but no layer_*_expert_*_mp_rank_*_model_states.pt");
  }
  if (ck.moe_) {
    const std::string where = (ck.dir_ / files.mp.at(0)).string();
    if (ck.zero3_files_ || ck.pp_ != 1) {
      return UnimplementedError(
          "checkpoint folder " + ck.dir_.string() + " holds DeepSpeed-MoE expert files with " +
          (ck.zero3_files_ ? std::string("ZeRO-3 model states")
                           : "pipeline stages (pp=" + std::to_string(ck.pp_) + ")") +
          "; ucp reads DeepSpeed-MoE at ZeRO-1/2 without pipeline stages (the missing piece is "
          "the expert files' MoE-layer numbering per stage and ZeRO-3's expert sub-groups)");
    }
    const PyValue* ne = root.Get("num_experts");
    if (ne == nullptr || ne->kind() != PyKind::kList || ne->items().empty()) {
      return DataLossError(where +
                           ": num_experts is not a list of expert counts per MoE layer, but the "
                           "folder holds DeepSpeed-MoE expert files (" +
                           files.experts.begin()->second + ")");
    }
    for (const PyValue* v : ne->items()) {
      UCP_ASSIGN_OR_RETURN(int64_t n, AsInt(v, where + ": num_experts"));
      if (n < 1 || n > (int64_t{1} << 20)) {
        return DataLossError(where + ": num_experts holds " + std::to_string(n));
      }
      ck.num_experts_.push_back(n);
    }
    // Expert-parallel ranks: expp_rank_0 .. expp_rank_{ep-1}, for every mp rank.
    ck.ep_ = files.expp.empty() ? 0 : files.expp.rbegin()->first.first + 1;
    if (ck.ep_ == 0) {
      return NotFoundError("checkpoint folder " + ck.dir_.string() +
                           " holds DeepSpeed-MoE expert files but no "
                           "expp_rank_0_mp_rank_00_optim_states.pt");
    }
    for (int e = 0; e < ck.ep_; ++e) {
      for (int m = 0; m < num_mp; ++m) {
        if (!files.expp.contains({e, m})) {
          char buf[80];
          std::snprintf(buf, sizeof buf, "expp_rank_%d_mp_rank_%02d_optim_states.pt", e, m);
          return NotFoundError("checkpoint folder " + ck.dir_.string() + " lacks " + buf + " (" +
                               std::to_string(ck.ep_) + " expert-parallel ranks)");
        }
      }
    }
    if (dp_sp % ck.ep_ != 0) {
      return DataLossError("checkpoint folder " + ck.dir_.string() + ": " + std::to_string(ck.ep_) +
                           " expert-parallel ranks (expp_rank files) do "
                           "not divide the " +
                           std::to_string(dp_sp) + " data-parallel optimizer partitions");
    }
    size_t want = 0;
    for (size_t l = 0; l < ck.num_experts_.size(); ++l) {
      const int64_t n = ck.num_experts_[l];
      if (n % ck.ep_ != 0) {
        return DataLossError(where + ": MoE layer " + std::to_string(l) + " has " +
                             std::to_string(n) +
                             " experts, not a multiple of ep=" + std::to_string(ck.ep_));
      }
      for (int64_t e = 0; e < n; ++e) {
        for (int m = 0; m < num_mp; ++m) {
          if (!files.experts.contains({static_cast<int>(l), static_cast<int>(e), m})) {
            return NotFoundError("checkpoint folder " + ck.dir_.string() + " lacks " +
                                 ExpertFile(static_cast<int>(l), e, m) + " (num_experts of " +
                                 files.mp.at(0) + ": MoE layer " + std::to_string(l) + " has " +
                                 std::to_string(n) + " experts)");
          }
        }
      }
      want += static_cast<size_t>(n) * static_cast<size_t>(num_mp);
    }
    if (files.experts.size() != want) {
      return DataLossError(
          "checkpoint folder " + ck.dir_.string() + " has " + std::to_string(files.experts.size()) +
          " expert files, but num_experts of " + files.mp.at(0) + " makes " + std::to_string(want));
    }
  }
  // Frozen parameters (requires_grad=False) have no optimizer state, and a universal checkpoint
  // holds fp32, exp_avg and exp_avg_sq for every parameter.
  if (const PyValue* frozen = root.Get("frozen_param_shapes");
      frozen != nullptr && frozen->kind() == PyKind::kDict && !frozen->entries().empty()) {
    const PyValue* k = frozen->entries().front().first;
    return UnimplementedError(
        (ck.dir_ / files.mp.at(0)).string() + ": frozen_param_shapes lists " +
        std::to_string(frozen->entries().size()) + " frozen parameter(s)" +
        (k->kind() == PyKind::kStr ? " (\"" + k->str() + "\")" : std::string()) +
        ", which have no optimizer state; ucp reads only checkpoints whose parameters are all "
        "trained");
  }
  const PyValue* args = ObjectState(root.Get("args"));
  ck.sp_ = 1;
  if (args != nullptr) {
    if (const PyValue* sp = args->Get("ds_sequence_parallel_size");
        sp != nullptr && sp->kind() == PyKind::kInt && sp->int_value() > 0) {
      if (sp->int_value() > dp_sp) {
        return DataLossError(
            files.mp.at(0) + ": args.ds_sequence_parallel_size=" + std::to_string(sp->int_value()) +
            " exceeds the " + std::to_string(dp_sp) + " optimizer partitions per model rank");
      }
      ck.sp_ = static_cast<int>(sp->int_value());
    }
  }
  if (dp_sp % ck.sp_ != 0) {
    return DataLossError(
        "checkpoint folder " + ck.dir_.string() + ": " + std::to_string(dp_sp) +
        " optimizer partitions per model rank not divisible by sp=" + std::to_string(ck.sp_));
  }
  ck.dp_ = dp_sp / ck.sp_;
  const PyValue* ds_config = root.Get("ds_config");
  auto enabled = [ds_config](const char* key) {
    const PyValue* c = ds_config ? ds_config->Get(key) : nullptr;
    const PyValue* e = c ? c->Get("enabled") : nullptr;
    return e != nullptr && e->kind() == PyKind::kBool && e->bool_value();
  };
  ck.dtype_ = files.optim_prefix == "bf16_" || enabled("bf16") ? DType::kBf16
              : enabled("fp16")                                ? DType::kFp16
                                                               : DType::kFp32;
  if (const PyValue* it = root.Get("iteration"); it != nullptr && it->kind() == PyKind::kInt) {
    ck.iteration_ = it->int_value();
  } else {
    UCP_ASSIGN_OR_RETURN(ck.iteration_,
                         AsInt(root.Get("global_steps"), files.mp.at(0) + ": global_steps"));
  }
  if (const PyValue* uci = root.Get("universal_checkpoint_info"); uci != nullptr) {
    if (const PyValue* v = uci->Get("original_vocab_size"); v != nullptr) {
      UCP_ASSIGN_OR_RETURN(ck.original_vocab_,
                           AsInt(v, "universal_checkpoint_info.original_vocab_size"));
    }
  }

  // Parameters: param_shapes of every (pp, tp) rank. A parameter keeps the position of its first
  // listing, so the order is the engine's (stage by stage, tp rank 0 first). DeepSpeed-MoE saves
  // no param_shapes: the module's tensors (the experts removed), then each expert file's.
  struct Listed {
    std::string name;
    Shape shape;
    int group = 0;
    int moe_layer = -1;
    int64_t expert = -1;
    std::string file;
  };
  bool naming_known = false;
  std::map<std::string, size_t> index;  // canonical -> params_
  for (int s = 0; s < ck.pp_; ++s) {
    for (int r = 0; r < ck.tp_; ++r) {
      const int mp = s * ck.tp_ + r;
      const std::string fname = files.mp.at(mp);
      std::optional<TorchFile> owned;
      const TorchFile* file = &mp0;
      if (mp != 0) {
        UCP_ASSIGN_OR_RETURN(owned, TorchFile::Open(ck.dir_ / fname));
        file = &*owned;
      }
      std::vector<Listed> listed;
      if (ck.moe_) {
        UCP_ASSIGN_OR_RETURN(const PyValue* module, file->root().Find("module", fname));
        if (module->kind() != PyKind::kDict) {
          return DataLossError(fname + ": module is not a state dict");
        }
        for (const auto& [k, v] : module->entries()) {
          if (k->kind() != PyKind::kStr || v->kind() != PyKind::kTensor) {
            return DataLossError(fname + ": module has an entry that is not name -> tensor");
          }
          listed.push_back(Listed{k->str(), v->tensor().size, 0, -1, -1, fname});
        }
        for (int l = 0; l < static_cast<int>(ck.num_experts_.size()); ++l) {
          for (int64_t e = 0; e < ck.num_experts_[static_cast<size_t>(l)]; ++e) {
            const std::string ename = ExpertFile(l, e, mp);
            UCP_ASSIGN_OR_RETURN(TorchFile ef, TorchFile::Open(ck.dir_ / ename));
            if (ef.root().kind() != PyKind::kDict || ef.root().entries().empty()) {
              return DataLossError(ename + ": not a non-empty state dict of expert " +
                                   std::to_string(e));
            }
            for (const auto& [k, v] : ef.root().entries()) {
              if (k->kind() != PyKind::kStr || v->kind() != PyKind::kTensor) {
                return DataLossError(ename + ": an entry is not name -> tensor");
              }
              Result<int64_t> at = DeepSpeedExpertIndex(k->str());
              if (!at.ok() || *at != e) {
                return DataLossError(ename + ": \"" + k->str() +
                                     "\" is not a parameter of expert " + std::to_string(e) +
                                     " (deepspeed_experts." + std::to_string(e) + ".…)");
              }
              listed.push_back(Listed{k->str(), v->tensor().size, 0, l, e, ename});
            }
          }
        }
      } else {
        UCP_ASSIGN_OR_RETURN(const PyValue* shapes, file->root().Find("param_shapes", fname));
        if (shapes->kind() != PyKind::kList) {
          return DataLossError(fname + ": param_shapes is a " +
                               std::string(PyKindName(shapes->kind())) + ", not a list of groups");
        }
        for (size_t g = 0; g < shapes->items().size(); ++g) {
          const PyValue* group = shapes->items()[g];
          if (group->kind() != PyKind::kDict) {
            return DataLossError(fname + ": param_shapes[" + std::to_string(g) + "] is not a dict");
          }
          for (const auto& [k, v] : group->entries()) {
            if (k->kind() != PyKind::kStr) {
              return DataLossError(fname + ": param_shapes[" + std::to_string(g) +
                                   "] has a key that is not a str");
            }
            UCP_ASSIGN_OR_RETURN(Shape shape,
                                 AsShape(v, fname + ": param_shapes[\"" + k->str() + "\"]"));
            listed.push_back(
                Listed{k->str(), std::move(shape), static_cast<int>(g), -1, -1, fname});
          }
        }
      }
      for (Listed& x : listed) {
        const std::string& name = x.name;
        const std::string& lname = x.file;
        if (!naming_known) {
          ck.naming_ = DetectNaming(name);
          naming_known = true;
        }
        if (IsDeepSpeedExpertName(name) && x.expert < 0) {
          return DataLossError(lname + ": \"" + name +
                               "\" is an expert of a DeepSpeed-MoE layer, but the folder holds no "
                               "layer_*_expert_* files");
        }
        UCP_ASSIGN_OR_RETURN(std::string canon, CanonicalName(name, ck.naming_), lname);
        Shape& shape = x.shape;
        // Sizes from a file are checked before any arithmetic uses them.
        for (int64_t d : shape) {
          if (d > (int64_t{1} << 40)) {
            return DataLossError(lname + ": param_shapes[\"" + name + "\"] " + ShapeString(shape) +
                                 " has an implausible dim");
          }
        }
        UCP_RETURN_IF_ERROR(
            CheckedProduct(shape, lname + ": param_shapes[\"" + name + "\"]").status());
        auto [it, inserted] = index.try_emplace(canon, ck.params_.size());
        if (inserted) {
          DeepSpeedParam p;
          p.name = canon;
          p.engine_name = name;
          p.group = x.group;
          p.moe_layer = x.moe_layer;
          p.expert = x.expert;
          p.shapes.resize(static_cast<size_t>(ck.pp_) * ck.tp_);
          ck.params_.push_back(std::move(p));
        }
        DeepSpeedParam& p = ck.params_[it->second];
        if (p.engine_name != name) {
          return DataLossError(lname + ": parameters \"" + p.engine_name + "\" and \"" + name +
                               "\" both map to \"" + canon + "\"");
        }
        std::optional<Shape>& slot = p.shapes[static_cast<size_t>(mp)];
        if (slot.has_value()) {
          return DataLossError(lname + ": parameter \"" + name + "\" listed twice");
        }
        if (p.stages.empty() || p.stages.back() != s) p.stages.push_back(s);
        // A pipeline replica (the tied embedding on the last stage) must agree with the first.
        const std::optional<Shape>& first =
            p.shapes[static_cast<size_t>(p.stages.front()) * ck.tp_ + r];
        if (p.stages.front() != s && first.has_value() && *first != shape) {
          return DataLossError(lname + ": parameter \"" + name + "\" has shape " +
                               ShapeString(shape) + " but " + ShapeString(*first) +
                               " on pipeline stage " + std::to_string(p.stages.front()));
        }
        slot = std::move(shape);
      }
    }
  }
  if (ck.params_.empty()) {
    return DataLossError(files.mp.at(0) + ": param_shapes lists no parameter");
  }

  // Rank 0's optimizer file: optimizer kind, step, hyper-parameters.
  const std::string optim0 = files.optim.at({0, 0});
  UCP_ASSIGN_OR_RETURN(TorchFile of, TorchFile::Open(ck.dir_ / optim0));
  UCP_ASSIGN_OR_RETURN(const PyValue* osd, of.root().Find("optimizer_state_dict", optim0));
  if (const PyValue* zs = osd->Get("zero_stage"); zs != nullptr) {
    UCP_ASSIGN_OR_RETURN(int64_t stage, ZeroStage(zs, optim0));
    if (stage < 1 || stage > 3) {
      return UnimplementedError(optim0 + ": zero_stage " + std::to_string(stage) +
                                " is not supported (ZeRO-1, 2 and 3 are)");
    }
    if ((stage == 3) != ck.zero3_files_) {
      return DataLossError(optim0 + ": zero_stage " + std::to_string(stage) + " but the folder " +
                           (ck.zero3_files_
                                ? "holds ZeRO-3 model states (zero_pp_rank_*_model_states.pt)"
                                : "holds mp_rank_*_model_states.pt, not ZeRO-3's"));
    }
    ck.optimizer_ = stage == 1 ? "zero1" : stage == 2 ? "zero2" : "zero3";
  } else if (ck.zero3_files_) {
    return DataLossError(optim0 +
                         ": optimizer_state_dict has no zero_stage, but the folder holds "
                         "ZeRO-3 model states (zero_pp_rank_*_model_states.pt)");
  } else {
    ck.optimizer_ = "bf16_optimizer";
  }
  if (ck.moe_ && ck.optimizer_ == "bf16_optimizer") {
    return UnimplementedError(optim0 +
                              ": DeepSpeed-MoE with BF16_Optimizer; ucp reads "
                              "DeepSpeed-MoE under ZeRO-1/2 (the missing piece is "
                              "BF16_Optimizer's expert-parallel partitions)");
  }
  // ZeRO-3 keeps the torch optimizer's state_dict under optimizer_state_dict (stage3.py
  // _rigid_state_dict), ZeRO-1/2 and BF16_Optimizer under base_optimizer_state.
  const char* base_key = ck.zero3() ? "optimizer_state_dict" : "base_optimizer_state";
  UCP_ASSIGN_OR_RETURN(const PyValue* base, osd->Find(base_key, optim0));
  if (base->kind() != PyKind::kDict) {
    return UnimplementedError(optim0 + ": " + base_key + " is a " +
                              std::string(PyKindName(base->kind())) +
                              " (elastic checkpoint), which ucp does not read");
  }
  UCP_ASSIGN_OR_RETURN(const PyValue* state,
                       base->Find("state", optim0 + ": base_optimizer_state"));
  // The torch optimizer's per-element states are the tensors of its per-group state other than
  // `step` (Adam: exp_avg, exp_avg_sq; SGD with momentum: momentum_buffer; Adagrad: sum; Lion:
  // exp_avg), in its order; a None (SGD without momentum) is no state. An optimizer without
  // any state (plain SGD) keeps an empty state dict.
  const PyValue* s0 = state->Get(int64_t{0});
  if (s0 == nullptr && state->kind() == PyKind::kDict && !state->entries().empty()) {
    return DataLossError(optim0 + ": " + base_key + ".state has no entry for param group 0");
  }
  if (s0 != nullptr) {
    if (s0->kind() != PyKind::kDict) {
      return DataLossError(optim0 + ": " + base_key + ".state[0] is not a dict");
    }
    for (const auto& [k, v] : s0->entries()) {
      if (k->kind() != PyKind::kStr || k->str() == "step" || v->kind() == PyKind::kNone) continue;
      const std::string what = optim0 + ": " + base_key + ".state[0]." + k->str();
      if (v->kind() != PyKind::kTensor) {
        return UnimplementedError(what + " is a " + std::string(PyKindName(v->kind())) +
                                  ", not a tensor: ucp carries per-element optimizer states only "
                                  "(the missing piece: per-group optimizer values in the "
                                  "universal manifest)");
      }
      if (v->tensor().size.size() != 1) {
        return UnimplementedError(what + " is a " + std::to_string(v->tensor().size.size()) +
                                  "-d tensor, not a per-element state over the flat partition: "
                                  "ucp carries per-element optimizer states only (the missing "
                                  "piece: per-group optimizer values in the universal manifest)");
      }
      const std::string& n = k->str();
      const bool name_ok =
          !n.empty() && n != "fp32" && n != "model" &&
          n.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") ==
              std::string::npos;
      if (!name_ok) {
        return UnimplementedError(what +
                                  ": the state name is not one ucp can store (letters, "
                                  "digits and _; not fp32 or model)");
      }
      ck.optimizer_states_.push_back(n);
    }
  }
  ck.step_ = ck.iteration_;
  if (const PyValue* st = s0 != nullptr ? s0->Get("step") : nullptr; st != nullptr) {
    if (st->kind() == PyKind::kTensor) {
      UCP_ASSIGN_OR_RETURN(Tensor t, of.ReadTensor(st->tensor()), optim0 + ": reading step");
      if (t.num_elements() != 1) return DataLossError(optim0 + ": step is not a scalar");
      if (t.dtype() == DType::kFp32) {
        ck.step_ = static_cast<int64_t>(t.as<float>()[0]);
      } else if (t.dtype() == DType::kInt64) {
        ck.step_ = t.as<int64_t>()[0];
      } else if (t.dtype() == DType::kFp64) {
        ck.step_ = static_cast<int64_t>(t.as<double>()[0]);
      }
    } else {
      UCP_ASSIGN_OR_RETURN(ck.step_, AsInt(st, optim0 + ": step"));
    }
  }
  ck.hyper_ = {0, 0, 0, 0, 0};
  if (const PyValue* groups = base->Get("param_groups");
      groups != nullptr && groups->kind() == PyKind::kList && !groups->items().empty()) {
    const PyValue* g0 = groups->items()[0];
    if (const PyValue* v = g0->Get("lr")) {
      UCP_ASSIGN_OR_RETURN(ck.hyper_[0], AsDouble(v, optim0 + ": lr"));
    }
    if (const PyValue* b = g0->Get("betas"); b && b->items().size() == 2) {
      UCP_ASSIGN_OR_RETURN(ck.hyper_[1], AsDouble(b->items()[0], optim0 + ": betas[0]"));
      UCP_ASSIGN_OR_RETURN(ck.hyper_[2], AsDouble(b->items()[1], optim0 + ": betas[1]"));
    }
    if (const PyValue* v = g0->Get("eps")) {
      UCP_ASSIGN_OR_RETURN(ck.hyper_[3], AsDouble(v, optim0 + ": eps"));
    }
    if (const PyValue* v = g0->Get("weight_decay")) {
      UCP_ASSIGN_OR_RETURN(ck.hyper_[4], AsDouble(v, optim0 + ": weight_decay"));
    }
  }

  // Every command refuses a non-finite hyper-parameter when it opens the folder, rather than
  // some reading it and others failing when a manifest (JSON: no NaN) is written (issue 16 #6).
  static constexpr const char* kHyperNames[5] = {"lr", "betas[0]", "betas[1]", "eps",
                                                 "weight_decay"};
  for (size_t i = 0; i < ck.hyper_.size(); ++i) {
    if (!std::isfinite(ck.hyper_[i])) {
      return DataLossError(optim0 + ": optimizer_state_dict param_groups[0]." + kHyperNames[i] +
                           " is " + std::to_string(ck.hyper_[i]) +
                           ", not a finite number (ucp records finite hyper-parameters only)");
    }
  }
  // Adam's five as ucp has always recorded them; another optimizer's every number of group 0
  // (SGD's momentum, dampening, nesterov as 0/1, ...), betas as beta1 / beta2.
  const bool adam = ck.optimizer_states_ == std::vector<std::string>{"exp_avg", "exp_avg_sq"};
  ck.optimizer_kind_ = ck.hyper_[4] != 0 ? "adamw" : "adam";
  ck.optimizer_hyper_ = {{"lr", ck.hyper_[0]},
                         {"beta1", ck.hyper_[1]},
                         {"beta2", ck.hyper_[2]},
                         {"eps", ck.hyper_[3]},
                         {"weight_decay", ck.hyper_[4]}};
  if (!adam) {
    // The optimizer DeepSpeed built from its config, when it did ("SGD", "Adagrad", "Lion").
    ck.optimizer_kind_ = "torch";
    if (const PyValue* cfg = root.Get("ds_config");
        cfg != nullptr && cfg->kind() == PyKind::kDict) {
      if (const PyValue* o = cfg->Get("optimizer"); o != nullptr && o->kind() == PyKind::kDict) {
        if (const PyValue* t = o->Get("type"); t != nullptr && t->kind() == PyKind::kStr) {
          ck.optimizer_kind_.clear();
          for (char c : t->str()) ck.optimizer_kind_ += static_cast<char>(std::tolower(c));
        }
      }
    }
    ck.optimizer_hyper_.clear();
    const PyValue* groups = base->Get("param_groups");
    if (groups != nullptr && groups->kind() == PyKind::kList && !groups->items().empty() &&
        groups->items()[0]->kind() == PyKind::kDict) {
      for (const auto& [k, v] : groups->items()[0]->entries()) {
        if (k->kind() != PyKind::kStr || k->str() == "params") continue;
        const std::string what = optim0 + ": optimizer_state_dict param_groups[0]." + k->str();
        if (k->str() == "betas" && v->items().size() == 2) {
          UCP_ASSIGN_OR_RETURN(ck.optimizer_hyper_["beta1"], AsDouble(v->items()[0], what));
          UCP_ASSIGN_OR_RETURN(ck.optimizer_hyper_["beta2"], AsDouble(v->items()[1], what));
        } else if (v->kind() == PyKind::kBool) {
          ck.optimizer_hyper_[k->str()] = v->bool_value() ? 1 : 0;
        } else if (v->kind() == PyKind::kInt || v->kind() == PyKind::kFloat) {
          UCP_ASSIGN_OR_RETURN(ck.optimizer_hyper_[k->str()], AsDouble(v, what));
        }
      }
    }
    for (const auto& [k, v] : ck.optimizer_hyper_) {
      if (!std::isfinite(v)) {
        return DataLossError(optim0 + ": optimizer_state_dict param_groups[0]." + k + " is " +
                             std::to_string(v) +
                             ", not a finite number (ucp records finite hyper-parameters only)");
      }
    }
  }
  if (const PyValue* u = root.Get("ucp_client_state"); u != nullptr) {
    if (u->kind() != PyKind::kStr) {
      return DataLossError((ck.dir_ / files.mp.at(0)).string() +
                           ": ucp_client_state is not a string");
    }
    ck.ucp_client_state_json_ = u->str();
  }
  // Client state, as JSON where representable.
  std::string js = "{\"naming\":\"" + std::string(NamingName(ck.naming_)) + "\",\"tag\":";
  AppendJsonString(ck.dir_.filename().string(), js);
  js += ",\"layout\":\"" + ck.LayoutString() + "\",\"optimizer\":\"" + ck.optimizer_ + "\"";
  // DeepSpeed-MoE files (at any ep, 1 included): a DeepSpeed writer writes them again.
  if (ck.moe_) js += ",\"deepspeed_moe\":true";
  for (const char* key :
       {"iteration", "args", "checkpoint_version", "tokens", "global_steps", "global_samples",
        "skipped_steps", "ds_version", "ds_config", "lr_scheduler", "universal_checkpoint_info"}) {
    if (const PyValue* v = root.Get(key); v != nullptr) {
      js += ",\"" + std::string(key) + "\":";
      UCP_RETURN_IF_ERROR(AppendJson(v, js), (ck.dir_ / files.mp.at(0)).string() + ": " + key);
    }
  }
  // What a DeepSpeed writer needs to carry the optimizer over: rank 0's clip_grad, loss scaler
  // (class and attributes), param-group hyper-parameters, and where Adam keeps its step.
  js += ",\"optimizer_state\":{";
  bool first = true;
  auto member = [&](const char* key) -> std::string& {
    js += std::string(first ? "" : ",") + "\"" + key + "\":";
    first = false;
    return js;
  };
  for (const char* key : {"clip_grad", "dynamic_loss_scale", "overflow"}) {
    if (const PyValue* v = osd->Get(key); v != nullptr) {
      UCP_RETURN_IF_ERROR(AppendJson(v, member(key)), optim0 + ": " + key);
    }
  }
  if (const PyValue* scaler = osd->Get("loss_scaler"); ObjectState(scaler) != nullptr) {
    AppendJsonString(scaler->class_name(), member("loss_scaler") += "{\"class\":");
    js += ",\"state\":";
    UCP_RETURN_IF_ERROR(AppendJson(ObjectState(scaler), js), optim0 + ": loss_scaler");
    js += "}";
  }
  if (const PyValue* groups = base->Get("param_groups");
      groups != nullptr && groups->kind() == PyKind::kList) {
    member("param_groups") += "[";
    for (size_t g = 0; g < groups->items().size(); ++g) {
      js += g ? ",{" : "{";
      bool first_key = true;
      for (const auto& [k, v] : groups->items()[g]->entries()) {
        if (k->kind() != PyKind::kStr || k->str() == "params") continue;
        js += first_key ? "" : ",";
        first_key = false;
        AppendJsonKey(k->str(), js);
        js += ":";
        UCP_RETURN_IF_ERROR(AppendJson(v, js), optim0 + ": param_groups");
      }
      js += "}";
    }
    js += "]";
  }
  if (const PyValue* st = s0 != nullptr ? s0->Get("step") : nullptr; st != nullptr) {
    AppendJsonString(st->kind() == PyKind::kTensor ? std::string(DTypeName(st->tensor().dtype))
                                                   : std::string("int"),
                     member("step"));
  } else if (const PyValue* groups = base->Get("param_groups");
             groups != nullptr && !groups->items().empty() && groups->items()[0]->Get("step")) {
    AppendJsonString("param_groups", member("step"));
  }
  js += "}}";
  ck.client_state_json_ = std::move(js);

  if (options.bind_model) {
    UCP_RETURN_IF_ERROR(ck.BindModel(options, args, root.Get("ucp_model")));
    UCP_RETURN_IF_ERROR(
        ck.DecideQkvLayout(options, args, root.Get("ucp_qkv_layout"), files.mp.at(0)));
    // Recorded with the client state, so that ucp's own formats carry it to a DeepSpeed writer.
    ck.client_state_json_.insert(
        ck.client_state_json_.size() - 1,
        ",\"qkv_layout\":\"" + std::string(QkvLayoutName(ck.qkv_layout_)) + "\"");
  }
  return ck;
}

Status DeepSpeedCheckpoint::DecideQkvLayout(const OpenOptions& options, const PyValue* args,
                                            const PyValue* recorded, const std::string& file) {
  std::optional<QkvLayout> given;
  if (!options.qkv_layout.empty()) {
    UCP_ASSIGN_OR_RETURN(given, ParseQkvLayout(options.qkv_layout, "--qkv-layout"));
  }
  if (!HasFusedQkv(model_)) {
    qkv_layout_ = QkvLayout::kPerGroup;
    qkv_layout_origin_ = "the model has no fused QKV";
    return Status::Ok();
  }
  // Multi-head attention: every fused QKV has as many q rows per group as k and v rows.
  bool mha = true;
  for (const patterns::ResolvedParam& p : model_.params) {
    if (IsFusedQkv(p) && (p.rule.part_sizes[0] != p.rule.part_sizes[1])) mha = false;
  }
  std::optional<QkvLayout> found;
  std::string why;
  if (recorded != nullptr) {
    const std::string what = file + ": ucp_qkv_layout";
    if (recorded->kind() != PyKind::kStr) return DataLossError(what + " is not a string");
    Result<QkvLayout> r = ParseQkvLayout(recorded->str(), what);
    if (!r.ok()) return DataLossError(r.status().message());
    found = *r;
    why = "recorded by ucp in " + file + " (ucp_qkv_layout)";
  } else if (args != nullptr && args->Get("ds_sequence_parallel_fpdt") != nullptr && mha) {
    // The argument came with PR #441, the change that made ParallelAttention slice each rank's
    // output into [Q | K | V]; the args are those of the run that saved the files. With GQA that
    // code cannot run (it cuts equal thirds), so such files come from converters that write
    // per-group (hf2megads_weight_converter.py), and nothing is detected.
    found = QkvLayout::kPerRankBlocks;
    why = "detected: " + file +
          " args hold ds_sequence_parallel_fpdt, so Megatron-DeepSpeed since PR #441 saved it";
  }
  if (found) {
    if (given && *given != *found) {
      return InvalidArgumentError("--qkv-layout " + std::string(QkvLayoutName(*given)) +
                                  " contradicts the checkpoint: " + why + " gives " +
                                  std::string(QkvLayoutName(*found)));
    }
    qkv_layout_ = *found;
    qkv_layout_origin_ = why;
  } else if (given) {
    qkv_layout_ = *given;
    qkv_layout_origin_ = "--qkv-layout";
  } else {
    qkv_layout_ = QkvLayout::kPerGroup;
    qkv_layout_origin_ = "default: " + file + " does not record it (" +
                         (args == nullptr ? std::string("no Megatron args")
                          : mha           ? std::string("Megatron args from before PR #441")
                                          : std::string("grouped-query attention")) +
                         "); --qkv-layout per-rank-blocks reads Megatron-DeepSpeed since PR #441";
  }
  return CheckQkvLayout(
      model_, qkv_layout_, tp_,
      "QKV order " + std::string(QkvLayoutName(qkv_layout_)) + " (" + qkv_layout_origin_ + ")");
}

}  // namespace ucp::deepspeed
