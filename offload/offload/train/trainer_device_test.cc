// The trainer's device code path (device.h) through the CPU twin device: training with
// forward/backward on the "device", gradients to the host, weights back, and the tail pieces
// stepped by the "device Adam" is bitwise the plain CPU trainer's, checkpoints included, at
// every training dtype; and what a device does not run is refused. The same checks on a GPU,
// within stated tolerances: offload/cuda/cuda_train_test.cc (label gpu).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "offload/train/device_check_config.h"
#include "offload/train/trainer.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"

namespace ucp::offload {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

fs::path WriteText(const fs::path& dir) { return WriteDeviceCheckText(dir); }

TrainConfig Config(const std::string& model, const std::string& dtype, const fs::path& data) {
  // some steps clipped, some not (the multiplier reaches the device Adam)
  return DeviceCheckConfig(model, dtype, data, /*lr=*/1e-2, /*min_lr=*/1e-3, /*clip_grad=*/0.5);
}

RunOptions Opts(const fs::path& out, const std::string& device, int tail,
                const std::string& pipeline = "sync") {
  RunOptions r;
  r.pipeline = pipeline;
  r.out = out;
  r.threads = 2;
  r.async_save = false;
  r.device = device;
  r.gpu_tail_buckets = tail;
  return r;
}

using State = std::vector<std::pair<std::string, std::vector<std::byte>>>;

struct Outcome {
  std::vector<double> losses, norms;
  double val = 0;
  State state;
};

Outcome Train(Trainer& t, int64_t until, int64_t save_at = -1) {
  Outcome r;
  while (t.step() < until) {
    auto rec = t.Step();
    EXPECT_TRUE(rec.ok()) << rec.status().ToString();
    if (!rec.ok()) break;
    r.losses.push_back(rec->loss);
    r.norms.push_back(rec->grad_norm);
    if (t.step() == save_at) {
      EXPECT_TRUE(t.Save().ok());
    }
  }
  auto v = t.Validate();
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  r.val = v.ok() ? *v : -1;
  r.state = t.StateForTest();
  return r;
}

void ExpectSame(const Outcome& a, const Outcome& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "loss of step " << i + 1;
    EXPECT_EQ(a.norms[i], b.norms[i]) << "norm of step " << i + 1;
  }
  EXPECT_EQ(a.val, b.val);
  ASSERT_EQ(a.state.size(), b.state.size());
  for (size_t i = 0; i < a.state.size(); ++i) {
    EXPECT_EQ(a.state[i].first, b.state[i].first);
    EXPECT_TRUE(a.state[i].second == b.state[i].second) << a.state[i].first;
  }
}

// A run in pieces (saved and resumed between them) against the uninterrupted run: every loss in
// order, and the last piece's validation loss.
void ExpectContinues(const Outcome& full, std::initializer_list<const Outcome*> pieces) {
  std::vector<double> all;
  for (const Outcome* p : pieces) all.insert(all.end(), p->losses.begin(), p->losses.end());
  ASSERT_EQ(all.size(), full.losses.size());
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], full.losses[i]) << "step " << i + 1;
  EXPECT_EQ((*std::prev(pieces.end()))->val, full.val);
}

// A checkpoint test's middle leg: the run in `run` resumed on the CPU engine at ZeRO-2, trained
// to step `until` and saved there.
Outcome CpuLegAtZero2(const TrainConfig& c, const fs::path& run, int64_t until) {
  TrainConfig c2 = c;
  c2.layout = "tp=1,pp=1,dp=1,zero=2";
  RunOptions r = Opts(run, "cpu", 0);
  r.resume = run;
  Result<Trainer> t = Trainer::Create(c2, r);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (!t.ok()) return {};
  return Train(*t, until, /*save_at=*/until);
}

class DeviceTwin
    : public ::testing::TestWithParam<std::tuple<std::string, std::string, int>> {};

// CPU trainer vs the device path on the twin (tail pieces 0, 2, or all 6 grad groups): 5 steps,
// every loss, norm, the validation loss, and every weight, master and Adam state bitwise.
TEST_P(DeviceTwin, BitwiseTheCpuTrainer) {
  const auto& [model, dtype, tail] = GetParam();
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  const TrainConfig c = Config(model, dtype, text);
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer twin,
                           Trainer::Create(c, Opts(tmp.path() / "twin", "twin", tail)));
  EXPECT_THAT(twin.Describe(), HasSubstr("device twin"));
  // The trainer's host buffers are page-owning (PageVector): the CUDA device pins all of them,
  // and copies from a buffer sharing a pinned page would fail (cudaErrorInvalidValue). bf16
  // has no host fp32 compute copy (the device widens its own weights), fp32 no 16-bit copy.
  EXPECT_THAT(twin.Describe(), HasSubstr(dtype == "fp16" ? "3 of 3 host buffers pinnable"
                                                         : "2 of 2 host buffers pinnable"));
  // bf16 through a device: 4 B/parameter less host memory than the CPU trainer.
  const int64_t cpu_copy = cpu.MemoryInUse()[static_cast<size_t>(MemClass::kComputeCopy)];
  const int64_t twin_copy = twin.MemoryInUse()[static_cast<size_t>(MemClass::kComputeCopy)];
  EXPECT_EQ(cpu_copy, cpu.num_params() * 4);
  EXPECT_EQ(twin_copy, dtype == "bf16" ? 0 : twin.num_params() * 4);
  const Outcome a = Train(cpu, 5);
  const Outcome b = Train(twin, 5);
  ExpectSame(a, b);
}

INSTANTIATE_TEST_SUITE_P(
    Models, DeviceTwin,
    ::testing::Values(std::make_tuple("llama-tiny", "bf16", 0),
                      std::make_tuple("llama-tiny", "bf16", 2),
                      std::make_tuple("llama-tiny", "bf16", 6),
                      std::make_tuple("gpt-tiny", "fp16", 2),
                      std::make_tuple("gpt-tiny", "fp32", 0),
                      std::make_tuple("llama-tiny-tied", "bf16", 1)));

// --pipeline overlap on the twin: the device's gradients cross bucket by bucket while backward
// goes on, the CPU Adam steps them speculatively, validation commits or corrects (clip 0.5:
// some steps of each; 1e-3: every step corrected), the weights go back bucket by bucket; tail
// buckets (1, 2, all 6 grad groups) cross too and the device Adam steps them after validation.
// Bitwise the plain CPU trainer (sync) over 5 steps: losses, norms, validation loss, every state.
class DeviceTwinOverlap
    : public ::testing::TestWithParam<std::tuple<std::string, std::string, double, int>> {};

TEST_P(DeviceTwinOverlap, BitwiseTheCpuTrainer) {
  const auto& [model, dtype, clip, tail] = GetParam();
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  TrainConfig c = Config(model, dtype, text);
  c.clip_grad = clip;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  const fs::path trace = tmp.path() / "trace.json";
  RunOptions o = Opts(tmp.path() / "twin", "twin", tail, "overlap");
  o.speculation = "always";  // every clipped step corrects (auto would hold the next ones)
  o.trace = trace;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer twin, Trainer::Create(c, o));
  const Outcome a = Train(cpu, 5);
  const Outcome b = Train(twin, 5);
  ExpectSame(a, b);
  // The trace shows the pipeline's stages: each bucket's gradient crossing, its speculative
  // Adam, and the wait for the gradients before the norm.
  std::ifstream f(trace);
  const std::string json((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_THAT(json, HasSubstr("grad->host "));
  EXPECT_THAT(json, HasSubstr("adam "));
  EXPECT_THAT(json, HasSubstr("wait for gradients"));
  // (With every grad group on the device Adam no weights cross.)
  if (tail < 6) {
    EXPECT_THAT(json, HasSubstr("weights->device"));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DeviceTwinOverlap,
                         ::testing::Values(std::make_tuple("llama-tiny", "bf16", 0.5, 0),
                                           std::make_tuple("llama-tiny", "bf16", 1e-3, 0),
                                           std::make_tuple("gpt-tiny", "bf16", 0.0, 0),
                                           std::make_tuple("gpt-tiny", "fp16", 0.5, 0),
                                           std::make_tuple("llama-tiny-tied", "bf16", 0.5, 0),
                                           // tail buckets on the device Adam after validation
                                           std::make_tuple("llama-tiny", "bf16", 0.5, 2),
                                           std::make_tuple("llama-tiny", "bf16", 1e-3, 6),
                                           std::make_tuple("gpt-tiny", "fp16", 0.5, 2),
                                           std::make_tuple("llama-tiny-tied", "bf16", 0.5, 1)));

// Without speculation (RunOptions::speculation "off") each bucket's Adam waits for validation,
// under the next step's forward or before Step returns: bitwise the CPU trainer either way, with
// and without tail buckets, and every bucket held (none speculated).
class DeviceTwinNoSpeculation : public ::testing::TestWithParam<std::tuple<bool, int>> {};

TEST_P(DeviceTwinNoSpeculation, BitwiseTheCpuTrainer) {
  const auto& [under_forward, tail] = GetParam();
  ucp::testing::TempDir tmp;
  TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  c.clip_grad = 0.5;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  RunOptions o = Opts(tmp.path() / "twin", "twin", tail, "overlap");
  o.speculation = "off";
  o.finish_under_forward = under_forward;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer twin, Trainer::Create(c, o));
  UCP_ASSERT_OK_AND_ASSIGN(StepRecord first, twin.Step());
  EXPECT_EQ(first.overlap.speculated, 0);
  EXPECT_EQ(first.overlap.held, 6 - tail);  // llama-tiny: 6 grad groups
  EXPECT_EQ(first.phases.finish_wait, 0.0);  // no earlier step to finish
  UCP_ASSERT_OK_AND_ASSIGN(StepRecord second, twin.Step());
  // The time the first forward waited for step 1's finish is part of its own backward phase.
  EXPECT_LE(second.phases.finish_wait, second.phases.backward);
  if (!under_forward) {
    EXPECT_EQ(second.phases.finish_wait, 0.0);
  }
  UCP_ASSERT_OK(cpu.Step().status());
  UCP_ASSERT_OK(cpu.Step().status());
  const Outcome a = Train(cpu, 4);
  const Outcome b = Train(twin, 4);
  ExpectSame(a, b);
}

INSTANTIATE_TEST_SUITE_P(Finishes, DeviceTwinNoSpeculation,
                         ::testing::Values(std::make_tuple(true, 0), std::make_tuple(false, 0),
                                           std::make_tuple(true, 2)));

// Streamed weights on the twin (RunOptions::weights "streamed"; device.h stream_weights): the
// "device" holds the embeddings, the head and two layer windows; each layer crosses when forward
// and backward reach it and its gradients leave as backward completes it, the first
// micro-batch's sum coming back for the second. Bitwise the CPU trainer over 5 steps (clip 0.5:
// some steps clipped), sync and overlapped (speculative or not, finished under the next forward
// or not), tied and untied, every dtype the pipeline runs; the device holds less than resident.
class DeviceTwinStreamed
    : public ::testing::TestWithParam<
          std::tuple<std::string, std::string, std::string, bool, bool>> {};

TEST_P(DeviceTwinStreamed, BitwiseTheCpuTrainer) {
  const auto& [model, dtype, pipeline, speculate, under_forward] = GetParam();
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config(model, dtype, WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  RunOptions o = Opts(tmp.path() / "twin", "twin", 0, pipeline);
  o.weights = "streamed";
  o.speculation = speculate ? "always" : "off";
  o.finish_under_forward = under_forward;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer twin, Trainer::Create(c, o));
  EXPECT_THAT(twin.Describe(), HasSubstr("weights streamed"));
  RunOptions ro = Opts(tmp.path() / "resident", "twin", 0, pipeline);
  ro.weights = "resident";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer resident, Trainer::Create(c, ro));
  EXPECT_LT(twin.DeviceBytesInUse(), resident.DeviceBytesInUse());
  EXPECT_EQ(resident.DeviceBytesStreamed(), 0);
  const Outcome a = Train(cpu, 5);
  const Outcome b = Train(twin, 5);
  ExpectSame(a, b);
  // Each step moves at least the weights in once and the gradients out once per micro-batch.
  const int64_t wbytes = dtype == "fp32" ? 4 : 2;
  EXPECT_GE(twin.DeviceBytesStreamed(), 5 * twin.num_params() * (wbytes + 2 * 4));
}

INSTANTIATE_TEST_SUITE_P(
    Models, DeviceTwinStreamed,
    ::testing::Values(std::make_tuple("llama-tiny", "bf16", "sync", true, true),
                      std::make_tuple("gpt-tiny", "fp16", "sync", true, true),
                      std::make_tuple("gpt-tiny", "fp32", "sync", true, true),
                      std::make_tuple("llama-tiny-tied", "bf16", "sync", true, true),
                      std::make_tuple("llama-tiny", "bf16", "overlap", true, true),
                      std::make_tuple("llama-tiny", "bf16", "overlap", true, false),
                      std::make_tuple("llama-tiny-tied", "bf16", "overlap", false, true),
                      std::make_tuple("gpt-tiny", "fp16", "overlap", true, true)));

// --recompute (activation checkpointing) changes no bit: the CPU trainer and the twin device
// recomputing all or some of llama-tiny's 4 layers (resident and streamed weights, sync and
// overlapped), against the CPU trainer without it.
TEST(Recompute, BitwiseTheKeptActivations) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  const Outcome a = Train(cpu, 4);
  struct Run {
    const char *device, *weights, *pipeline, *recompute, *describe;
  };
  for (const Run& run :
       {Run{"cpu", "auto", "sync", "all", "all 4 layers recomputed in backward"},
        Run{"cpu", "auto", "overlap", "2", "the first 2 of 4 layers recomputed in backward"},
        Run{"twin", "auto", "sync", "all", "all 4 layers"},
        Run{"twin", "streamed", "sync", "3", "the first 3 of 4 layers"},
        Run{"twin", "streamed", "overlap", "all", "all 4 layers"}}) {
    const std::string name = std::string(run.device) + "_" + run.weights + "_" + run.pipeline +
                             "_" + run.recompute;
    SCOPED_TRACE(name);
    RunOptions o = Opts(tmp.path() / name, run.device, 0, run.pipeline);
    o.recompute = run.recompute;
    o.weights = run.weights;
    UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, o));
    EXPECT_THAT(t.Describe(), HasSubstr(run.describe));
    ExpectSame(a, Train(t, 4));
  }
  EXPECT_THAT(cpu.Describe(), ::testing::Not(HasSubstr("recomputed")));

  // Not recorded: a run saved without it resumes with it (on the twin), and continues bitwise.
  UCP_ASSERT_OK_AND_ASSIGN(Trainer first, Trainer::Create(c, Opts(tmp.path() / "run", "cpu", 0)));
  const Outcome p1 = Train(first, 2, /*save_at=*/2);
  RunOptions r = Opts(tmp.path() / "run", "twin", 0);
  r.resume = tmp.path() / "run";
  r.recompute = "all";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer second, Trainer::Create(c, r));
  const Outcome p2 = Train(second, 4);
  ExpectContinues(a, {&p1, &p2});
}

// --recompute auto takes the plan's count for the memory given (the CPU engine: --host-memory;
// a device: --device-memory, none when unknown), and a bad value is refused naming the option.
TEST(Recompute, AutoTakesThePlansCountAndBadValuesAreRefused) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  RunOptions two = Opts(tmp.path() / "plan", "cpu", 0);
  two.recompute = "2";
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan p2, Trainer::Plan(c, two, PlanMachine{}));
  RunOptions o = Opts(tmp.path() / "auto", "cpu", 0);
  o.recompute = "auto";
  o.host_memory = p2.cpu_total;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, o));
  EXPECT_THAT(t.Describe(), HasSubstr("the first 2 of 4 layers recomputed in backward"));
  PlanMachine host;
  host.host_bytes = p2.cpu_total;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan pa, Trainer::Plan(c, o, host));
  EXPECT_EQ(pa.cpu_total, p2.cpu_total);
  EXPECT_TRUE(pa.cpu_fits);

  RunOptions twin = Opts(tmp.path() / "twin", "twin", 0);
  twin.recompute = "auto";  // no --device-memory: nothing to fit, nothing recomputed
  UCP_ASSERT_OK_AND_ASSIGN(Trainer tw, Trainer::Create(c, twin));
  EXPECT_THAT(tw.Describe(), ::testing::Not(HasSubstr("recomputed")));

  for (const char* bad : {"5", "-1", "some", "2x", ""}) {
    RunOptions b = Opts(tmp.path() / "bad", "cpu", 0);
    b.recompute = bad;
    EXPECT_THAT(Trainer::Create(c, b).status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--recompute " + std::string(bad) +
                                   ": must be none, all, auto or a layer count in [0, 4]")))
        << bad;
  }
}

// --gpu-tail-buckets auto on the twin: the count the plan fits in --device-memory (here a device
// with room for 3 of llama-tiny's 6 grad groups beside the rest, its reserve and kTailHeadroom),
// which the run's description and its plan name; the training is bitwise the CPU trainer's.
// Where the count cannot be chosen it is 0, and the description says why.
TEST(TailBuckets, AutoTakesThePlansCountBitwise) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan three,
                           Trainer::Plan(c, Opts(tmp.path() / "p", "twin", 3), PlanMachine{}));
  PlanMachine m;  // as the trainer plans: the default reserve
  m.device_bytes = static_cast<int64_t>(
      static_cast<double>(three.device_total + m.device_reserve_bytes) / (1.0 - kTailHeadroom));
  while (m.device_bytes - m.device_reserve_bytes -
             static_cast<int64_t>(kTailHeadroom * m.device_bytes) < three.device_total) {
    ++m.device_bytes;
  }
  RunOptions o = Opts(tmp.path() / "auto", "twin", kGpuTailAuto);
  o.device_memory = m.device_bytes;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan planned, Trainer::Plan(c, o, m));
  EXPECT_EQ(planned.device_total, three.device_total);
  EXPECT_THAT(planned.rows[static_cast<size_t>(MemClass::kOptimizer)].note,
              HasSubstr(", the last 3 grad groups, on the device"));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer twin, Trainer::Create(c, o));
  EXPECT_THAT(twin.Describe(), HasSubstr("--gpu-tail-buckets auto: 3 of 6 grad groups on the "
                                         "device Adam\n"));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  ExpectSame(Train(cpu, 3), Train(twin, 3));

  const std::vector<std::pair<RunOptions, std::string>> none = {
      {Opts(tmp.path() / "n1", "twin", kGpuTailAuto), "the device's memory is unknown"},
      {Opts(tmp.path() / "n2", "cpu", kGpuTailAuto), "the CPU engine"},
  };
  for (const auto& [run, why] : none) {
    UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, run));
    EXPECT_THAT(t.Describe(), HasSubstr("--gpu-tail-buckets auto: 0 of 6 grad groups on the "
                                        "device Adam (" + why));
  }
  RunOptions streamed = o;
  streamed.out = tmp.path() / "n3";
  streamed.weights = "streamed";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer st, Trainer::Create(c, streamed));
  EXPECT_THAT(st.Describe(), HasSubstr("0 of 6 grad groups on the device Adam (the weights are "
                                       "streamed)"));
  RunOptions bad = Opts(tmp.path() / "bad", "twin", -2);
  EXPECT_THAT(Trainer::Create(c, bad).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("--gpu-tail-buckets -2: must be auto or a count")));
  EXPECT_EQ(ParseGpuTailBuckets("auto").value_or(0), kGpuTailAuto);
  EXPECT_EQ(ParseGpuTailBuckets("4").value_or(0), 4);
  for (const char* text : {"-1", "", "3x", "all"}) {
    EXPECT_FALSE(ParseGpuTailBuckets(text).ok()) << text;
  }
}

// A device that runs out of memory: the error carries the memory plan's verdict for the
// device's memory, which names the count of layers to recompute that would fit.
TEST(Recompute, OutOfDeviceMemoryNamesTheCountThatFits) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  RunOptions o = Opts(tmp.path() / "oom", "cuda", 0);
  o.device_factory = [](const TrainDeviceSpec&) -> Result<std::unique_ptr<TrainDevice>> {
    return ResourceExhaustedError("CUDA model: activations do not fit in device memory");
  };
  o.weights = "resident";
  RunOptions all = o;
  all.recompute = "all";
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan p, Trainer::Plan(c, all, PlanMachine{}));
  o.device_memory = p.device_total + (int64_t{2} << 30);  // fits only with every layer rerun
  EXPECT_THAT(Trainer::Create(c, o).status(),
              StatusIs(StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("do not fit in device memory; --device cuda; the memory "
                                       "plan for its "),
                             HasSubstr("or recompute layers (--recompute all: it fits"))));
}

// The chunks of the devices' reduction (PlanReduceChunks): packing every chunk by its copies,
// zero elsewhere, gives exactly the flat view's chunk (every block's [begin, begin + n), block r
// at r n), for pieces that cross chunk boundaries, padding between and after them, a shorter
// last chunk, and pieces given out of order; misplaced pieces and empty chunks are refused.
TEST(PlanReduceChunks, PackEveryBlocksChunk) {
  const int ranks = 3;
  const int64_t numel = 40, block = 17;
  DeviceReduceSpec spec;
  spec.block = block;
  // Block 0: model [0, 10) at 0, [10, 15) at 12 (padding 10-11, 17); block 1: [15, 30) at 1;
  // block 2: [30, 40) at 7 (padding 0-6). Given out of order.
  spec.pieces = {{2, 30, 7, 10}, {0, 10, 12, 5}, {1, 15, 1, 15}, {0, 0, 0, 10}};
  std::vector<float> grads(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) grads[static_cast<size_t>(i)] = static_cast<float>(i + 1);
  std::vector<float> flat(static_cast<size_t>(ranks * block), 0.0f);
  for (const FlatPiece& pc : spec.pieces) {
    for (int64_t i = 0; i < pc.n; ++i) {
      flat[static_cast<size_t>(pc.block * block + pc.flat_offset + i)] =
          grads[static_cast<size_t>(pc.model_offset + i)];
    }
  }
  for (int64_t chunk : {1, 4, 5, 16, 17, 100}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    UCP_ASSERT_OK_AND_ASSIGN(std::vector<ExchangeChunk> chunks,
                             PlanReduceChunks(spec, ranks, numel, chunk));
    int64_t next = 0;
    for (const ExchangeChunk& c : chunks) {
      EXPECT_EQ(c.begin, next);
      EXPECT_EQ(c.recv_n, std::min(chunk, block - c.begin));
      EXPECT_EQ(c.send_counts, std::vector<int64_t>(ranks, c.recv_n));
      next = c.begin + c.recv_n;
      std::vector<float> packed(static_cast<size_t>(ranks * c.recv_n), 0.0f);
      for (const GradCopy& cp : c.copies) {
        ASSERT_GE(cp.from, 0);
        ASSERT_LE(cp.from + cp.n, numel);
        ASSERT_GE(cp.to, 0);
        ASSERT_LE(cp.to + cp.n, ranks * c.recv_n);
        for (int64_t i = 0; i < cp.n; ++i) {
          packed[static_cast<size_t>(cp.to + i)] = grads[static_cast<size_t>(cp.from + i)];
        }
      }
      for (int r = 0; r < ranks; ++r) {
        for (int64_t i = 0; i < c.recv_n; ++i) {
          EXPECT_EQ(packed[static_cast<size_t>(r * c.recv_n + i)],
                    flat[static_cast<size_t>(r * block + c.begin + i)])
              << "block " << r << " element " << c.begin + i;
        }
      }
    }
    EXPECT_EQ(next, block);
  }
  DeviceReduceSpec bad = spec;
  bad.pieces.push_back({1, 0, 10, 8});  // past its block's 17
  EXPECT_THAT(PlanReduceChunks(bad, ranks, numel, 4).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("outside")));
  bad.pieces.back() = {3, 0, 0, 1};  // no rank 3
  EXPECT_THAT(PlanReduceChunks(bad, ranks, numel, 4).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("outside")));
  bad.pieces.back() = {0, 39, 0, 2};  // past the model
  EXPECT_THAT(PlanReduceChunks(bad, ranks, numel, 4).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("outside")));
  EXPECT_THAT(PlanReduceChunks(spec, ranks, numel, 0).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("chunks of 0")));
}

// The chunks of a bucket exchange (PlanBucketChunks): each chunk's packed floats, segment by
// segment, are that segment's next elements, so that the segments rebuilt from every chunk are
// the whole exchange's (ranges crossing segment and chunk boundaries, an empty segment, a rank
// whose segment ends before the others'); every chunk's counts are what each rank sends, and
// recv_n is this rank's (sum_n) part; ZeRO-0's all-reduce packs its sum in order. Mismatched
// counts are refused.
TEST(PlanBucketChunks, RebuildTheSegments) {
  BucketExchange ex;
  ex.pack = {{50, 7}, {10, 5}, {80, 9}, {30, 4}};  // 25 floats: segments of 11, 0, 14
  ex.send_counts = {11, 0, 14};
  ex.sum_n = 11;  // this rank is rank 0
  ex.recv_counts = {11, 11, 11};
  std::vector<float> grads(100);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i);
  std::vector<float> whole;  // the unchunked pack
  for (const auto& r : ex.pack) {
    for (int64_t i = 0; i < r.n; ++i) {
      whole.push_back(grads[static_cast<size_t>(r.model_offset + i)]);
    }
  }
  for (int64_t chunk : {1, 3, 4, 11, 14, 100}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    UCP_ASSERT_OK_AND_ASSIGN(std::vector<ExchangeChunk> chunks, PlanBucketChunks(ex, 3, chunk));
    EXPECT_EQ(static_cast<int64_t>(chunks.size()), (14 + chunk - 1) / chunk);
    std::vector<std::vector<float>> seg(3);
    int64_t received = 0;
    for (const ExchangeChunk& c : chunks) {
      ASSERT_EQ(c.send_counts.size(), 3u);
      EXPECT_EQ(c.recv_n, std::clamp<int64_t>(11 - c.begin, 0, chunk));
      EXPECT_EQ(c.begin, received);
      received += chunk;
      int64_t packed = 0;
      for (int64_t n : c.send_counts) packed += n;
      std::vector<float> buf(static_cast<size_t>(packed), -1.0f);
      for (const GradCopy& cp : c.copies) {
        ASSERT_LE(cp.to + cp.n, packed);
        for (int64_t i = 0; i < cp.n; ++i) {
          buf[static_cast<size_t>(cp.to + i)] = grads[static_cast<size_t>(cp.from + i)];
        }
      }
      int64_t at = 0;
      for (size_t r = 0; r < 3; ++r) {
        seg[r].insert(seg[r].end(), buf.begin() + at, buf.begin() + at + c.send_counts[r]);
        at += c.send_counts[r];
      }
    }
    EXPECT_EQ(seg[0], std::vector<float>(whole.begin(), whole.begin() + 11));
    EXPECT_TRUE(seg[1].empty());
    EXPECT_EQ(seg[2], std::vector<float>(whole.begin() + 11, whole.end()));
  }
  BucketExchange zero0;  // ZeRO-0: the pack is the sum
  zero0.pack = ex.pack;
  zero0.sum_n = 25;
  UCP_ASSERT_OK_AND_ASSIGN(std::vector<ExchangeChunk> chunks, PlanBucketChunks(zero0, 3, 10));
  ASSERT_EQ(chunks.size(), 3u);
  std::vector<float> sum(25, -1.0f);
  for (const ExchangeChunk& c : chunks) {
    EXPECT_TRUE(c.send_counts.empty());
    for (const GradCopy& cp : c.copies) {
      ASSERT_LE(cp.to + cp.n, c.recv_n);
      for (int64_t i = 0; i < cp.n; ++i) {
        sum[static_cast<size_t>(c.begin + cp.to + i)] = grads[static_cast<size_t>(cp.from + i)];
      }
    }
  }
  EXPECT_EQ(sum, whole);
  BucketExchange bad = ex;
  bad.send_counts = {11, 1, 14};  // 26, not the pack's 25
  EXPECT_THAT(PlanBucketChunks(bad, 3, 4).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("do not agree")));
  bad = ex;
  bad.recv_counts = {11, 11, 10};  // a rank that sends this one other than its sum
  EXPECT_THAT(PlanBucketChunks(bad, 3, 4).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("do not agree")));
  EXPECT_THAT(PlanBucketChunks(ex, 2, 4).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("do not agree")));
}

// The book of streamed weights: in the graph's order (forward, then backward) each group sits
// at an offset congruent to its model offset modulo kAlign, inside the arena, never overlapping
// another group held or loaded at the same time; forward's last two layers, still in the
// windows, do not cross again for backward; the gradients come from the host only once released in this step;
// and misuse is refused.
TEST(WeightWindowBook, PlacesGroupsAlignedAndApartInTheGraphsOrder) {
  ModelConfig mc;  // a small LLaMA of 4 layers (odd sizes: groups start at every alignment)
  mc.family = Family::kLlama;
  mc.vocab = 100;
  mc.padded_vocab = 104;
  mc.hidden = 36;
  mc.layers = 4;
  mc.heads = 6;
  mc.kv_heads = 2;
  mc.head_dim = 6;
  mc.ffn_hidden = 50;
  mc.max_positions = 64;
  UCP_ASSERT_OK_AND_ASSIGN(auto ranges, GradGroupRanges(mc));
  WeightWindowBook book(ranges);
  const int G = book.groups(), L = G - 2, emb = G - 1;
  std::vector<std::pair<int64_t, int64_t>> held(static_cast<size_t>(G), {-1, -1});
  auto acquire = [&](int k, bool grads) {
    UCP_ASSERT_OK_AND_ASSIGN(WeightWindowBook::Use u, book.Acquire(k, grads));
    EXPECT_EQ(u.begin, ranges[static_cast<size_t>(k)].first);
    EXPECT_EQ(u.n, ranges[static_cast<size_t>(k)].second - u.begin);
    EXPECT_EQ((u.offset - u.begin) % WeightWindowBook::kAlign, 0) << "group " << k;
    EXPECT_GE(u.offset, 0);
    EXPECT_LE(u.offset + u.n, book.elements());
    for (int j = 0; j < G; ++j) {
      const auto [o, n] = held[static_cast<size_t>(j)];
      if (j == k || o < 0) continue;
      EXPECT_TRUE(u.offset + u.n <= o || o + n <= u.offset) << "groups " << k << " and " << j;
    }
    held[static_cast<size_t>(k)] = {u.offset, u.n};
  };
  auto release = [&](int k, bool grads) {
    UCP_ASSERT_OK(book.Release(k, grads).status());
    if (k != 0 && k != emb) held[static_cast<size_t>(k)] = {-1, -1};  // a window, reusable
  };
  book.NewStep();
  for (int mb = 0; mb < 2; ++mb) {
    acquire(emb, false);
    release(emb, false);
    for (int k = L; k >= 1; --k) {
      acquire(k, false);
      release(k, false);
    }
    acquire(0, true);
    release(0, true);
    for (int k = 1; k <= L; ++k) {
      Result<WeightWindowBook::Use> u = book.Acquire(k, true);
      ASSERT_TRUE(u.ok());
      // Forward's last two layers are still in the windows.
      EXPECT_EQ(u->load_weights, k > 2) << "layer group " << k;
      EXPECT_EQ(u->grads_from_host, mb == 1) << "layer group " << k;
      release(k, true);
    }
    acquire(emb, true);
    release(emb, true);
  }
  for (int k = 0; k < G; ++k) EXPECT_TRUE(book.grads_on_host(k));
  book.NewStep();
  EXPECT_FALSE(book.grads_on_host(0));
  // Loaded groups stay current until the host's weights change.
  UCP_ASSERT_OK_AND_ASSIGN(WeightWindowBook::Use e, book.Acquire(emb, false));
  EXPECT_FALSE(e.load_weights);
  EXPECT_THAT(book.Acquire(emb, false).status(), StatusIs(StatusCode::kFailedPrecondition, ::testing::_));
  UCP_ASSERT_OK(book.Release(emb, false).status());
  EXPECT_THAT(book.Release(emb, false).status(), StatusIs(StatusCode::kFailedPrecondition, ::testing::_));
  UCP_ASSERT_OK(book.GroupWeightsChanged(emb));
  UCP_ASSERT_OK_AND_ASSIGN(e, book.Acquire(emb, false));
  EXPECT_TRUE(e.load_weights);
  EXPECT_THAT(book.Acquire(G, false).status(), StatusIs(StatusCode::kInvalidArgument, ::testing::_));
  // Two layers held at once fill both windows; a third has none.
  UCP_ASSERT_OK(book.Acquire(1, false).status());
  UCP_ASSERT_OK(book.Acquire(2, false).status());
  EXPECT_THAT(book.Acquire(3, false).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no free layer window")));
  book.ReleaseAll();
  UCP_ASSERT_OK(book.Acquire(3, false).status());
  book.ReleaseAll();

  // Prefetch: after each layer's Acquire the next layer in the graph's order goes to the other
  // window, so its own Acquire finds it current; a group whose host weights change after its
  // prefetch crosses again; while the weights are in flight (the finish under forward) nothing
  // is prefetched until the group is final.
  book.WeightsChanged();
  for (int k = L; k >= 1; --k) {  // forward: the layers up
    UCP_ASSERT_OK_AND_ASSIGN(WeightWindowBook::Use u, book.Acquire(k, false));
    EXPECT_EQ(u.load_weights, k == L) << "layer group " << k;
    std::optional<WeightWindowBook::Use> next = book.PrefetchAfter(k, false);
    ASSERT_EQ(next.has_value(), k > 1) << "layer group " << k;
    if (next) {
      EXPECT_EQ(next->begin, ranges[static_cast<size_t>(k - 1)].first);
      EXPECT_NE(next->store, u.store);
      EXPECT_EQ((next->offset - next->begin) % WeightWindowBook::kAlign, 0);
    }
    UCP_ASSERT_OK(book.Release(k, false).status());
  }
  for (int k = 1; k <= L; ++k) {  // backward: the layers down
    UCP_ASSERT_OK_AND_ASSIGN(WeightWindowBook::Use u, book.Acquire(k, true));
    EXPECT_FALSE(u.load_weights) << "layer group " << k;
    const std::optional<WeightWindowBook::Use> next = book.PrefetchAfter(k, true);
    if (k == 2) {
      ASSERT_TRUE(next.has_value());  // layer group 3 was evicted in forward
      UCP_ASSERT_OK(book.GroupWeightsChanged(3));  // after its prefetch
    }
    UCP_ASSERT_OK(book.Release(k, true).status());
    if (k == 2) {
      UCP_ASSERT_OK_AND_ASSIGN(WeightWindowBook::Use again, book.Acquire(3, true));
      EXPECT_TRUE(again.load_weights);  // prefetched, then changed: crosses again
      UCP_ASSERT_OK(book.Release(3, true).status());
      break;
    }
  }
  book.WeightsInFlight();
  UCP_ASSERT_OK_AND_ASSIGN(WeightWindowBook::Use top, book.Acquire(L, false));
  EXPECT_TRUE(top.load_weights);
  EXPECT_FALSE(book.PrefetchAfter(L, false).has_value());  // L - 1 not final yet
  UCP_ASSERT_OK(book.GroupWeightsChanged(L - 1));
  EXPECT_TRUE(book.PrefetchAfter(L, false).has_value());
}

// A checkpoint of a streamed run resumes resident, and a resident one streamed: the host state
// is the same either way, so both continue bitwise as the uninterrupted CPU run.
TEST(DeviceTwinStreamedCheckpoint, ResumesAcrossPlacements) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer ref, Trainer::Create(c, Opts(tmp.path() / "ref", "cpu", 0)));
  const Outcome full = Train(ref, 6);
  RunOptions s = Opts(tmp.path() / "a", "twin", 0, "overlap");
  s.weights = "streamed";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer streamed, Trainer::Create(c, s));
  const Outcome first = Train(streamed, 2, /*save_at=*/2);
  RunOptions r = Opts(tmp.path() / "a", "twin", 2);
  r.weights = "resident";
  r.resume = tmp.path() / "a";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer resident, Trainer::Create(c, r));
  const Outcome mid = Train(resident, 4, /*save_at=*/4);
  s.resume = tmp.path() / "a";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer back, Trainer::Create(c, s));
  ASSERT_EQ(back.step(), 4);
  const Outcome last = Train(back, 6);
  ExpectContinues(full, {&first, &mid, &last});
  ExpectSame(Train(back, 6), Train(ref, 6));  // (no steps left: the validation and every state)
}

// fp16 from a loss scale of 2^60: the overlapped twin skips the overflowing steps (every
// speculative bucket undone; a bucket with a non-finite gradient never stepped) and halves the
// scale exactly as the CPU trainer; a skipped first step leaves every state as it was.
TEST(DeviceTwinOverlapFp16, OverflowSkipsLikeTheCpuTrainer) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  TrainConfig c = Config("gpt-tiny", "fp16", text);
  c.initial_loss_scale = std::ldexp(1.0, 60);
  c.steps = 60;  // enough for the scale to come down and some clean steps
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  // (two tail buckets on the device Adam: an overflowing step steps none of them)
  UCP_ASSERT_OK_AND_ASSIGN(Trainer twin,
                           Trainer::Create(c, Opts(tmp.path() / "twin", "twin", 2, "overlap")));
  const auto before = twin.StateForTest();
  UCP_ASSERT_OK_AND_ASSIGN(StepRecord first, twin.Step());
  EXPECT_TRUE(first.skipped);
  EXPECT_TRUE(twin.StateForTest() == before);
  UCP_ASSERT_OK_AND_ASSIGN(StepRecord first_cpu, cpu.Step());
  EXPECT_TRUE(first_cpu.skipped);
  int skipped = 1;
  while (cpu.step() < c.steps) {
    UCP_ASSERT_OK_AND_ASSIGN(StepRecord x, cpu.Step());
    UCP_ASSERT_OK_AND_ASSIGN(StepRecord y, twin.Step());
    EXPECT_EQ(x.skipped, y.skipped) << "step " << x.step;
    EXPECT_EQ(x.loss, y.loss) << "step " << x.step;
    EXPECT_EQ(x.grad_norm, y.grad_norm) << "step " << x.step;
    EXPECT_EQ(x.loss_scale, y.loss_scale) << "step " << x.step;
    // After a skipped step every state is the one before it, the weights' training-dtype copy
    // included (the pipeline wrote it speculatively into the trainer's own buffer).
    if (x.skipped) {
      EXPECT_TRUE(cpu.StateForTest() == twin.StateForTest()) << "step " << x.step;
    }
    skipped += x.skipped;
  }
  EXPECT_GT(skipped, 1);
  EXPECT_LT(skipped, c.steps);
  EXPECT_TRUE(cpu.StateForTest() == twin.StateForTest());
}

// A checkpoint of the overlapped twin resumes on the CPU engine at another ZeRO stage, and back
// on the overlapped twin: both continue bitwise as the uninterrupted CPU run.
TEST(DeviceTwinOverlapCheckpoint, ResumesAcrossEngines) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  const TrainConfig c = Config("llama-tiny", "bf16", text);
  UCP_ASSERT_OK_AND_ASSIGN(Trainer ref, Trainer::Create(c, Opts(tmp.path() / "ref", "cpu", 0)));
  const Outcome full = Train(ref, 6);
  UCP_ASSERT_OK_AND_ASSIGN(Trainer dev,
                           Trainer::Create(c, Opts(tmp.path() / "a", "twin", 0, "overlap")));
  const Outcome first = Train(dev, 2, /*save_at=*/2);
  const Outcome mid = CpuLegAtZero2(c, tmp.path() / "a", 4);
  RunOptions r3 = Opts(tmp.path() / "a", "twin", 0, "overlap");
  r3.resume = tmp.path() / "a";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer back, Trainer::Create(c, r3));
  ASSERT_EQ(back.step(), 4);
  const Outcome last = Train(back, 6);
  ExpectContinues(full, {&first, &mid, &last});
}

// A checkpoint written through the device path (tail pieces on the "device": their state is
// pulled into the save) resumes on the CPU engine at another ZeRO stage, and a CPU checkpoint
// resumes on the device path: both continue bitwise as the uninterrupted CPU run.
TEST(DeviceTwinCheckpoint, ResumesAcrossEnginesAndLayouts) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  const TrainConfig c = Config("llama-tiny", "bf16", text);
  UCP_ASSERT_OK_AND_ASSIGN(Trainer ref, Trainer::Create(c, Opts(tmp.path() / "ref", "cpu", 0)));
  const Outcome full = Train(ref, 6);

  UCP_ASSERT_OK_AND_ASSIGN(Trainer dev, Trainer::Create(c, Opts(tmp.path() / "a", "twin", 3)));
  const Outcome first = Train(dev, 2, /*save_at=*/2);
  for (size_t i = 0; i < first.losses.size(); ++i) EXPECT_EQ(first.losses[i], full.losses[i]);

  // Device (zero=1) -> CPU (zero=2): steps 3 and 4, then saved.
  TrainConfig c2 = c;
  c2.layout = "tp=1,pp=1,dp=1,zero=2";
  RunOptions r2 = Opts(tmp.path() / "a", "cpu", 0);
  r2.resume = tmp.path() / "a";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c2, r2));
  ASSERT_EQ(cpu.step(), 2);
  const Outcome mid = Train(cpu, 4, /*save_at=*/4);
  ASSERT_EQ(mid.losses.size(), 2u);
  EXPECT_EQ(mid.losses[0], full.losses[2]);
  EXPECT_EQ(mid.losses[1], full.losses[3]);

  // CPU (zero=2) -> device (zero=0, all groups on the device Adam): steps 5 and 6.
  TrainConfig c3 = c;
  c3.layout = "tp=1,pp=1,dp=1,zero=0";
  RunOptions r3 = Opts(tmp.path() / "a", "twin", 6);
  r3.resume = tmp.path() / "a";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer back, Trainer::Create(c3, r3));
  ASSERT_EQ(back.step(), 4);
  const Outcome last = Train(back, 6);
  ASSERT_EQ(last.losses.size(), 2u);
  EXPECT_EQ(last.losses[0], full.losses[4]);
  EXPECT_EQ(last.losses[1], full.losses[5]);
  EXPECT_EQ(last.val, full.val);
}

// The twin, but a device that leaves the gradient norm to the host (TrainDevice's default
// GradNormChunks), as a device of a user's own may: everything else forwarded.
class HostNormDevice final : public TrainDevice {
 public:
  explicit HostNormDevice(std::unique_ptr<TrainDevice> twin) : d_(std::move(twin)) {}
  static Result<std::unique_ptr<TrainDevice>> Make(const TrainDeviceSpec& spec) {
    UCP_ASSIGN_OR_RETURN(std::unique_ptr<TrainDevice> twin, MakeCpuTwinDevice(spec));
    return std::unique_ptr<TrainDevice>(std::make_unique<HostNormDevice>(std::move(twin)));
  }
  std::string Describe() const override { return d_->Describe(); }
  Status UploadWeights() override { return d_->UploadWeights(); }
  Status ZeroGrads() override { return d_->ZeroGrads(); }
  Result<double> ForwardBackward(const Batch& b, float s, const BackwardHook* h) override {
    return d_->ForwardBackward(b, s, h);
  }
  Result<double> Forward(const Batch& b) override { return d_->Forward(b); }
  Status GradsToHost() override { return d_->GradsToHost(); }
  Status GroupGradsToHost(int g) override { return d_->GroupGradsToHost(g); }
  Status PushState(std::span<const float> m, std::span<const float> a,
                   std::span<const float> v) override {
    return d_->PushState(m, a, v);
  }
  Status PullState(std::span<float> m, std::span<float> a, std::span<float> v) override {
    return d_->PullState(m, a, v);
  }
  Status StepDevicePieces(int64_t step, float lr, float s) override {
    return d_->StepDevicePieces(step, lr, s);
  }
  DevicePipelineView PipelineView() override { return d_->PipelineView(); }
  Result<std::unique_ptr<PipelineBackend>> MakePipelineBackend() override {
    return d_->MakePipelineBackend();
  }
  Status WeightsWritten() override { return d_->WeightsWritten(); }
  Status GroupWeightsWritten(int g) override { return d_->GroupWeightsWritten(g); }
  void WeightsInFlight() override { d_->WeightsInFlight(); }
  Status GradsRangeToHostAsync(int64_t b, int64_t n, int slot, int64_t at) override {
    return d_->GradsRangeToHostAsync(b, n, slot, at);
  }
  Status WeightsRangeToDeviceAsync(int64_t b, int64_t n, int slot) override {
    return d_->WeightsRangeToDeviceAsync(b, n, slot);
  }
  Status WaitStaged(int slot) override { return d_->WaitStaged(slot); }
  Status WeightsRangeToHost(int64_t b, int64_t n) override { return d_->WeightsRangeToHost(b, n); }
  int64_t device_bytes() const override { return d_->device_bytes(); }
  int64_t staged_bytes() const override { return d_->staged_bytes(); }
  int64_t streamed_bytes() const override { return d_->streamed_bytes(); }

 private:
  std::unique_ptr<TrainDevice> d_;
};

// Staged host buffers: the host keeps only the optimizer state and two windows (gradients in,
// weights out). The device sums the gradient norm where the gradients are, so they cross once
// (for Adam) and the weights once: 6 B/parameter a step; a device that leaves the norm to the
// host has them cross twice (the norm, then Adam): 10. Bitwise the CPU trainer over 5 steps of
// 2 micro-batches, clipped and not, with windows smaller than the model (pieces cut at a
// window's edge; tied embeddings) and one window of it all.
class DeviceTwinStaged
    : public ::testing::TestWithParam<std::tuple<std::string, int64_t, bool>> {};

TEST_P(DeviceTwinStaged, BitwiseTheCpuTrainer) {
  const auto& [model, window, host_norm] = GetParam();
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config(model, "bf16", WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  RunOptions o = Opts(tmp.path() / "twin", "twin", 0);
  if (host_norm) {
    o.device = "cuda";  // the factory's device: the twin, less its norm
    o.device_factory = HostNormDevice::Make;
  }
  o.host_buffers = "staged";
  o.host_window = window;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer twin, Trainer::Create(c, o));
  const int64_t n = twin.num_params();
  const int64_t w = window == 0 ? n : std::min(window, n);
  if (window != 0) {
    ASSERT_GT(n, 2 * window) << "the model should span several windows";
  }
  const auto mem = twin.MemoryInUse();
  EXPECT_EQ(mem[static_cast<size_t>(MemClass::kWeights)], kStagedSlots * w * 2);
  EXPECT_EQ(mem[static_cast<size_t>(MemClass::kGradients)], kStagedSlots * w * 4);
  EXPECT_EQ(mem[static_cast<size_t>(MemClass::kComputeCopy)], 0);
  EXPECT_THAT(twin.Describe(), HasSubstr("2 of 2 host buffers pinnable"));
  const Outcome a = Train(cpu, 5);
  const Outcome b = Train(twin, 4);
  const int64_t before = twin.DeviceBytesStaged();
  UCP_ASSERT_OK_AND_ASSIGN(StepRecord r5, twin.Step());
  EXPECT_EQ(twin.DeviceBytesStaged() - before, n * (host_norm ? 10 : 6)) << "bytes of a step";
  Outcome all = b;
  all.losses.push_back(r5.loss);
  all.norms.push_back(r5.grad_norm);
  UCP_ASSERT_OK_AND_ASSIGN(all.val, twin.Validate());
  all.state = twin.StateForTest();
  ExpectSame(a, all);
  // Clipping decided some steps and not others (the multiplier reaches every window).
  int clipped = 0;
  for (double g : a.norms) clipped += g > c.clip_grad ? 1 : 0;
  EXPECT_GT(clipped, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, DeviceTwinStaged,
                         ::testing::Values(std::make_tuple("llama-tiny", int64_t{1} << 16, false),
                                           std::make_tuple("gpt-tiny", int64_t{1} << 16, false),
                                           std::make_tuple("llama-tiny-tied", int64_t{1} << 16,
                                                           false),
                                           std::make_tuple("llama-tiny", int64_t{0}, false),
                                           std::make_tuple("llama-tiny", int64_t{1} << 16, true),
                                           std::make_tuple("gpt-tiny", int64_t{1} << 16, true)));

// A staged run's checkpoint (its weights saved from the device) resumes on the CPU engine at
// another ZeRO stage, whose checkpoint resumes staged with a background save (the weights
// staged from the device); both continue bitwise as the uninterrupted CPU run. --init from it
// (masters rounded on the way to the device) is the CPU engine's --init.
TEST(DeviceTwinStagedCheckpoint, ResumesAcrossEnginesAndLayouts) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer ref, Trainer::Create(c, Opts(tmp.path() / "ref", "cpu", 0)));
  const Outcome full = Train(ref, 6);
  RunOptions s = Opts(tmp.path() / "a", "twin", 0);
  s.host_buffers = "staged";
  s.host_window = int64_t{1} << 16;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer staged, Trainer::Create(c, s));
  const Outcome first = Train(staged, 2, /*save_at=*/2);
  const Outcome mid = CpuLegAtZero2(c, tmp.path() / "a", 4);
  RunOptions r3 = s;
  r3.resume = tmp.path() / "a";
  r3.async_save = true;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer back, Trainer::Create(c, r3));
  ASSERT_EQ(back.step(), 4);
  const Outcome last = Train(back, 6, /*save_at=*/6);
  ASSERT_TRUE(back.Wait().ok());
  ExpectContinues(full, {&first, &mid, &last});
  // The background save holds what the live state does: resumed on the CPU, the same state.
  RunOptions r4 = Opts(tmp.path() / "a", "cpu", 0);
  r4.resume = tmp.path() / "a";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu6, Trainer::Create(c, r4));
  ASSERT_EQ(cpu6.step(), 6);
  ExpectSame(Train(cpu6, 6), Train(ref, 6));

  RunOptions i1 = Opts(tmp.path() / "i1", "cpu", 0);
  i1.init = tmp.path() / "a" / "step_00000002";
  RunOptions i2 = s;
  i2.out = tmp.path() / "i2";
  i2.init = i1.init;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer ci, Trainer::Create(c, i1));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer si, Trainer::Create(c, i2));
  ExpectSame(Train(ci, 2), Train(si, 2));
}

// --host-buffers auto (the default) stages only where whole buffers would not fit the host
// memory it is given (RunOptions::host_memory; the plan's host column, which is exact), and the
// plan shows the same choice.
TEST(DeviceTwinStaged, AutoStagesOnlyWhereWholeBuffersDoNotFit) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  RunOptions o = Opts(tmp.path() / "whole", "twin", 0);
  o.host_buffers = "whole";
  o.host_window = int64_t{1} << 16;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan whole, Trainer::Plan(c, o, PlanMachine{}));
  o.host_buffers = "auto";
  o.host_memory = whole.host_total;  // fits whole
  UCP_ASSERT_OK_AND_ASSIGN(Trainer roomy, Trainer::Create(c, o));
  EXPECT_EQ(roomy.MemoryInUse()[static_cast<size_t>(MemClass::kWeights)], roomy.num_params() * 2);
  EXPECT_THAT(roomy.Describe(), ::testing::Not(HasSubstr("host buffers staged")));

  o.out = tmp.path() / "tight";
  o.host_memory = whole.host_total - 1;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer tight, Trainer::Create(c, o));
  EXPECT_EQ(tight.MemoryInUse()[static_cast<size_t>(MemClass::kWeights)],
            kStagedSlots * (int64_t{1} << 16) * 2);
  EXPECT_THAT(tight.Describe(), HasSubstr("host buffers staged: windows of 65536 elements"));
  PlanMachine m;
  m.host_bytes = o.host_memory;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan plan, Trainer::Plan(c, o, m));
  EXPECT_TRUE(plan.host_fits);
  EXPECT_EQ(plan.rows[static_cast<size_t>(MemClass::kWeights)].host_bytes,
            kStagedSlots * (int64_t{1} << 16) * 2);
  EXPECT_THAT(plan.verdict, HasSubstr("buffers staged: what --host-buffers auto picks"));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", "cpu", 0)));
  ExpectSame(Train(cpu, 3), Train(tight, 3));

  // Where staged buffers do not run (the overlapped pipeline), or do not fit either, whole.
  o.out = tmp.path() / "overlap";
  o.pipeline = "overlap";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer overlap, Trainer::Create(c, o));
  EXPECT_THAT(overlap.Describe(), ::testing::Not(HasSubstr("host buffers staged")));
  o.out = tmp.path() / "tiny";
  o.pipeline = "sync";
  o.host_memory = 1 << 20;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer tiny, Trainer::Create(c, o));
  EXPECT_THAT(tiny.Describe(), ::testing::Not(HasSubstr("host buffers staged")));
}

TEST(DeviceOptions, StagedHostBuffersRefusedWhereNotRun) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config("llama-tiny", "bf16", WriteText(tmp.path()));
  auto staged = [&](const std::string& name, const std::string& device, int tail = 0,
                    const std::string& pipeline = "sync") {
    RunOptions o = Opts(tmp.path() / name, device, tail, pipeline);
    o.host_buffers = "staged";
    return o;
  };
  RunOptions bad = staged("a", "twin");
  bad.host_buffers = "none";
  EXPECT_THAT(Trainer::Create(c, bad).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--host-buffers none: must be auto")));
  EXPECT_THAT(Trainer::Create(c, staged("b", "cpu")).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--device cuda or twin")));
  TrainConfig f16 = c;
  f16.dtype = "fp16";
  EXPECT_THAT(Trainer::Create(f16, staged("c", "twin")).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("bf16 training only")));
  EXPECT_THAT(Trainer::Create(c, staged("d", "twin", 0, "overlap")).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("--pipeline sync")));
  EXPECT_THAT(Trainer::Create(c, staged("e", "twin", 1)).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("--gpu-tail-buckets")));
  RunOptions st = staged("f", "twin");
  st.weights = "streamed";
  EXPECT_THAT(Trainer::Create(c, st).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("--weights resident")));
  RunOptions odd = staged("g", "twin");
  odd.host_window = 1000;
  EXPECT_THAT(Trainer::Create(c, odd).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("multiple of 65536")));
}

TEST(DeviceOptions, RefusedWhereNotRun) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  const TrainConfig c = Config("llama-tiny", "bf16", text);
  EXPECT_THAT(Trainer::Create(c, Opts(tmp.path() / "a", "tpu", 0)).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--device tpu")));
  // No factory: a build without the CUDA engine.
  EXPECT_THAT(Trainer::Create(c, Opts(tmp.path() / "b", "cuda", 0)).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no CUDA engine")));
  // The overlapped pipeline on a device of one process: no fp32 training.
  TrainConfig f32 = c;
  f32.dtype = "fp32";
  EXPECT_THAT(Trainer::Create(f32, Opts(tmp.path() / "c2", "twin", 0, "overlap")).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("bf16 or fp16 training in one process")));
  EXPECT_THAT(Trainer::Create(c, Opts(tmp.path() / "d", "twin", 7)).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--gpu-tail-buckets 7")));
  TrainConfig d = c;
  d.deterministic = true;
  EXPECT_THAT(Trainer::Create(d, Opts(tmp.path() / "e", "twin", 0)).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("--deterministic")));
  TrainConfig f = c;
  f.dtype = "fp32";
  EXPECT_THAT(Trainer::Create(f, Opts(tmp.path() / "f", "twin", 1)).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("bf16 or fp16")));
  // Streamed weights need a device; a placement is one of three, also where no device runs.
  for (const char* w : {"streamed", "paged"}) {
    RunOptions cw = Opts(tmp.path() / (std::string("cw") + w), "cpu", 0);
    cw.weights = w;
    EXPECT_THAT(Trainer::Create(c, cw).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr(std::string("--weights ") + w)));
  }
  // Streamed weights hold no device Adam pieces.
  RunOptions st = Opts(tmp.path() / "h", "twin", 2);
  st.weights = "streamed";
  EXPECT_THAT(Trainer::Create(c, st).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("--weights resident")));
  // --gpu-gemm takes auto or fp32, also where no device runs (a typo is not ignored).
  for (const char* device : {"twin", "cpu"}) {
    RunOptions g = Opts(tmp.path() / (std::string("g") + device), device, 0);
    g.gpu_gemm = "bf16";
    EXPECT_THAT(Trainer::Create(c, g).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("--gpu-gemm bf16"))) << device;
    // Refused after the run folder (and its tokenized data) was made: the folder is gone.
    EXPECT_FALSE(fs::exists(g.out)) << device;
  }
  // --gpu-attention takes gemm or flash, and flash only where the bf16 GEMMs run (bf16 training,
  // --gpu-gemm auto): the flash kernels are their attention.
  struct BadAttention {
    const char* attention;
    const char* gemm;
    const char* want;
  };
  for (const BadAttention& b : {BadAttention{"fused", "auto", "--gpu-attention fused"},
                                BadAttention{"flash", "fp32", "--gpu-gemm auto"}}) {
    for (const char* device : {"twin", "cpu"}) {
      RunOptions a = Opts(tmp.path() / (std::string("a") + b.attention + device), device, 0);
      a.gpu_attention = b.attention;
      a.gpu_gemm = b.gemm;
      EXPECT_THAT(Trainer::Create(c, a).status(),
                  StatusIs(StatusCode::kInvalidArgument, HasSubstr(b.want)))
          << device << " " << b.attention;
    }
  }
  // Where it runs, it is taken (the twin's model is the CPU's either way).
  RunOptions flash = Opts(tmp.path() / "flash", "twin", 0);
  flash.gpu_attention = "flash";
  UCP_EXPECT_OK(Trainer::Create(c, flash).status());
  // A folder that was there before is kept.
  RunOptions kept = Opts(tmp.path() / "kept", "twin", 0);
  kept.gpu_gemm = "bf16";
  fs::create_directories(kept.out / "mine");
  EXPECT_FALSE(Trainer::Create(c, kept).ok());
  EXPECT_TRUE(fs::exists(kept.out / "mine"));
}

}  // namespace
}  // namespace ucp::offload
