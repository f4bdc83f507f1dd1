// Reading DeepSpeed / Megatron-DeepSpeed ZeRO-1/2 and BF16-optimizer checkpoints without Python
// (shared/reference/deepspeed_ucp.md sections 2-5): topology from file names and saved
// metadata, parameters under ucp's canonical names, and extraction into ucp's universal
// checkpoint. Fragments are read as byte ranges of the flat fp32 / Adam partitions, so memory
// is bounded by the parameters in flight, not by the files. TP slices are merged by ucp's own
// rules for the model family, never by the `universal_checkpoint_info` the source saved
// (which is wrong for TP=1 sources, section 9): the rules are those of the family's rule set,
// patterns/<family>.json, read through ucp/patterns.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/io/universal/universal_checkpoint.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"

namespace ucp::deepspeed {

/// Whose parameter names the engine saved.
enum class Naming : uint8_t {
  kMegatronPipe,  ///< Megatron-DeepSpeed GPTModelPipe: "tied_modules.embed.…", "{i+2}.…"
  kMegatronGpt,   ///< Megatron-DeepSpeed GPTModel: "language_model.encoder.layers.{i}.…"
  kPlain,         ///< plain DeepSpeed: the engine's names are ucp's canonical names
};
std::string_view NamingName(Naming n);

/// How TP slices of a parameter combine; mapped from the kind of the parameter's rule in the
/// family's rule set (patterns/<family>.json): replicate -> kReplicate, shard dim d -> kShard
/// along d, pad_strip dim 0 -> kPadStrip, fuse dim 0 in interleaved_groups order (Megatron's
/// per-head QKV) -> kShard along 0. Other kinds are kUnimplemented at Open.
enum class MergeKind : uint8_t { kReplicate, kShard, kPadStrip };

struct DeepSpeedParam {
  std::string name;         ///< ucp canonical name ("layers.0.self_attention.dense.weight")
  std::string engine_name;  ///< the name in the files
  Shape shape;              ///< logical shape (TP merged, vocabulary padding removed)
  Shape tp_shape;           ///< one TP rank's shard shape (param_shapes)
  std::string rule;         ///< the `match` of its rule in the family's rule set
  MergeKind merge = MergeKind::kReplicate;
  int dim = 0;    ///< concatenation dim for kShard / kPadStrip
  int stage = 0;  ///< the pipeline stage whose copy is read (the first that holds it)
  int group = 0;  ///< optimizer param group
};

struct OpenOptions {
  /// A family ("gpt": `<data_dir>/gpt.json`) or a preset (`<data_dir>/models/gpt-tiny.json`,
  /// whose family is used); "" recognises the family from the parameter names: the one rule
  /// set in data_dir that gives every parameter exactly one rule.
  std::string model;
  /// The folder holding the rule sets and models/; "" is env UCP_DATA_DIR + "/patterns" when
  /// set, else the source tree's patterns/ (as `ucp plan --data-dir`).
  std::filesystem::path data_dir;
};

class DeepSpeedCheckpoint {
 public:
  /// Opens the tag folder (holding mp_rank_*_model_states.pt and *zero_pp_rank_*_optim_states.pt)
  /// or its parent holding `latest`. Reads every mp_rank file's pickle (not the weights).
  /// Errors: kNotFound (no such folder, no `latest` tag folder, no mp_rank or optim files, a
  /// rank file missing from the grid, a key missing, no such model or rule set); kDataLoss
  /// (file counts that do not form a tp x pp x dp grid, param_shapes that differ between
  /// replicas, a bad pickle); kInvalidArgument (a parameter matched by no rule or by two of the
  /// family's rule set, names that no rule set or two fit, a bad rule set);
  /// kUnimplemented (ZeRO-3, elastic checkpoints, an optimizer without exp_avg / exp_avg_sq, a
  /// rule kind the extractor cannot merge: average, fuse other than dim-0 interleaved_groups,
  /// pad_strip off dim 0, axis ep).
  static Result<DeepSpeedCheckpoint> Open(const std::filesystem::path& path,
                                          const OpenOptions& options = {});

  const std::filesystem::path& dir() const { return dir_; }
  int tp() const { return tp_; }
  int pp() const { return pp_; }
  /// Number of optimizer partitions per (pp, tp): dp * sp.
  int dp_sp() const { return dp_ * sp_; }
  int dp() const { return dp_; }
  int sp() const { return sp_; }
  int64_t iteration() const { return iteration_; }
  int64_t step() const { return step_; }
  DType dtype() const { return dtype_; }
  Naming naming() const { return naming_; }
  /// "bf16_optimizer", "zero1" or "zero2".
  const std::string& optimizer() const { return optimizer_; }
  int64_t original_vocab_size() const { return original_vocab_; }
  /// The family whose rule set gave the merge rules ("gpt").
  const std::string& family() const { return family_; }
  /// Parameters in canonical order (embedding, layers by index, final norm).
  const std::vector<DeepSpeedParam>& params() const { return params_; }
  /// iteration, args, ds_version, ... of rank 0's model states as a JSON object.
  const std::string& client_state_json() const { return client_state_json_; }
  /// lr, beta1, beta2, eps, weight_decay of optimizer group 0.
  const std::vector<double>& hyper() const { return hyper_; }
  /// "tp=2,pp=2,dp=2,sp=1,zero=1".
  std::string LayoutString() const;

  /// File names relative to dir().
  std::string ModelStatesFile(int pp_rank, int tp_rank) const;
  std::string OptimStatesFile(int pp_rank, int tp_rank, int dp_rank) const;

 private:
  friend class Extractor;
  std::filesystem::path dir_;
  int tp_ = 1, pp_ = 1, dp_ = 1, sp_ = 1;
  int64_t iteration_ = 0, step_ = 0;
  DType dtype_ = DType::kFp32;
  Naming naming_ = Naming::kPlain;
  std::string optimizer_;
  std::string optim_prefix_;
  int64_t original_vocab_ = 0;
  std::string family_;
  std::vector<DeepSpeedParam> params_;
  std::string client_state_json_;
  std::vector<double> hyper_;  // lr, beta1, beta2, eps, weight_decay
};

/// True for a DeepSpeed ZeRO checkpoint folder, or a parent holding `latest` that names one.
bool LooksLikeDeepSpeedCheckpoint(const std::filesystem::path& path);

struct ExtractOptions {
  std::string model;                ///< as OpenOptions::model
  std::filesystem::path data_dir;   ///< as OpenOptions::data_dir
  int threads = 2;                  ///< parameters extracted at once
  io::UniversalWriteOptions write;  ///< its step is replaced by the checkpoint's step
};

/// Extracts every parameter's fp32 weight, exp_avg and exp_avg_sq at its logical shape into a
/// new universal checkpoint at `dst`; the manifest's client_state_json carries iteration, args
/// and the DeepSpeed version as JSON.
/// Errors: those of Open; kNotFound / kDataLoss for a missing fragment, fragments that do not
/// tile a TP shard, replicated slices that differ; errors of UniversalWriter.
Status ExtractDeepSpeedToUniversal(const std::filesystem::path& src,
                                   const std::filesystem::path& dst,
                                   const ExtractOptions& options = {});

struct DeepSpeedUniversalOptions {
  /// The DeepSpeed tag folder the universal checkpoint came from: its mp_rank_*_model_states.pt
  /// are copied byte for byte (client state: args, RNG, scheduler), as DeepSpeed's converter
  /// does. Empty: minimal mp_rank_00_model_states.pt files are written from client_state_json.
  std::filesystem::path model_states_from;
  int tp = 1;  ///< the layout the model-state files describe when written from scratch
  int pp = 1;
  /// The family or preset whose rule set gives cat_dim; "" is the manifest's source_model
  /// (recognised from the names when that is empty too).
  std::string model;
  std::filesystem::path data_dir;  ///< as OpenOptions::data_dir
};

/// Writes DeepSpeed's universal layout at `dst` (a new folder): zero/<engine name>/{fp32,
/// exp_avg,exp_avg_sq}.pt as dicts {'param': tensor, 'cat_dim': d, ['vocab_tensor': True]},
/// zero/<engine name>/step.pt, zero/optimizer_state.pt, mp_rank_XX_model_states.pt and
/// dirname(dst)/latest_universal naming basename(dst). Names use Megatron-DeepSpeed
/// GPTModelPipe naming (the source's naming when client_state_json records one).
/// Errors: kAlreadyExists (dst exists); those of Open for the rule set and its matching;
/// errors of UniversalReader and TorchWriter.
Status WriteDeepSpeedUniversal(const io::UniversalReader& reader, const std::filesystem::path& dst,
                               const DeepSpeedUniversalOptions& options = {});

}  // namespace ucp::deepspeed
