// Layouts and all parallelism arithmetic: rank <-> coordinates, even / padded / explicit splits,
// ZeRO flat partitioning, pipeline stage assignment and expert placement. Pure: no I/O, no
// threads, no regex. Every function is total: a case either maps or returns an error with the
// numbers in it (docs/patterns.md, "Layouts").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::layout {

/// A parallel layout. Sizes are >= 1; zero_stage is 0..3. `universal` marks the universal form:
/// one rank holding every full, unpadded parameter and every optimizer state (all sizes 1).
struct Layout {
  int tp = 1;
  int pp = 1;
  int dp = 1;
  int sp = 1;  ///< sequence (Ulysses) / context parallel; multiplies the ZeRO fragment count
  int ep = 1;  ///< expert parallel, carved out of dp for expert parameters; must divide dp
  int zero_stage = 0;
  bool universal = false;
  /// Transformer layers per pipeline stage, in stage order (`stages=4+4+2`), or empty for the
  /// even split. When given it has pp entries, each >= 1; that they sum to the model's layers is
  /// checked where the model is known (AssignStages). Uneven pipelines need it: peers disagree on
  /// a default (Megatron-LM refuses, DeepSpeed's partition_method splits its whole layer list,
  /// embeddings included), so ucp never guesses one.
  std::vector<int64_t> stages;

  friend bool operator==(const Layout&, const Layout&) = default;
};

/// Largest number of layers one stage of `stages=` may name (a typo guard, like kMaxAxisSize).
inline constexpr int64_t kMaxStageLayers = int64_t{1} << 24;

/// Largest size of one axis (tp, pp, dp, sp, ep) a layout may ask for.
inline constexpr int kMaxAxisSize = 1 << 16;
/// Largest world size (tp * sp * dp * pp) a layout may ask for: about 2^20 ranks, well above any
/// real job, so that a typo such as dp=1048576000 fails at once instead of planning a billion
/// ranks (the plan costs a few KB per rank).
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 20;

/// The universal layout (what `--from universal` / `--to universal` means).
Layout UniversalLayout();

/// Parses `tp=2,pp=2,dp=4[,sp=1][,ep=1][,zero=1][,stages=4+4+2]` (keys in any order, each at
/// most once; missing keys are 1, zero defaults to 0; `stages` without `pp` sets pp to its
/// length) or the word `universal`.
/// Errors: kInvalidArgument naming the token for an unknown key, a duplicate key, a value that is
/// not a positive integer, a size above kMaxAxisSize, a world size above kMaxWorldSize, a zero
/// stage outside 0..3, ep not dividing dp, a stages list whose length is not pp, or an empty
/// string.
Result<Layout> ParseLayout(std::string_view text);

/// A layout string that may name only some keys (`--layout tp=1`): the keys it names, to be
/// laid over another layout (MergeLayout), so a conversion keeps what the user did not mention.
struct PartialLayout {
  Layout values;  ///< the named keys' values (the others as ParseLayout defaults them)
  bool given[6] = {false, false, false, false, false, false};  ///< tp, pp, dp, sp, ep, zero
  bool stages_given = false;                                   ///< `stages=`
  bool universal = false;                                      ///< the word `universal`
  /// The keys named, "tp,zero" (or "universal").
  std::string Keys() const;
};

/// Parses what ParseLayout parses, checking each token but not the whole (`ep=2` alone is
/// valid here: dp may come from the layout it is merged into).
/// Errors: kInvalidArgument as ParseLayout's token errors.
Result<PartialLayout> ParsePartialLayout(std::string_view text);

/// `base` with the keys `partial` names replaced; a universal partial gives the universal
/// layout, a universal base keeps nothing (sizes 1, zero 0). A kept ep that does not divide a
/// given dp becomes 1 (ep is carved out of dp). Kept stages go when a given pp differs from the
/// base's (they describe the old pipeline); given stages without pp set pp to their length.
/// Errors: kInvalidArgument as Validate, saying which keys were kept from `base`.
Result<Layout> MergeLayout(const Layout& base, const PartialLayout& partial);

/// The canonical form: `tp=2,pp=2,dp=4,sp=1,ep=1,zero=1[,stages=4+4+2]` (stages only when
/// given), or `universal`.
std::string ToString(const Layout& layout);

/// Checks the invariants ParseLayout enforces (for layouts built in code).
/// Errors: kInvalidArgument naming the field and its value.
Status Validate(const Layout& layout);

/// tp * sp * dp * pp (ep does not add ranks: it is carved out of dp).
int64_t WorldSize(const Layout& layout);

/// One rank's coordinates. Megatron order: tp fastest, then sp, then dp, then pp:
/// rank = tp + tp_size * (sp + sp_size * (dp + dp_size * pp)).
struct RankCoords {
  int tp = 0;
  int sp = 0;
  int dp = 0;
  int pp = 0;
  friend bool operator==(const RankCoords&, const RankCoords&) = default;
};

/// Errors: kOutOfRange when rank is not in [0, WorldSize).
Result<RankCoords> CoordsOfRank(const Layout& layout, int64_t rank);
/// Errors: kOutOfRange naming the coordinate that is outside its size.
Result<int64_t> RankOfCoords(const Layout& layout, const RankCoords& coords);

/// Expert parallelism carved out of dp: ep_rank = dp % ep, expert_dp = dp / ep.
inline int ExpertRankOfDp(const Layout& l, int dp_rank) { return dp_rank % l.ep; }
inline int ExpertDpRankOfDp(const Layout& l, int dp_rank) { return dp_rank / l.ep; }
inline int DpRankOfExpert(const Layout& l, int ep_rank, int expert_dp_rank) {
  return expert_dp_rank * l.ep + ep_rank;
}

/// How many ZeRO fragments a flat buffer is cut into: dp * sp for dense parameters,
/// (dp / ep) * sp for expert parameters.
int NumZeroFragments(const Layout& layout, bool expert);
/// The fragment a rank owns: dp_index * sp + sp (dp_index is expert_dp for expert parameters),
/// i.e. fragments follow global rank order within the data-parallel group.
int ZeroFragmentOfRank(const Layout& layout, const RankCoords& coords, bool expert);
/// The rank coordinates (tp, pp given) that own fragment `fragment` of an (expert) group.
RankCoords OwnerOfZeroFragment(const Layout& layout, int pp, int tp, int ep_rank, int fragment,
                               bool expert);

/// A half-open range of indices [inclusive_min, exclusive_max).
struct IndexRange {
  int64_t inclusive_min = 0;
  int64_t exclusive_max = 0;
  int64_t size() const { return exclusive_max - inclusive_min; }
  bool empty() const { return exclusive_max <= inclusive_min; }
  friend bool operator==(const IndexRange&, const IndexRange&) = default;
};

/// The overlap of two ranges (empty, with min == max, when they do not meet).
IndexRange Intersect(const IndexRange& a, const IndexRange& b);

/// Part `index` of `size` split into `parts` equal pieces.
/// Errors: kFailedPrecondition "<size> <what> not divisible by <axis>=<parts>";
/// kInvalidArgument for parts < 1 or index outside [0, parts).
Result<IndexRange> EvenSplit(int64_t size, int parts, int index, std::string_view what,
                             std::string_view axis);

/// A padded split: `size` is rounded up to a multiple of `multiple_of` (a multiple of parts),
/// each part gets padded_size / parts indices; `valid` is the part of `range` below `size`.
struct PaddedPart {
  int64_t padded_size = 0;
  IndexRange range;  ///< in padded coordinates
  IndexRange valid;  ///< range clipped to [0, size); may be empty
};
/// Errors: kInvalidArgument when multiple_of is not a positive multiple of parts, or for a bad
/// index.
Result<PaddedPart> PaddedSplit(int64_t size, int64_t multiple_of, int parts, int index);

/// Part `index` of an explicit, possibly uneven split with the given part sizes.
/// Errors: kInvalidArgument for a negative size or an index outside the list.
Result<IndexRange> ExplicitSplit(std::span<const int64_t> sizes, int index);

/// ZeRO-1/2 partitioning of one flat buffer: the numels are concatenated in order (no per-param
/// alignment), the total is zero-padded to a multiple of alignment_factor * num_fragments
/// (DeepSpeed's nccl_start_alignment_factor = 2 times the group size) and cut into
/// num_fragments equal fragments.
struct ZeroPartition {
  int64_t total = 0;          ///< sum of numels
  int64_t padded_total = 0;   ///< total rounded up
  int64_t fragment_size = 0;  ///< padded_total / num_fragments
  int num_fragments = 0;
  std::vector<int64_t> offsets;  ///< start of each param in the flat buffer
  IndexRange Fragment(int f) const { return {f * fragment_size, (f + 1) * fragment_size}; }
};
/// Errors: kInvalidArgument for num_fragments or alignment_factor < 1, a negative numel;
/// kOutOfRange when the total overflows int64.
Result<ZeroPartition> PartitionFlat(std::span<const int64_t> numels, int num_fragments,
                                    int alignment_factor = 2);

/// ZeRO-3: one parameter partitioned by itself (padded to a multiple of num_fragments).
Result<ZeroPartition> PartitionParam(int64_t numel, int num_fragments);

/// Which transformer layers each pipeline stage holds.
struct StageAssignment {
  std::vector<IndexRange> layers;  ///< per stage, global layer indices
  /// The stage holding global layer `layer` (layer must be in range: a bug otherwise).
  int StageOfLayer(int64_t layer) const;
  int64_t LocalIndex(int64_t layer) const {
    return layer - layers[StageOfLayer(layer)].inclusive_min;
  }
  int64_t GlobalIndex(int stage, int64_t local) const {
    return layers[stage].inclusive_min + local;
  }
};
/// Even split of num_layers over pp stages, or the explicit per-stage counts when given.
/// Errors: kFailedPrecondition "<n> layers not divisible by pp=<pp>" (no explicit list), listing
/// the uneven splits to choose from (`stages=4+3+3`, front-loaded as DeepSpeed's
/// partition_uniform, or back-loaded); kInvalidArgument when the explicit list has the wrong
/// length, a count < 1, or a sum != layers.
Result<StageAssignment> AssignStages(int64_t num_layers, int pp,
                                     std::span<const int64_t> explicit_counts = {});
/// The stage assignment of a layout: AssignStages(num_layers, l.pp, l.stages).
Result<StageAssignment> AssignStages(int64_t num_layers, const Layout& l);

/// Per-stage layer counts of an assignment (what `stages=` spells).
std::vector<int64_t> StageCounts(const StageAssignment& a);
/// True when the counts are the even split (all equal).
bool IsEvenSplit(std::span<const int64_t> counts);
/// `4+4+2`.
std::string StagesToString(std::span<const int64_t> counts);

/// Experts placed over ep ranks: rank e holds experts [e * per_rank, (e + 1) * per_rank).
struct ExpertPlacement {
  int64_t num_experts = 0;
  int ep = 1;
  int64_t per_rank = 0;
  int RankOfExpert(int64_t expert) const { return static_cast<int>(expert / per_rank); }
  int64_t LocalIndex(int64_t expert) const { return expert % per_rank; }
  int64_t GlobalIndex(int ep_rank, int64_t local) const { return ep_rank * per_rank + local; }
};
/// Errors: kFailedPrecondition "<n> experts not divisible by ep=<ep>".
Result<ExpertPlacement> PlaceExperts(int64_t num_experts, int ep);

}  // namespace ucp::layout
