// CpuAdam: AdamStep's kernels run over cache-sized blocks with tbb::parallel_for inside the
// optimizer's own tbb::task_arena (a static partition: each thread streams contiguous blocks,
// which the hardware prefetchers like, and the element-wise math makes any split bitwise equal).
// With CPUs given, an arena observer pins the thread in slot i to cpus[i % size] while it works
// in the arena and gives it back its own mask when it leaves (TBB's workers serve other arenas
// too: the model's).
#include "offload/optim/cpu_adam.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "offload/optim/adam_kernel.h"
#include "offload/optim/cpu_affinity.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload {
namespace {

// Pins each thread that enters the arena to its slot's CPU and restores the thread's mask when
// it leaves. A failure (the process's CPU set shrank under it) is kept for the pass to report.
class Pinner final : public tbb::task_scheduler_observer {
 public:
  Pinner(tbb::task_arena& arena, std::vector<int> cpus)
      : tbb::task_scheduler_observer(arena), cpus_(std::move(cpus)) {
    observe(true);
  }
  ~Pinner() override { observe(false); }

  void on_scheduler_entry(bool) override {
    Result<std::vector<int>> own = ThisThreadCpus();
    Saved().push_back(own.ok() ? *std::move(own) : std::vector<int>());
    const int slot = tbb::this_task_arena::current_thread_index();
    const int cpu = cpus_[static_cast<size_t>(slot) % cpus_.size()];
    if (!own.ok()) {
      Fail(own.status());
    } else if (Status s = SetThisThreadCpus(std::span<const int>(&cpu, 1)); !s.ok()) {
      Fail(std::move(s));
    }
  }
  void on_scheduler_exit(bool) override {
    std::vector<std::vector<int>>& saved = Saved();
    if (saved.empty()) return;
    if (!saved.back().empty()) {
      if (Status s = SetThisThreadCpus(saved.back()); !s.ok()) Fail(std::move(s));
    }
    saved.pop_back();
  }

  // The first failure since the last call, if any.
  Status TakeFailure() {
    if (!failed_.load(std::memory_order_acquire)) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    failed_.store(false, std::memory_order_relaxed);
    return std::exchange(failure_, Status::Ok());
  }

 private:
  // Per thread, the masks to give back, innermost last (a thread may enter another pinned
  // arena from inside this one).
  static std::vector<std::vector<int>>& Saved() {
    static thread_local std::vector<std::vector<int>> saved;
    return saved;
  }
  void Fail(Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = std::move(s);
    failed_.store(true, std::memory_order_release);
  }

  const std::vector<int> cpus_;
  std::mutex mu_;
  Status failure_;
  std::atomic<bool> failed_{false};
};

}  // namespace

struct CpuAdam::Impl {
  AdamConfig config;
  int num_threads;
  SimdPath path;
  tbb::task_arena arena;
  std::vector<int> cpus;
  std::unique_ptr<Pinner> pinner;  // set where cpus is; destroyed before the arena

  // Runs body(i) for i in [0, count) on the arena, statically partitioned. Errors: a thread
  // could not be pinned (the work has run, unpinned).
  template <class Body>
  Status ParallelFor(size_t count, const Body& body) {
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, count),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t i = r.begin(); i < r.end(); ++i) body(i);
          },
          tbb::static_partitioner());
    });
    if (pinner == nullptr) return Status::Ok();
    UCP_RETURN_IF_ERROR(pinner->TakeFailure(), "cpu adam: pinning to CPUs " + CpuListString(cpus));
    return Status::Ok();
  }

  Status Step(int64_t step, std::span<const AdamSpans> bucket,
              std::span<const AdamSnapshot> snapshots, bool speculative) {
    UCP_ASSIGN_OR_RETURN(const AdamStepScalars s, MakeAdamStepScalars(config, step));
    if (speculative && snapshots.size() != bucket.size()) {
      return InvalidArgumentError("adam bucket: " + std::to_string(bucket.size()) +
                                  " entries but " + std::to_string(snapshots.size()) +
                                  " snapshots");
    }
    std::vector<internal::AdamKernelArgs> blocks;
    for (size_t i = 0; i < bucket.size(); ++i) {
      UCP_ASSIGN_OR_RETURN(
          const internal::AdamKernelArgs a,
          internal::PrepareAdamArgs(config, bucket[i], speculative ? &snapshots[i] : nullptr),
          "in bucket entry " + std::to_string(i));
      for (size_t off = 0; off < a.n; off += kBlockElems) {
        blocks.push_back(internal::SubArgs(a, off, std::min(kBlockElems, a.n - off)));
      }
    }
    return ParallelFor(blocks.size(), [&](size_t b) {
      internal::RunAdamKernel(path, config, step, s, blocks[b]);
    });
  }
};

CpuAdam::CpuAdam(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuAdam::CpuAdam(CpuAdam&&) noexcept = default;
CpuAdam& CpuAdam::operator=(CpuAdam&&) noexcept = default;
CpuAdam::~CpuAdam() = default;

Result<CpuAdam> CpuAdam::Create(const AdamConfig& config, int num_threads, SimdPath path,
                                std::vector<int> cpus) {
  UCP_RETURN_IF_ERROR(ValidateAdamConfig(config));
  if (num_threads < 1) {
    return InvalidArgumentError("cpu adam: num_threads is " + std::to_string(num_threads) +
                                ", must be >= 1");
  }
  UCP_RETURN_IF_ERROR(internal::CheckSimdPath(path));
  if (!cpus.empty()) {
    UCP_ASSIGN_OR_RETURN(const std::vector<int> allowed, ThisThreadCpus(), "cpu adam: pinning");
    for (const int c : cpus) {
      if (!std::binary_search(allowed.begin(), allowed.end(), c)) {
        return InvalidArgumentError("cpu adam: CPU " + std::to_string(c) +
                                    " is not one this thread may run on (" +
                                    CpuListString(allowed) + ")");
      }
    }
  }
  auto impl = std::make_unique<Impl>(
      Impl{config, num_threads, path, tbb::task_arena(num_threads), std::move(cpus), nullptr});
  if (!impl->cpus.empty()) impl->pinner = std::make_unique<Pinner>(impl->arena, impl->cpus);
  return CpuAdam(std::move(impl));
}

const std::vector<int>& CpuAdam::cpus() const { return impl_->cpus; }

Result<std::vector<std::vector<int>>> CpuAdam::TaskCpus(int tasks) {
  if (tasks < 1) {
    return InvalidArgumentError("cpu adam: TaskCpus of " + std::to_string(tasks) + " tasks");
  }
  std::vector<Result<std::vector<int>>> seen(static_cast<size_t>(tasks), std::vector<int>());
  UCP_RETURN_IF_ERROR(
      impl_->ParallelFor(seen.size(), [&](size_t i) { seen[i] = ThisThreadCpus(); }));
  std::vector<std::vector<int>> out;
  for (Result<std::vector<int>>& r : seen) {
    UCP_RETURN_IF_ERROR(r.status());
    out.push_back(*std::move(r));
  }
  return out;
}

const AdamConfig& CpuAdam::config() const { return impl_->config; }

Status CpuAdam::set_lr(float lr) {
  AdamConfig c = impl_->config;
  c.lr = lr;
  UCP_RETURN_IF_ERROR(ValidateAdamConfig(c));
  impl_->config = c;
  return Status::Ok();
}
int CpuAdam::num_threads() const { return impl_->num_threads; }
SimdPath CpuAdam::path() const { return impl_->path; }

Status CpuAdam::StepBucket(int64_t step, std::span<const AdamSpans> bucket) {
  return impl_->Step(step, bucket, {}, false);
}

Status CpuAdam::StepBucketSpeculative(int64_t step, std::span<const AdamSpans> bucket,
                                      std::span<const AdamSnapshot> snapshots) {
  return impl_->Step(step, bucket, snapshots, true);
}

Status CpuAdam::StepBucketFused(int64_t step, std::span<const AdamSpans> bucket,
                                std::span<const AdamSnapshot> snapshots, SnapshotUse use,
                                float grad_scale) {
  UCP_ASSIGN_OR_RETURN(const AdamStepScalars s, MakeAdamStepScalars(impl_->config, step));
  const size_t want = use == SnapshotUse::kNone ? 0 : bucket.size();
  if (snapshots.size() != want) {
    return InvalidArgumentError("adam fused bucket: " + std::to_string(bucket.size()) +
                                " entries but " + std::to_string(snapshots.size()) +
                                " snapshots (want " + std::to_string(want) + ")");
  }
  std::vector<internal::AdamFusedArgs> blocks;
  for (size_t i = 0; i < bucket.size(); ++i) {
    AdamFusedOptions o;
    o.grad_scale = grad_scale;
    if (use == SnapshotUse::kSave) o.save = &snapshots[i];
    if (use == SnapshotUse::kSource) o.source = &snapshots[i];
    UCP_ASSIGN_OR_RETURN(const internal::AdamFusedArgs f,
                         internal::PrepareFusedArgs(impl_->config, bucket[i], o),
                         "in bucket entry " + std::to_string(i));
    for (size_t off = 0; off < f.args.n; off += kBlockElems) {
      blocks.push_back(internal::SubFusedArgs(f, off, std::min(kBlockElems, f.args.n - off)));
    }
  }
  return impl_->ParallelFor(blocks.size(),
                            [&](size_t b) { internal::RunFusedKernel(impl_->path, s, blocks[b]); });
}

Status CpuAdam::RollbackBucket(std::span<const AdamSpans> bucket,
                               std::span<const AdamSnapshot> snapshots) {
  if (snapshots.size() != bucket.size()) {
    return InvalidArgumentError("adam rollback: " + std::to_string(bucket.size()) +
                                " entries but " + std::to_string(snapshots.size()) + " snapshots");
  }
  struct Block {
    size_t entry, offset, count;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < bucket.size(); ++i) {
    UCP_RETURN_IF_ERROR(internal::CheckRollbackSizes(bucket[i], snapshots[i]),
                        "in bucket entry " + std::to_string(i));
    const AdamSpans& e = bucket[i];
    for (size_t off = 0; off < e.param.size(); off += kBlockElems) {
      blocks.push_back({i, off, std::min(kBlockElems, e.param.size() - off)});
    }
  }
  return impl_->ParallelFor(blocks.size(), [&](size_t b) {
    const Block& k = blocks[b];
    AdamRollback(bucket[k.entry].Sub(k.offset, k.count), snapshots[k.entry].Sub(k.offset, k.count))
        .IgnoreError();  // sizes were checked above
  });
}

Status CpuAdam::BandwidthProbe(std::span<float> p, std::span<const float> g, std::span<float> m,
                               std::span<float> v) {
  if (g.size() != p.size() || m.size() != p.size() || v.size() != p.size()) {
    return InvalidArgumentError("bandwidth probe: sizes differ (p " + std::to_string(p.size()) +
                                ", g " + std::to_string(g.size()) + ", m " +
                                std::to_string(m.size()) + ", v " + std::to_string(v.size()) + ")");
  }
  // A run-time zero the compiler cannot fold away: every byte is read and written back.
  volatile float zero = 0.0f;
  const float s = zero;
  const size_t n = p.size();
  return impl_->ParallelFor((n + kBlockElems - 1) / kBlockElems, [&](size_t b) {
    const size_t off = b * kBlockElems;
    const size_t count = std::min(kBlockElems, n - off);
    internal::RunProbeKernel(impl_->path, p.data() + off, g.data() + off, m.data() + off,
                             v.data() + off, count, s);
  });
}

}  // namespace ucp::offload
