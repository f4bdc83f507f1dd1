// OrderedSum: fp32 sums in a fixed order, tile by tile so the tree's scratch stays in cache.
#include "offload/comm/ordered_sum.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace ucp::offload {
namespace {

// Elements per tile: the tree keeps one partial sum per level, so scratch is levels * kTile.
constexpr size_t kTile = 4096;

// dst[0, len) <- contributions [first, first + count) at element offset `at`, in rank order.
void FoldInRankOrder(const float* parts, size_t n, int64_t first, int64_t count, size_t at,
                     size_t len, float* dst) {
  const float* c = parts + static_cast<size_t>(first) * n + at;
  std::copy(c, c + len, dst);
  for (int64_t i = 1; i < count; ++i) {
    c += n;
    for (size_t k = 0; k < len; ++k) dst[k] += c[k];
  }
}

// dst <- Tree(contributions [first, first + count)); scratch holds one tile per tree level.
void Tree(const float* parts, size_t n, int64_t first, int64_t count, size_t at, size_t len,
          float* dst, float* scratch) {
  if (count % 2 != 0) {
    FoldInRankOrder(parts, n, first, count, at, len, dst);
    return;
  }
  const int64_t half = count / 2;
  Tree(parts, n, first, half, at, len, dst, scratch + kTile);
  Tree(parts, n, first + half, half, at, len, scratch, scratch + kTile);
  for (size_t k = 0; k < len; ++k) dst[k] += scratch[k];
}

}  // namespace

Status OrderedSum(std::span<const float> parts, int64_t count, std::span<float> out,
                  SumOrder order) {
  const size_t n = out.size();
  if (count < 1) {
    return InvalidArgumentError("ordered_sum: " + std::to_string(count) +
                                " contributions, need at least 1");
  }
  if (parts.size() / static_cast<size_t>(count) != n ||
      parts.size() % static_cast<size_t>(count) != 0) {
    return InvalidArgumentError("ordered_sum: " + std::to_string(parts.size()) +
                                " floats are not " + std::to_string(count) + " contributions of " +
                                std::to_string(n) + " floats");
  }
  if (n == 0) return Status::Ok();
  if (parts.data() < out.data() + n && out.data() < parts.data() + parts.size()) {
    return InvalidArgumentError("ordered_sum: the output overlaps the contributions");
  }
  if (order == SumOrder::kRankOrder || count % 2 != 0) {
    FoldInRankOrder(parts.data(), n, 0, count, 0, n, out.data());
    return Status::Ok();
  }
  // Levels of the tree: one per halving, plus the odd-count fold at the bottom.
  int levels = 1;
  for (int64_t c = count; c % 2 == 0; c /= 2) ++levels;
  std::vector<float> scratch(static_cast<size_t>(levels) * kTile);
  for (size_t at = 0; at < n; at += kTile) {
    const size_t len = std::min(kTile, n - at);
    Tree(parts.data(), n, 0, count, at, len, out.data() + at, scratch.data());
  }
  return Status::Ok();
}

}  // namespace ucp::offload
