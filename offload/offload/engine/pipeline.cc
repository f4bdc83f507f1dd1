// The pipeline (pipeline.h): two worker threads stand for the device's copy stream and the host's
// Adam dispatcher; the Adam itself runs on CpuAdam's own pool of adam_threads.
#include "offload/engine/pipeline.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "offload/optim/cpu_adam.h"
#include "ucp/base/check.h"
#include "ucp/base/status_macros.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload {
namespace {

using Clock = TraceRecorder::Clock;

class CpuBackend final : public PipelineBackend {
 public:
  Result<bool> GradToHost(const Bucket& bucket, std::span<const float> d_grad,
                          std::span<float> h_grad, std::span<uint16_t> h_grad16,
                          bool fp16_range) override {
    bool ok = true;
    for (const BucketPiece& pc : bucket.pieces) {
      const float* src = d_grad.data() + pc.grad_offset;
      float maxabs = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < pc.n; ++i) {
        const float v = src[i];
        finite = finite && std::isfinite(v);
        maxabs = std::max(maxabs, std::fabs(v));
      }
      ok = ok && finite && !(fp16_range && maxabs > 65504.0f);
      if (!h_grad16.empty()) {
        uint16_t* dst = h_grad16.data() + pc.state_offset;
        for (int64_t i = 0; i < pc.n; ++i) dst[i] = Bf16FromFloat(src[i]);
      } else if (float* dst = h_grad.data() + pc.state_offset; dst != src) {
        // (The same memory when a streamed device's gradients are the host's: device.h.)
        std::memcpy(dst, src, static_cast<size_t>(pc.n) * 4);
      }
    }
    return ok;
  }
  Status WeightsToDevice(const Bucket& bucket, std::span<const uint16_t> h_out,
                         std::span<uint16_t> d_weights) override {
    for (const BucketPiece& pc : bucket.pieces) {
      uint16_t* dst = d_weights.data() + pc.grad_offset;
      const uint16_t* src = h_out.data() + pc.state_offset;
      if (dst != src) std::memcpy(dst, src, static_cast<size_t>(pc.n) * 2);
    }
    return Status::Ok();
  }
};

// kDevice: a tail bucket the CPU Adam steps after validation; kCaller: one the caller steps;
// kHeld: a finite bucket left for validation to step (speculation off).
enum class Fate : uint8_t { kPending, kSpeculated, kDeferred, kDevice, kCaller, kHeld };

}  // namespace

std::unique_ptr<PipelineBackend> CpuPipelineBackend() { return std::make_unique<CpuBackend>(); }

struct Pipeline::Impl {
  PipelineOptions opt;
  std::vector<Bucket> buckets;
  PipelineMemory mem;
  std::unique_ptr<PipelineBackend> backend;
  std::optional<CpuAdam> adam;
  // Host staging: the gradient as it crossed the link, the snapshots, the updated low-precision
  // weights on their way back; all in state order.
  std::vector<float> h_grad, snap_p, snap_m, snap_v;
  std::vector<uint16_t> h_grad16, h_out;
  // What the stages use: the vectors above (state order), or the caller's staging
  // (PipelineMemory; the device's order). The transfers take a bucket's pieces at their offsets
  // into the host buffer: the buckets' own for state order, else `by_grad` (the same pieces with
  // state_offset = grad_offset).
  std::span<float> grad_host;
  std::span<uint16_t> out_host;
  bool grad_by_grad = false, out_by_grad = false;
  std::vector<Bucket> by_grad;
  const Bucket& GradCopyBucket(int k) const { return grad_by_grad ? by_grad[k] : buckets[k]; }
  const Bucket& OutCopyBucket(int k) const { return out_by_grad ? by_grad[k] : buckets[k]; }
  int num_cpu = 0;  // buckets [0, num_cpu) go through the host; the rest stay on the device

  // The step in flight.
  bool in_step = false;
  int64_t step = 0;
  float spec_scale = 1.0f;
  bool speculate = false;  // this step's buckets are stepped during backward (Begin)
  std::vector<Fate> fate;
  std::vector<char> handed, finite;
  int num_handed = 0, cpu_handed = 0, copy_handed = 0;
  PipelineStats stats;
  Clock::time_point mark, hook_made;

  // The stages' queues; `done` counts host buckets the Adam stage has finished.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<int> copy_q, adam_q;
  int done = 0, copied = 0;
  bool stop = false;
  Status error;

  // The finish in flight (StartFinish): buckets queued in forward's order on the Adam thread;
  // finished[k]: 1 once bucket k's final weights are on the device, 2 when it failed or was
  // passed over after an earlier bucket's failure.
  bool finishing = false;
  Validation fin_v;
  bool fin_same_scale = false;
  std::deque<int> fin_q;
  std::vector<char> finished;
  int fin_left = 0;
  Status fin_error;
  std::thread copy_thread, adam_thread;

  void Trace(std::string name, const char* cat, TraceTrack track, Clock::time_point b) {
    if (opt.trace != nullptr) opt.trace->Add(std::move(name), cat, track, b, Clock::now());
  }

  // Bucket k's Adam spans over the host gradient (or, for a device bucket, the device one).
  void Spans(int k, bool device_grad, std::vector<AdamSpans>& out,
             std::vector<AdamSnapshot>& snaps) {
    out.clear();
    snaps.clear();
    for (const BucketPiece& pc : buckets[k].pieces) {
      const size_t so = static_cast<size_t>(pc.state_offset), n = static_cast<size_t>(pc.n);
      const size_t go = static_cast<size_t>(pc.grad_offset);
      AdamSpans a;
      a.param = mem.h_master.subspan(so, n);
      a.exp_avg = mem.h_exp_avg.subspan(so, n);
      a.exp_avg_sq = mem.h_exp_avg_sq.subspan(so, n);
      if (device_grad) {
        a.grad = GradSpan::Fp32(mem.d_grad.subspan(static_cast<size_t>(pc.grad_offset), n));
      } else if (!mem.h_reduced_grad.empty()) {
        a.grad = GradSpan::Fp32(mem.h_reduced_grad.subspan(so, n));
      } else if (opt.bf16_link) {
        a.grad = GradSpan::Bf16(std::span<const uint16_t>(h_grad16).subspan(so, n));
      } else {
        a.grad = GradSpan::Fp32(std::span<const float>(grad_host).subspan(grad_by_grad ? go : so, n));
      }
      if (opt.weights != LowpDType::kFp32) {
        a.out = {opt.weights, out_host.subspan(out_by_grad ? go : so, n)};
      }
      out.push_back(a);
      if (snap_p.empty()) continue;  // speculation off: no snapshots
      snaps.push_back({std::span<float>(snap_p).subspan(so, n),
                       std::span<float>(snap_m).subspan(so, n),
                       std::span<float>(snap_v).subspan(so, n),
                       {}});
    }
  }

  void CopyLoop() {
    for (;;) {
      int k;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !copy_q.empty(); });
        if (stop) return;
        k = copy_q.front();
        copy_q.pop_front();
      }
      const auto t0 = Clock::now();
      const Result<bool> ok = backend->GradToHost(GradCopyBucket(k), mem.d_grad, grad_host, h_grad16,
                                                  opt.fp16_range_check);
      Trace("grad->host " + buckets[k].name, "transfer", TraceTrack::kTransfer, t0);
      // Before `copied` counts it: WaitGradients returns only after every landing was reported.
      if (ok.ok() && opt.on_grad_landed && grad_by_grad) opt.on_grad_landed(k);
      {
        std::lock_guard<std::mutex> lock(mu);
        // A failed transfer is never stepped; Drain reports it (the Adam stage still counts the
        // bucket, so the step's accounting completes).
        finite[k] = ok.ok() && *ok;
        if (!ok.ok() && error.ok()) {
          error = Status(ok.status().code(), "gradient of bucket " + buckets[k].name +
                                                 " to the host: " + std::string(ok.status().message()));
        }
        if (k < num_cpu) adam_q.push_back(k);  // a caller-stepped tail bucket only crosses
        copied += 1;
      }
      cv.notify_all();
    }
  }

  void AdamLoop() {
    std::vector<AdamSpans> spans;
    std::vector<AdamSnapshot> snaps;
    for (;;) {
      int k;
      bool ok, spec;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !adam_q.empty() || !fin_q.empty(); });
        if (stop) return;
        if (adam_q.empty()) {
          k = fin_q.front();
          fin_q.pop_front();
          lock.unlock();
          FinishQueued(k, spans, snaps);
          continue;
        }
        k = adam_q.front();
        adam_q.pop_front();
        ok = finite[k];
        spec = speculate;
      }
      Status st;
      Fate f = ok && !spec ? Fate::kHeld : Fate::kDeferred;
      if (ok && spec) {
        // Speculative: the pre-step state saved in the same pass, 1/loss_scale folded in.
        const auto t0 = Clock::now();
        Spans(k, false, spans, snaps);
        st = adam->StepBucketFused(step, spans, snaps, CpuAdam::SnapshotUse::kSave, spec_scale);
        Trace("adam " + buckets[k].name, "speculative", TraceTrack::kCpuAdam, t0);
        f = Fate::kSpeculated;
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        if (st.ok()) {
          fate[k] = f;
        } else if (error.ok()) {
          error = st;
        }
        done += 1;
      }
      cv.notify_all();
    }
  }

  // Validation's work on bucket k (the stats are counted by CountStats).
  Status FinishBucket(int k, const Validation& v, bool same_scale, std::vector<AdamSpans>& spans,
                      std::vector<AdamSnapshot>& snaps) {
    const auto t0 = Clock::now();
    const std::string& name = buckets[k].name;
    switch (fate[k]) {
      case Fate::kSpeculated:
        if (same_scale) return Status::Ok();
        // The clip correction: one pass from the snapshot with the final multiplier.
        Spans(k, false, spans, snaps);
        UCP_RETURN_IF_ERROR(adam->StepBucketFused(step, spans, snaps, CpuAdam::SnapshotUse::kSource,
                                                  v.grad_scale));
        Trace("correct " + name, "validate", TraceTrack::kValidate, t0);
        return Status::Ok();
      case Fate::kDeferred:
      case Fate::kHeld:
        Spans(k, false, spans, snaps);
        UCP_RETURN_IF_ERROR(
            adam->StepBucketFused(step, spans, {}, CpuAdam::SnapshotUse::kNone, v.grad_scale));
        if (fate[k] == Fate::kHeld) {
          Trace("adam " + name, "after validation", TraceTrack::kCpuAdam, t0);
        } else {
          Trace("deferred " + name, "validate", TraceTrack::kValidate, t0);
        }
        return Status::Ok();
      case Fate::kDevice:
        Spans(k, true, spans, snaps);
        UCP_RETURN_IF_ERROR(
            adam->StepBucketFused(step, spans, {}, CpuAdam::SnapshotUse::kNone, v.grad_scale));
        Trace("adam " + name, "device", TraceTrack::kDeviceAdam, t0);
        return Status::Ok();
      case Fate::kCaller:
        return Status::Ok();  // the caller's device Adam steps it after Finish
      case Fate::kPending:
        break;
    }
    UCP_CHECK(false) << "pipeline: bucket " << name << " was never processed";
    return Status::Ok();
  }

  // Whether bucket k's updated weights go device-ward (not a caller-stepped tail bucket's, not
  // in fp32 training).
  bool SendsWeights(int k) const {
    return opt.weights != LowpDType::kFp32 && !(opt.tail_stepped_by_caller && k >= num_cpu);
  }

  void CountStats(const Validation& v, bool same_scale) {
    for (int k = 0; k < static_cast<int>(buckets.size()); ++k) {
      switch (fate[k]) {
        case Fate::kSpeculated:
          stats.speculated += 1;
          if (v.skip) break;
          (same_scale ? stats.committed : stats.corrected) += 1;
          break;
        case Fate::kDeferred: stats.deferred += 1; break;
        case Fate::kHeld: stats.held += 1; break;
        case Fate::kDevice:
        case Fate::kCaller: stats.device += v.skip ? 0 : 1; break;
        case Fate::kPending: break;
      }
    }
  }

  // What Finish and StartFinish do before any bucket's work: wait for the Adam stage (a failure
  // there undoes the step), compare the multipliers bitwise and count the stats. Returns whether
  // the final multiplier is the speculative one (a commit).
  Result<bool> Decide(const Validation& v) {
    const auto t_wait = Clock::now();
    Status drained = Drain();
    Trace("wait for cpu adam", "validate", TraceTrack::kValidate, t_wait);
    if (!drained.ok()) {
      UCP_RETURN_IF_ERROR(Undo());
      in_step = false;
      return drained;
    }
    uint32_t a, b;
    std::memcpy(&a, &v.grad_scale, 4);
    std::memcpy(&b, &spec_scale, 4);
    CountStats(v, a == b);
    return a == b;
  }

  // One bucket of the finish in flight, on the Adam thread.
  void FinishQueued(int k, std::vector<AdamSpans>& spans, std::vector<AdamSnapshot>& snaps) {
    Status st;
    {
      std::lock_guard<std::mutex> lock(mu);
      st = fin_error;  // after a failure the rest only count down (and are not final)
    }
    if (st.ok()) {
      st = FinishBucket(k, fin_v, fin_same_scale, spans, snaps);
      if (!st.ok()) {
        st = st.WithContext("pipeline step " + std::to_string(step));
      } else if (SendsWeights(k)) {
        const auto t0 = Clock::now();
        st = backend->WeightsToDevice(OutCopyBucket(k), out_host, mem.d_weights);
        if (!st.ok()) st = st.WithContext("weights of bucket " + buckets[k].name + " to the device");
        Trace("weights->device " + buckets[k].name, "transfer", TraceTrack::kTransfer, t0);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!st.ok() && fin_error.ok()) fin_error = st;
      finished[k] = st.ok() ? 1 : 2;
      fin_left -= 1;
    }
    cv.notify_all();
  }

  // Waits until the Adam stage has finished every host bucket handed over
  Status Drain() {
    std::unique_lock<std::mutex> lock(mu);
    // (and every copy: a caller-stepped tail bucket's goes into the caller's memory)
    cv.wait(lock, [&] { return done == cpu_handed && copied == copy_handed; });
    return error;
  }

  // The caller's weight staging is its live copy of the weights (PipelineMemory::h_weights),
  // which a speculative step has already overwritten: after the masters are restored, bucket k's
  // weights are rounded from them again. The Adam's copy-out is that same rounding (RNE of the
  // master, adam_element.h), and the trainer keeps its weights equal to it, so this gives back
  // the bits the step found.
  void RestoreOut(int k) {
    for (const BucketPiece& pc : buckets[k].pieces) {
      const float* m = mem.h_master.data() + pc.state_offset;
      uint16_t* o = out_host.data() + pc.grad_offset;
      for (int64_t i = 0; i < pc.n; ++i) {
        o[i] = opt.weights == LowpDType::kBf16 ? Bf16FromFloat(m[i]) : HalfFromFloat(m[i]);
      }
    }
  }

  Status Undo() {
    std::vector<AdamSpans> spans;
    std::vector<AdamSnapshot> snaps;
    for (int k = 0; k < num_cpu; ++k) {
      if (fate[k] != Fate::kSpeculated) continue;
      const auto t0 = Clock::now();
      Spans(k, false, spans, snaps);
      UCP_RETURN_IF_ERROR(adam->RollbackBucket(spans, snaps), "undoing bucket " + buckets[k].name);
      if (out_by_grad) RestoreOut(k);
      Trace("undo " + buckets[k].name, "validate", TraceTrack::kValidate, t0);
      stats.rolled_back += 1;
    }
    return Status::Ok();
  }
};

Pipeline::Pipeline(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Pipeline::~Pipeline() {
  if (impl_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->copy_thread.joinable()) impl_->copy_thread.join();
  if (impl_->adam_thread.joinable()) impl_->adam_thread.join();
}

Result<std::unique_ptr<Pipeline>> Pipeline::Create(const PipelineOptions& options,
                                                   std::vector<Bucket> buckets,
                                                   const PipelineMemory& memory,
                                                   std::unique_ptr<PipelineBackend> backend) {
  if (backend == nullptr) return InvalidArgumentError("pipeline: no backend");
  if (options.adam_threads < 1) {
    return InvalidArgumentError("pipeline: adam_threads is " +
                                std::to_string(options.adam_threads) + ", must be >= 1");
  }
  const int nb = static_cast<int>(buckets.size());
  if (options.gpu_tail_buckets < 0 || options.gpu_tail_buckets > nb) {
    return InvalidArgumentError("pipeline: gpu_tail_buckets is " +
                                std::to_string(options.gpu_tail_buckets) + ", must be in [0, " +
                                std::to_string(nb) + "] (the number of buckets)");
  }
  const int64_t states = static_cast<int64_t>(memory.h_master.size());
  const int64_t grads = static_cast<int64_t>(memory.d_grad.size());
  if (static_cast<int64_t>(memory.h_exp_avg.size()) != states ||
      static_cast<int64_t>(memory.h_exp_avg_sq.size()) != states) {
    return InvalidArgumentError("pipeline: master, exp_avg and exp_avg_sq differ in size");
  }
  const bool lowp = options.weights != LowpDType::kFp32;
  if (lowp != (static_cast<int64_t>(memory.d_weights.size()) == grads)) {
    return InvalidArgumentError("pipeline: device weights hold " +
                                std::to_string(memory.d_weights.size()) + " values for " +
                                std::to_string(grads) + " gradients (training dtype " +
                                std::string(LowpDTypeName(options.weights)) + ")");
  }
  if (!memory.h_reduced_grad.empty()) {
    if (static_cast<int64_t>(memory.h_reduced_grad.size()) != states) {
      return InvalidArgumentError("pipeline: the reduced host gradient holds " +
                                  std::to_string(memory.h_reduced_grad.size()) +
                                  " values for " + std::to_string(states) + " state elements");
    }
    if (options.gpu_tail_buckets != 0 || options.bf16_link) {
      return InvalidArgumentError("pipeline: with a reduced host gradient (data parallelism) "
                                  "gpu_tail_buckets must be 0 and bf16_link off");
    }
  }
  if (!memory.h_grad.empty() &&
      (static_cast<int64_t>(memory.h_grad.size()) != grads || options.bf16_link ||
       !memory.h_reduced_grad.empty())) {
    return InvalidArgumentError("pipeline: the caller's host gradient staging holds " +
                                std::to_string(memory.h_grad.size()) + " values for " +
                                std::to_string(grads) + " gradients, or the gradient comes "
                                "another way (bf16 link, reduced host gradient)");
  }
  if (!memory.h_weights.empty() &&
      (static_cast<int64_t>(memory.h_weights.size()) != grads || !lowp)) {
    return InvalidArgumentError("pipeline: the caller's host weight staging holds " +
                                std::to_string(memory.h_weights.size()) + " values for " +
                                std::to_string(grads) + " gradients (training dtype " +
                                std::string(LowpDTypeName(options.weights)) + ")");
  }
  for (const Bucket& b : buckets) {
    for (const BucketPiece& pc : b.pieces) {
      if (pc.n < 0 || pc.grad_offset < 0 || pc.state_offset < 0 ||
          pc.grad_offset + pc.n > grads || pc.state_offset + pc.n > states) {
        return InvalidArgumentError("pipeline: bucket " + b.name + " has a piece of " +
                                    std::to_string(pc.n) + " elements at gradient offset " +
                                    std::to_string(pc.grad_offset) + " / state offset " +
                                    std::to_string(pc.state_offset) + " outside " +
                                    std::to_string(grads) + " / " + std::to_string(states));
      }
    }
  }
  auto impl = std::make_unique<Impl>();
  Impl& p = *impl;
  p.opt = options;
  p.buckets = std::move(buckets);
  for (int k = 0; k < nb; ++k) p.buckets[static_cast<size_t>(k)].index = k;
  p.mem = memory;
  p.backend = std::move(backend);
  if (options.tail_stepped_by_caller && options.gpu_tail_buckets != 0 && memory.h_grad.empty()) {
    return InvalidArgumentError("pipeline: caller-stepped tail buckets need the caller's host "
                                "gradient staging (its norm reads their gradients)");
  }
  if (p.backend && !p.backend->host_addressable()) {
    if (options.gpu_tail_buckets != 0 && !options.tail_stepped_by_caller) {
      return UnimplementedError("pipeline: tail buckets on a real device need a GPU Adam "
                                "(not built); gpu_tail_buckets must be 0");
    }
    if (!lowp) {
      return UnimplementedError("pipeline: fp32 training on a real device (the device weights "
                                "would be the host masters); train in bf16 or fp16");
    }
  }
  p.num_cpu = nb - options.gpu_tail_buckets;
  UCP_ASSIGN_OR_RETURN(CpuAdam adam,
                       CpuAdam::Create(options.adam, options.adam_threads, BestSimdPath(),
                                       options.adam_cpus),
                       "pipeline adam");
  p.adam.emplace(std::move(adam));
  try {
    const auto ns = static_cast<size_t>(states);
    if (options.speculate) {
      p.snap_p.assign(ns, 0.0f);
      p.snap_m.assign(ns, 0.0f);
      p.snap_v.assign(ns, 0.0f);
    }
    if (options.bf16_link) {
      p.h_grad16.assign(ns, 0);
    } else if (memory.h_reduced_grad.empty() && memory.h_grad.empty()) {
      p.h_grad.assign(ns, 0.0f);
    }
    if (lowp && memory.h_weights.empty()) p.h_out.assign(ns, 0);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("pipeline: host buffers for " + std::to_string(states) +
                                  " state elements do not fit in memory");
  }
  p.grad_host = memory.h_grad.empty() ? std::span<float>(p.h_grad) : memory.h_grad;
  p.out_host = memory.h_weights.empty() ? std::span<uint16_t>(p.h_out) : memory.h_weights;
  p.grad_by_grad = !memory.h_grad.empty();
  p.out_by_grad = !memory.h_weights.empty();
  if (p.grad_by_grad || p.out_by_grad) {
    p.by_grad = p.buckets;
    for (Bucket& b : p.by_grad) {
      for (BucketPiece& pc : b.pieces) pc.state_offset = pc.grad_offset;
    }
  }
  p.fate.assign(static_cast<size_t>(nb), Fate::kPending);
  p.handed.assign(p.fate.size(), 0);
  p.finite.assign(p.fate.size(), 0);
  p.finished.assign(p.fate.size(), 0);
  auto out = std::unique_ptr<Pipeline>(new Pipeline(std::move(impl)));
  Impl* ip = out->impl_.get();
  ip->copy_thread = std::thread([ip] { ip->CopyLoop(); });
  ip->adam_thread = std::thread([ip] { ip->AdamLoop(); });
  return out;
}

const std::vector<Bucket>& Pipeline::buckets() const { return impl_->buckets; }
int Pipeline::adam_threads() const { return impl_->adam->num_threads(); }
const std::vector<int>& Pipeline::adam_cpus() const { return impl_->adam->cpus(); }
PipelineStats Pipeline::last_stats() const { return impl_->stats; }

int64_t Pipeline::host_staging_bytes() const {
  const Impl& p = *impl_;
  return static_cast<int64_t>((p.snap_p.size() + p.snap_m.size() + p.snap_v.size() +
                               p.h_grad.size()) * sizeof(float) +
                              (p.h_grad16.size() + p.h_out.size()) * sizeof(uint16_t));
}

Status Pipeline::Begin(int64_t step, float lr, float speculative_grad_scale, bool speculate) {
  Impl& p = *impl_;
  UCP_RETURN_IF_ERROR(WaitFinished(), "the previous step's finish");
  if (p.in_step) return FailedPreconditionError("pipeline: step " + std::to_string(p.step) +
                                                " is still in flight (Finish or Cancel it)");
  UCP_RETURN_IF_ERROR(p.adam->set_lr(lr), "pipeline step " + std::to_string(step));
  std::lock_guard<std::mutex> lock(p.mu);
  p.in_step = true;
  p.step = step;
  p.spec_scale = speculative_grad_scale;
  p.speculate = speculate && p.opt.speculate;
  std::fill(p.fate.begin(), p.fate.end(), Fate::kPending);
  std::fill(p.handed.begin(), p.handed.end(), 0);
  p.num_handed = p.cpu_handed = p.copy_handed = p.done = p.copied = 0;
  p.error = Status::Ok();
  p.stats = {};
  if (p.opt.trace != nullptr) p.opt.trace->set_step(step);
  return Status::Ok();
}

void Pipeline::BucketReady(int k) {
  Impl& p = *impl_;
  UCP_CHECK(p.mem.h_reduced_grad.empty()) << "pipeline: BucketReady with a reduced gradient";
  UCP_CHECK(p.in_step && k >= 0 && k < static_cast<int>(p.buckets.size()) && !p.handed[k])
      << "pipeline: bucket " << k << " handed over outside a step or twice";
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.handed[k] = 1;
    p.num_handed += 1;
    if (k < p.num_cpu) {
      p.cpu_handed += 1;
      p.copy_handed += 1;
      p.copy_q.push_back(k);
    } else if (p.opt.tail_stepped_by_caller) {
      p.fate[k] = Fate::kCaller;
      p.copy_handed += 1;
      p.copy_q.push_back(k);
    } else {
      p.fate[k] = Fate::kDevice;
    }
  }
  p.cv.notify_all();
}

void Pipeline::HostBucketReady(int k, bool finite) {
  Impl& p = *impl_;
  UCP_CHECK(!p.mem.h_reduced_grad.empty()) << "pipeline: HostBucketReady without a reduced gradient";
  {
    std::lock_guard<std::mutex> lock(p.mu);
    UCP_CHECK(p.in_step && k >= 0 && k < static_cast<int>(p.buckets.size()) && !p.handed[k])
        << "pipeline: bucket " << k << " handed over outside a step or twice";
    p.handed[k] = 1;
    p.num_handed += 1;
    p.cpu_handed += 1;
    p.finite[k] = finite;
    p.adam_q.push_back(k);
  }
  p.cv.notify_all();
}

BackwardHook Pipeline::Hook() {
  return Hook([this](int k) { BucketReady(k); });
}

BackwardHook Pipeline::Hook(std::function<void(int)> ready) {
  Impl* p = impl_.get();
  p->hook_made = p->mark = Clock::now();
  BackwardHook h;
  h.on_backward_begin = [p] {
    p->Trace("forward", "compute", TraceTrack::kBackward, p->hook_made);
    p->mark = Clock::now();
  };
  h.on_group_done = [p, ready = std::move(ready)](int k) {
    p->Trace("backward " + p->buckets[k].name, "compute", TraceTrack::kBackward, p->mark);
    p->mark = Clock::now();
    ready(k);
  };
  return h;
}

Status Pipeline::WaitGradients() {
  Impl& p = *impl_;
  if (!p.in_step) return FailedPreconditionError("pipeline: WaitGradients without Begin");
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(p.mu);
  p.cv.wait(lock, [&] { return p.copied == p.copy_handed; });
  lock.unlock();
  p.Trace("wait for gradients", "validate", TraceTrack::kValidate, t0);
  std::lock_guard<std::mutex> relock(p.mu);
  return p.error;
}

Status Pipeline::Finish(const Validation& v) {
  Impl& p = *impl_;
  if (!p.in_step) return FailedPreconditionError("pipeline: Finish without Begin");
  if (p.num_handed != static_cast<int>(p.buckets.size())) {
    UCP_RETURN_IF_ERROR(Cancel());
    return FailedPreconditionError("pipeline: " + std::to_string(p.num_handed) + " of " +
                                   std::to_string(p.buckets.size()) +
                                   " buckets were handed over before Finish");
  }
  UCP_ASSIGN_OR_RETURN(const bool same_scale, p.Decide(v));
  if (v.skip) {
    Status st = p.Undo();
    p.in_step = false;
    return st;
  }
  std::vector<AdamSpans> spans;
  std::vector<AdamSnapshot> snaps;
  Status st;
  for (int k = 0; k < static_cast<int>(p.buckets.size()) && st.ok(); ++k) {
    st = p.FinishBucket(k, v, same_scale, spans, snaps);
  }
  p.in_step = false;
  UCP_RETURN_IF_ERROR(st, "pipeline step " + std::to_string(p.step));
  if (p.opt.weights != LowpDType::kFp32) {
    const auto t0 = Clock::now();
    for (int k = 0; k < static_cast<int>(p.buckets.size()); ++k) {
      if (!p.SendsWeights(k)) continue;
      UCP_RETURN_IF_ERROR(p.backend->WeightsToDevice(p.OutCopyBucket(k), p.out_host,
                                                     p.mem.d_weights),
                          "weights of bucket " + p.buckets[k].name + " to the device");
    }
    p.Trace("weights->device", "transfer", TraceTrack::kTransfer, t0);
  }
  return Status::Ok();
}

Status Pipeline::StartFinish(const Validation& v) {
  Impl& p = *impl_;
  if (!p.in_step) return FailedPreconditionError("pipeline: StartFinish without Begin");
  if (v.skip) return Finish(v);  // the undo is quick and leaves nothing for forward to wait on
  if (p.num_handed != static_cast<int>(p.buckets.size())) return Finish(v);  // its error
  UCP_ASSIGN_OR_RETURN(const bool same_scale, p.Decide(v));
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.in_step = false;
    p.finishing = true;
    p.fin_v = v;
    p.fin_same_scale = same_scale;
    p.fin_error = Status::Ok();
    std::fill(p.finished.begin(), p.finished.end(), 0);
    p.fin_left = static_cast<int>(p.buckets.size());
    // Forward reads the buckets in the reverse of backward's order.
    for (int k = p.fin_left - 1; k >= 0; --k) p.fin_q.push_back(k);
  }
  p.cv.notify_all();
  return Status::Ok();
}

Status Pipeline::WaitFinished(int k) {
  Impl& p = *impl_;
  if (k < 0 || k >= static_cast<int>(p.buckets.size())) {
    return InvalidArgumentError("pipeline: WaitFinished(" + std::to_string(k) + "): no such bucket");
  }
  std::unique_lock<std::mutex> lock(p.mu);
  if (!p.finishing) return Status::Ok();
  p.cv.wait(lock, [&] { return p.finished[k] != 0; });
  return p.finished[k] == 1 ? Status::Ok() : p.fin_error;
}

bool Pipeline::IsFinished(int k) const {
  Impl& p = *impl_;
  if (k < 0 || k >= static_cast<int>(p.buckets.size())) return false;
  std::lock_guard<std::mutex> lock(p.mu);
  return !p.finishing || p.finished[k] == 1;
}

Status Pipeline::WaitFinished() {
  Impl& p = *impl_;
  std::unique_lock<std::mutex> lock(p.mu);
  if (!p.finishing) return Status::Ok();
  p.cv.wait(lock, [&] { return p.fin_left == 0; });
  p.finishing = false;
  return p.fin_error;
}

Status Pipeline::Cancel() {
  Impl& p = *impl_;
  if (!p.in_step) return Status::Ok();
  Status drained = p.Drain();
  Status undone = p.Undo();
  p.in_step = false;
  UCP_RETURN_IF_ERROR(drained);
  return undone;
}

}  // namespace ucp::offload
