// Tests of CpuAdam: the threaded bucket step equals the single-threaded AdamStep bitwise for any
// thread count and bucket grouping; sharding a parameter's state into ZeRO-like fragments and
// stepping each equals stepping the whole (the element-wise property); bucket rollback is bitwise;
// the bandwidth probe moves bytes without changing them.
#include "offload/optim/cpu_adam.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "offload/optim/cpu_affinity.h"
#include "tests/testutil/status_matchers.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

struct State {
  std::vector<float> p, g, m, v;
  std::vector<uint16_t> out;
  explicit State(size_t n, uint64_t seed) : p(n), g(n), m(n), v(n), out(n) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (size_t i = 0; i < n; ++i) {
      p[i] = normal(rng);
      g[i] = 1e-2f * normal(rng);
      m[i] = 1e-3f * normal(rng);
      v[i] = 1e-5f * std::abs(normal(rng));
    }
  }
  AdamSpans Spans(size_t offset, size_t count) {
    AdamSpans s;
    s.param = std::span<float>(p).subspan(offset, count);
    s.grad = GradSpan::Fp32(std::span<const float>(g).subspan(offset, count));
    s.exp_avg = std::span<float>(m).subspan(offset, count);
    s.exp_avg_sq = std::span<float>(v).subspan(offset, count);
    s.out = LowpOutSpan::Bf16(std::span<uint16_t>(out).subspan(offset, count));
    return s;
  }
  bool operator==(const State& o) const {
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
    };
    return same(p, o.p) && same(m, o.m) && same(v, o.v) && out == o.out;
  }
};

AdamConfig Config() {
  AdamConfig c;
  c.lr = 3e-4f;
  c.weight_decay = 0.1f;
  return c;
}

TEST(CpuAdam, BucketStepEqualsSingleThreadForAnyThreadCount) {
  // Three parameters in one bucket, one larger than a block and not a multiple of it.
  const std::vector<size_t> sizes = {CpuAdam::kBlockElems * 2 + 17, 1, 1025};
  size_t total = 0;
  for (size_t s : sizes) total += s;
  State expected(total, 11);
  const State initial = expected;
  UCP_ASSERT_OK(AdamStep(Config(), 5, expected.Spans(0, total)));
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    UCP_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(Config(), threads));
    EXPECT_EQ(adam.num_threads(), threads);
    EXPECT_EQ(adam.path(), BestSimdPath());
    State got = initial;
    std::vector<AdamSpans> bucket;
    size_t off = 0;
    for (size_t s : sizes) {
      bucket.push_back(got.Spans(off, s));
      off += s;
    }
    UCP_ASSERT_OK(adam.StepBucket(5, bucket));
    EXPECT_TRUE(got == expected);
  }
}

TEST(CpuAdam, ShardedFragmentsEqualUnsharded) {
  // ZeRO-like: k contiguous, uneven fragments of one flat state, each stepped on its own (as
  // k data-parallel ranks would), concatenate to the full step, bitwise.
  const size_t n = 10007;
  State full(n, 3);
  const State initial = full;
  UCP_ASSERT_OK(AdamStep(Config(), 12, full.Spans(0, n)));
  UCP_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(Config(), 2));
  for (size_t k : {1, 2, 3, 7}) {
    SCOPED_TRACE(k);
    State sharded = initial;
    const size_t base = n / k;
    size_t off = 0;
    for (size_t r = 0; r < k; ++r) {
      const size_t count = r + 1 == k ? n - off : base + (r % 2 ? 5 : 0);
      const AdamSpans fragment = sharded.Spans(off, count);
      UCP_ASSERT_OK(adam.StepBucket(12, std::span<const AdamSpans>(&fragment, 1)));
      off += count;
    }
    EXPECT_TRUE(sharded == full);
  }
}

TEST(CpuAdam, SpeculativeBucketRollsBackBitwise) {
  const size_t n = CpuAdam::kBlockElems * 3 + 5;
  State s(n, 8);
  const State initial = s;
  std::vector<float> sp(n), sm(n), sv(n);
  UCP_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(Config(), 2));
  const std::vector<AdamSpans> bucket = {s.Spans(0, 100), s.Spans(100, n - 100)};
  const std::vector<AdamSnapshot> snaps = {AdamSnapshot{sp, sm, sv, {}}.Sub(0, 100),
                                           AdamSnapshot{sp, sm, sv, {}}.Sub(100, n - 100)};
  UCP_ASSERT_OK(adam.StepBucketSpeculative(2, bucket, snaps));
  State plain = initial;
  UCP_ASSERT_OK(AdamStep(Config(), 2, plain.Spans(0, n)));
  EXPECT_TRUE(s == plain);
  UCP_ASSERT_OK(adam.RollbackBucket(bucket, snaps));
  s.out = initial.out;  // the low-precision copy is not rolled back (documented)
  EXPECT_TRUE(s == initial);
}

TEST(CpuAdam, BadEntryStepsNothingAndNamesIt) {
  State s(300, 1);
  const State initial = s;
  UCP_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(Config(), 2));
  std::vector<AdamSpans> bucket = {s.Spans(0, 100), s.Spans(100, 200)};
  bucket[1].exp_avg = bucket[1].exp_avg.first(150);
  EXPECT_THAT(adam.StepBucket(1, bucket),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("exp_avg has 150 elements, param has 200; in bucket entry 1")));
  EXPECT_TRUE(s == initial);
  EXPECT_THAT(adam.StepBucketSpeculative(1, bucket, {}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("2 entries but 0 snapshots")));
  std::vector<float> a(100), b(100), c(99);
  const std::vector<AdamSnapshot> snaps = {{a, b, c, {}}};
  const std::vector<AdamSpans> one = {s.Spans(0, 100)};
  EXPECT_THAT(
      adam.RollbackBucket(one, snaps),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr("exp_avg_sq has 100 elements, its snapshot 99; in bucket entry 0")));
  EXPECT_TRUE(s == initial);
}

TEST(CpuAdam, CreateRejectsBadArguments) {
  EXPECT_THAT(CpuAdam::Create(Config(), 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("num_threads is 0")));
  AdamConfig bad = Config();
  bad.lr = -1.0f;
  EXPECT_THAT(CpuAdam::Create(bad, 1), StatusIs(StatusCode::kInvalidArgument, HasSubstr("lr is")));
  for (SimdPath p : {SimdPath::kAvx512, SimdPath::kNeon, SimdPath::kSve}) {
    if (SimdPathAvailable(p)) continue;
    EXPECT_THAT(CpuAdam::Create(Config(), 1, p),
                StatusIs(StatusCode::kFailedPrecondition, HasSubstr("is not available")));
  }
}

#if defined(__linux__)
// A pinned pool (--pin-threads): every task runs on one CPU of the pool's list, the step's bits
// are the unpinned pool's, and the threads leave with their own masks: the caller's thread, and
// TBB's workers, which then serve an unpinned pool on every CPU again.
TEST(CpuAdam, PinnedPoolRunsOnItsCpusAndGivesThreadsBackTheirMasks) {
  UCP_ASSERT_OK_AND_ASSIGN(const std::vector<int> own, ThisThreadCpus());
  ASSERT_FALSE(own.empty());
  std::vector<int> cpus = {own.back()};
  if (own.size() > 1) cpus.push_back(own.front());
  UCP_ASSERT_OK_AND_ASSIGN(CpuAdam pinned, CpuAdam::Create(Config(), 3, BestSimdPath(), cpus));
  EXPECT_EQ(pinned.cpus(), cpus);
  UCP_ASSERT_OK_AND_ASSIGN(const auto seen, pinned.TaskCpus(64));
  ASSERT_EQ(seen.size(), 64u);
  for (const std::vector<int>& task : seen) {
    ASSERT_EQ(task.size(), 1u) << "a task ran unpinned, on " << CpuListString(task);
    EXPECT_THAT(cpus, ::testing::Contains(task[0]));
  }
  UCP_ASSERT_OK_AND_ASSIGN(const std::vector<int> after, ThisThreadCpus());
  EXPECT_EQ(after, own);

  const size_t n = 5 * CpuAdam::kBlockElems + 17;
  State a(n, 11), b(n, 11);
  UCP_ASSERT_OK_AND_ASSIGN(CpuAdam free, CpuAdam::Create(Config(), 3));
  EXPECT_TRUE(free.cpus().empty());
  const std::vector<AdamSpans> ba = {a.Spans(0, n)}, bb = {b.Spans(0, n)};
  UCP_ASSERT_OK(pinned.StepBucket(1, ba));
  UCP_ASSERT_OK(free.StepBucket(1, bb));
  EXPECT_TRUE(a == b);

  UCP_ASSERT_OK_AND_ASSIGN(const auto unpinned, free.TaskCpus(64));
  for (const std::vector<int>& task : unpinned) {
    EXPECT_EQ(task, own) << "a worker kept the pinned pool's CPU";
  }
}

TEST(CpuAdam, PinningRefusesACpuThisThreadMayNotUse) {
  UCP_ASSERT_OK_AND_ASSIGN(const std::vector<int> own, ThisThreadCpus());
  int outside = 0;
  while (std::binary_search(own.begin(), own.end(), outside)) ++outside;
  EXPECT_THAT(CpuAdam::Create(Config(), 2, BestSimdPath(), {own.front(), outside}),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("CPU " + std::to_string(outside) + " is not one")));
  EXPECT_THAT(SetThisThreadCpus(std::vector<int>{-1}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("CPU -1 is outside")));
  EXPECT_EQ(CpuListString(std::vector<int>{0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(CpuListString(std::vector<int>{5}), "5");
}
#endif

TEST(CpuAdam, BandwidthProbeMovesBytesWithoutChangingThem) {
  const size_t n = CpuAdam::kBlockElems + 9;
  State s(n, 2);
  const State initial = s;
  for (SimdPath path : {SimdPath::kPortable, BestSimdPath()}) {
    UCP_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(Config(), 2, path));
    UCP_ASSERT_OK(adam.BandwidthProbe(s.p, s.g, s.m, s.v));
    EXPECT_TRUE(s == initial);
    EXPECT_THAT(adam.BandwidthProbe(s.p, std::span<const float>(s.g).first(3), s.m, s.v),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("g 3")));
  }
}

}  // namespace
}  // namespace ucp::offload

namespace ucp::offload {
namespace {

// The offloaded pipeline's kernel (AdamStepFused, CpuAdam::StepBucketFused): a speculative step
// with the loss scale folded in, then the clip correction from its snapshot, each bitwise equal
// to scaling the gradient in place and calling AdamStep, on every available path.
TEST(AdamFused, ScaledSpeculativeAndCorrectionEqualDirectSteps) {
  const size_t n = CpuAdam::kBlockElems + 37;
  const float spec_scale = 1.0f / 65536.0f, clip_scale = static_cast<float>(0.37 / 65536.0);
  for (SimdPath path : {SimdPath::kPortable, SimdPath::kAvx2, SimdPath::kAvx512}) {
    if (!SimdPathAvailable(path)) continue;
    SCOPED_TRACE(SimdPathName(path));
    const State initial(n, 21);
    // Direct: the gradient scaled in place, then AdamStep (what the synchronous trainer does).
    State direct_spec = initial, direct_clip = initial;
    for (float& g : direct_spec.g) g *= spec_scale;
    for (float& g : direct_clip.g) g *= clip_scale;
    UCP_ASSERT_OK(AdamStep(Config(), 7, direct_spec.Spans(0, n), path));
    UCP_ASSERT_OK(AdamStep(Config(), 7, direct_clip.Spans(0, n), path));

    UCP_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(Config(), 2, path));
    State got = initial;
    std::vector<float> sp(n), sm(n), sv(n);
    const AdamSnapshot snap{sp, sm, sv, {}};
    const AdamSpans spans[] = {got.Spans(0, n)};
    const AdamSnapshot snaps[] = {snap};
    UCP_ASSERT_OK(adam.StepBucketFused(7, spans, snaps, CpuAdam::SnapshotUse::kSave, spec_scale));
    EXPECT_TRUE(got == direct_spec) << "speculative step with the loss scale folded in";
    EXPECT_EQ(std::memcmp(sp.data(), initial.p.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(sv.data(), initial.v.data(), n * 4), 0);
    UCP_ASSERT_OK(adam.StepBucketFused(7, spans, snaps, CpuAdam::SnapshotUse::kSource, clip_scale));
    EXPECT_TRUE(got == direct_clip) << "the clip correction from the snapshot";
    // A plain fused step with scale 1 is AdamStep.
    State plain = initial, fused = initial;
    UCP_ASSERT_OK(AdamStep(Config(), 3, plain.Spans(0, n), path));
    UCP_ASSERT_OK(AdamStepFused(Config(), 3, fused.Spans(0, n), {}, path));
    EXPECT_TRUE(plain == fused);
  }
}

TEST(AdamFused, RejectsSourceAndSaveTogetherAndBadSnapshots) {
  State s(8, 1);
  std::vector<float> a(8), b(8), c(8);
  const AdamSnapshot snap{a, b, c, {}};
  AdamFusedOptions o;
  o.source = &snap;
  o.save = &snap;
  EXPECT_THAT(AdamStepFused(Config(), 1, s.Spans(0, 8), o),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("source and save")));
  const AdamSnapshot aliased{s.p, b, c, {}};
  AdamFusedOptions src;
  src.source = &aliased;
  EXPECT_THAT(AdamStepFused(Config(), 1, s.Spans(0, 8), src),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlap")));
  UCP_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::Create(Config(), 1));
  const AdamSpans spans[] = {s.Spans(0, 8)};
  EXPECT_THAT(adam.StepBucketFused(1, spans, {}, CpuAdam::SnapshotUse::kSave, 1.0f),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("snapshots")));
}

}  // namespace
}  // namespace ucp::offload

namespace ucp::offload {
namespace {

// The vector paths' fused loops (adam_avx2.cc, adam_avx512.cc) against the portable fused loop,
// bitwise, over every variant they are instantiated for: gradient fp32/bf16/fp16, copy-out
// none/bf16/fp16, AdamW and L2, amsgrad, and a plain, a speculative (save) and a correction
// (source) step, at a size with a scalar tail. Gradients are scaled by a non-power of two, so the
// multiply rounds.
TEST(AdamFused, VectorPathsEqualThePortableLoopInEveryVariant) {
  const size_t n = 16 * 5 + 13;
  std::vector<SimdPath> vector_paths;
  for (SimdPath p : {SimdPath::kAvx2, SimdPath::kAvx512}) {
    if (SimdPathAvailable(p)) vector_paths.push_back(p);
  }
  if (vector_paths.empty()) GTEST_SKIP() << "no AVX2 or AVX-512 on this CPU";
  struct Run {
    std::vector<float> p, m, v, vmax, sp, sm, sv, svmax;
    std::vector<uint16_t> out;
  };
  int variants = 0;
  for (LowpDType gd : {LowpDType::kFp32, LowpDType::kBf16, LowpDType::kFp16}) {
    for (LowpDType od : {LowpDType::kFp32, LowpDType::kBf16, LowpDType::kFp16}) {
      for (bool decoupled : {true, false}) {
        for (bool ams : {false, true}) {
          for (int mode = 0; mode < 3; ++mode) {  // plain, save, source
            AdamConfig c = Config();
            c.decoupled = decoupled;
            c.amsgrad = ams;
            const State init(n, 97 + static_cast<uint64_t>(variants));
            std::vector<float> g32 = init.g;
            std::vector<uint16_t> g16(n);
            for (size_t i = 0; i < n; ++i) {
              g16[i] = gd == LowpDType::kBf16 ? Bf16FromFloat(g32[i]) : HalfFromFloat(g32[i]);
            }
            auto run = [&](SimdPath path) {
              Run r{init.p, init.m, init.v, init.v, {}, {}, {}, {}, std::vector<uint16_t>(n)};
              for (float& x : r.vmax) x *= 1.5f;
              // The source a correction reads: a perturbed copy of the state.
              r.sp = r.p;
              r.sm = r.m;
              r.sv = r.v;
              r.svmax = r.vmax;
              for (size_t i = 0; i < n; ++i) {
                r.sp[i] += 1e-3f;
                r.sm[i] *= 0.9f;
                r.sv[i] *= 0.5f;
                r.svmax[i] *= 2.0f;
              }
              AdamSpans s;
              s.param = r.p;
              s.grad = gd == LowpDType::kFp32 ? GradSpan::Fp32(g32)
                       : gd == LowpDType::kBf16 ? GradSpan::Bf16(g16)
                                                : GradSpan::Fp16(g16);
              s.exp_avg = r.m;
              s.exp_avg_sq = r.v;
              if (ams) s.max_exp_avg_sq = r.vmax;
              if (od == LowpDType::kBf16) s.out = LowpOutSpan::Bf16(r.out);
              if (od == LowpDType::kFp16) s.out = LowpOutSpan::Fp16(r.out);
              const AdamSnapshot snap{r.sp, r.sm, r.sv, ams ? std::span<float>(r.svmax)
                                                            : std::span<float>()};
              AdamFusedOptions o;
              o.grad_scale = 0.37f;
              if (mode == 1) o.save = &snap;
              if (mode == 2) o.source = &snap;
              const Status st = AdamStepFused(c, 5, s, o, path);
              EXPECT_TRUE(st.ok()) << st.ToString();
              return r;
            };
            const Run want = run(SimdPath::kPortable);
            for (SimdPath path : vector_paths) {
              const Run got = run(path);
              auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
                return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
              };
              EXPECT_TRUE(same(got.p, want.p) && same(got.m, want.m) && same(got.v, want.v) &&
                          same(got.vmax, want.vmax) && same(got.sp, want.sp) &&
                          same(got.sm, want.sm) && same(got.sv, want.sv) &&
                          same(got.svmax, want.svmax) && got.out == want.out)
                  << SimdPathName(path) << ": grad " << static_cast<int>(gd) << ", out "
                  << static_cast<int>(od) << (decoupled ? ", AdamW" : ", L2")
                  << (ams ? ", amsgrad" : "") << ", mode " << mode;
            }
            ++variants;
          }
        }
      }
    }
  }
  EXPECT_EQ(variants, 3 * 3 * 2 * 2 * 3);
}

}  // namespace
}  // namespace ucp::offload
