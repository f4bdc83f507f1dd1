// The trainer with --pipeline overlap (offload/engine): bitwise the synchronous trainer over
// several steps, GPT and LLaMA, bf16 and fp16, with clipping that commits and clipping that
// corrects every step, with tail buckets on the "device", and under fp16 overflows (skipped and
// restored exactly as the sync path); refusals; the Chrome trace shows Adam under backward.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "offload/engine/trace.h"
#include "offload/optim/cpu_affinity.h"
#include "offload/train/trainer.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/json/strict_json.h"

namespace ucp::offload {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

fs::path WriteText(const fs::path& dir) {
  const fs::path p = dir / "text.txt";
  std::ofstream f(p);
  const char* lines[] = {
      "The quick brown fox jumps over the lazy dog.",
      "A journey of a thousand miles begins with a single step.",
      "To be or not to be, that is the question.",
      "All that glitters is not gold; all who wander are not lost.",
  };
  for (int i = 0; i < 80; ++i) f << lines[i % 4] << " " << i << "\n";
  return p;
}

TrainConfig Small(const std::string& model, const std::string& dtype, const fs::path& data) {
  TrainConfig c;
  c.model = model;
  c.dtype = dtype;
  c.data = data.string();
  c.seq_len = 32;
  c.global_batch = 4;
  c.micro_batch = 2;
  c.steps = 4;
  c.lr = 1e-2;
  c.min_lr = 1e-3;
  c.warmup_samples = 4;
  return c;
}

struct TrainRun {
  std::vector<StepRecord> records;
  std::vector<std::pair<std::string, std::vector<std::byte>>> state;
};

// `adjust`: changes to the options beyond those; `describe`: set to Trainer::Describe.
TrainRun Train(const TrainConfig& c, const fs::path& out, const std::string& pipeline, int tail = 0,
               const std::function<void(RunOptions&)>& adjust = {},
               std::string* describe = nullptr) {
  RunOptions r;
  r.out = out;
  r.threads = 2;
  r.pipeline = pipeline;
  r.gpu_tail_buckets = tail;
  r.speculation = "always";  // every step speculates: the clipped ones correct every bucket
  if (adjust) adjust(r);
  TrainRun run;
  auto t = Trainer::Create(c, r);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (!t.ok()) return run;
  if (describe != nullptr) *describe = t->Describe();
  while (t->step() < c.steps) {
    auto rec = t->Step();
    EXPECT_TRUE(rec.ok()) << rec.status().ToString();
    if (!rec.ok()) break;
    run.records.push_back(*rec);
  }
  run.state = t->StateForTest();
  return run;
}

void ExpectSame(const TrainRun& a, const TrainRun& b) {
  ASSERT_EQ(a.records.size(), b.records.size());
  for (size_t i = 0; i < a.records.size(); ++i) {
    EXPECT_EQ(a.records[i].loss, b.records[i].loss) << "step " << i + 1;
    EXPECT_EQ(a.records[i].grad_norm, b.records[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(a.records[i].skipped, b.records[i].skipped) << "step " << i + 1;
    EXPECT_EQ(a.records[i].loss_scale, b.records[i].loss_scale) << "step " << i + 1;
  }
  ASSERT_EQ(a.state.size(), b.state.size());
  for (size_t i = 0; i < a.state.size(); ++i) {
    EXPECT_EQ(a.state[i].first, b.state[i].first);
    EXPECT_TRUE(a.state[i].second == b.state[i].second) << a.state[i].first << " differs";
  }
}

struct Case {
  std::string model, dtype;
  double clip;
  int tail;
};
std::string Name(const ::testing::TestParamInfo<Case>& i) {
  std::string m = i.param.model;
  for (char& ch : m) {
    if (ch == '-') ch = '_';
  }
  const double clip = i.param.clip;
  return m + "_" + i.param.dtype + (clip == 0 ? "_noclip" : clip < 0.1 ? "_clipped" : "_clip1") +
         "_tail" +
         std::to_string(i.param.tail);
}

class OverlapTest : public ::testing::TestWithParam<Case> {};

// clip 0 (off): every speculative bucket commits; clip 1e-3: every step is clipped and every
// speculative bucket corrected from its snapshot; clip 1.0: some steps of each. Always bitwise.
TEST_P(OverlapTest, BitwiseEqualToSync) {
  ucp::testing::TempDir tmp;
  TrainConfig c = Small(GetParam().model, GetParam().dtype, WriteText(tmp.path()));
  c.clip_grad = GetParam().clip;
  const TrainRun sync = Train(c, tmp.path() / "sync", "sync");
  const TrainRun overlap = Train(c, tmp.path() / "overlap", "overlap", GetParam().tail);
  ExpectSame(sync, overlap);
  ASSERT_FALSE(sync.records.empty());
  if (c.clip_grad > 0 && c.clip_grad < 0.1) {
    for (const StepRecord& r : sync.records) EXPECT_GT(r.grad_norm, c.clip_grad);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, OverlapTest,
    ::testing::Values(Case{"gpt-tiny", "bf16", 0, 0}, Case{"gpt-tiny", "bf16", 1e-3, 0},
                      Case{"gpt-tiny", "fp16", 0, 0}, Case{"gpt-tiny", "fp16", 1e-3, 2},
                      Case{"llama-tiny", "bf16", 0, 2}, Case{"llama-tiny", "bf16", 1e-3, 0},
                      Case{"llama-tiny", "fp16", 0, 0}, Case{"llama-tiny", "fp16", 1e-3, 1},
                      Case{"llama-tiny", "bf16", 1.0, 0}, Case{"gpt-tiny", "fp32", 1e-3, 0}),
    Name);

// fp16 with a loss scale of 2^60: the scaled gradients overflow, the step is skipped and the
// scale halves until they fit, exactly as in the sync path; the skipped steps' speculative
// buckets are undone bitwise (the state after the first step equals the initial state).
TEST(OverlapTest, Fp16OverflowSkipsAndRestoresLikeSync) {
  ucp::testing::TempDir tmp;
  TrainConfig c = Small("gpt-tiny", "fp16", WriteText(tmp.path()));
  c.initial_loss_scale = std::ldexp(1.0, 60);
  c.steps = 1;
  RunOptions r;
  r.out = tmp.path() / "first";
  r.threads = 2;
  r.pipeline = "overlap";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, r));
  const auto before = t.StateForTest();
  UCP_ASSERT_OK_AND_ASSIGN(StepRecord r1, t.Step());
  EXPECT_TRUE(r1.skipped);
  EXPECT_TRUE(t.StateForTest() == before);

  c.steps = 50;  // enough for the scale to come down and a few clean steps
  const TrainRun sync = Train(c, tmp.path() / "sync", "sync");
  const TrainRun overlap = Train(c, tmp.path() / "overlap", "overlap");
  ExpectSame(sync, overlap);
  int skipped = 0;
  for (const StepRecord& rec : sync.records) skipped += rec.skipped;
  EXPECT_GT(skipped, 0);
  EXPECT_LT(skipped, 50);
}

TEST(OverlapTest, RefusesBadPipelineOptions) {
  ucp::testing::TempDir tmp;
  TrainConfig c = Small("gpt-tiny", "bf16", WriteText(tmp.path()));
  RunOptions r;
  r.out = tmp.path() / "a";
  r.threads = 1;
  r.pipeline = "fast";
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--pipeline fast")));
  r.pipeline = "sync";
  r.trace = tmp.path() / "t.json";
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--trace needs")));
  r.pipeline = "overlap";
  r.trace.clear();
  r.gpu_tail_buckets = 99;
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("--gpu-tail-buckets 99: must be in [0, 6]")));
  r.gpu_tail_buckets = 0;
  for (int bad : {2, -1}) {  // the pool is some of the run's 1 thread
    r.adam_threads = bad;
    EXPECT_THAT(Trainer::Create(c, r).status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("--adam-threads " + std::to_string(bad) +
                                   ": must be in [1, 1]")));
  }
  r.adam_threads = 0;
  r.speculation = "sometimes";
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("--speculation sometimes: must be auto, always or off")));
  r.speculation = "auto";
  r.pipeline = "sync";
  r.adam_threads = 1;
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("--pipeline sync steps the optimizer after backward on all 1")));
  // The device's options on the CPU engine are refused, not ignored.
  r.adam_threads = 0;
  r.gpu_tail_buckets = 1;
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--gpu-tail-buckets 1: the CPU")));
  r.gpu_tail_buckets = 0;
  r.gpu_attention = "flash";
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--gpu-attention flash: the CPU")));
  r.gpu_attention = "gemm";
  r.gpu_gemm = "fp32";
  EXPECT_THAT(Trainer::Create(c, r).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--gpu-gemm fp32: the CPU")));
}

// --speculation auto (the default): a step after a clipped one holds its buckets for validation
// (no speculative pass to correct), every other step speculates, the first too; bitwise the sync
// path, whose norms say which steps were clipped. llama-tiny at clip 2 clips some steps.
TEST(OverlapTest, AutoSpeculationHoldsTheStepAfterAClippedOne) {
  ucp::testing::TempDir tmp;
  TrainConfig c = Small("llama-tiny", "bf16", WriteText(tmp.path()));
  c.clip_grad = 2.0;
  c.steps = 8;
  const TrainRun sync = Train(c, tmp.path() / "sync", "sync");
  const TrainRun run = Train(c, tmp.path() / "auto", "overlap", 0,
                             [](RunOptions& r) { r.speculation = "auto"; });
  ExpectSame(sync, run);
  ASSERT_EQ(run.records.size(), 8u);
  int held = 0, speculated = 0;
  for (size_t i = 0; i < run.records.size(); ++i) {
    const bool after_clipped = i > 0 && sync.records[i - 1].grad_norm > c.clip_grad;
    const bool clipped = sync.records[i].grad_norm > c.clip_grad;
    const PipelineStats& o = run.records[i].overlap;
    EXPECT_EQ(o.held, after_clipped ? 6 : 0) << "step " << i + 1;  // llama-tiny: 6 buckets
    EXPECT_EQ(o.speculated, after_clipped ? 0 : 6) << "step " << i + 1;
    EXPECT_EQ(o.corrected, !after_clipped && clipped ? 6 : 0) << "step " << i + 1;
    (after_clipped ? held : speculated) += i > 0;
  }
  EXPECT_GT(held, 0);
  EXPECT_GT(speculated, 0);
}

// Where the CPU Adam runs (--adam-threads, --pin-threads) does not change what it computes: an
// overlapped run with its pool pinned, and a synchronous one with its optimizer pinned, are
// bitwise the unpinned sync run, and Describe says where the Adam ran.
TEST(OverlapTest, AdamThreadsAndPinningKeepTheBits) {
  ucp::testing::TempDir tmp;
  TrainConfig c = Small("llama-tiny", "bf16", WriteText(tmp.path()));
  c.clip_grad = 1e-3;  // every bucket corrected: the pool also runs the corrections
  const TrainRun sync = Train(c, tmp.path() / "sync", "sync");
  UCP_ASSERT_OK_AND_ASSIGN(const std::vector<int> own, ThisThreadCpus());
  struct Way {
    std::string pipeline;
    int adam_threads;
    bool pin;
    std::string describe;
  };
  const std::string last = std::to_string(own.back());
  for (const Way& w :
       {Way{"overlap", 2, false, "(the overlapped CPU Adam on 2)"},
        Way{"overlap", 1, true, "(the overlapped CPU Adam on 1), the CPU Adam pinned to CPUs " +
                                    last + "\n"},
        Way{"sync", 0, true, "2 threads, the CPU Adam pinned to CPUs " +
                                 CpuListString(AdamCpus(own, 2)) + "\n"}}) {
    std::string describe;
    const TrainRun run = Train(c, tmp.path() / (w.pipeline + std::to_string(w.adam_threads)),
                               w.pipeline, 0, [&](RunOptions& r) {
                                 r.adam_threads = w.adam_threads;
                                 r.pin_threads = w.pin;
                               }, &describe);
    EXPECT_THAT(describe, HasSubstr(w.describe));
    ExpectSame(sync, run);
  }
  UCP_ASSERT_OK_AND_ASSIGN(const std::vector<int> after, ThisThreadCpus());
  EXPECT_EQ(after, own);
}

// The default split: half beside a model computing on this CPU; beside a GPU all but the
// launching and copying threads (and the communicator's with several processes). The pins: the
// last CPUs of the process's, all of them in turn where there are fewer.
TEST(OverlapTest, DefaultAdamThreadsAndTheirCpus) {
  EXPECT_EQ(DefaultAdamThreads(16, true, 1), 8);
  EXPECT_EQ(DefaultAdamThreads(16, false, 1), 14);
  EXPECT_EQ(DefaultAdamThreads(16, false, 4), 13);
  EXPECT_EQ(DefaultAdamThreads(2, false, 1), 1);
  EXPECT_EQ(DefaultAdamThreads(1, true, 1), 1);
  EXPECT_EQ(AdamCpus(std::vector<int>{0, 1, 2, 3, 4, 5}, 4), (std::vector<int>{2, 3, 4, 5}));
  EXPECT_EQ(AdamCpus(std::vector<int>{4, 5, 9}, 1), (std::vector<int>{9}));
  EXPECT_EQ(AdamCpus(std::vector<int>{0, 1}, 3), (std::vector<int>{0, 1}));
}

// A GPT of 8 layers, hidden 256: per-layer backward and per-bucket Adam are long enough (ms) for
// the trace to show the CPU Adam of one bucket running while backward computes later layers.
// On the CPU, and through the device path on the CPU twin (backward on the "device", each
// bucket's gradient crossing into the trainer's buffer): Adam events run under backward events.
class OverlapTrace : public ::testing::TestWithParam<std::string> {};

TEST_P(OverlapTrace, ShowsAdamOverlappingBackward) {
  ucp::testing::TempDir tmp;
  const fs::path model = tmp.path() / "gpt-8x256.json";
  {
    std::ofstream f(model);
    f << R"({"name": "gpt-8x256", "family": "gpt", "dtype": "bf16",
 "source": "a GPT deep enough to show the pipeline's overlap in a trace",
 "hyper": {"hidden": 256, "layers": 8, "heads": 8, "ffn_hidden": 1024, "vocab": 250,
           "max_positions": 64, "make_vocab_size_divisible_by": 16, "tied_embeddings": true}})";
  }
  TrainConfig c = Small(model.string(), "bf16", WriteText(tmp.path()));
  c.seq_len = 64;
  c.global_batch = 4;
  c.micro_batch = 4;
  c.steps = 3;
  RunOptions r;
  r.out = tmp.path() / "run";
  r.threads = 2;
  r.pipeline = "overlap";
  r.speculation = "always";  // every step's buckets under backward (random tokens clip)
  r.device = GetParam();
  r.trace = tmp.path() / "trace.json";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, r));
  for (int i = 0; i < 3; ++i) UCP_ASSERT_OK(t.Step().status());
  std::ifstream f(r.trace);
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = ucp::json::ParseStrict(ss.str(), "trace", StatusCode::kDataLoss);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  struct Span {
    double b, e;
  };
  std::vector<Span> backward, adam;
  std::set<std::string> names;
  // Per step: its forward, its first backward event, and its weights' crossings.
  std::map<int64_t, Span> forward, backward_head;
  std::map<int64_t, std::vector<Span>> crossings;
  for (const auto& e : (*j)["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const std::string name = e["name"];
    names.insert(name);
    const Span s{e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()};
    const int64_t step = e["args"]["step"].get<int64_t>();
    if (e["tid"] == static_cast<int>(TraceTrack::kBackward) && name.rfind("backward ", 0) == 0) {
      backward.push_back(s);
    }
    if (name == "forward") forward[step] = s;
    if (name == "backward head") backward_head[step] = s;
    if (name.rfind("weights->device", 0) == 0) crossings[step].push_back(s);
    if (e["tid"] == static_cast<int>(TraceTrack::kCpuAdam)) adam.push_back(s);
  }
  EXPECT_EQ(backward.size(), 3u * 10);  // 10 grad groups (head, 8 layers, embedding) x 3 steps
  EXPECT_EQ(adam.size(), 3u * 10);
  EXPECT_TRUE(names.count("grad->host layers.7"));
  if (GetParam() == "cpu") {
    EXPECT_TRUE(names.count("weights->device"));  // one crossing, in Finish
  } else {
    // The finish under the next forward: each bucket's weights cross on their own, after the
    // step's validation, and before the next step's forward has finished reading them (the
    // trace is written at the end of step 3, while step 3's finish is still in flight).
    for (int64_t step : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      ASSERT_EQ(crossings[step].size(), 10u);
      ASSERT_TRUE(forward.count(step + 1) && backward_head.count(step + 1));
      double under_forward_us = 0;
      const Span& fw = forward[step + 1];
      for (const Span& x : crossings[step]) {
        EXPECT_LE(x.e, backward_head[step + 1].b);
        under_forward_us += std::max(0.0, std::min(x.e, fw.e) - std::max(x.b, fw.b));
      }
      std::printf("step %lld's weights crossing under step %lld's forward: %.0f us\n",
                  static_cast<long long>(step), static_cast<long long>(step + 1),
                  under_forward_us);
    }
  }
  double overlap_us = 0;
  for (const Span& a : adam) {
    for (const Span& b : backward) {
      overlap_us += std::max(0.0, std::min(a.e, b.e) - std::max(a.b, b.b));
    }
  }
  EXPECT_GT(overlap_us, 0.0) << "no Adam event overlaps a backward event";
  std::printf("--device %s: adam under backward: %.0f us over 3 steps\n", GetParam().c_str(),
              overlap_us);
}

INSTANTIATE_TEST_SUITE_P(Devices, OverlapTrace, ::testing::Values("cpu", "twin"));

}  // namespace
}  // namespace ucp::offload
