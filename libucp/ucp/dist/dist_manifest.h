// ucp_layout.json: the metadata file of a distributed (per-rank) checkpoint (docs/
// distributed_format.md, schemas/distributed.schema.json). Plain structs, a deterministic
// serializer and a strict parser (duplicate, unknown, missing keys and wrong types rejected with
// the JSON path). The model is described inline so the checkpoint reads without a preset file.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"

namespace ucp::dist {

inline constexpr std::string_view kDistFormatName = "ucp-distributed";
inline constexpr int64_t kDistFormatVersion = 1;
inline constexpr std::string_view kLayoutFileName = "ucp_layout.json";

/// The model a checkpoint was written for: preset name, rule-set family, training dtype and
/// every hyper-parameter (patterns::ModelSpec without its templates, which come from the family).
struct DistModel {
  std::string name;
  std::string family;
  DType dtype = DType::kBf16;
  std::map<std::string, int64_t> hyper;
};

struct DistParam {
  std::string name;  ///< logical parameter
  Shape shape;       ///< logical, unpadded
  DType dtype = DType::kBf16;
};

/// One dataset of a rank file.
struct DistTensor {
  std::string name;  ///< the plan's per-rank tensor name (convert/plan.h)
  DType dtype = DType::kFp32;
  Shape shape;
  std::string checksum;  ///< "xxh3-64:<hex>" of the dataset's little-endian bytes
};

struct DistRankFile {
  int64_t rank = 0;
  std::string file;                 ///< "rank_00003.h5"
  std::vector<DistTensor> tensors;  ///< sorted by name
};

struct DistManifest {
  DistModel model;
  std::string layout;  ///< canonical layout string
  int64_t step = 0;
  std::string optimizer_kind = "adam";
  std::map<std::string, double> optimizer_hyper;
  std::vector<std::string> optimizer_states;  ///< "fp32", "exp_avg", "exp_avg_sq"
  std::vector<DistParam> params;              ///< canonical model order
  std::vector<DistRankFile> ranks;            ///< sorted by rank, one per global rank
  /// Optional opaque JSON object carried through (a trainer's own state: consumed samples,
  /// schedule, scaler, config; or a DeepSpeed source's client state); "" for none. Stored as
  /// `client_state` with sorted keys; it never holds "ucp_model" (the model is `model`).
  std::string client_state_json;
};

/// "rank_00003.h5".
std::string RankFileName(int64_t rank);

/// Sorted keys, two-space indent: equal manifests give equal bytes.
/// Errors: kInvalidArgument for a non-finite hyper-parameter (naming it).
Result<std::string> SerializeDistManifest(const DistManifest& m);

/// Parses and validates `text`; `file` names it in errors. Checks JSON syntax, duplicate keys,
/// exactly the known keys, types, format name and version, dtype names, dims, checksums, unique
/// parameter / tensor names, safe file names and ranks 0..n-1 in order.
/// Errors: kDataLoss naming the file and JSON path; kUnimplemented for another version.
Result<DistManifest> ParseDistManifest(std::string_view text, const std::string& file);

}  // namespace ucp::dist
