// Models and rule sets as data: a model preset (patterns/models/<name>.json) gives
// hyper-parameters and names a family; the family's rule set (patterns/<family>.json) gives the
// parameter templates, one rule per parameter (full-match regexes), and the pipeline / expert
// renumbering patterns. Resolve() binds the two and checks that every parameter has exactly one
// rule and every rule matched something; SliceParam() says what one TP/EP rank holds.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/layout/layout.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"

namespace ucp::patterns {

/// One parameter template of a family: `name` may hold {layer} and {expert}.
struct ParamTemplate {
  std::string name;
  std::vector<std::string> shape;  ///< size expressions over hyper-parameters ("heads*head_dim")
  std::string when;                ///< "" (always), "tied_embeddings" or "!tied_embeddings", ...
};

/// A model: hyper-parameters plus its family's parameter templates.
struct ModelSpec {
  std::string name;
  std::string family;
  DType dtype = DType::kBf16;
  /// hidden, layers, heads, kv_heads, head_dim (derived = hidden / heads when absent),
  /// ffn_hidden, vocab, max_positions, num_experts, make_vocab_size_divisible_by,
  /// tied_embeddings (0/1).
  std::map<std::string, int64_t> hyper;
  std::vector<ParamTemplate> templates;

  /// The logical (unpadded) parameters in canonical order (= ZeRO flat-buffer order).
  /// Errors: kInvalidArgument for a bad size expression (naming the template and expression).
  Result<std::vector<struct ParamSpec>> Parameters() const;
};

struct ParamSpec {
  std::string name;
  Shape shape;
  DType dtype = DType::kBf16;
};

/// Evaluates an integer expression of + - * / ( ) over hyper-parameter names and literals.
/// Division must be exact.
/// Errors: kInvalidArgument naming the expression and the unknown name or inexact division.
Result<int64_t> EvalSizeExpr(std::string_view expr, const std::map<std::string, int64_t>& hyper);

/// The hyper-parameter recording the rotary pairing of a model's q/k rows: absent or 0 is the
/// half-split pairing (HF's rotate_half, Megatron's default), 1 the interleaved one (GPT-J, Meta's
/// original LLaMA, Megatron `--rotary-interleaved`); shared/reference/hf.md 2.3, docs/hf.md.
inline constexpr std::string_view kRotaryInterleavedHyper = "rotary_interleaved";

/// "interleaved" -> 1, "half-split" -> 0 (the values of kRotaryInterleavedHyper).
/// Errors: kInvalidArgument naming `what` and the two names.
Result<int64_t> ParseRotaryLayout(std::string_view text, const std::string& what);
/// The inverse of ParseRotaryLayout for a model's hyper-parameters ("half-split" when absent).
std::string_view RotaryLayoutName(const std::map<std::string, int64_t>& hyper);

/// Loads `<data_dir>/models/<name>.json` (or the file `name_or_path` when it ends in .json) and
/// the templates of `<data_dir>/<family>.json`.
/// Errors: kNotFound (no preset / family file), kInvalidArgument (bad JSON or field, naming the
/// file and field).
/// For a name given on the command line only: a `.json` argument is a path. A name read from a
/// file (a checkpoint's metadata, client state) goes to LoadModelPreset instead.
Result<ModelSpec> LoadModel(const std::filesystem::path& data_dir, std::string_view name_or_path);

/// Loads the preset `<data_dir>/models/<name>.json`; `name` is a name, never a path.
/// Errors: kInvalidArgument when `name` fails ValidateRuleSetName; then as LoadModel.
Result<ModelSpec> LoadModelPreset(const std::filesystem::path& data_dir, std::string_view name);

/// Longest rule-set / preset name, in bytes.
inline constexpr size_t kMaxRuleSetNameBytes = 64;

/// Checks that `name` (a family or preset name, usually read from a file) is a name and not a
/// path: 1 to kMaxRuleSetNameBytes bytes of [A-Za-z0-9_-], so no '/', '.', '..', NUL or absolute
/// path can make it name a file outside the data directory.
/// Errors: `code` with "<what>: \"<name, escaped>\" is not a rule-set or preset name ...".
Status ValidateRuleSetName(std::string_view name, const std::string& what, StatusCode code);

enum class RuleKind : uint8_t { kReplicate, kAverage, kShard, kFuse, kPadStrip };
enum class Axis : uint8_t { kTp, kEp };
enum class FuseOrder : uint8_t { kConcat, kInterleavedGroups };
std::string_view RuleKindName(RuleKind k);

struct FusePart {
  std::string name;
  std::string size;  ///< expression; per group for interleaved_groups, total for concat
};

struct Rule {
  std::string match;  ///< the regex text, also the rule's name in messages
  std::shared_ptr<const std::regex> re;
  RuleKind kind = RuleKind::kReplicate;
  int dim = 0;
  Axis axis = Axis::kTp;
  FuseOrder order = FuseOrder::kConcat;
  std::vector<FusePart> parts;
  std::string groups;                 ///< interleaved_groups: number of groups ("kv_heads")
  std::string group_name = "groups";  ///< in messages: "8 query groups not divisible by tp=3"
  /// interleaved_groups only; "" = tp must divide the groups. Otherwise an expression ("heads"):
  /// tp may also be a multiple of the groups that divides its value, and each rank then holds an
  /// even contiguous 1/tp of the rows, part of one group (Megatron-Core's linear_qkv when
  /// num_query_groups < tp: a plain column-parallel split, KV heads not replicated).
  std::string split_groups_up_to;
  std::string divisible_by;  ///< pad_strip: expression ("make_vocab_size_divisible_by")
  std::string source;        ///< where the rule comes from (a note, not used)
};

struct RuleSet {
  std::string family;
  std::vector<Rule> rules;
  std::vector<ParamTemplate> templates;
  /// Full-match regex whose group 1 is the global layer index ("layers\\.(\\d+)\\..*").
  std::string layer_pattern;
  /// Full-match regex whose group 1 is the global expert index; empty when the family has none.
  std::string expert_pattern;
  /// Non-layer parameters: on the first stage / on the last stage.
  std::vector<std::string> first_stage;
  std::vector<std::string> last_stage;
  /// Parameters also held by the last stage when the model has tied embeddings.
  std::vector<std::string> tied_to_last_stage;
};

/// Parses a rule set; structural validation as in schemas/pattern_set.schema.json.
/// Errors: kInvalidArgument naming `what` (the file), the rule and the field; bad regexes too.
Result<RuleSet> ParseRuleSet(std::string_view json_text, const std::string& what);
/// Loads `<data_dir>/<family>.json`; `family` must pass ValidateRuleSetName.
/// Errors: kInvalidArgument (not a name), kNotFound, as ParseRuleSet.
Result<RuleSet> LoadRuleSet(const std::filesystem::path& data_dir, std::string_view family);

/// A rule with every expression evaluated for one parameter.
struct ResolvedRule {
  std::string match;
  RuleKind kind = RuleKind::kReplicate;
  int dim = 0;
  Axis axis = Axis::kTp;
  FuseOrder order = FuseOrder::kConcat;
  std::vector<std::string> part_names;
  std::vector<int64_t> part_sizes;  ///< rows along dim (per group for interleaved_groups)
  int64_t groups = 1;
  std::string group_name = "groups";
  int64_t split_groups_up_to = 0;       ///< 0: tp must divide groups (see Rule)
  std::string split_groups_up_to_expr;  ///< its expression, for messages ("heads")
  int64_t divisible_by = 1;
};

enum class StagePlacement : uint8_t { kLayer, kFirst, kLast, kFirstAndLast };

struct ResolvedParam {
  std::string name;
  Shape shape;
  DType dtype = DType::kBf16;
  ResolvedRule rule;
  StagePlacement stage = StagePlacement::kLayer;
  int64_t layer = -1;                     ///< global layer index, when stage == kLayer
  int64_t expert = -1;                    ///< global expert index, for per-expert parameters
  size_t layer_pos = 0, layer_len = 0;    ///< where the layer digits are in `name`
  size_t expert_pos = 0, expert_len = 0;  ///< where the expert digits are in `name`
  int optimizer_group = 0;                ///< 0: >= 2 dims and not a bias; 1: the rest
  /// Lives on an ep rank (a per-expert parameter, or a rule sharded on axis ep).
  bool is_expert() const { return expert >= 0 || rule.axis == Axis::kEp; }
};

struct ResolvedModel {
  ModelSpec spec;
  std::vector<ResolvedParam> params;
  int64_t num_layers = 0;
  int64_t num_experts = 0;
};

/// Binds every parameter of `spec` to exactly one rule of `rules`.
/// Errors: kInvalidArgument for a parameter matched by no rule or by two (naming both rules), a
/// rule that matched no parameter, bad expressions, fuse parts that do not add up to the dim;
/// kFailedPrecondition for stage patterns that leave a parameter nowhere.
Result<ResolvedModel> Resolve(const ModelSpec& spec, const RuleSet& rules);

/// A box of a tensor: start and counts per dim.
struct Box {
  Shape start;
  Shape counts;
};

/// A piece of a rank's slice that comes from the full parameter: `counts` elements starting at
/// `local_start` in the slice and at `full_start` in the full tensor.
struct Piece {
  Shape local_start;
  Shape full_start;
  Shape counts;
};

/// What one (tp, ep) rank holds of a parameter.
struct Slice {
  Shape local_shape;
  std::vector<Piece> pieces;  ///< disjoint; together with `pad` they tile local_shape
  std::vector<Box> pad;       ///< local boxes that hold zeros (vocabulary padding)
  int replica = 0;            ///< > 0 for the 2nd, 3rd, ... copy of a replicated parameter
};

/// The slice of `param` on tp rank `tp_rank` of `tp` and ep rank `ep_rank` of `ep`.
/// Errors: kFailedPrecondition "parameter \"X\": 8 query groups not divisible by tp=3" and alike
/// (with split_groups_up_to: "..., nor is tp=3 a multiple of them", "heads=8 not divisible by
/// tp=16 ...").
Result<Slice> SliceParam(const ResolvedParam& param, int tp, int tp_rank, int ep, int ep_rank);

/// The parameter's name with its layer index made local to its stage and its expert index local
/// to its ep rank.
std::string LocalName(const ResolvedParam& param, const layout::StageAssignment& stages,
                      const layout::ExpertPlacement* experts);

}  // namespace ucp::patterns
