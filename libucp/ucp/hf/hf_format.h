// Hugging Face model folders as a format (api/format.h, docs/hf.md): "hf" reads a folder with
// config.json and model.safetensors (or model-0000k-of-0000n.safetensors shards with
// model.safetensors.index.json) as a universal-layout CheckpointSource of weights only, and
// writes one from any source. The name and layout maps are data (patterns/hf/*.json, hf_map.h);
// both directions are plans of strided boxes run by the executor, so memory is a few windows and
// only the byte ranges a plan needs are read.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "ucp/api/format.h"
#include "ucp/api/source.h"
#include "ucp/base/result.h"

namespace ucp::hf {

/// The files of a Hugging Face folder.
inline constexpr std::string_view kConfigFileName = "config.json";
inline constexpr std::string_view kSingleFileName = "model.safetensors";
inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";

/// Whether `dir` has config.json and model.safetensors or the index.
bool LooksLikeHfFolder(const std::filesystem::path& dir);

/// Opens a Hugging Face folder. meta(): format "hf", layout universal, the model from config.json
/// through the map of its architecture (family rule set from `data_dir`; vocabulary rows padded
/// with zeros to make_vocab_size_divisible_by * tp at a layout), dtype the tensors', states
/// `model` and `fp32` (the weights widened exactly; no Adam moments), client state
/// {"hf": {"architecture": A, "config": {...}}}.
/// Errors: kNotFound (no config.json, no weights, a shard the index names is missing);
/// kUnimplemented (an architecture with no map, an unmet map requirement such as biases);
/// kDataLoss (corrupt config, index or shard: the safetensors reader's errors, a tensor the index
/// and the shards disagree on, a shard not in the index, a tensor of the wrong shape or dtype,
/// a tensor with no map entry, a tensor missing, "tie_word_embeddings is false but lm_head.weight
/// is missing").
/// `rotary_layout` (--rotary-layout): the rotary pairing of the q/k rows the source serves. The
/// files are HF's half-split; "interleaved" permutes each head's rows (the map's `rotary` parts)
/// and records the model's rotary_interleaved hyper-parameter, so a ucp checkpoint made from it
/// is an interleaved-rotary one; "" or "half-split" moves rows in order.
/// Errors: also kInvalidArgument for another rotary_layout.
Result<std::unique_ptr<api::CheckpointSource>> OpenHfSource(const std::filesystem::path& dir,
                                                            const std::filesystem::path& data_dir,
                                                            const std::string& rotary_layout = "");

struct HfWriteOptions {
  /// "" (the model's training dtype, from its `model` state), "fp32", "bf16" or "fp16" (from the
  /// `fp32` state when the source has one, rounded to nearest even).
  std::string dtype;
  /// Shards are cut at this many bytes (decimal units); default transformers 4.47's "5GB".
  int64_t max_shard_bytes = 5'000'000'000;
  /// The architecture to write; "" takes the one the source recorded, else the family's default
  /// map.
  std::string architecture;
};

/// Writes `src` as a Hugging Face folder at `dst` (must not exist): config.json, the shards and
/// (for several) the index; under dst.tmp-XXXXXX, fsynced and renamed.
/// Errors: kAlreadyExists; kInvalidArgument (dtype); kNotFound (no map for the model's family);
/// kFailedPrecondition (the model cannot be expressed in the architecture's config); the
/// source's, the plan's, the executor's and the safetensors writer's errors.
Result<exec::ExecStats> WriteHf(const api::CheckpointSource& src, const std::filesystem::path& dst,
                                const api::RunOptions& run, const HfWriteOptions& options);

/// The "hf" format (source and sink; options dtype, max-shard-size, architecture).
std::unique_ptr<api::CheckpointFormat> MakeHfFormat();

}  // namespace ucp::hf
