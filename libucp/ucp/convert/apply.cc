// The in-memory executor (see apply.h). Boxes are walked row by row: the innermost dim is one
// contiguous run when its stride is 1 on both sides, so a copy is one CastElements call per row.
#include "ucp/convert/apply.h"

#include <cstring>
#include <vector>

#include "ucp/base/status_macros.h"
#include "ucp/tensor/cast.h"

namespace ucp::convert {
namespace {

std::string Q(std::string_view s) { return "\"" + std::string(s) + "\""; }

// Calls fn(dst_offset, src_offsets, run) for every run of the box's innermost dim. `run` is the
// number of elements when every innermost stride is 1, else 1 (element by element).
template <typename Fn>
void ForEachRun(const Op& op, Fn&& fn) {
  const size_t nd = op.counts.size();
  for (int64_t c : op.counts) {
    if (c <= 0) return;
  }
  std::vector<const StridedRef*> refs;
  if (op.dst.tensor >= 0) refs.push_back(&op.dst);
  for (const StridedRef& r : op.srcs) refs.push_back(&r);
  bool contiguous = nd > 0;
  for (const StridedRef* r : refs) contiguous = contiguous && r->strides[nd - 1] == 1;
  const size_t outer = contiguous ? nd - 1 : nd;
  const int64_t run = contiguous ? op.counts[nd - 1] : 1;
  std::vector<int64_t> idx(outer, 0);
  std::vector<int64_t> offs(refs.size());
  for (;;) {
    for (size_t j = 0; j < refs.size(); ++j) {
      int64_t off = refs[j]->offset;
      for (size_t k = 0; k < outer; ++k) off += idx[k] * refs[j]->strides[k];
      offs[j] = off;
    }
    fn(offs, run);
    size_t k = outer;
    bool done = true;
    while (k > 0) {
      --k;
      if (++idx[k] < op.counts[k]) {
        done = false;
        break;
      }
      idx[k] = 0;
    }
    if (done) return;
  }
}

std::string BoxText(const Op& op) {
  std::string s = "[";
  for (size_t k = 0; k < op.counts.size(); ++k) s += (k ? ", " : "") + std::to_string(op.counts[k]);
  return s + "]";
}

}  // namespace

Result<TensorMap> ApplyPlan(const Plan& plan, const TensorMap& sources) {
  std::vector<const Tensor*> src(plan.sources.size(), nullptr);
  for (size_t i = 0; i < plan.sources.size(); ++i) {
    const TensorInfo& info = plan.sources[i];
    auto it = sources.find(info.name);
    if (it == sources.end()) return NotFoundError("source tensor " + Q(info.name) + " is missing");
    if (it->second.dtype() != info.dtype || it->second.shape() != info.shape) {
      return InvalidArgumentError(
          "source tensor " + Q(info.name) + ": has " + std::string(DTypeName(it->second.dtype())) +
          " " + ShapeToString(it->second.shape()) + ", the plan expects " +
          std::string(DTypeName(info.dtype)) + " " + ShapeToString(info.shape));
    }
    src[i] = &it->second;
  }
  TensorMap out;
  std::vector<Tensor*> dst(plan.targets.size(), nullptr);
  for (size_t i = 0; i < plan.targets.size(); ++i) {
    UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Zeros(plan.targets[i].dtype, plan.targets[i].shape),
                         "target tensor " + Q(plan.targets[i].name));
    auto [it, inserted] = out.emplace(plan.targets[i].name, std::move(t));
    if (!inserted) return InternalError("target tensor " + Q(plan.targets[i].name) + " twice");
    dst[i] = &it->second;
  }
  std::vector<double> acc, tmp;
  for (const Op& op : plan.ops) {
    const std::string what = "parameter " + Q(op.param) + " state " + Q(op.state);
    Status status;
    switch (op.kind) {
      case OpKind::kFill: {
        Tensor* d = dst[op.dst.tensor];
        const int64_t es = DTypeSizeBytes(d->dtype());
        ForEachRun(op, [&](const std::vector<int64_t>& offs, int64_t run) {
          std::memset(d->data() + offs[0] * es, 0, static_cast<size_t>(run * es));
        });
        break;
      }
      case OpKind::kCopy: {
        Tensor* d = dst[op.dst.tensor];
        const Tensor* s = src[op.srcs[0].tensor];
        const int64_t des = DTypeSizeBytes(d->dtype()), ses = DTypeSizeBytes(s->dtype());
        ForEachRun(op, [&](const std::vector<int64_t>& offs, int64_t run) {
          if (!status.ok()) return;
          if (d->dtype() == s->dtype()) {
            std::memcpy(d->data() + offs[0] * des, s->data() + offs[1] * ses,
                        static_cast<size_t>(run * des));
            return;
          }
          status = CastElements(s->dtype(), {s->data() + offs[1] * ses, size_t(run * ses)},
                                d->dtype(), {d->data() + offs[0] * des, size_t(run * des)}, run);
        });
        UCP_RETURN_IF_ERROR(status, what);
        break;
      }
      case OpKind::kCheckEqual: {
        const Tensor* first = src[op.srcs[0].tensor];
        const int64_t es = DTypeSizeBytes(first->dtype());
        for (size_t j = 1; j < op.srcs.size() && status.ok(); ++j) {
          const Tensor* other = src[op.srcs[j].tensor];
          Op pair = op;
          pair.srcs = {op.srcs[0], op.srcs[j]};
          int64_t element = 0;
          ForEachRun(pair, [&](const std::vector<int64_t>& offs, int64_t run) {
            if (!status.ok()) return;
            if (std::memcmp(first->data() + offs[0] * es, other->data() + offs[1] * es,
                            static_cast<size_t>(run * es)) != 0) {
              status = DataLossError(
                  what + ": replicated copies differ: " + Q(plan.sources[op.srcs[0].tensor].name) +
                  " and " + Q(plan.sources[op.srcs[j].tensor].name) + " in box " + BoxText(op) +
                  " near box element " + std::to_string(element));
            }
            element += run;
          });
        }
        UCP_RETURN_IF_ERROR(status);
        break;
      }
      case OpKind::kAverage: {
        Tensor* d = dst[op.dst.tensor];
        if (!IsFloating(d->dtype())) {
          return UnimplementedError(what + ": average of " + std::string(DTypeName(d->dtype())) +
                                    " is not supported");
        }
        const int64_t des = DTypeSizeBytes(d->dtype());
        ForEachRun(op, [&](const std::vector<int64_t>& offs, int64_t run) {
          if (!status.ok()) return;
          acc.assign(static_cast<size_t>(run), 0.0);
          tmp.resize(static_cast<size_t>(run));
          for (size_t j = 0; j < op.srcs.size() && status.ok(); ++j) {
            const Tensor* s = src[op.srcs[j].tensor];
            const int64_t ses = DTypeSizeBytes(s->dtype());
            status = CastElements(s->dtype(), {s->data() + offs[j + 1] * ses, size_t(run * ses)},
                                  DType::kFp64,
                                  {reinterpret_cast<std::byte*>(tmp.data()), size_t(run * 8)}, run);
            for (int64_t e = 0; e < run; ++e) acc[e] += tmp[e];
          }
          if (!status.ok()) return;
          for (int64_t e = 0; e < run; ++e) acc[e] /= static_cast<double>(op.srcs.size());
          status = CastElements(DType::kFp64,
                                {reinterpret_cast<const std::byte*>(acc.data()), size_t(run * 8)},
                                d->dtype(), {d->data() + offs[0] * des, size_t(run * des)}, run);
        });
        UCP_RETURN_IF_ERROR(status, what);
        break;
      }
    }
  }
  return out;
}

}  // namespace ucp::convert
