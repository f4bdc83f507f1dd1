// CpuAdam: AdamStep's kernels run over cache-sized blocks with tbb::parallel_for inside the
// optimizer's own tbb::task_arena (a static partition: each thread streams contiguous blocks,
// which the hardware prefetchers like, and the element-wise math makes any split bitwise equal).
#include "offload/optim/cpu_adam.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "offload/optim/adam_kernel.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload {

struct CpuAdam::Impl {
  AdamConfig config;
  int num_threads;
  SimdPath path;
  tbb::task_arena arena;

  // Runs body(i) for i in [0, count) on the arena, statically partitioned.
  template <class Body>
  void ParallelFor(size_t count, const Body& body) {
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, count),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t i = r.begin(); i < r.end(); ++i) body(i);
          },
          tbb::static_partitioner());
    });
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
    ParallelFor(blocks.size(),
                [&](size_t b) { internal::RunAdamKernel(path, config, step, s, blocks[b]); });
    return Status::Ok();
  }
};

CpuAdam::CpuAdam(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuAdam::CpuAdam(CpuAdam&&) noexcept = default;
CpuAdam& CpuAdam::operator=(CpuAdam&&) noexcept = default;
CpuAdam::~CpuAdam() = default;

Result<CpuAdam> CpuAdam::Create(const AdamConfig& config, int num_threads, SimdPath path) {
  UCP_RETURN_IF_ERROR(ValidateAdamConfig(config));
  if (num_threads < 1) {
    return InvalidArgumentError("cpu adam: num_threads is " + std::to_string(num_threads) +
                                ", must be >= 1");
  }
  UCP_RETURN_IF_ERROR(internal::CheckSimdPath(path));
  auto impl = std::make_unique<Impl>(Impl{config, num_threads, path, tbb::task_arena(num_threads)});
  return CpuAdam(std::move(impl));
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
  impl_->ParallelFor(blocks.size(),
                     [&](size_t b) { internal::RunFusedKernel(impl_->path, s, blocks[b]); });
  return Status::Ok();
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
  impl_->ParallelFor(blocks.size(), [&](size_t b) {
    const Block& k = blocks[b];
    AdamRollback(bucket[k.entry].Sub(k.offset, k.count), snapshots[k.entry].Sub(k.offset, k.count))
        .IgnoreError();  // sizes were checked above
  });
  return Status::Ok();
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
  impl_->ParallelFor((n + kBlockElems - 1) / kBlockElems, [&](size_t b) {
    const size_t off = b * kBlockElems;
    const size_t count = std::min(kBlockElems, n - off);
    internal::RunProbeKernel(impl_->path, p.data() + off, g.data() + off, m.data() + off,
                             v.data() + off, count, s);
  });
  return Status::Ok();
}

}  // namespace ucp::offload
