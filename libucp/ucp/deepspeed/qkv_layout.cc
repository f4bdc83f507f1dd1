// The fused QKV's row order in Megatron-DeepSpeed files (see qkv_layout.h).
#include "ucp/deepspeed/qkv_layout.h"

#include "ucp/base/status_macros.h"
#include "ucp/deepspeed/pickle_values.h"

namespace ucp::deepspeed {

std::string_view QkvLayoutName(QkvLayout layout) {
  return layout == QkvLayout::kPerGroup ? "per-group" : "per-rank-blocks";
}

Result<QkvLayout> ParseQkvLayout(std::string_view text, const std::string& what) {
  if (text == "per-group") return QkvLayout::kPerGroup;
  if (text == "per-rank-blocks") return QkvLayout::kPerRankBlocks;
  return InvalidArgumentError(
      what +
      " must be per-group (Megatron-LM, Megatron-DeepSpeed before PR "
      "#441) or per-rank-blocks (Megatron-DeepSpeed since PR #441), not \"" +
      std::string(text) + "\"");
}

bool IsFusedQkv(const patterns::ResolvedParam& p) {
  const patterns::ResolvedRule& r = p.rule;
  return r.kind == patterns::RuleKind::kFuse &&
         r.order == patterns::FuseOrder::kInterleavedGroups && r.dim == 0 &&
         r.part_names == std::vector<std::string>{"q", "k", "v"} && r.part_sizes.size() == 3;
}

bool HasFusedQkv(const patterns::ResolvedModel& model) {
  for (const patterns::ResolvedParam& p : model.params) {
    if (IsFusedQkv(p)) return true;
  }
  return false;
}

namespace {

Status CheckParam(const patterns::ResolvedParam& p, int tp, const std::string& what) {
  const std::vector<int64_t>& s = p.rule.part_sizes;
  if (s[0] != s[1] || s[1] != s[2]) {
    return FailedPreconditionError(
        what + ": the QKV order per-rank-blocks cannot hold \"" + p.name + "\" (" +
        std::to_string(s[0]) + " q rows per group, " + std::to_string(s[1]) +
        " k and v rows: grouped-query attention); Megatron-DeepSpeed since PR #441 cuts each "
        "rank's QKV into equal thirds, which only multi-head attention runs with, so its GQA "
        "checkpoints are per-group (as tools/hf2megads_weight_converter.py writes them)");
  }
  if (tp <= 0 || p.rule.groups % tp != 0) {
    return FailedPreconditionError(what + ": the QKV order per-rank-blocks needs whole " +
                                   p.rule.group_name + " per tp rank; \"" + p.name + "\" has " +
                                   std::to_string(p.rule.groups) + " at tp=" + std::to_string(tp));
  }
  return Status::Ok();
}

}  // namespace

Status CheckQkvLayout(const patterns::ResolvedModel& model, QkvLayout layout, int tp,
                      const std::string& what) {
  if (layout == QkvLayout::kPerGroup) return Status::Ok();
  for (const patterns::ResolvedParam& p : model.params) {
    if (IsFusedQkv(p)) UCP_RETURN_IF_ERROR(CheckParam(p, tp, what));
  }
  return Status::Ok();
}

Result<std::vector<RowBlock>> QkvRowBlocks(const patterns::ResolvedParam& p,
                                           const Shape& local_shape, int tp, QkvLayout layout) {
  std::vector<RowBlock> blocks;
  if (layout == QkvLayout::kPerGroup || !IsFusedQkv(p)) return blocks;
  UCP_RETURN_IF_ERROR(CheckParam(p, tp, "parameter \"" + p.name + "\""));
  const std::vector<int64_t>& parts = p.rule.part_sizes;
  const int64_t groups = p.rule.groups / tp;  // on this rank
  int64_t group_rows = 0;
  for (int64_t s : parts) group_rows += s;
  if (local_shape.empty() || local_shape[0] != groups * group_rows) {
    return FailedPreconditionError("parameter \"" + p.name + "\": its TP shard " +
                                   ShapeString(local_shape) + " is not " + std::to_string(groups) +
                                   " whole groups of " + std::to_string(group_rows) + " rows");
  }
  int64_t row = 1;
  for (size_t d = 1; d < local_shape.size(); ++d) row *= local_shape[d];
  // View row g * group_rows + P_j + o (group g, part j at prefix P_j) is stored row
  // groups * P_j + g * parts[j] + o: all groups' part j back to back, part after part.
  blocks.reserve(static_cast<size_t>(groups) * parts.size());
  for (int64_t g = 0; g < groups; ++g) {
    int64_t prefix = 0;
    for (int64_t size : parts) {
      blocks.push_back(RowBlock{(g * group_rows + prefix) * row, (groups * prefix + g * size) * row,
                                size * row});
      prefix += size;
    }
  }
  return blocks;
}

}  // namespace ucp::deepspeed
