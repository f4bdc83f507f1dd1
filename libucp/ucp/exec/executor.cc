// Executor: box gather / scatter over flat ranges, a byte budget, and oneTBB over targets.
#include "ucp/exec/executor.h"

#include <sys/resource.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>

#include "ucp/base/status_macros.h"
#include "ucp/tensor/cast.h"

namespace ucp::exec {

using convert::Op;
using convert::OpKind;
using convert::Plan;
using convert::StridedRef;
using convert::TensorInfo;

namespace {

// Counts the bytes alive in buffers and blocks a new buffer while the budget is spent. One
// request larger than the budget runs when nothing else is in flight, so progress is assured.
class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  void Acquire(int64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return limit_ <= 0 || used_ == 0 || used_ + n <= limit_; });
    used_ += n;
    peak_ = std::max(peak_, used_);
  }
  void Release(int64_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      used_ -= n;
    }
    cv_.notify_all();
  }
  int64_t peak() const { return peak_; }

 private:
  int64_t limit_;
  int64_t used_ = 0;
  int64_t peak_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

int64_t Span(const StridedRef& ref, const std::vector<int64_t>& counts) {
  int64_t hi = 0;
  for (size_t k = 0; k < counts.size(); ++k) hi += (counts[k] - 1) * ref.strides[k];
  return hi + 1;
}

// Calls fn(outer_index, src_elem_offset_delta) for each row of the box: rows are the last dim.
template <typename Fn>
void ForEachRow(const std::vector<int64_t>& counts, const std::vector<int64_t>& strides, Fn fn) {
  const size_t nd = counts.size();
  if (nd <= 1) {
    fn(int64_t{0}, int64_t{0});
    return;
  }
  std::vector<int64_t> idx(nd - 1, 0);
  int64_t row = 0;
  while (true) {
    int64_t off = 0;
    for (size_t k = 0; k + 1 < nd; ++k) off += idx[k] * strides[k];
    fn(row++, off);
    size_t k = nd - 1;
    while (k > 0) {
      --k;
      if (++idx[k] < counts[k]) break;
      idx[k] = 0;
      if (k == 0) return;
    }
  }
}

Status CheckRef(const StridedRef& ref, const std::vector<int64_t>& counts, const TensorInfo& t,
                const std::string& what) {
  if (ref.strides.size() != counts.size()) {
    return InvalidArgumentError(what + ": stride rank differs from box rank for tensor \"" +
                                t.name + "\"");
  }
  for (int64_t s : ref.strides) {
    if (s < 0) return InvalidArgumentError(what + ": negative stride in \"" + t.name + "\"");
  }
  const int64_t n = NumElementsOrDie(t.shape);
  if (ref.offset < 0 || ref.offset + Span(ref, counts) > n) {
    return InvalidArgumentError(what + ": box outside tensor \"" + t.name + "\" (" +
                                std::to_string(n) + " elements)");
  }
  return Status::Ok();
}

// Reads the box `ref` x `counts` of source tensor `t` and returns it contiguous, cast to
// `out_dtype`.
Result<HostBuffer> Gather(const TensorInfo& t, const StridedRef& ref,
                          const std::vector<int64_t>& counts, DType out_dtype,
                          const TensorSource& source, std::atomic<int64_t>& bytes_read) {
  const int64_t box = NumElementsOrDie(counts);
  const int64_t span = Span(ref, counts);
  const int64_t in_size = DTypeSizeBytes(t.dtype);
  const int64_t out_size = DTypeSizeBytes(out_dtype);
  UCP_ASSIGN_OR_RETURN(HostBuffer raw, HostBuffer::Allocate(span * in_size));
  UCP_RETURN_IF_ERROR(source.ReadFlatRange(t, ref.offset, ref.offset + span, raw.bytes()),
                      "while reading \"" + t.name + "\"");
  bytes_read += span * in_size;
  const int64_t row_len = counts.empty() ? 1 : counts.back();
  const int64_t inner = counts.empty() ? 1 : ref.strides.back();
  if (box == span && out_dtype == t.dtype) return raw;  // the box is the whole range
  UCP_ASSIGN_OR_RETURN(HostBuffer out, HostBuffer::Allocate(box * out_size));
  Status status;
  ForEachRow(counts, ref.strides, [&](int64_t row, int64_t off) {
    if (!status.ok()) return;
    std::byte* dst = out.data() + row * row_len * out_size;
    if (inner == 1 || row_len == 1) {
      status = CastElements(t.dtype, raw.bytes().subspan(off * in_size, row_len * in_size),
                            out_dtype, {dst, static_cast<size_t>(row_len * out_size)}, row_len);
      return;
    }
    for (int64_t i = 0; i < row_len && status.ok(); ++i) {
      status = CastElements(t.dtype, raw.bytes().subspan((off + i * inner) * in_size, in_size),
                            out_dtype, {dst + i * out_size, static_cast<size_t>(out_size)}, 1);
    }
  });
  UCP_RETURN_IF_ERROR(status, "while casting \"" + t.name + "\"");
  return out;
}

// Writes the contiguous `box` bytes (in the target's dtype) into the box `ref` of `dst`.
void Scatter(const StridedRef& ref, const std::vector<int64_t>& counts,
             std::span<const std::byte> box, Tensor& dst) {
  const int64_t size = DTypeSizeBytes(dst.dtype());
  const int64_t row_len = counts.empty() ? 1 : counts.back();
  const int64_t inner = counts.empty() ? 1 : ref.strides.back();
  ForEachRow(counts, ref.strides, [&](int64_t row, int64_t off) {
    const std::byte* src = box.data() + row * row_len * size;
    std::byte* base = dst.data() + (ref.offset + off) * size;
    if (inner == 1) {
      std::memcpy(base, src, row_len * size);
    } else {
      for (int64_t i = 0; i < row_len; ++i)
        std::memcpy(base + i * inner * size, src + i * size, size);
    }
  });
}

std::string OpWhat(const Op& op) {
  return "parameter \"" + op.param + "\" state \"" + op.state + "\"";
}

Status ApplyOp(const Plan& plan, const Op& op, Tensor& dst, const TensorSource& source,
               std::atomic<int64_t>& bytes_read) {
  const TensorInfo& dinfo = plan.targets[op.dst.tensor];
  const int64_t box = NumElementsOrDie(op.counts);
  if (box == 0) return Status::Ok();
  UCP_RETURN_IF_ERROR(CheckRef(op.dst, op.counts, dinfo, OpWhat(op)));
  for (const StridedRef& s : op.srcs) {
    if (s.tensor < 0 || s.tensor >= static_cast<int32_t>(plan.sources.size())) {
      return InvalidArgumentError(OpWhat(op) + ": source index " + std::to_string(s.tensor) +
                                  " outside the plan");
    }
    UCP_RETURN_IF_ERROR(CheckRef(s, op.counts, plan.sources[s.tensor], OpWhat(op)));
  }
  const int64_t size = DTypeSizeBytes(dinfo.dtype);
  switch (op.kind) {
    case OpKind::kFill: {
      UCP_ASSIGN_OR_RETURN(HostBuffer zeros, HostBuffer::Allocate(box * size, true));
      Scatter(op.dst, op.counts, zeros.bytes(), dst);
      return Status::Ok();
    }
    case OpKind::kCopy: {
      if (op.srcs.size() != 1) return InvalidArgumentError(OpWhat(op) + ": copy needs 1 source");
      const StridedRef& s = op.srcs[0];
      UCP_ASSIGN_OR_RETURN(HostBuffer data, Gather(plan.sources[s.tensor], s, op.counts,
                                                   dinfo.dtype, source, bytes_read));
      Scatter(op.dst, op.counts, data.bytes(), dst);
      return Status::Ok();
    }
    case OpKind::kAverage: {
      if (!IsFloating(dinfo.dtype)) {
        return UnimplementedError(OpWhat(op) + ": average of non-floating dtype " +
                                  std::string(DTypeName(dinfo.dtype)));
      }
      if (op.srcs.empty()) return InvalidArgumentError(OpWhat(op) + ": average needs sources");
      std::vector<double> sum(box, 0.0);
      for (const StridedRef& s : op.srcs) {
        UCP_ASSIGN_OR_RETURN(HostBuffer data, Gather(plan.sources[s.tensor], s, op.counts,
                                                     DType::kFp64, source, bytes_read));
        auto v = data.as<double>();
        for (int64_t i = 0; i < box; ++i) sum[i] += v[i];
      }
      const double n = static_cast<double>(op.srcs.size());
      for (double& x : sum) x /= n;
      UCP_ASSIGN_OR_RETURN(HostBuffer out, HostBuffer::Allocate(box * size));
      UCP_RETURN_IF_ERROR(CastElements(DType::kFp64, std::as_bytes(std::span<const double>(sum)),
                                       dinfo.dtype, out.bytes(), box));
      Scatter(op.dst, op.counts, out.bytes(), dst);
      return Status::Ok();
    }
    case OpKind::kCheckEqual:
      return InternalError("check op given to ApplyOp");
  }
  return InternalError("unknown op kind");
}

Status RunCheck(const Plan& plan, const Op& op, const TensorSource& source,
                std::atomic<int64_t>& bytes_read) {
  if (op.srcs.size() < 2 || NumElementsOrDie(op.counts) == 0) return Status::Ok();
  for (const StridedRef& s : op.srcs) {
    if (s.tensor < 0 || s.tensor >= static_cast<int32_t>(plan.sources.size())) {
      return InvalidArgumentError(OpWhat(op) + ": source index outside the plan");
    }
    UCP_RETURN_IF_ERROR(CheckRef(s, op.counts, plan.sources[s.tensor], OpWhat(op)));
  }
  const TensorInfo& first = plan.sources[op.srcs[0].tensor];
  UCP_ASSIGN_OR_RETURN(HostBuffer ref,
                       Gather(first, op.srcs[0], op.counts, first.dtype, source, bytes_read));
  const int64_t size = DTypeSizeBytes(first.dtype);
  for (size_t i = 1; i < op.srcs.size(); ++i) {
    const TensorInfo& t = plan.sources[op.srcs[i].tensor];
    UCP_ASSIGN_OR_RETURN(HostBuffer other,
                         Gather(t, op.srcs[i], op.counts, first.dtype, source, bytes_read));
    if (std::memcmp(ref.data(), other.data(), ref.num_bytes()) != 0) {
      int64_t e = 0;
      while (std::memcmp(ref.data() + e * size, other.data() + e * size, size) == 0) ++e;
      return DataLossError(OpWhat(op) + ": replicated copies differ at element " +
                           std::to_string(e) + " of the box (\"" + first.name + "\" vs \"" +
                           t.name + "\")");
    }
  }
  return Status::Ok();
}

std::vector<std::vector<const Op*>> OpsByTarget(const Plan& plan, std::vector<const Op*>& checks) {
  std::vector<std::vector<const Op*>> by(plan.targets.size());
  for (const Op& op : plan.ops) {
    if (op.kind == OpKind::kCheckEqual) {
      checks.push_back(&op);
    } else if (op.dst.tensor >= 0 && op.dst.tensor < static_cast<int32_t>(by.size())) {
      by[op.dst.tensor].push_back(&op);
    }
  }
  return by;
}

Result<Tensor> Materialize(const Plan& plan, int32_t target, const std::vector<const Op*>& ops,
                           const TensorSource& source, std::atomic<int64_t>& bytes_read) {
  const TensorInfo& t = plan.targets[target];
  UCP_ASSIGN_OR_RETURN(Tensor out, Tensor::Zeros(t.dtype, t.shape), "for \"" + t.name + "\"");
  for (const Op* op : ops) UCP_RETURN_IF_ERROR(ApplyOp(plan, *op, out, source, bytes_read));
  return out;
}

}  // namespace

Result<Tensor> MaterializeTarget(const Plan& plan, int32_t target, const TensorSource& source) {
  if (target < 0 || target >= static_cast<int32_t>(plan.targets.size())) {
    return OutOfRangeError("target " + std::to_string(target) + " outside the plan's " +
                           std::to_string(plan.targets.size()));
  }
  std::vector<const Op*> checks;
  auto by = OpsByTarget(plan, checks);
  std::atomic<int64_t> bytes_read{0};
  return Materialize(plan, target, by[target], source, bytes_read);
}

Result<ExecStats> ExecutePlan(const Plan& plan, const TensorSource& source, TensorSink& sink,
                              const ExecOptions& options) {
  std::vector<const Op*> checks;
  auto by = OpsByTarget(plan, checks);
  std::vector<int32_t> selected = options.targets;
  if (selected.empty()) {
    for (int32_t i = 0; i < static_cast<int32_t>(plan.targets.size()); ++i) selected.push_back(i);
  }
  if (!options.targets.empty()) {
    // Only the checks of parameters the selected targets serve.
    std::map<std::string, bool> params;
    for (int32_t t : selected) {
      for (const Op* op : by[t]) params[op->param] = true;
    }
    std::erase_if(checks, [&](const Op* op) { return !params.count(op->param); });
  }
  if (!options.run_checks) checks.clear();
  ByteBudget budget(options.memory_limit_bytes);
  std::atomic<int64_t> bytes_read{0}, bytes_written{0}, done{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  Status first_error;
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(err_mu);
    if (first_error.ok()) first_error = std::move(s);
    failed = true;
  };
  const int64_t total = static_cast<int64_t>(selected.size() + checks.size());
  tbb::parallel_for(
      size_t{0}, selected.size() + checks.size(),
      [&](size_t i) {
        if (failed) return;
        if (i >= selected.size()) {
          const Op& op = *checks[i - selected.size()];
          int64_t est = 0;
          for (const StridedRef& s : op.srcs) {
            est = std::max(est, Span(s, op.counts) * DTypeSizeBytes(plan.sources[s.tensor].dtype));
          }
          est *= 3;
          budget.Acquire(est);
          Status s = RunCheck(plan, op, source, bytes_read);
          budget.Release(est);
          if (!s.ok()) return fail(std::move(s));
        } else {
          const int32_t t = selected[i];
          const TensorInfo& info = plan.targets[t];
          // The target plus, at worst, one source read of the same size and its cast copy.
          const int64_t est = 3 * NumElementsOrDie(info.shape) * DTypeSizeBytes(info.dtype);
          budget.Acquire(est);
          Result<Tensor> data = Materialize(plan, t, by[t], source, bytes_read);
          Status s = data.status();
          if (s.ok()) {
            bytes_written += data->num_bytes();
            s = sink.Write(info, std::move(*data));
          }
          budget.Release(est);
          if (!s.ok()) return fail(std::move(s));
        }
        const int64_t d = ++done;
        if (options.progress) options.progress(d, total);
      },
      tbb::simple_partitioner());
  if (!first_error.ok()) return first_error;
  ExecStats stats;
  stats.targets_written = static_cast<int64_t>(selected.size());
  stats.bytes_read = bytes_read;
  stats.bytes_written = bytes_written;
  stats.peak_in_flight_bytes = budget.peak();
  return stats;
}

struct ScopedThreadLimit::Impl {
  std::unique_ptr<tbb::global_control> control;
};

ScopedThreadLimit::ScopedThreadLimit(int threads) : impl_(std::make_unique<Impl>()) {
  if (threads > 0) {
    impl_->control = std::make_unique<tbb::global_control>(
        tbb::global_control::max_allowed_parallelism, static_cast<size_t>(threads));
  }
}
ScopedThreadLimit::~ScopedThreadLimit() = default;

int64_t PeakRssBytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

Result<int64_t> ParseByteSize(std::string_view text) {
  if (text.empty()) return InvalidArgumentError("empty byte size");
  int64_t mult = 1;
  std::string_view digits = text;
  switch (text.back()) {
    case 'K':
    case 'k':
      mult = int64_t{1} << 10;
      break;
    case 'M':
    case 'm':
      mult = int64_t{1} << 20;
      break;
    case 'G':
    case 'g':
      mult = int64_t{1} << 30;
      break;
    default:
      break;
  }
  if (mult != 1) digits.remove_suffix(1);
  if (digits.empty() || digits.size() > 12) {
    return InvalidArgumentError("byte size \"" + std::string(text) + "\" is not N[K|M|G]");
  }
  int64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') {
      return InvalidArgumentError("byte size \"" + std::string(text) + "\" is not N[K|M|G]");
    }
    v = v * 10 + (c - '0');
  }
  return v * mult;
}

}  // namespace ucp::exec
