// Fixed-order fp32 sums: the serial definition of what the *Deterministic collectives compute,
// and the helper a trainer uses to pre-reduce its own share of the contributions the same way.
//
// kHalvingTree and layout invariance. Let G contributions (micro-batch gradients, say) be summed
// by Tree(G): Tree(n) = Tree(first n/2) + Tree(last n/2) for even n, the rank-order fold for odd
// n. If P = 2^k divides G and rank r holds contributions [r G/P, (r+1) G/P), then Tree(G) equals
// Tree over the P ranks of (each rank's Tree(G/P)), because halving G k times lands exactly on
// the rank boundaries. So a rank that pre-reduces its share with OrderedSum(kHalvingTree) and then
// calls AllReduceDeterministic(kHalvingTree) gets the same bits at P = 1, 2, 4, 8, ... For odd P
// the tree is the rank-order fold, like kRankOrder.
#pragma once

#include <cstdint>
#include <span>

#include "ucp/base/status.h"

namespace ucp::offload {

/// The order in which count contributions c_0 ... c_{count-1} are added, in fp32.
enum class SumOrder : uint8_t {
  kRankOrder,    ///< ((c_0 + c_1) + c_2) + ...
  kHalvingTree,  ///< even count: each half summed by this rule, then added; odd count: kRankOrder
};

/// out[k] <- the sum over i in [0, count) of parts[i * n + k] in `order`, n = out.size(); parts is
/// count contributions of n floats each [count, n]. Bits depend only on the inputs and `order`.
/// Errors: kInvalidArgument (count < 1, parts.size() != count * n, parts and out overlap).
Status OrderedSum(std::span<const float> parts, int64_t count, std::span<float> out,
                  SumOrder order);

}  // namespace ucp::offload
