// The planner (see plan.h). A layout is first described as a catalogue: its tensors, and for
// every (parameter, state) the boxes of the full parameter each tensor holds ("placements"), plus
// the zero-filled regions. A plan intersects the target's placements with the source's.
#include "ucp/convert/plan.h"

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

#include "ucp/base/check.h"
#include "ucp/base/status_macros.h"

namespace ucp::convert {
namespace {

using layout::Layout;
using patterns::Piece;
using patterns::ResolvedModel;
using patterns::ResolvedParam;
using patterns::Slice;

std::string Q(std::string_view s) { return "\"" + std::string(s) + "\""; }

// Box `counts` elements of the full parameter starting at full_start live in a tensor at
// offset + sum_k (i_k - full_start_k) * strides_k.
struct Placement {
  Shape full_start;
  Shape counts;
  StridedRef ref;  // offset of full_start
  int replica = 0;
};

struct Catalog {
  std::vector<TensorInfo> tensors;
  std::vector<std::string> states;            // "model" first when model slices are planned
  std::vector<std::vector<Placement>> place;  // [param * states.size() + state]
  std::vector<Op> fills;                      // dst indexes `tensors`
};

// Intersects box (a_start, a_counts) with (b_start, b_counts); false when empty.
bool IntersectBox(const Shape& a_start, const Shape& a_counts, const Shape& b_start,
                  const Shape& b_counts, Shape* start, Shape* counts) {
  const size_t n = a_start.size();
  start->resize(n);
  counts->resize(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t lo = std::max(a_start[k], b_start[k]);
    const int64_t hi = std::min(a_start[k] + a_counts[k], b_start[k] + b_counts[k]);
    if (hi <= lo) return false;
    (*start)[k] = lo;
    (*counts)[k] = hi - lo;
  }
  return true;
}

StridedRef Shifted(const StridedRef& r, const Shape& from, const Shape& to) {
  StridedRef out = r;
  for (size_t k = 0; k < from.size(); ++k) out.offset += (to[k] - from[k]) * r.strides[k];
  return out;
}

// Row-major decomposition of the flat range [a, b) of a tensor of `shape` into boxes.
void DecomposeFlat(const Shape& shape, size_t dim, Shape& prefix, int64_t a, int64_t b,
                   std::vector<std::pair<Shape, Shape>>& out) {
  if (a >= b) return;
  const size_t nd = shape.size();
  if (dim == nd) {
    out.push_back({prefix, Shape(nd, 1)});
    return;
  }
  int64_t inner = 1;
  for (size_t k = dim + 1; k < nd; ++k) inner *= shape[k];
  auto emit_rows = [&](int64_t r0, int64_t r1) {
    Shape start = prefix;
    start.resize(nd, 0);
    start[dim] = r0;
    Shape counts(nd, 1);
    counts[dim] = r1 - r0;
    for (size_t k = dim + 1; k < nd; ++k) counts[k] = shape[k];
    out.push_back({start, counts});
  };
  auto recurse = [&](int64_t row, int64_t lo, int64_t hi) {
    prefix.push_back(row);
    DecomposeFlat(shape, dim + 1, prefix, lo, hi, out);
    prefix.pop_back();
  };
  int64_t first = a / inner;
  const int64_t last_full = b / inner;  // rows [first, last_full) may be whole
  if (a % inner != 0) {
    const int64_t row_end = std::min(b, (first + 1) * inner);
    recurse(first, a - first * inner, row_end - first * inner);
    ++first;
    if (row_end == b) return;
  }
  if (last_full > first) emit_rows(first, last_full);
  if (b % inner != 0 && b / inner >= first) recurse(b / inner, 0, b - (b / inner) * inner);
}

class CatalogBuilder {
 public:
  CatalogBuilder(const ResolvedModel& m, const Layout& l, const PlanOptions& o)
      : model_(m), layout_(l), options_(o) {
    if (o.model_slices) cat_.states.push_back("model");
    for (const auto& s : o.optimizer_states) cat_.states.push_back(s);
    cat_.place.resize(m.params.size() * cat_.states.size());
  }

  Result<Catalog> Build() {
    UCP_RETURN_IF_ERROR(layout::Validate(layout_));
    if (layout_.universal) {
      BuildUniversal();
      return std::move(cat_);
    }
    UCP_RETURN_IF_ERROR(Check());
    for (int s = 0; s < layout_.pp; ++s) {
      for (int t = 0; t < layout_.tp; ++t) {
        UCP_RETURN_IF_ERROR(BuildGroup(s, t, -1));
        if (has_experts_) {
          for (int e = 0; e < layout_.ep; ++e) UCP_RETURN_IF_ERROR(BuildGroup(s, t, e));
        }
      }
    }
    return std::move(cat_);
  }

 private:
  size_t Slot(size_t param, size_t state) const { return param * cat_.states.size() + state; }
  DType StateDType(size_t state, const ResolvedParam& p) const {
    return (options_.model_slices && state == 0) ? p.dtype : DType::kFp32;
  }

  void BuildUniversal() {
    for (size_t i = 0; i < model_.params.size(); ++i) {
      const ResolvedParam& p = model_.params[i];
      for (size_t s = 0; s < cat_.states.size(); ++s) {
        TensorInfo ti;
        ti.name = p.name + "/" + cat_.states[s];
        ti.kind = TensorKind::kUniversal;
        ti.dtype = StateDType(s, p);
        ti.shape = p.shape;
        ti.param = p.name;
        ti.state = cat_.states[s];
        const int32_t idx = AddTensor(std::move(ti));
        cat_.place[Slot(i, s)].push_back(
            {Shape(p.shape.size(), 0), p.shape, {idx, 0, ContiguousStrides(p.shape)}, 0});
      }
    }
  }

  // Checks that the model fits the layout before any tensor is described.
  Status Check() {
    const ResolvedParam* first_layer = nullptr;
    for (const auto& p : model_.params) {
      if (p.stage == patterns::StagePlacement::kLayer && first_layer == nullptr) first_layer = &p;
      if (p.is_expert()) has_experts_ = true;
    }
    auto st = layout::AssignStages(model_.num_layers, layout_);
    if (!st.ok()) {
      return st.status().WithContext(
          "model " + Q(model_.spec.name) +
          (first_layer ? " (parameter " + Q(first_layer->name) + ")" : std::string()));
    }
    stages_ = *st;
    if (model_.num_experts > 0) {
      const ResolvedParam* first_expert = nullptr;
      for (const auto& p : model_.params) {
        if (p.expert >= 0) {
          first_expert = &p;
          break;
        }
      }
      auto ex = layout::PlaceExperts(model_.num_experts, layout_.ep);
      if (!ex.ok()) {
        return ex.status().WithContext(
            "model " + Q(model_.spec.name) +
            (first_expert ? " (parameter " + Q(first_expert->name) + ")" : std::string()));
      }
      experts_ = *ex;
    }
    for (const auto& p : model_.params) {
      for (int t = 0; t < layout_.tp; ++t) {
        UCP_RETURN_IF_ERROR(patterns::SliceParam(p, layout_.tp, t, layout_.ep, 0).status());
      }
    }
    return Status::Ok();
  }

  // The tensor-name prefix of a (pp, tp[, ep]) group.
  std::string Prefix(int s, int t, int e) const {
    std::string pre = "pp" + std::to_string(s) + ".tp" + std::to_string(t);
    if (e >= 0) pre += ".ep" + std::to_string(e);
    return pre;
  }

  int32_t AddTensor(TensorInfo ti) {
    cat_.tensors.push_back(std::move(ti));
    return static_cast<int32_t>(cat_.tensors.size() - 1);
  }

  int64_t RankOf(const layout::RankCoords& c) const {
    return layout::RankOfCoords(layout_, c).value();
  }

  // Places the local flat range [a, b) of `slice` into tensor `tensor`, whose element `base` is
  // the slice's flat element 0 (base may be negative for a fragment that starts mid-param).
  void MapRange(size_t param, size_t state, const Slice& slice, int replica, int32_t tensor,
                int64_t base, int64_t a, int64_t b) {
    const Shape ls = ContiguousStrides(slice.local_shape);
    std::vector<std::pair<Shape, Shape>> boxes;
    Shape prefix;
    if (slice.local_shape.empty()) {
      if (a < b) boxes.push_back({Shape{}, Shape{}});
    } else {
      DecomposeFlat(slice.local_shape, 0, prefix, a, b, boxes);
    }
    const std::string& pname = model_.params[param].name;
    auto offset_of = [&](const Shape& local) {
      int64_t off = base;
      for (size_t k = 0; k < local.size(); ++k) off += local[k] * ls[k];
      return off;
    };
    for (const auto& [bs, bc] : boxes) {
      Shape is, ic;
      for (const Piece& pc : slice.pieces) {
        if (!IntersectBox(bs, bc, pc.local_start, pc.counts, &is, &ic)) continue;
        Shape full = pc.full_start;
        for (size_t k = 0; k < full.size(); ++k) full[k] += is[k] - pc.local_start[k];
        cat_.place[Slot(param, state)].push_back({full, ic, {tensor, offset_of(is), ls}, replica});
      }
      for (const patterns::Box& pad : slice.pad) {
        if (!IntersectBox(bs, bc, pad.start, pad.counts, &is, &ic)) continue;
        Op fill;
        fill.kind = OpKind::kFill;
        fill.param = pname;
        fill.state = cat_.states[state];
        fill.counts = ic;
        fill.dst = {tensor, offset_of(is), ls};
        cat_.fills.push_back(std::move(fill));
      }
    }
  }

  void AddTailFill(int32_t tensor, int64_t from, int64_t to, const std::string& state) {
    if (to <= from) return;
    Op fill;
    fill.kind = OpKind::kFill;
    fill.state = state;
    fill.counts = {to - from};
    fill.dst = {tensor, from, {1}};
    cat_.fills.push_back(std::move(fill));
  }

  struct Local {
    size_t param;
    Slice slice;
    int replica;
    std::string name;
  };

  Status BuildGroup(int s, int t, int e) {
    const bool expert_group = e >= 0;
    std::vector<Local> locals;
    for (size_t i = 0; i < model_.params.size(); ++i) {
      const ResolvedParam& p = model_.params[i];
      if (p.is_expert() != expert_group) continue;
      if (p.expert >= 0 && experts_.RankOfExpert(p.expert) != e) continue;
      int pp_copy = 0;
      switch (p.stage) {
        case patterns::StagePlacement::kLayer:
          if (stages_.StageOfLayer(p.layer) != s) continue;
          break;
        case patterns::StagePlacement::kFirst:
          if (s != 0) continue;
          break;
        case patterns::StagePlacement::kLast:
          if (s != layout_.pp - 1) continue;
          break;
        case patterns::StagePlacement::kFirstAndLast:
          if (s != 0 && s != layout_.pp - 1) continue;
          pp_copy = (s != 0) ? 1 : 0;
          break;
      }
      UCP_ASSIGN_OR_RETURN(
          Slice sl, patterns::SliceParam(p, layout_.tp, t, layout_.ep, expert_group ? e : 0));
      const int replica = sl.replica + layout_.tp * pp_copy;
      locals.push_back(
          {i, std::move(sl), replica,
           patterns::LocalName(p, stages_, model_.num_experts > 0 ? &experts_ : nullptr)});
    }
    if (locals.empty()) return Status::Ok();
    const std::string pre = Prefix(s, t, e);
    layout::RankCoords owner{.tp = t, .sp = 0, .dp = expert_group ? e : 0, .pp = s};
    const int64_t owner_rank = RankOf(owner);
    const size_t first_opt = options_.model_slices ? 1 : 0;
    auto base_info = [&](const std::string& name, TensorKind kind, DType dtype, Shape shape,
                         const std::string& param, const std::string& state) {
      TensorInfo ti;
      ti.name = name;
      ti.kind = kind;
      ti.dtype = dtype;
      ti.shape = std::move(shape);
      ti.param = param;
      ti.state = state;
      ti.pp = s;
      ti.tp = t;
      ti.ep = e;
      ti.rank = owner_rank;
      return ti;
    };
    for (const Local& lp : locals) {
      const ResolvedParam& p = model_.params[lp.param];
      const int64_t numel = NumElementsOrDie(lp.slice.local_shape);
      if (options_.model_slices) {
        const int32_t idx = AddTensor(base_info(pre + "/model/" + lp.name, TensorKind::kModelSlice,
                                                p.dtype, lp.slice.local_shape, p.name, "model"));
        MapRange(lp.param, 0, lp.slice, lp.replica, idx, 0, 0, numel);
      }
      if (layout_.zero_stage == 0) {
        for (size_t st = first_opt; st < cat_.states.size(); ++st) {
          const int32_t idx = AddTensor(base_info(pre + "/optim/" + lp.name + "/" + cat_.states[st],
                                                  TensorKind::kOptimSlice, DType::kFp32,
                                                  lp.slice.local_shape, p.name, cat_.states[st]));
          MapRange(lp.param, st, lp.slice, lp.replica, idx, 0, 0, numel);
        }
      }
    }
    const int nfrag = layout::NumZeroFragments(layout_, expert_group);
    auto owner_of = [&](int f) {
      return RankOf(layout::OwnerOfZeroFragment(layout_, s, t, std::max(e, 0), f, expert_group));
    };
    if (layout_.zero_stage == 3) {
      for (const Local& lp : locals) {
        const ResolvedParam& p = model_.params[lp.param];
        const int64_t numel = NumElementsOrDie(lp.slice.local_shape);
        UCP_ASSIGN_OR_RETURN(layout::ZeroPartition z, layout::PartitionParam(numel, nfrag));
        for (int f = 0; f < nfrag; ++f) {
          const layout::IndexRange fr = z.Fragment(f);
          for (size_t st = first_opt; st < cat_.states.size(); ++st) {
            TensorInfo ti = base_info(
                pre + "/zero3/f" + std::to_string(f) + "/" + lp.name + "/" + cat_.states[st],
                TensorKind::kZero3Fragment, DType::kFp32, {z.fragment_size}, p.name,
                cat_.states[st]);
            ti.fragment = f;
            ti.rank = owner_of(f);
            const int32_t idx = AddTensor(std::move(ti));
            const layout::IndexRange in = layout::Intersect(fr, {0, numel});
            MapRange(lp.param, st, lp.slice, lp.replica, idx, -fr.inclusive_min, in.inclusive_min,
                     in.exclusive_max);
            AddTailFill(idx, std::max<int64_t>(numel - fr.inclusive_min, 0), z.fragment_size,
                        cat_.states[st]);
          }
        }
      }
    } else if (layout_.zero_stage == 1 || layout_.zero_stage == 2) {
      for (int g = 0; g < 2; ++g) {
        std::vector<const Local*> members;
        std::vector<int64_t> numels;
        for (const Local& lp : locals) {
          if (model_.params[lp.param].optimizer_group != g) continue;
          members.push_back(&lp);
          numels.push_back(NumElementsOrDie(lp.slice.local_shape));
        }
        if (members.empty()) continue;
        UCP_ASSIGN_OR_RETURN(layout::ZeroPartition z, layout::PartitionFlat(numels, nfrag));
        for (int f = 0; f < nfrag; ++f) {
          const layout::IndexRange fr = z.Fragment(f);
          for (size_t st = first_opt; st < cat_.states.size(); ++st) {
            TensorInfo ti = base_info(pre + "/zero/g" + std::to_string(g) + ".f" +
                                          std::to_string(f) + "/" + cat_.states[st],
                                      TensorKind::kZeroFragment, DType::kFp32, {z.fragment_size},
                                      "", cat_.states[st]);
            ti.group = g;
            ti.fragment = f;
            ti.rank = owner_of(f);
            const int32_t idx = AddTensor(std::move(ti));
            for (size_t m = 0; m < members.size(); ++m) {
              const int64_t o = z.offsets[m];
              const layout::IndexRange in = layout::Intersect(fr, {o, o + numels[m]});
              if (in.empty()) continue;
              MapRange(members[m]->param, st, members[m]->slice, members[m]->replica, idx,
                       o - fr.inclusive_min, in.inclusive_min - o, in.exclusive_max - o);
            }
            AddTailFill(idx, std::max<int64_t>(z.total - fr.inclusive_min, 0), z.fragment_size,
                        cat_.states[st]);
          }
        }
      }
    }
    return Status::Ok();
  }

  const ResolvedModel& model_;
  Layout layout_;
  PlanOptions options_;
  Catalog cat_;
  layout::StageAssignment stages_;
  layout::ExpertPlacement experts_;
  bool has_experts_ = false;
};

// A region of the full parameter with the source refs that hold it (one per replica).
struct Group {
  Shape start;
  Shape counts;
  std::vector<StridedRef> refs;
};

std::vector<Group> CanonicalGroups(const std::vector<Placement>& place) {
  std::map<int, std::vector<const Placement*>> by_replica;
  for (const Placement& p : place) by_replica[p.replica].push_back(&p);
  std::vector<Group> groups;
  if (by_replica.empty()) return groups;
  for (const Placement* p : by_replica.begin()->second) {
    groups.push_back({p->full_start, p->counts, {p->ref}});
  }
  for (auto it = std::next(by_replica.begin()); it != by_replica.end(); ++it) {
    std::vector<Group> refined;
    for (const Group& g : groups) {
      for (const Placement* p : it->second) {
        Group n;
        if (!IntersectBox(g.start, g.counts, p->full_start, p->counts, &n.start, &n.counts)) {
          continue;
        }
        for (const StridedRef& r : g.refs) n.refs.push_back(Shifted(r, g.start, n.start));
        n.refs.push_back(Shifted(p->ref, p->full_start, n.start));
        refined.push_back(std::move(n));
      }
    }
    groups = std::move(refined);
  }
  return groups;
}

void AppendJsonString(std::ostringstream& os, std::string_view s) {
  os << '"';
  for (char c : s) {
    if (c == '"' || c == '\\') {
      os << '\\' << c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      static const char* kHex = "0123456789abcdef";
      os << "\\u00" << kHex[(c >> 4) & 0xf] << kHex[c & 0xf];
    } else {
      os << c;
    }
  }
  os << '"';
}

void AppendInts(std::ostringstream& os, const std::vector<int64_t>& v) {
  os << '[';
  for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  os << ']';
}

void AppendTensor(std::ostringstream& os, const TensorInfo& t) {
  os << "{\"name\":";
  AppendJsonString(os, t.name);
  os << ",\"kind\":\"" << TensorKindName(t.kind) << "\",\"dtype\":\"" << DTypeName(t.dtype)
     << "\",\"shape\":";
  AppendInts(os, t.shape);
  os << ",\"param\":";
  AppendJsonString(os, t.param);
  os << ",\"state\":";
  AppendJsonString(os, t.state);
  os << ",\"pp\":" << t.pp << ",\"tp\":" << t.tp << ",\"ep\":" << t.ep << ",\"group\":" << t.group
     << ",\"fragment\":" << t.fragment << ",\"rank\":" << t.rank << "}";
}

void AppendRef(std::ostringstream& os, const StridedRef& r) {
  os << "{\"tensor\":" << r.tensor << ",\"offset\":" << r.offset << ",\"strides\":";
  AppendInts(os, r.strides);
  os << "}";
}

}  // namespace

std::string_view TensorKindName(TensorKind k) {
  switch (k) {
    case TensorKind::kUniversal:
      return "universal";
    case TensorKind::kModelSlice:
      return "model_slice";
    case TensorKind::kOptimSlice:
      return "optim_slice";
    case TensorKind::kZeroFragment:
      return "zero_fragment";
    case TensorKind::kZero3Fragment:
      return "zero3_fragment";
  }
  return "?";
}

std::string_view OpKindName(OpKind k) {
  switch (k) {
    case OpKind::kCopy:
      return "copy";
    case OpKind::kFill:
      return "fill";
    case OpKind::kCheckEqual:
      return "check_equal";
    case OpKind::kAverage:
      return "average";
  }
  return "?";
}

Result<std::vector<TensorInfo>> DescribeLayout(const ResolvedModel& model, const Layout& l,
                                               const PlanOptions& options) {
  UCP_ASSIGN_OR_RETURN(Catalog c, CatalogBuilder(model, l, options).Build(),
                       "layout " + layout::ToString(l));
  return std::move(c.tensors);
}

Result<Plan> PlanConversion(const ResolvedModel& model, const Layout& from, const Layout& to,
                            const PlanOptions& options) {
  UCP_ASSIGN_OR_RETURN(Catalog src, CatalogBuilder(model, from, options).Build(),
                       "source layout " + layout::ToString(from));
  UCP_ASSIGN_OR_RETURN(Catalog dst, CatalogBuilder(model, to, options).Build(),
                       "target layout " + layout::ToString(to));
  Plan plan;
  plan.from = from;
  plan.to = to;
  std::vector<Op> ops = std::move(dst.fills);
  std::vector<Op> checks;
  const size_t ns = src.states.size();
  for (size_t i = 0; i < model.params.size(); ++i) {
    const ResolvedParam& p = model.params[i];
    const bool average = p.rule.kind == patterns::RuleKind::kAverage;
    for (size_t s = 0; s < ns; ++s) {
      std::vector<Group> groups = CanonicalGroups(src.place[i * ns + s]);
      if (!average) {
        for (const Group& g : groups) {
          if (g.refs.size() < 2) continue;
          checks.push_back({OpKind::kCheckEqual, p.name, src.states[s], g.counts, {}, g.refs});
        }
      }
      for (const Placement& d : dst.place[i * ns + s]) {
        for (const Group& g : groups) {
          Op op;
          Shape is;
          if (!IntersectBox(d.full_start, d.counts, g.start, g.counts, &is, &op.counts)) continue;
          op.kind = (average && g.refs.size() > 1) ? OpKind::kAverage : OpKind::kCopy;
          op.param = p.name;
          op.state = src.states[s];
          op.dst = Shifted(d.ref, d.full_start, is);
          if (op.kind == OpKind::kAverage) {
            for (const StridedRef& r : g.refs) op.srcs.push_back(Shifted(r, g.start, is));
          } else {
            op.srcs.push_back(Shifted(g.refs[0], g.start, is));
          }
          ops.push_back(std::move(op));
        }
      }
    }
  }
  std::stable_sort(ops.begin(), ops.end(),
                   [](const Op& a, const Op& b) { return a.dst.tensor < b.dst.tensor; });
  for (Op& c : checks) ops.push_back(std::move(c));
  plan.ops = std::move(ops);
  plan.sources = std::move(src.tensors);
  plan.targets = std::move(dst.tensors);
  return plan;
}

namespace {

// Calls fn(first, length) for the flat runs a box covers: the innermost dimensions that are
// contiguous in `r` are merged into one run, so a row-major box is one run and a column block
// is one run per row.
template <typename Fn>
void ForEachRun(const std::vector<int64_t>& counts, const StridedRef& r, Fn&& fn) {
  for (int64_t c : counts) {
    if (c <= 0) return;
  }
  size_t nd = counts.size();
  int64_t run = 1;
  while (nd > 0 && (counts[nd - 1] == 1 || r.strides[nd - 1] == run)) {
    run *= counts[nd - 1];
    --nd;
  }
  std::vector<int64_t> idx(nd, 0);
  for (;;) {
    int64_t off = r.offset;
    for (size_t k = 0; k < nd; ++k) off += idx[k] * r.strides[k];
    fn(off, run);
    size_t k = nd;
    while (k > 0) {
      --k;
      if (++idx[k] < counts[k]) break;
      idx[k] = 0;
      if (k == 0) return;
    }
    if (nd == 0) return;
  }
}

// The lowest and highest element a box touches (strides are non-negative).
std::pair<int64_t, int64_t> Extent(const std::vector<int64_t>& counts, const StridedRef& r) {
  int64_t hi = r.offset;
  for (size_t k = 0; k < counts.size(); ++k) hi += (counts[k] - 1) * r.strides[k];
  return {r.offset, hi};
}

}  // namespace

Status CheckCoverage(const Plan& plan) {
  // Per target, the runs of elements the ops write; sorted, they must tile the tensor. Memory is
  // a pair per run (a row or more), not a counter per element.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> runs(plan.targets.size());
  auto check_ref = [&](const Op& op, const StridedRef& r, const std::vector<TensorInfo>& tensors,
                       const char* side) -> Status {
    if (r.tensor < 0 || static_cast<size_t>(r.tensor) >= tensors.size() ||
        r.strides.size() != op.counts.size()) {
      return InternalError(std::string("plan op for ") + Q(op.param) + ": bad " + side +
                           " tensor index " + std::to_string(r.tensor) + " or stride rank");
    }
    for (int64_t st : r.strides) {
      if (st < 0) return InternalError("plan op for " + Q(op.param) + ": negative stride");
    }
    const auto [lo, hi] = Extent(op.counts, r);
    const int64_t n = NumElementsOrDie(tensors[r.tensor].shape);
    if (lo < 0 || hi >= n) {
      return InternalError(std::string("plan op for ") + Q(op.param) + ": " + side + " box [" +
                           std::to_string(lo) + ", " + std::to_string(hi) + "] outside " +
                           Q(tensors[r.tensor].name) + " of " + std::to_string(n) + " elements");
    }
    return Status::Ok();
  };
  for (const Op& op : plan.ops) {
    for (const StridedRef& r : op.srcs)
      UCP_RETURN_IF_ERROR(check_ref(op, r, plan.sources, "source"));
    if (op.kind == OpKind::kCheckEqual) {
      if (op.srcs.size() < 2 || op.dst.tensor != -1) {
        return InternalError("check_equal op for " + Q(op.param) + " is malformed");
      }
      continue;
    }
    UCP_RETURN_IF_ERROR(check_ref(op, op.dst, plan.targets, "target"));
    const size_t want = op.kind == OpKind::kFill ? 0 : op.kind == OpKind::kCopy ? 1 : 2;
    if ((want < 2 && op.srcs.size() != want) || (want == 2 && op.srcs.size() < 2)) {
      return InternalError(std::string(OpKindName(op.kind)) + " op for " + Q(op.param) + " has " +
                           std::to_string(op.srcs.size()) + " sources");
    }
    auto& r = runs[op.dst.tensor];
    ForEachRun(op.counts, op.dst, [&](int64_t first, int64_t len) { r.emplace_back(first, len); });
  }
  for (size_t t = 0; t < plan.targets.size(); ++t) {
    auto& r = runs[t];
    std::sort(r.begin(), r.end());
    const int64_t n = NumElementsOrDie(plan.targets[t].shape);
    int64_t next = 0;  // the first element no run has covered yet
    auto fail = [&](int64_t e, const char* times) {
      return InternalError("target tensor " + Q(plan.targets[t].name) + ": element " +
                           std::to_string(e) + " is written " + times +
                           " (expected exactly once)");
    };
    for (const auto& [first, len] : r) {
      if (first > next) return fail(next, "0 times");
      if (first < next) return fail(first, "at least 2 times");
      next = first + len;
    }
    if (next < n) return fail(next, "0 times");
  }
  return Status::Ok();
}

std::vector<RankSummary> Summarize(const Plan& plan) {
  std::map<int64_t, RankSummary> by_rank;
  for (const TensorInfo& t : plan.targets) {
    RankSummary& r = by_rank[t.rank];
    r.rank = t.rank;
    ++r.tensors;
  }
  for (const Op& op : plan.ops) {
    if (op.kind == OpKind::kCheckEqual) {
      // Checks read sources only and belong to no target rank: they are counted on rank -1.
      RankSummary& r = by_rank[-1];
      r.rank = -1;
      ++r.check_ops;
      continue;
    }
    const TensorInfo& t = plan.targets[op.dst.tensor];
    RankSummary& r = by_rank[t.rank];
    int64_t n = 1;
    for (int64_t c : op.counts) n *= c;
    r.bytes_written += n * DTypeSizeBytes(t.dtype);
    switch (op.kind) {
      case OpKind::kCopy:
        ++r.copy_ops;
        break;
      case OpKind::kFill:
        ++r.fill_ops;
        break;
      case OpKind::kAverage:
        ++r.average_ops;
        break;
      case OpKind::kCheckEqual:
        break;
    }
  }
  std::vector<RankSummary> out;
  for (auto& [rank, s] : by_rank) out.push_back(s);
  return out;
}

std::string PlanToJson(const Plan& plan) {
  std::ostringstream os;
  os << "{\"from\":\"" << layout::ToString(plan.from) << "\",\"to\":\"" << layout::ToString(plan.to)
     << "\",\"sources\":[";
  for (size_t i = 0; i < plan.sources.size(); ++i) {
    os << (i ? ",\n" : "\n");
    AppendTensor(os, plan.sources[i]);
  }
  os << "],\"targets\":[";
  for (size_t i = 0; i < plan.targets.size(); ++i) {
    os << (i ? ",\n" : "\n");
    AppendTensor(os, plan.targets[i]);
  }
  os << "],\"ops\":[";
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const Op& op = plan.ops[i];
    os << (i ? ",\n" : "\n") << "{\"kind\":\"" << OpKindName(op.kind) << "\",\"param\":";
    AppendJsonString(os, op.param);
    os << ",\"state\":";
    AppendJsonString(os, op.state);
    os << ",\"counts\":";
    AppendInts(os, op.counts);
    os << ",\"dst\":";
    if (op.dst.tensor < 0) {
      os << "null";
    } else {
      AppendRef(os, op.dst);
    }
    os << ",\"srcs\":[";
    for (size_t k = 0; k < op.srcs.size(); ++k) {
      if (k) os << ",";
      AppendRef(os, op.srcs[k]);
    }
    os << "]}";
  }
  os << "]}\n";
  return os.str();
}

}  // namespace ucp::convert
