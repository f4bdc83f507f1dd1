// Tests of the trainer: resume is bitwise (same layout, and another ZeRO stage), the schedule and
// the fp16 loss scaler, checkpoints committed atomically with `latest` and --keep, --init from
// any checkpoint, and that the model learns.
#include "offload/train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "offload/optim/cpu_affinity.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/api/checkpoint.h"

namespace ucp::offload {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

// A small English text: enough distinct samples for a few steps of seq 32.
fs::path WriteText(const fs::path& dir) {
  const fs::path p = dir / "text.txt";
  std::ofstream f(p);
  const char* lines[] = {
      "The quick brown fox jumps over the lazy dog.",
      "A journey of a thousand miles begins with a single step.",
      "To be or not to be, that is the question.",
      "All that glitters is not gold; all who wander are not lost.",
      "It was the best of times, it was the worst of times.",
      "Call me Ishmael. Some years ago, never mind how long precisely.",
  };
  for (int i = 0; i < 60; ++i) f << lines[i % 6] << " " << i << "\n";
  return p;
}

TrainConfig SmallConfig(const std::string& model, const fs::path& data) {
  TrainConfig c;
  c.model = model;
  c.data = data.string();
  c.seq_len = 32;
  c.global_batch = 4;
  c.micro_batch = 2;
  c.steps = 6;
  c.lr = 1e-2;
  c.min_lr = 1e-3;
  c.warmup_samples = 8;
  c.val_samples = 4;
  return c;
}

RunOptions Opts(const fs::path& out) {
  RunOptions r;
  r.out = out;
  r.threads = 2;
  r.async_save = true;
  return r;
}

using State = std::vector<std::pair<std::string, std::vector<std::byte>>>;

struct Trace {
  std::vector<double> losses;
  State state;
};

Trace RunSteps(Trainer& t, int64_t until, int64_t save_at = -1) {
  Trace tr;
  while (t.step() < until) {
    auto r = t.Step();
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) break;
    tr.losses.push_back(r->loss);
    if (t.step() == save_at) {
      EXPECT_TRUE(t.Save().ok());
    }
  }
  EXPECT_TRUE(t.Wait().ok());
  tr.state = t.StateForTest();
  return tr;
}

class ResumeTest : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

// N steps, save, M more steps == N steps, resume from the save, M steps: every weight, master,
// Adam state and loss, bitwise; with a background save (from a staged copy) and a foreground one
// (--sync-save: from the live state).
TEST_P(ResumeTest, BitwiseAtSameLayout) {
  for (const bool async_save : {true, false}) {
    SCOPED_TRACE(async_save ? "background save" : "foreground save");
    ucp::testing::TempDir tmp;
    const fs::path text = WriteText(tmp.path());
    TrainConfig c = SmallConfig(GetParam().first, text);
    c.dtype = GetParam().second;
    RunOptions first = Opts(tmp.path() / "a");
    first.async_save = async_save;
    UCP_ASSERT_OK_AND_ASSIGN(Trainer a, Trainer::Create(c, first));
    const Trace full = RunSteps(a, 6, /*save_at=*/3);
    ASSERT_EQ(full.losses.size(), 6u);
    for (double l : full.losses) EXPECT_TRUE(std::isfinite(l));

    RunOptions r = Opts(tmp.path() / "a");
    r.resume = tmp.path() / "a";
    UCP_ASSERT_OK_AND_ASSIGN(TrainConfig rec, Trainer::RecordedConfig(
                                                  tmp.path() / "a" / "step_00000003", ""));
    EXPECT_EQ(rec.global_batch, 4);
    EXPECT_EQ(rec.seq_len, 32);
    UCP_ASSERT_OK_AND_ASSIGN(Trainer b, Trainer::Create(rec, r));
    EXPECT_EQ(b.step(), 3);
    const Trace resumed = RunSteps(b, 6);
    ASSERT_EQ(resumed.losses.size(), 3u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], full.losses[3 + i]) << "step " << 4 + i;
    ASSERT_EQ(resumed.state.size(), full.state.size());
    for (size_t i = 0; i < full.state.size(); ++i) {
      EXPECT_EQ(resumed.state[i].first, full.state[i].first);
      EXPECT_TRUE(resumed.state[i].second == full.state[i].second) << full.state[i].first;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ResumeTest,
                         ::testing::Values(std::make_pair("llama-tiny", "bf16"),
                                           std::make_pair("gpt-tiny", "fp32"),
                                           std::make_pair("llama-tiny-tied", "fp16")));

// Resuming at another ZeRO stage (zero=0 -> 2) restores the same state and continues bitwise:
// the optimizer is element-wise, so only the partitioning of the state changes.
TEST(TrainerTest, ResumeAtAnotherZeroStage) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  TrainConfig c = SmallConfig("llama-tiny", text);
  c.layout = "tp=1,pp=1,dp=1,zero=0";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer a, Trainer::Create(c, Opts(tmp.path() / "a")));
  const Trace full = RunSteps(a, 5, 2);
  RunOptions r = Opts(tmp.path() / "a");
  r.resume = tmp.path() / "a";
  TrainConfig rc = c;
  rc.layout = "tp=1,pp=1,dp=1,zero=2";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer b, Trainer::Create(rc, r));
  const Trace resumed = RunSteps(b, 5);
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], full.losses[2 + i]);
}

TEST(TrainerTest, CheckpointsLatestAndKeep) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  TrainConfig c = SmallConfig("gpt-tiny", text);
  c.keep = 2;
  RunOptions r = Opts(tmp.path() / "run");
  UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, r));
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(t.Step().ok());
    ASSERT_TRUE(t.Save().ok());
  }
  ASSERT_TRUE(t.Wait().ok());
  EXPECT_FALSE(fs::exists(tmp.path() / "run" / "step_00000001"));
  EXPECT_FALSE(fs::exists(tmp.path() / "run" / "step_00000002"));
  EXPECT_TRUE(fs::exists(tmp.path() / "run" / "step_00000003" / "ucp_layout.json"));
  EXPECT_TRUE(fs::exists(tmp.path() / "run" / "step_00000004" / "ucp_layout.json"));
  std::ifstream latest(tmp.path() / "run" / "latest");
  std::string line;
  std::getline(latest, line);
  EXPECT_EQ(line, "step_00000004");
  UCP_ASSERT_OK_AND_ASSIGN(fs::path found, FindResumeCheckpoint(tmp.path() / "run"));
  EXPECT_EQ(found.filename(), "step_00000004");
  // No temporary folder is left behind, and the checkpoint reads back and verifies.
  for (const auto& e : fs::directory_iterator(tmp.path() / "run")) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  }
  UCP_ASSERT_OK_AND_ASSIGN(auto src, api::CheckpointSource::Open(found, api::UcpDataDir()));
  EXPECT_TRUE(api::Verify(*src).ok());
  EXPECT_EQ(src->meta().step, 4);
  EXPECT_NE(src->meta().client_state_json.find("\"consumed_samples\":16"), std::string::npos);
  // A fresh run into a folder that holds checkpoints is refused.
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("already holds checkpoints")));
}

// fp16: a scale that overflows skips the step (nothing changes) and halves until it fits.
TEST(TrainerTest, Fp16LossScalerSkipsAndBacksOff) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  TrainConfig c = SmallConfig("gpt-tiny", text);
  c.dtype = "fp16";
  c.initial_loss_scale = std::ldexp(1.0, 60);
  UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, Opts(tmp.path() / "run")));
  const State before = t.StateForTest();
  UCP_ASSERT_OK_AND_ASSIGN(StepRecord r1, t.Step());
  EXPECT_TRUE(r1.skipped);
  EXPECT_EQ(r1.loss_scale, std::ldexp(1.0, 60));
  EXPECT_TRUE(t.StateForTest() == before);
  int skipped = 1;
  StepRecord r;
  do {
    UCP_ASSERT_OK_AND_ASSIGN(r, t.Step());
    skipped += r.skipped;
  } while (r.skipped && t.step() < 100);
  EXPECT_FALSE(r.skipped);
  EXPECT_LT(r.loss_scale, std::ldexp(1.0, 60));
  EXPECT_EQ(r.loss_scale, std::ldexp(1.0, 60 - skipped));
  EXPECT_FALSE(t.StateForTest() == before);
}

TEST(TrainerTest, ScheduleCountsSamples) {
  LrSchedule s{1.0, 0.1, 100, 1100};
  EXPECT_EQ(s.At(0), 0.0);
  EXPECT_DOUBLE_EQ(s.At(50), 0.5);
  EXPECT_DOUBLE_EQ(s.At(100), 1.0);
  EXPECT_DOUBLE_EQ(s.At(600), 0.55);
  EXPECT_DOUBLE_EQ(s.At(1100), 0.1);
  EXPECT_DOUBLE_EQ(s.At(5000), 0.1);
  LossScaler ls{true, 8.0, 1.0, 2, 0};
  EXPECT_FALSE(ls.Update(true));
  EXPECT_EQ(ls.scale, 4.0);
  EXPECT_TRUE(ls.Update(false));
  EXPECT_TRUE(ls.Update(false));
  EXPECT_EQ(ls.scale, 8.0);
}

// --init from a universal checkpoint: the masters are its fp32 state, the step is 0, and the
// loss of the first step is the loss of exactly those weights.
TEST(TrainerTest, InitFromUniversalCheckpoint) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  TrainConfig c = SmallConfig("llama-tiny", text);
  c.dtype = "fp32";
  c.init_std = 0.05;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer a, Trainer::Create(c, Opts(tmp.path() / "a")));
  RunSteps(a, 2, 2);
  UCP_ASSERT_OK_AND_ASSIGN(auto src, api::CheckpointSource::Open(tmp.path() / "a" / "step_00000002",
                                                                 api::UcpDataDir()));
  ASSERT_TRUE(api::Extract(*src, tmp.path() / "universal", {}).ok());
  RunOptions r = Opts(tmp.path() / "b");
  r.init = tmp.path() / "universal";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer b, Trainer::Create(c, r));
  EXPECT_EQ(b.step(), 0);
  // The same weights give the same held-out loss.
  UCP_ASSERT_OK_AND_ASSIGN(double va, a.Validate());
  UCP_ASSERT_OK_AND_ASSIGN(double vb, b.Validate());
  EXPECT_EQ(va, vb);
}

TEST(TrainerTest, LearnsAndRefusesBadInput) {
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  TrainConfig c = SmallConfig("llama-tiny", text);
  c.steps = 30;
  c.lr = 3e-3;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, Opts(tmp.path() / "run")));
  UCP_ASSERT_OK_AND_ASSIGN(double v0, t.Validate());
  RunSteps(t, 30);
  UCP_ASSERT_OK_AND_ASSIGN(double v1, t.Validate());
  EXPECT_LT(v1, v0 - 1.0) << "held-out loss " << v0 << " -> " << v1;

  TrainConfig bad = c;
  bad.micro_batch = 3;
  EXPECT_THAT(Trainer::Create(bad, Opts(tmp.path() / "x")).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("does not divide")));
  bad = c;
  bad.layout = "tp=2";
  EXPECT_THAT(Trainer::Create(bad, Opts(tmp.path() / "y")).status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("tensor, pipeline and expert")));
  bad = c;
  bad.data = (tmp.path() / "missing.bin").string();
  EXPECT_THAT(Trainer::Create(bad, Opts(tmp.path() / "z")).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("missing.bin")));
  bad = c;
  bad.model = "no-such-model";
  EXPECT_FALSE(Trainer::Create(bad, Opts(tmp.path() / "w")).ok());
  RunOptions negative = Opts(tmp.path() / "v");
  negative.threads = -1;
  EXPECT_THAT(Trainer::Create(c, negative).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--threads must be >= 0")));
  EXPECT_THAT(Trainer::Plan(c, negative, PlanMachine{}).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--threads must be >= 0")));
  // Numbers no later step checks: each refused, naming its option.
  const std::vector<std::pair<void (*)(TrainConfig&), std::string>> numbers = {
      {[](TrainConfig& b) { b.eps = 0; }, "--eps"},
      {[](TrainConfig& b) { b.init_std = -0.02; }, "--init-std"},
      {[](TrainConfig& b) { b.init_std = std::nan(""); }, "--init-std"},
      {[](TrainConfig& b) { b.initial_loss_scale = -1; }, "--loss-scale"},
      {[](TrainConfig& b) { b.initial_loss_scale = std::nan(""); }, "--loss-scale"},
      {[](TrainConfig& b) { b.loss_scale_window = 0; }, "--loss-scale-window"},
      {[](TrainConfig& b) { b.warmup_samples = -5; }, "--warmup-samples"},
      {[](TrainConfig& b) { b.decay_samples = -2; }, "--decay-samples"},
      {[](TrainConfig& b) { b.val_every = -3; }, "--val-every"},
      {[](TrainConfig& b) { b.val_samples = -1; }, "--val-samples"},
  };
  for (const auto& [spoil, option] : numbers) {
    bad = c;
    spoil(bad);
    EXPECT_THAT(Trainer::Create(bad, Opts(tmp.path() / "n")).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr(option)));
    EXPECT_THAT(Trainer::Plan(bad, Opts(tmp.path() / "n"), PlanMachine{}).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr(option)));
  }
  // --val-samples 0 asks for no validation.
  bad = c;
  bad.val_samples = 0;
  {
    UCP_ASSERT_OK_AND_ASSIGN(Trainer quiet, Trainer::Create(bad, Opts(tmp.path() / "q")));
    EXPECT_FALSE(quiet.can_validate());
    EXPECT_THAT(quiet.Describe(), HasSubstr("(--val-samples 0: no validation)"));
  }
  bad = c;
  bad.threads = -2;
  EXPECT_THAT(Trainer::Create(bad, Opts(tmp.path() / "u")).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("config \"threads\")")));
}

// --threads 0 starts as many threads as the process may use CPUs (under mpirun --bind-to core
// or taskset a share of the machine), not hardware_concurrency(): processes bound to a core
// each would otherwise run pools as wide as the machine on it. The count is the run's, recorded.
TEST(TrainerTest, DefaultThreadsAreTheProcessCpus) {
  UCP_ASSERT_OK_AND_ASSIGN(const std::vector<int> own, ThisThreadCpus());
  ucp::testing::TempDir tmp;
  const fs::path text = WriteText(tmp.path());
  TrainConfig c = SmallConfig("llama-tiny", text);
  c.steps = 1;
  RunOptions r = Opts(tmp.path() / "all");
  r.threads = 0;
  {
    UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, r));
    EXPECT_THAT(t.Describe(), HasSubstr(", " + std::to_string(own.size()) + " threads"));
  }
  // Bound to one CPU, as `mpirun --bind-to core` binds a process (the trainer reads the mask
  // of the thread that creates it; a process's threads inherit it).
  UCP_ASSERT_OK(SetThisThreadCpus(std::vector<int>{own.front()}));
  EXPECT_EQ(DefaultThreads(), 1);
  r.out = tmp.path() / "bound";
  Result<Trainer> bound = Trainer::Create(c, r);
  std::string described;
  if (bound.ok()) {
    described = bound->Describe();
    EXPECT_TRUE(bound->Step().ok());
    EXPECT_TRUE(bound->Save().ok());
    EXPECT_TRUE(bound->Wait().ok());
  }
  UCP_ASSERT_OK(SetThisThreadCpus(own));  // (before any assertion can return)
  UCP_ASSERT_OK(bound.status());
  EXPECT_THAT(described, HasSubstr(", 1 threads"));
  EXPECT_EQ(DefaultThreads(), static_cast<int>(own.size()));
  UCP_ASSERT_OK_AND_ASSIGN(TrainConfig rec, Trainer::RecordedConfig(
                                                tmp.path() / "bound" / "step_00000001", ""));
  EXPECT_EQ(rec.threads, 1);
}

}  // namespace
}  // namespace ucp::offload
