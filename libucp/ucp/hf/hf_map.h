// Hugging Face name and layout maps (patterns/hf/<architecture>.json, schema
// schemas/hf_map.schema.json, docs/hf.md): how one transformers architecture's config.json gives a
// ucp model (hyper-parameters of a family), and how its state-dict tensors are laid out against
// the family's universal parameters. Pure: no I/O beyond reading the map files, no threads.
//
// Every ucp parameter is cut along dim 0 into `groups` blocks of [part 0 | part 1 | ...] rows;
// part p of group g comes from rows (the "out" dim) [offset_p + g*size_p, + size_p) of the HF
// tensor `hf_p`, which stores [out, in] ("transpose": false) or [in, out] (Conv1D, "transpose":
// true). A rename is one part and one group; Llama's GQA QKV is kv_heads groups of [q | k | v]
// from q_proj, k_proj, v_proj; GPT-2's c_attn is heads groups of [q | k | v] head_dim rows from
// the columns [Q | K | V] of one transposed tensor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/convert/plan.h"
#include "ucp/json/strict_json.h"
#include "ucp/patterns/model.h"

namespace ucp::hf {

/// A ucp hyper-parameter read from config.json: the first of `keys` present and not null, else
/// `default_expr` (evaluated over the hyper-parameters read before it); on export written under
/// keys[0].
struct HyperKey {
  std::string name;
  std::vector<std::string> keys;
  std::string default_expr;  ///< "" when the key is required
};

/// A config.json field that must hold a value for the map to apply (Llama's attention_bias:
/// false, since the llama rule set has no linear biases).
struct Requirement {
  std::string key;
  json::Json equals;
  json::Json default_value;  ///< the value when the key is absent
  std::string why;
};

struct MapPart {
  std::string hf;  ///< HF tensor name, may hold {layer} and {expert}
  std::string size;
  std::string offset = "0";
  /// A row permutation, as data ("rotary": {"when": W, "head": E}): where hyper W is set, the
  /// part's rows are heads of E rows whose rotary pairs are adjacent on the ucp side, (2i, 2i+1),
  /// and halves on the HF side, (i, i + E/2): ucp row 2i+s of a head is HF row s*E/2 + i, the
  /// permutation transformers' convert_llama_weights_to_hf applies to Meta's q and k (issue 13,
  /// shared/reference/hf.md 2.3). Empty `rotary_when`: rows map in order.
  std::string rotary_when;
  std::string rotary_head;
};

struct MapTensor {
  /// ucp parameter template: {layer}; {expert} in consecutive {layer} entries, repeated per
  /// expert (hyper num_experts) inside each layer, as HF's state dict orders them
  std::string param;
  std::string when;  ///< "", "tied_embeddings" or "!tied_embeddings"
  bool transpose = false;
  std::string groups = "1";
  std::vector<MapPart> parts;  ///< one part with size "" is the whole dim 0
};

struct HfMap {
  std::string file;  ///< where it was read from, for messages
  std::string architecture;
  std::string model_type;
  std::string family;
  bool default_for_family = false;
  std::string base_model_prefix;  ///< "transformer." / "model."
  std::vector<HyperKey> hyper;
  std::vector<Requirement> requires_;
  json::Json config_defaults;      ///< config.json written when the source recorded none
  std::vector<std::string> skip;   ///< full-match regexes over unprefixed keys
  std::vector<MapTensor> tensors;  ///< in state-dict order
};

/// Parses one map. Errors: kInvalidArgument naming `what` and the field.
Result<HfMap> ParseHfMap(std::string_view text, const std::string& what);
/// Every map in `<data_dir>/hf/*.json`, sorted by file name. Errors: as ParseHfMap; kNotFound.
Result<std::vector<HfMap>> LoadHfMaps(const std::filesystem::path& data_dir);

/// The ucp hyper-parameters a config gives (tied_embeddings as 0/1), after checking the map's
/// requirements.
/// Errors: kUnimplemented for an unmet requirement (naming the key, value and why);
/// kInvalidArgument for a missing or non-integer key ("config.json: n_embd is missing").
Result<std::map<std::string, int64_t>> HyperFromConfig(const HfMap& map, const json::Json& config,
                                                       const std::string& where);

/// The config.json for `model` exported as `map.architecture` with weights in `dtype`: `base`
/// (the source's recorded config of the same architecture, else the map's defaults) with the
/// architecture, model_type, every hyper key, tie_word_embeddings and torch_dtype set from the
/// model. TF5-only spellings (`dtype`, `rope_parameters`) are replaced by the legacy ones both
/// 4.x and 5.x read.
/// Errors: kFailedPrecondition when the config cannot express the model (a hyper-parameter that
/// would read back differently, e.g. GPT-2 with head_dim != hidden/heads).
Result<json::Json> ConfigForModel(const HfMap& map, const patterns::ModelSpec& model,
                                  const json::Json& base, DType dtype);

/// TF5 spellings folded into TF4 ones (dtype -> torch_dtype, rope_parameters -> rope_theta and
/// rope_scaling).
json::Json NormalizeConfig(json::Json config);

/// One HF tensor as the map lays it out for a model.
struct HfTensor {
  std::string name;  ///< with the base-model prefix
  Shape shape;
  std::string when;  ///< the map entry's condition ("!tied_embeddings" for an untied head)
};

/// One block: `counts` elements of ucp parameter `param` (flat strides param_strides from
/// param_offset) <-> of HF tensor `tensor` (hf_strides from hf_offset).
struct HfBlock {
  std::string param;
  int32_t tensor = 0;  ///< index into HfLayout::tensors
  std::vector<int64_t> counts;
  int64_t param_offset = 0, hf_offset = 0;
  std::vector<int64_t> param_strides, hf_strides;
};

/// The HF state dict of a model: its tensors in state-dict order and the blocks that tile both
/// sides exactly.
struct HfLayout {
  std::vector<HfTensor> tensors;
  std::vector<HfBlock> blocks;
  /// HF tensors of entries whose condition does not hold (a tied head's lm_head.weight): a file
  /// may hold them; they are not read.
  std::vector<std::string> unused;
};

/// Lays out `model` (bound to map.family) as map.architecture.
/// Errors: kInvalidArgument (a map parameter the model lacks, a model parameter no map entry
/// gives, bad expressions, parts that do not tile a parameter or an HF tensor).
Result<HfLayout> LayOutHf(const HfMap& map, const patterns::ResolvedModel& model);

/// Strips the base-model prefix from `name` when it has it.
std::string Unprefixed(const HfMap& map, const std::string& name);

/// Greedy shard split in state-dict order, as huggingface_hub's split_state_dict_into_shards:
/// a tensor larger than max_shard_bytes gets a shard of its own (placed before the one being
/// filled), otherwise a shard is closed when the next tensor would take it past the limit.
/// Returns each tensor's shard index, shards in file order.
std::vector<int> SplitShards(const std::vector<int64_t>& tensor_bytes, int64_t max_shard_bytes);

/// "5GB", "500MB", "10KB", "1TB" (decimal, as huggingface_hub's parse_size_to_int) or a
/// plain byte count. Errors: kInvalidArgument.
Result<int64_t> ParseShardSize(std::string_view text);

/// Shard file names: "model.safetensors" for one, else "model-0000k-of-0000n.safetensors".
std::string ShardFileName(int index, int count);

}  // namespace ucp::hf
