// Parallelism arithmetic (see layout.h). Every error message carries the numbers involved.
#include "ucp/layout/layout.h"

#include <algorithm>
#include <charconv>
#include <limits>

#include "ucp/base/check.h"
#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"

namespace ucp::layout {
namespace {

std::string Q(std::string_view s) { return "\"" + std::string(s) + "\""; }

}  // namespace

Layout UniversalLayout() {
  Layout l;
  l.universal = true;
  return l;
}

Status Validate(const Layout& l) {
  const std::pair<const char*, int> sizes[] = {
      {"tp", l.tp}, {"pp", l.pp}, {"dp", l.dp}, {"sp", l.sp}, {"ep", l.ep}};
  for (const auto& [name, v] : sizes) {
    if (v < 1) {
      return InvalidArgumentError(std::string("layout ") + name + "=" + std::to_string(v) +
                                  ": sizes must be >= 1");
    }
  }
  for (const auto& [name, v] : sizes) {
    if (v > kMaxAxisSize) {
      return InvalidArgumentError(std::string("layout ") + name + "=" + std::to_string(v) +
                                  ": sizes must be <= " + std::to_string(kMaxAxisSize));
    }
  }
  // Multiplied one axis at a time and checked after each (each size <= 2^16, so a product that
  // is still within the limit times one more size fits int64; 2^64 would not).
  int64_t world = 1;
  for (int v : {l.tp, l.sp, l.dp, l.pp}) {
    world *= v;
    if (world > kMaxWorldSize) {
      return InvalidArgumentError("layout " + ToString(l) + ": world size tp*sp*dp*pp exceeds " +
                                  "the limit of " + std::to_string(kMaxWorldSize) + " ranks");
    }
  }
  if (l.zero_stage < 0 || l.zero_stage > 3) {
    return InvalidArgumentError("layout zero=" + std::to_string(l.zero_stage) +
                                ": zero stage must be 0, 1, 2 or 3");
  }
  if (l.dp % l.ep != 0) {
    return InvalidArgumentError("layout ep=" + std::to_string(l.ep) + " does not divide dp=" +
                                std::to_string(l.dp) + " (ep is carved out of dp)");
  }
  if (l.universal && (l.tp != 1 || l.pp != 1 || l.dp != 1 || l.sp != 1 || l.ep != 1 ||
                      l.zero_stage != 0 || !l.stages.empty())) {
    return InvalidArgumentError("layout universal must have every size 1, zero=0 and no stages");
  }
  if (!l.stages.empty()) {
    if (static_cast<int64_t>(l.stages.size()) != l.pp) {
      return InvalidArgumentError("layout stages=" + StagesToString(l.stages) + " names " +
                                  std::to_string(l.stages.size()) + " stages, pp=" +
                                  std::to_string(l.pp) + " (one count per pipeline stage)");
    }
    for (size_t s = 0; s < l.stages.size(); ++s) {
      if (l.stages[s] < 1 || l.stages[s] > kMaxStageLayers) {
        return InvalidArgumentError("layout stages=" + StagesToString(l.stages) + ": stage " +
                                    std::to_string(s) + " has " + std::to_string(l.stages[s]) +
                                    " layers (must be 1.." + std::to_string(kMaxStageLayers) +
                                    ")");
      }
    }
  }
  return Status::Ok();
}

namespace {

constexpr std::string_view kKeys[6] = {"tp", "pp", "dp", "sp", "ep", "zero"};

int* FieldOf(Layout& l, int k) {
  int* fields[6] = {&l.tp, &l.pp, &l.dp, &l.sp, &l.ep, &l.zero_stage};
  return fields[k];
}

// `4+4+2` into per-stage counts, each a positive integer within kMaxStageLayers.
Status ParseStages(std::string_view token, std::string_view value, std::vector<int64_t>& out) {
  out.clear();
  size_t pos = 0;
  while (pos <= value.size()) {
    size_t plus = value.find('+', pos);
    if (plus == std::string_view::npos) plus = value.size();
    std::string_view item = value.substr(pos, plus - pos);
    int64_t v = 0;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size()) {
      return InvalidArgumentError("layout token " + Q(token) + ": " + Q(item) +
                                  " is not an integer (expected layers per stage, e.g. "
                                  "stages=4+4+2)");
    }
    if (v < 1 || v > kMaxStageLayers) {
      return InvalidArgumentError("layout token " + Q(token) + ": a stage must hold 1.." +
                                  std::to_string(kMaxStageLayers) + " layers, not " +
                                  std::to_string(v));
    }
    if (out.size() >= static_cast<size_t>(kMaxAxisSize)) {
      return InvalidArgumentError("layout token " + Q(token) + ": more than " +
                                  std::to_string(kMaxAxisSize) + " stages");
    }
    out.push_back(v);
    pos = plus + 1;
  }
  return Status::Ok();
}

// The tokens of a non-universal layout string into `l` (missing keys keep l's values), marking
// the keys named; each token checked alone, the whole not validated.
Status ParseTokens(std::string_view text, Layout& l, bool (&seen)[6], bool& stages_seen) {
  if (text.empty()) return InvalidArgumentError("layout \"\": empty (expected tp=..,pp=..,dp=..)");
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view token = text.substr(pos, comma - pos);
    size_t eq = token.find('=');
    if (eq == std::string_view::npos) {
      return InvalidArgumentError("layout token " + Q(token) + ": expected key=value");
    }
    std::string_view key = token.substr(0, eq);
    std::string_view value = token.substr(eq + 1);
    if (key == "stages") {
      if (stages_seen)
        return InvalidArgumentError("layout token " + Q(token) + ": duplicate key " + Q(key));
      stages_seen = true;
      UCP_RETURN_IF_ERROR(ParseStages(token, value, l.stages));
      pos = comma + 1;
      continue;
    }
    int k = -1;
    for (int i = 0; i < 6; ++i) {
      if (kKeys[i] == key) k = i;
    }
    if (k < 0) {
      return InvalidArgumentError("layout token " + Q(token) + ": unknown key " + Q(key) +
                                  " (expected tp, pp, dp, sp, ep, zero, stages)");
    }
    if (seen[k])
      return InvalidArgumentError("layout token " + Q(token) + ": duplicate key " + Q(key));
    seen[k] = true;
    int v = 0;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (value.empty() || ec != std::errc() || end != value.data() + value.size()) {
      return InvalidArgumentError("layout token " + Q(token) + ": value is not an integer");
    }
    if (k == 5) {
      if (v < 0 || v > 3) {
        return InvalidArgumentError("layout token " + Q(token) + ": zero stage must be 0..3");
      }
    } else if (v < 1) {
      return InvalidArgumentError("layout token " + Q(token) + ": size must be >= 1");
    }
    *FieldOf(l, k) = v;
    pos = comma + 1;
  }
  return Status::Ok();
}

}  // namespace

Result<Layout> ParseLayout(std::string_view text) {
  if (text == "universal") return UniversalLayout();
  Layout l;
  bool seen[6] = {false, false, false, false, false, false};
  bool stages_seen = false;
  UCP_RETURN_IF_ERROR(ParseTokens(text, l, seen, stages_seen));
  // `stages=4+4+2` says how many stages there are; a pp beside it must agree (Validate).
  if (stages_seen && !seen[1]) l.pp = static_cast<int>(l.stages.size());
  UCP_RETURN_IF_ERROR(Validate(l));
  return l;
}

Result<PartialLayout> ParsePartialLayout(std::string_view text) {
  PartialLayout p;
  if (text == "universal") {
    p.universal = true;
    return p;
  }
  Layout l;
  UCP_RETURN_IF_ERROR(ParseTokens(text, l, p.given, p.stages_given));
  if (p.stages_given && !p.given[1]) l.pp = static_cast<int>(l.stages.size());
  p.values = l;
  return p;
}

std::string PartialLayout::Keys() const {
  std::string out;
  if (universal) return "universal";
  for (int k = 0; k < 6; ++k) {
    if (given[k]) out += (out.empty() ? "" : ",") + std::string(kKeys[k]);
  }
  if (stages_given) out += out.empty() ? "stages" : ",stages";
  return out;
}

Result<Layout> MergeLayout(const Layout& base, const PartialLayout& partial) {
  if (partial.universal) return UniversalLayout();
  // A universal base has no sizes to keep: the defaults (1, zero 0) stand in for it.
  Layout l = base.universal ? Layout{} : base;
  l.universal = false;
  Layout values = partial.values;
  std::string kept;
  for (int k = 0; k < 6; ++k) {
    if (partial.given[k]) {
      *FieldOf(l, k) = *FieldOf(values, k);
    } else if (!base.universal) {
      kept +=
          (kept.empty() ? "" : ",") + std::string(kKeys[k]) + "=" + std::to_string(*FieldOf(l, k));
    }
  }
  // Expert parallelism is carved out of dp: a kept ep that the new dp cannot hold gives way to
  // it (ep=1) rather than turning `--layout dp=1` into an error about a key the user never named.
  if (!partial.given[4] && partial.given[2] && l.ep > 1 && l.dp % l.ep != 0) l.ep = 1;
  if (partial.stages_given) {
    l.stages = values.stages;
    if (!partial.given[1]) l.pp = static_cast<int>(l.stages.size());
  } else if (partial.given[1] && l.pp != base.pp) {
    // The source's stage counts describe its pipeline, not the new one: a new pp takes the even
    // split unless stages are given with it.
    l.stages.clear();
  } else if (!base.universal && !l.stages.empty()) {
    kept += (kept.empty() ? "" : ",") + std::string("stages=") + StagesToString(l.stages);
  }
  Status st = Validate(l);
  if (!st.ok() && !kept.empty()) {
    return Status(st.code(), st.message() + " (keys not given keep the source's values: " + kept +
                                 "; give them to change them)");
  }
  UCP_RETURN_IF_ERROR(st);
  return l;
}

std::string ToString(const Layout& l) {
  if (l.universal) return "universal";
  std::string out = "tp=" + std::to_string(l.tp) + ",pp=" + std::to_string(l.pp) +
                    ",dp=" + std::to_string(l.dp) + ",sp=" + std::to_string(l.sp) +
                    ",ep=" + std::to_string(l.ep) + ",zero=" + std::to_string(l.zero_stage);
  if (!l.stages.empty()) out += ",stages=" + StagesToString(l.stages);
  return out;
}

std::string StagesToString(std::span<const int64_t> counts) {
  std::string out;
  for (size_t i = 0; i < counts.size(); ++i) {
    out += (i ? "+" : "") + std::to_string(counts[i]);
  }
  return out;
}

bool IsEvenSplit(std::span<const int64_t> counts) {
  for (int64_t c : counts) {
    if (c != counts.front()) return false;
  }
  return true;
}

std::vector<int64_t> StageCounts(const StageAssignment& a) {
  std::vector<int64_t> out;
  out.reserve(a.layers.size());
  for (const IndexRange& r : a.layers) out.push_back(r.size());
  return out;
}

int64_t WorldSize(const Layout& l) { return static_cast<int64_t>(l.tp) * l.sp * l.dp * l.pp; }

Result<RankCoords> CoordsOfRank(const Layout& l, int64_t rank) {
  const int64_t world = WorldSize(l);
  if (rank < 0 || rank >= world) {
    return OutOfRangeError("rank " + std::to_string(rank) + " outside [0, " +
                           std::to_string(world) + ") of layout " + ToString(l));
  }
  RankCoords c;
  c.tp = static_cast<int>(rank % l.tp);
  rank /= l.tp;
  c.sp = static_cast<int>(rank % l.sp);
  rank /= l.sp;
  c.dp = static_cast<int>(rank % l.dp);
  rank /= l.dp;
  c.pp = static_cast<int>(rank);
  return c;
}

Result<int64_t> RankOfCoords(const Layout& l, const RankCoords& c) {
  const std::pair<const char*, std::pair<int, int>> checks[] = {
      {"tp", {c.tp, l.tp}}, {"sp", {c.sp, l.sp}}, {"dp", {c.dp, l.dp}}, {"pp", {c.pp, l.pp}}};
  for (const auto& [name, vs] : checks) {
    if (vs.first < 0 || vs.first >= vs.second) {
      return OutOfRangeError(std::string("coordinate ") + name + "=" + std::to_string(vs.first) +
                             " outside [0, " + std::to_string(vs.second) + ")");
    }
  }
  return c.tp +
         static_cast<int64_t>(l.tp) *
             (c.sp + static_cast<int64_t>(l.sp) * (c.dp + static_cast<int64_t>(l.dp) * c.pp));
}

int NumZeroFragments(const Layout& l, bool expert) { return (expert ? l.dp / l.ep : l.dp) * l.sp; }

int ZeroFragmentOfRank(const Layout& l, const RankCoords& c, bool expert) {
  const int d = expert ? ExpertDpRankOfDp(l, c.dp) : c.dp;
  return d * l.sp + c.sp;
}

RankCoords OwnerOfZeroFragment(const Layout& l, int pp, int tp, int ep_rank, int fragment,
                               bool expert) {
  RankCoords c;
  c.pp = pp;
  c.tp = tp;
  c.sp = fragment % l.sp;
  const int d = fragment / l.sp;
  c.dp = expert ? DpRankOfExpert(l, ep_rank, d) : d;
  return c;
}

IndexRange Intersect(const IndexRange& a, const IndexRange& b) {
  const int64_t lo = std::max(a.inclusive_min, b.inclusive_min);
  const int64_t hi = std::min(a.exclusive_max, b.exclusive_max);
  return hi > lo ? IndexRange{lo, hi} : IndexRange{lo, lo};
}

Result<IndexRange> EvenSplit(int64_t size, int parts, int index, std::string_view what,
                             std::string_view axis) {
  if (parts < 1 || index < 0 || index >= parts) {
    return InvalidArgumentError("split of " + std::to_string(size) + " " + std::string(what) +
                                ": part " + std::to_string(index) + " of " + std::to_string(parts) +
                                " is not a valid part");
  }
  if (size < 0 || size % parts != 0) {
    return FailedPreconditionError(std::to_string(size) + " " + std::string(what) +
                                   " not divisible by " + std::string(axis) + "=" +
                                   std::to_string(parts));
  }
  const int64_t n = size / parts;
  return IndexRange{index * n, (index + 1) * n};
}

Result<PaddedPart> PaddedSplit(int64_t size, int64_t multiple_of, int parts, int index) {
  if (parts < 1 || index < 0 || index >= parts || multiple_of < 1 || multiple_of % parts != 0 ||
      size < 0) {
    return InvalidArgumentError("padded split of " + std::to_string(size) + " to a multiple of " +
                                std::to_string(multiple_of) + ": part " + std::to_string(index) +
                                " of " + std::to_string(parts) + " is not valid");
  }
  PaddedPart p;
  p.padded_size = RoundUp(size, multiple_of);
  const int64_t n = p.padded_size / parts;
  p.range = {index * n, (index + 1) * n};
  p.valid = Intersect(p.range, {0, size});
  return p;
}

Result<IndexRange> ExplicitSplit(std::span<const int64_t> sizes, int index) {
  if (index < 0 || static_cast<size_t>(index) >= sizes.size()) {
    return InvalidArgumentError("explicit split: part " + std::to_string(index) + " outside [0, " +
                                std::to_string(sizes.size()) + ")");
  }
  int64_t start = 0;
  for (int i = 0; i < index; ++i) {
    if (sizes[i] < 0) {
      return InvalidArgumentError("explicit split: part " + std::to_string(i) + " has size " +
                                  std::to_string(sizes[i]));
    }
    start += sizes[i];
  }
  if (sizes[index] < 0) {
    return InvalidArgumentError("explicit split: part " + std::to_string(index) + " has size " +
                                std::to_string(sizes[index]));
  }
  return IndexRange{start, start + sizes[index]};
}

Result<ZeroPartition> PartitionFlat(std::span<const int64_t> numels, int num_fragments,
                                    int alignment_factor) {
  if (num_fragments < 1 || alignment_factor < 1) {
    return InvalidArgumentError("zero partition: num_fragments=" + std::to_string(num_fragments) +
                                " and alignment_factor=" + std::to_string(alignment_factor) +
                                " must be >= 1");
  }
  ZeroPartition z;
  z.num_fragments = num_fragments;
  z.offsets.reserve(numels.size());
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) {
      return InvalidArgumentError("zero partition: numel " + std::to_string(numels[i]) +
                                  " of parameter " + std::to_string(i) + " is negative");
    }
    z.offsets.push_back(z.total);
    auto sum = CheckedAdd(z.total, numels[i]);
    if (!sum) return OutOfRangeError("zero partition: total numel overflows int64");
    z.total = *sum;
  }
  const int64_t multiple = static_cast<int64_t>(alignment_factor) * num_fragments;
  if (z.total > std::numeric_limits<int64_t>::max() - multiple) {
    return OutOfRangeError("zero partition: padded total overflows int64");
  }
  z.padded_total = RoundUp(z.total, multiple);
  z.fragment_size = z.padded_total / num_fragments;
  return z;
}

Result<ZeroPartition> PartitionParam(int64_t numel, int num_fragments) {
  const int64_t n[1] = {numel};
  return PartitionFlat(n, num_fragments, 1);
}

int StageAssignment::StageOfLayer(int64_t layer) const {
  for (size_t s = 0; s < layers.size(); ++s) {
    if (layer >= layers[s].inclusive_min && layer < layers[s].exclusive_max) {
      return static_cast<int>(s);
    }
  }
  UCP_CHECK(false) << "layer " << layer << " is on no stage";
  return -1;
}

Result<StageAssignment> AssignStages(int64_t num_layers, int pp,
                                     std::span<const int64_t> explicit_counts) {
  if (pp < 1 || num_layers < 0) {
    return InvalidArgumentError("stage assignment: pp=" + std::to_string(pp) +
                                " and layers=" + std::to_string(num_layers) + " are not valid");
  }
  StageAssignment a;
  if (explicit_counts.empty()) {
    if (num_layers % pp != 0) {
      if (num_layers < pp) {
        return FailedPreconditionError(std::to_string(num_layers) +
                                       " layers not divisible by pp=" + std::to_string(pp) +
                                       " (and too few for one layer per stage: pp <= " +
                                       std::to_string(num_layers) + ")");
      }
      // No default: Megatron-LM refuses such a pp, DeepSpeed's partition_method splits its
      // whole layer list (embeddings and norms included), so the transformer split depends on
      // the model code. The two orders of the near-even split are the usual choices.
      const int64_t q = num_layers / pp;
      const int64_t r = num_layers % pp;
      std::vector<int64_t> front(pp, q), back(pp, q);
      for (int64_t s = 0; s < r; ++s) {
        front[s] += 1;
        back[pp - 1 - s] += 1;
      }
      return FailedPreconditionError(
          std::to_string(num_layers) + " layers not divisible by pp=" + std::to_string(pp) +
          " (give the layers per stage, e.g. stages=" + StagesToString(front) +
          " (front-loaded, the way DeepSpeed's partition_uniform cuts a list) or stages=" +
          StagesToString(back) +
          "; a DeepSpeed checkpoint's own split is read from its files)");
    }
    const int64_t n = num_layers / pp;
    for (int s = 0; s < pp; ++s) a.layers.push_back({s * n, (s + 1) * n});
    return a;
  }
  if (static_cast<int64_t>(explicit_counts.size()) != pp) {
    return InvalidArgumentError("stage assignment: " + std::to_string(explicit_counts.size()) +
                                " per-stage counts given for pp=" + std::to_string(pp));
  }
  int64_t start = 0;
  for (int s = 0; s < pp; ++s) {
    if (explicit_counts[s] < 1) {
      return InvalidArgumentError("stage assignment: stage " + std::to_string(s) + " has " +
                                  std::to_string(explicit_counts[s]) + " layers (must be >= 1)");
    }
    a.layers.push_back({start, start + explicit_counts[s]});
    start += explicit_counts[s];
  }
  if (start != num_layers) {
    return InvalidArgumentError("stage assignment: per-stage counts sum to " +
                                std::to_string(start) + ", model has " +
                                std::to_string(num_layers) + " layers");
  }
  return a;
}

Result<StageAssignment> AssignStages(int64_t num_layers, const Layout& l) {
  return AssignStages(num_layers, l.pp, l.stages);  // callers name the layout
}

Result<ExpertPlacement> PlaceExperts(int64_t num_experts, int ep) {
  if (ep < 1 || num_experts < 1) {
    return InvalidArgumentError("expert placement: num_experts=" + std::to_string(num_experts) +
                                " and ep=" + std::to_string(ep) + " must be >= 1");
  }
  if (num_experts % ep != 0) {
    return FailedPreconditionError(std::to_string(num_experts) +
                                   " experts not divisible by ep=" + std::to_string(ep));
  }
  return ExpertPlacement{num_experts, ep, num_experts / ep};
}

}  // namespace ucp::layout
