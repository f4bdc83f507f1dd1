// Tests of the pipeline on synthetic buckets (the trainer-level equalities are in
// offload/train/trainer_test.cc): commit and clip correction equal the direct step bitwise, an
// overflow restores every state bit, a non-finite bucket is never stepped, tail buckets are
// stepped on the "device", and the trace is valid JSON.
#include "offload/engine/pipeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "offload/optim/cpu_adam.h"
#include "tests/testutil/status_matchers.h"
#include "ucp/json/strict_json.h"

namespace ucp::offload {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

// A model of 3 buckets whose pieces sit at other offsets in the state than in the gradient (as
// the ZeRO group buffers put matrices and biases apart).
struct World {
  static constexpr int64_t kN = 40000;
  std::vector<float> grad, master, m, v;
  std::vector<uint16_t> weights;
  std::vector<Bucket> buckets;
  explicit World(uint64_t seed) : grad(kN), master(kN), m(kN), v(kN), weights(kN) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < kN; ++i) {
      grad[i] = 1e3f * nd(rng);
      master[i] = nd(rng);
      m[i] = 1e-1f * nd(rng);
      v[i] = 1e-2f * std::fabs(nd(rng));
    }
    // Gradient order: [0, 20000) bucket "layers.1", [20000, 30000) "layers.0", rest "embedding";
    // state order reversed in blocks.
    buckets = {{"layers.1", {{0, 20000, 15000}, {15000, 5000, 5000}}},
               {"layers.0", {{20000, 10000, 10000}}},
               {"embedding", {{30000, 0, 5000}, {35000, 35000, 5000}}}};
  }
  PipelineMemory Memory() { return {grad, weights, master, m, v}; }
  // The synchronous path: g *= scale in fp32, then one AdamStep over every piece.
  void DirectStep(int64_t step, float lr, float scale) {
    std::vector<float> g = grad;
    for (float& x : g) x *= scale;
    AdamConfig c = Config();
    c.lr = lr;
    for (const Bucket& b : buckets) {
      for (const BucketPiece& pc : b.pieces) {
        AdamSpans a;
        a.param = std::span(master).subspan(pc.state_offset, pc.n);
        a.grad = GradSpan::Fp32(std::span<const float>(g).subspan(pc.grad_offset, pc.n));
        a.exp_avg = std::span(m).subspan(pc.state_offset, pc.n);
        a.exp_avg_sq = std::span(v).subspan(pc.state_offset, pc.n);
        a.out = LowpOutSpan::Bf16(std::span(weights).subspan(pc.grad_offset, pc.n));
        ASSERT_TRUE(AdamStep(c, step, a).ok());
      }
    }
  }
  bool SameState(const World& o) const {
    auto same = [](const auto& a, const auto& b) {
      return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return same(master, o.master) && same(m, o.m) && same(v, o.v) && same(weights, o.weights);
  }
  static AdamConfig Config() {
    AdamConfig c;
    c.beta2 = 0.95f;
    c.weight_decay = 0.1f;
    return c;
  }
};

std::unique_ptr<Pipeline> Make(World& w, int tail, TraceRecorder* trace = nullptr) {
  PipelineOptions o;
  o.adam = World::Config();
  o.adam_threads = 2;
  o.gpu_tail_buckets = tail;
  o.trace = trace;
  auto p = Pipeline::Create(o, w.buckets, w.Memory(), CpuPipelineBackend());
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(*p);
}

void RunStep(Pipeline& p, int64_t step, float lr, float spec, const Validation& v) {
  UCP_ASSERT_OK(p.Begin(step, lr, spec));
  for (int k = 0; k < static_cast<int>(p.buckets().size()); ++k) p.BucketReady(k);
  UCP_ASSERT_OK(p.Finish(v));
}

TEST(Pipeline, CommitAndClipCorrectionEqualTheDirectStepBitwise) {
  const float spec = 1.0f / 1024.0f;
  for (int tail : {0, 1}) {
    for (float final_scale : {spec, static_cast<float>(0.3 / 1024.0)}) {
      SCOPED_TRACE(::testing::Message() << "tail " << tail << " scale " << final_scale);
      World direct(5), piped(5);
      for (int64_t step = 1; step <= 3; ++step) direct.DirectStep(step, 1e-3f, final_scale);
      auto p = Make(piped, tail);
      for (int64_t step = 1; step <= 3; ++step) {
        RunStep(*p, step, 1e-3f, spec, {false, final_scale});
      }
      EXPECT_TRUE(piped.SameState(direct));
      const PipelineStats s = p->last_stats();
      EXPECT_EQ(s.speculated, 3 - tail);
      EXPECT_EQ(s.device, tail);
      EXPECT_EQ(final_scale == spec ? s.committed : s.corrected, 3 - tail);
    }
  }
}

// Speculation off: no bucket is stepped before validation, which steps each with the final
// multiplier: the direct step's bits (both finishes), no snapshots, and a skipped step touches
// nothing.
TEST(Pipeline, WithoutSpeculationValidationStepsEveryBucketWithTheSameBits) {
  const float spec = 1.0f / 1024.0f, clipped = static_cast<float>(0.3 / 1024.0);
  for (bool under_forward : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "under forward " << under_forward);
    World w(31), direct(31);
    PipelineOptions o;
    o.adam = World::Config();
    o.adam_threads = 2;
    o.speculate = false;
    auto p = Pipeline::Create(o, w.buckets, w.Memory(), CpuPipelineBackend());
    UCP_ASSERT_OK(p.status());
    o.speculate = true;
    World other(31);
    auto with = Pipeline::Create(o, other.buckets, other.Memory(), CpuPipelineBackend());
    UCP_ASSERT_OK(with.status());
    EXPECT_EQ((*with)->host_staging_bytes() - (*p)->host_staging_bytes(), World::kN * 12);
    for (int64_t step = 1; step <= 3; ++step) {
      const float scale = step == 2 ? spec : clipped;
      UCP_ASSERT_OK((*p)->Begin(step, 1e-3f, spec));
      for (int k = 0; k < 3; ++k) (*p)->BucketReady(k);
      if (under_forward) {
        UCP_ASSERT_OK((*p)->StartFinish({false, scale}));
        UCP_ASSERT_OK((*p)->WaitFinished());
      } else {
        UCP_ASSERT_OK((*p)->Finish({false, scale}));
      }
      direct.DirectStep(step, 1e-3f, scale);
      const PipelineStats s = (*p)->last_stats();
      EXPECT_EQ(s.held, 3);
      EXPECT_EQ(s.speculated + s.committed + s.corrected, 0);
    }
    EXPECT_TRUE(w.SameState(direct));
    World before = w;
    RunStep(**p, 4, 1e-3f, spec, {true, spec});
    EXPECT_TRUE(w.SameState(before));
  }
}

// Speculation chosen step by step (Begin's `speculate`, what the trainer's --speculation auto
// decides): a held step and speculative steps, committed and corrected, in one run of the same
// pipeline give the direct steps' bits.
TEST(Pipeline, SpeculationDecidedPerStepKeepsTheBits) {
  const float spec = 1.0f / 1024.0f, clipped = static_cast<float>(0.3 / 1024.0);
  World w(37), direct(37);
  PipelineOptions o;
  o.adam = World::Config();
  o.adam_threads = 2;
  auto p = Pipeline::Create(o, w.buckets, w.Memory(), CpuPipelineBackend());
  UCP_ASSERT_OK(p.status());
  struct Step {
    int64_t step;
    bool speculate;
    float scale;
  };
  for (const Step& k : {Step{1, true, clipped}, Step{2, false, clipped}, Step{3, false, spec},
                        Step{4, true, spec}}) {
    const int64_t step = k.step;
    UCP_ASSERT_OK((*p)->Begin(step, 1e-3f, spec, k.speculate));
    for (int b = 0; b < 3; ++b) (*p)->BucketReady(b);
    UCP_ASSERT_OK((*p)->Finish({false, k.scale}));
    direct.DirectStep(step, 1e-3f, k.scale);
    const PipelineStats s = (*p)->last_stats();
    EXPECT_EQ(s.held, k.speculate ? 0 : 3) << "step " << step;
    EXPECT_EQ(s.speculated, k.speculate ? 3 : 0) << "step " << step;
    EXPECT_EQ(s.corrected, k.speculate && k.scale != spec ? 3 : 0) << "step " << step;
  }
  EXPECT_TRUE(w.SameState(direct));
}

TEST(Pipeline, OverflowUndoesEveryBitAndANonFiniteBucketIsNeverStepped) {
  World w(7);
  auto p = Make(w, 0);
  RunStep(*p, 1, 1e-3f, 1.0f, {false, 1.0f});  // some history first
  w.grad[20000 + 17] = NAN;                     // bucket "layers.0"
  w.grad[3] = INFINITY;                         // bucket "layers.1"
  World before = w;
  RunStep(*p, 2, 1e-3f, 1.0f, {true, 1.0f});
  EXPECT_TRUE(w.SameState(before));
  PipelineStats s = p->last_stats();
  EXPECT_EQ(s.speculated, 1);  // only "embedding" was finite
  EXPECT_EQ(s.deferred, 2);
  EXPECT_EQ(s.rolled_back, 1);
  // After the undo the pipeline takes the next step as if the bad one never happened.
  w.grad = World(7).grad;
  World direct(7);
  direct.DirectStep(1, 1e-3f, 1.0f);
  direct.DirectStep(2, 1e-3f, 1.0f);
  RunStep(*p, 2, 1e-3f, 1.0f, {false, 1.0f});
  EXPECT_TRUE(w.SameState(direct));
}

TEST(Pipeline, RefusesBadOptionsAndUnfinishedSteps) {
  World w(9);
  PipelineOptions o;
  o.adam = World::Config();
  o.gpu_tail_buckets = 4;
  EXPECT_THAT(Pipeline::Create(o, w.buckets, w.Memory(), CpuPipelineBackend()).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("gpu_tail_buckets")));
  o.gpu_tail_buckets = 0;
  std::vector<Bucket> bad = w.buckets;
  bad[1].pieces[0].n = World::kN;
  EXPECT_THAT(Pipeline::Create(o, bad, w.Memory(), CpuPipelineBackend()).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("layers.0")));
  auto p = Make(w, 0);
  World before = w;
  UCP_ASSERT_OK(p->Begin(1, 1e-3f, 1.0f));
  EXPECT_THAT(p->Begin(1, 1e-3f, 1.0f), StatusIs(StatusCode::kFailedPrecondition, HasSubstr("in flight")));
  p->BucketReady(0);
  EXPECT_THAT(p->Finish({false, 1.0f}),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("1 of 3 buckets")));
  EXPECT_TRUE(w.SameState(before));  // the speculative step of bucket 0 was undone
}

// A backend standing for a device the host cannot address, whose transfers can be made to fail.
class FlakyBackend final : public PipelineBackend {
 public:
  explicit FlakyBackend(int fail_bucket) : fail_(fail_bucket), cpu_(CpuPipelineBackend()) {}
  Result<bool> GradToHost(const Bucket& b, std::span<const float> d, std::span<float> h,
                          std::span<uint16_t> h16, bool fp16) override {
    if (b.name == kNames[fail_]) return DeviceError("cudaErrorLaunchFailure (injected)");
    return cpu_->GradToHost(b, d, h, h16, fp16);
  }
  Status WeightsToDevice(const Bucket& b, std::span<const uint16_t> h,
                         std::span<uint16_t> d) override {
    return cpu_->WeightsToDevice(b, h, d);
  }
  bool host_addressable() const override { return false; }

 private:
  static constexpr const char* kNames[] = {"layers.1", "layers.0", "embedding", "none"};
  int fail_;
  std::unique_ptr<PipelineBackend> cpu_;
};

// A transfer that fails is the step's error: Finish returns it, every speculative step is undone
// bitwise, and the next step (transfers healthy again) is as if the failed one never happened.
TEST(Pipeline, AFailedTransferFailsTheStepAndUndoesIt) {
  World w(13), direct(13);
  PipelineOptions o;
  o.adam = World::Config();
  o.adam_threads = 2;
  auto bad = Pipeline::Create(o, w.buckets, w.Memory(), std::make_unique<FlakyBackend>(1));
  UCP_ASSERT_OK(bad.status());
  World before = w;
  UCP_ASSERT_OK((*bad)->Begin(1, 1e-3f, 1.0f));
  for (int k = 0; k < 3; ++k) (*bad)->BucketReady(k);
  EXPECT_THAT((*bad)->Finish({false, 1.0f}),
              StatusIs(StatusCode::kDeviceError, HasSubstr("layers.0")));
  EXPECT_TRUE(w.SameState(before));
  auto good = Pipeline::Create(o, w.buckets, w.Memory(), std::make_unique<FlakyBackend>(3));
  UCP_ASSERT_OK(good.status());
  RunStep(**good, 1, 1e-3f, 1.0f, {false, 1.0f});
  direct.DirectStep(1, 1e-3f, 1.0f);
  EXPECT_TRUE(w.SameState(direct));
}

// A backend whose weight copy of one bucket waits for the test's word (or fails), standing in
// for a slow (or broken) link while the next step's forward runs.
class GatedBackend final : public PipelineBackend {
 public:
  GatedBackend(std::string gated, bool fail) : gated_(std::move(gated)), fail_(fail) {}
  Result<bool> GradToHost(const Bucket& b, std::span<const float> d, std::span<float> h,
                          std::span<uint16_t> h16, bool fp16) override {
    return cpu_->GradToHost(b, d, h, h16, fp16);
  }
  Status WeightsToDevice(const Bucket& b, std::span<const uint16_t> h,
                         std::span<uint16_t> d) override {
    if (b.name == gated_) {
      if (fail_) return DeviceError("cudaErrorIllegalAddress (injected)");
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return open_; });
    }
    return cpu_->WeightsToDevice(b, h, d);
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::string gated_;
  bool fail_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  std::unique_ptr<PipelineBackend> cpu_ = CpuPipelineBackend();
};

// StartFinish (the finish under the next forward): the buckets are finished in forward's order,
// so while the copy of the bucket backward finished first ("layers.1", forward's last) is held
// back, the others are already final on the device, and that one still holds the old weights.
// Once it crosses, the state is bitwise the direct step's, for a commit and a clip correction;
// the next Begin waits for the finish.
TEST(Pipeline, StartFinishFinishesInForwardOrderWithTheSameBits) {
  const float spec = 1.0f / 1024.0f;
  for (float final_scale : {spec, static_cast<float>(0.3 / 1024.0)}) {
    SCOPED_TRACE(::testing::Message() << "scale " << final_scale);
    World w(21), direct(21);
    PipelineOptions o;
    o.adam = World::Config();
    o.adam_threads = 2;
    auto gate = std::make_unique<GatedBackend>("layers.1", false);
    GatedBackend* g = gate.get();
    auto p = Pipeline::Create(o, w.buckets, w.Memory(), std::move(gate));
    UCP_ASSERT_OK(p.status());
    const std::vector<uint16_t> old_weights = w.weights;
    UCP_ASSERT_OK((*p)->Begin(1, 1e-3f, spec));
    for (int k = 0; k < 3; ++k) (*p)->BucketReady(k);
    UCP_ASSERT_OK((*p)->StartFinish({false, final_scale}));
    const PipelineStats s = (*p)->last_stats();  // final at once
    EXPECT_EQ(final_scale == spec ? s.committed : s.corrected, 3);
    UCP_ASSERT_OK((*p)->WaitFinished(2));  // "embedding": forward's first
    UCP_ASSERT_OK((*p)->WaitFinished(1));  // "layers.0"
    EXPECT_TRUE((*p)->IsFinished(1));
    EXPECT_FALSE((*p)->IsFinished(0));  // held back: asking does not wait
    direct.DirectStep(1, 1e-3f, final_scale);
    for (int k : {1, 2}) {
      for (const BucketPiece& pc : w.buckets[static_cast<size_t>(k)].pieces) {
        const auto at = static_cast<size_t>(pc.grad_offset);
        EXPECT_EQ(std::memcmp(w.weights.data() + at, direct.weights.data() + at,
                              static_cast<size_t>(pc.n) * 2), 0) << w.buckets[k].name;
      }
    }
    EXPECT_EQ(std::memcmp(w.weights.data(), old_weights.data(), 20000 * 2), 0)
        << "layers.1 crossed before its copy was let through";
    g->Open();
    UCP_ASSERT_OK((*p)->WaitFinished(0));
    EXPECT_TRUE((*p)->IsFinished(0));
    UCP_ASSERT_OK((*p)->WaitFinished());
    EXPECT_TRUE((*p)->IsFinished(0));  // no finish in flight
    EXPECT_FALSE((*p)->IsFinished(3));  // no such bucket
    EXPECT_TRUE(w.SameState(direct));
    // The next step through Begin (which waits for any finish) and the synchronous Finish.
    RunStep(**p, 2, 1e-3f, spec, {false, final_scale});
    direct.DirectStep(2, 1e-3f, final_scale);
    EXPECT_TRUE(w.SameState(direct));
  }
}

// A weight copy that fails under the next forward is that wait's error, and the next Begin's.
TEST(Pipeline, AFailedCopyUnderForwardIsTheWaitsError) {
  World w(23);
  PipelineOptions o;
  o.adam = World::Config();
  auto p = Pipeline::Create(o, w.buckets, w.Memory(),
                            std::make_unique<GatedBackend>("layers.0", true));
  UCP_ASSERT_OK(p.status());
  UCP_ASSERT_OK((*p)->Begin(1, 1e-3f, 1.0f));
  for (int k = 0; k < 3; ++k) (*p)->BucketReady(k);
  UCP_ASSERT_OK((*p)->StartFinish({false, 1.0f}));
  UCP_EXPECT_OK((*p)->WaitFinished(2));
  EXPECT_THAT((*p)->WaitFinished(1),
              StatusIs(StatusCode::kDeviceError, HasSubstr("bucket layers.0")));
  EXPECT_FALSE((*p)->IsFinished(1));  // failed
  EXPECT_THAT((*p)->Begin(2, 1e-3f, 1.0f),
              StatusIs(StatusCode::kDeviceError, HasSubstr("previous step's finish")));
  EXPECT_THAT((*p)->WaitFinished(7), StatusIs(StatusCode::kInvalidArgument, HasSubstr("no such bucket")));
}

// A device the host cannot address has no stand-in for a GPU Adam (tail buckets) or for fp32
// training's shared weights.
TEST(Pipeline, ARealDeviceRefusesTailBucketsAndFp32) {
  World w(15);
  PipelineOptions o;
  o.adam = World::Config();
  o.gpu_tail_buckets = 1;
  EXPECT_THAT(Pipeline::Create(o, w.buckets, w.Memory(), std::make_unique<FlakyBackend>(3)).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("GPU Adam")));
  o.gpu_tail_buckets = 0;
  o.weights = LowpDType::kFp32;
  PipelineMemory m = w.Memory();
  m.d_weights = {};
  EXPECT_THAT(Pipeline::Create(o, w.buckets, m, std::make_unique<FlakyBackend>(3)).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("fp32")));
}

TEST(Pipeline, TraceIsChromeJsonWithEveryStage) {
  World w(11);
  TraceRecorder trace;
  auto p = Make(w, 1, &trace);
  RunStep(*p, 1, 1e-3f, 1.0f, {false, 0.5f});
  auto j = ucp::json::ParseStrict(trace.ToJson(), "trace", StatusCode::kDataLoss);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  std::set<int> tracks;
  for (const auto& e : (*j)["traceEvents"]) {
    if (e["ph"] == "X") tracks.insert(e["tid"].get<int>());
  }
  EXPECT_TRUE(tracks.count(static_cast<int>(TraceTrack::kTransfer)));
  EXPECT_TRUE(tracks.count(static_cast<int>(TraceTrack::kCpuAdam)));
  EXPECT_TRUE(tracks.count(static_cast<int>(TraceTrack::kDeviceAdam)));
  EXPECT_TRUE(tracks.count(static_cast<int>(TraceTrack::kValidate)));
}

}  // namespace
}  // namespace ucp::offload
