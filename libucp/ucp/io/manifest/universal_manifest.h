// The manifest.json of a universal checkpoint (docs/format.md, schemas/manifest.schema.json):
// plain structs, a deterministic serializer, and a strict parser that rejects duplicate keys,
// unknown keys, missing keys and wrong types with the JSON path of the offence.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"

namespace ucp::io {

inline constexpr std::string_view kUniversalFormatName = "ucp-universal";
/// The format version this code writes and the only one it reads.
inline constexpr int64_t kUniversalFormatVersion = 1;
inline constexpr std::string_view kManifestFileName = "manifest.json";
/// The dataset holding the fp32 master weight.
inline constexpr std::string_view kMasterWeightState = "fp32";

struct UniversalStateInfo {
  std::string name;  ///< "fp32", "exp_avg", ...: also the dataset name in the param file
  DType dtype = DType::kFp32;
  std::string checksum;  ///< "xxh3-64:<16 hex>" of the dataset's little-endian bytes
};

struct UniversalParamInfo {
  std::string name;                 ///< logical parameter name
  Shape shape;                      ///< logical (unpadded, unsharded) shape
  DType dtype = DType::kFp32;       ///< the dtype the trainer's model holds it in
  std::string pattern_json = "{}";  ///< a JSON object: how a trainer shards it (patterns/)
  std::vector<UniversalStateInfo> states;
  std::string file;  ///< relative path of the parameter file
};

struct UniversalManifest {
  int64_t step = 0;
  std::string optimizer_kind;                 ///< "adam", "adamw", "sgd", ...
  std::map<std::string, double> hyper;        ///< lr, betas, eps, weight_decay, ...: finite numbers
  std::vector<std::string> optimizer_states;  ///< names of the optimizer's states, e.g. exp_avg
  std::string source_layout;                  ///< "tp=2,pp=2,dp=2,zero=1"
  std::string source_model;                   ///< rule-set name, e.g. "gpt2"
  std::string source_framework;               ///< "megatron-deepspeed", "ucp-offload", ...
  /// The fused QKV's row order in the source's files, where the code that trained it decides
  /// it (Megatron-DeepSpeed: "per-group" or "per-rank-blocks", docs/deepspeed.md); the params
  /// are per-group whatever it says. Optional: "" is not written.
  std::string source_qkv_layout;
  std::string client_state_json;              ///< a JSON object, or empty for none
  std::vector<UniversalParamInfo> params;
};

/// Serializes with sorted keys and two-space indent: equal manifests give equal bytes.
/// Errors: kInvalidArgument (non-finite hyper-parameter, pattern_json or client_state_json not a
/// JSON object, negative dim), naming the field.
Result<std::string> SerializeUniversalManifest(const UniversalManifest& m);

/// Parses and validates the text of a manifest; `file` names it in errors. Checks: JSON syntax,
/// no duplicate keys, exactly the known keys, their types, format name, version (another is
/// kUnimplemented), dtype names, dims >= 0 and their product, checksum syntax, unique parameter
/// names and unique state names per parameter, `file` a safe relative path.
/// Errors: kDataLoss naming the file, JSON path and key; kUnimplemented for another version.
Result<UniversalManifest> ParseUniversalManifest(std::string_view text, const std::string& file);

/// Checks that `text` is one JSON object without duplicate keys; `what` names it in errors.
/// Errors: kInvalidArgument.
Status ValidateJsonObject(std::string_view text, const std::string& what);

}  // namespace ucp::io
