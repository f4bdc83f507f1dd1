// The row order of a fused QKV weight in Megatron-DeepSpeed files: a property of the code that
// trained the checkpoint, recorded with it, never guessed (shared/reference/hf.md 2.1).
//
//   per-group        Megatron-LM's and Megatron-DeepSpeed's before PR #441 (676a482c,
//                    2024-12-04): per query group g, [q heads of g | k_g | v_g]. ucp's rule sets
//                    (fuse in interleaved_groups order) and its universal form use this order.
//   per-rank-blocks  Megatron-DeepSpeed since PR #441: each TP rank's output is cut into
//                    contiguous [Q_r | K_r | V_r] (megatron/model/transformer.py, "each_hidden_size
//                    = ... // 3"), the rank's q heads, then its k heads, then its v heads.
//
// The two differ at every tp (at tp=1 too) as soon as there is more than one group, so reading
// a checkpoint in the wrong one silently scrambles attention. Within one TP rank the change is a
// permutation of row blocks of the shard (whole groups per rank), which RowBlocks gives; the
// DeepSpeed reader and writer apply it to every view slice of a fused QKV, so the planner and
// the universal form only ever see per-group.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/patterns/model.h"
#include "ucp/tensor/shape.h"

namespace ucp::deepspeed {

enum class QkvLayout : uint8_t {
  kPerGroup,       ///< [q heads of group g | k_g | v_g] per query group (ucp's canonical order)
  kPerRankBlocks,  ///< per TP rank [Q_r | K_r | V_r] (Megatron-DeepSpeed after PR #441)
};

/// "per-group", "per-rank-blocks".
std::string_view QkvLayoutName(QkvLayout layout);

/// The inverse of QkvLayoutName; `what` names the option or field in the error.
/// Errors: kInvalidArgument listing the two names.
Result<QkvLayout> ParseQkvLayout(std::string_view text, const std::string& what);

/// Whether `p` is a fused QKV whose row order the layout decides: a fuse rule on dim 0 in
/// interleaved_groups order whose parts are q, k, v.
bool IsFusedQkv(const patterns::ResolvedParam& p);

/// Whether the model holds a fused QKV at all.
bool HasFusedQkv(const patterns::ResolvedModel& model);

/// Why `layout` cannot hold `model`'s fused QKV at `tp`, or Ok. per-rank-blocks needs whole
/// groups per rank and heads == kv_heads: post-#441 Megatron-DeepSpeed cuts the rank's output
/// into equal thirds, which is right only for multi-head attention (with GQA it cannot run), so
/// no checkpoint of a GQA model has that order. Errors: kFailedPrecondition naming the
/// parameter and the numbers; `what` says where the layout came from.
Status CheckQkvLayout(const patterns::ResolvedModel& model, QkvLayout layout, int tp,
                      const std::string& what);

/// Elements [view_offset, view_offset + numel) of a TP shard in ucp's per-group order are
/// elements [stored_offset, stored_offset + numel) of the same shard as the files hold it.
struct RowBlock {
  int64_t view_offset = 0;
  int64_t stored_offset = 0;
  int64_t numel = 0;
};

/// The blocks of the TP shard of fused QKV `p` (TP-local shape `local_shape`, one of `tp` ranks)
/// in per-rank-blocks order, sorted by view_offset and tiling the shard; empty for per-group
/// (the identity) and for a parameter that is not a fused QKV.
/// Errors: kFailedPrecondition when the shard is not whole groups (CheckQkvLayout).
Result<std::vector<RowBlock>> QkvRowBlocks(const patterns::ResolvedParam& p,
                                           const Shape& local_shape, int tp, QkvLayout layout);

/// Calls fn(view_begin, stored_begin, n) for each piece of view elements [begin, end) that
/// `blocks` (sorted, tiling) map to one contiguous stored range, in view order. With no blocks,
/// once with the range itself. Stops at, and returns, the first error.
template <typename Fn>
Status ForEachStoredRange(const std::vector<RowBlock>& blocks, int64_t begin, int64_t end,
                          Fn&& fn) {
  if (blocks.empty()) return fn(begin, begin, end - begin);
  // The last block starting at or before `begin`: blocks are sorted by view_offset from 0.
  size_t lo = 0, hi = blocks.size();
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    (blocks[mid].view_offset <= begin ? lo : hi) = mid;
  }
  for (size_t i = lo; i < blocks.size() && blocks[i].view_offset < end; ++i) {
    const RowBlock& b = blocks[i];
    const int64_t a = std::max(begin, b.view_offset);
    const int64_t z = std::min(end, b.view_offset + b.numel);
    if (a >= z) continue;
    Status s = fn(a, b.stored_offset + (a - b.view_offset), z - a);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace ucp::deepspeed
