// GPU check (label gpu): `ucp-train --device cuda` (the trainer over cuda_train_device.h) against
// the CPU engine, and its checkpoints across engines and layouts. Skips where no CUDA device
// exists; tests/gpu/run_bundle.sh runs it on one (a skip there fails the run). Also the
// data-parallel reduction on the GPU (ReduceGradsToHost over NCCL) with one rank.
//
// Tolerances: with fp32 GEMMs (--gpu-gemm fp32) the first step computes on the same weights, so
// its loss is within 1e-5 relative of the CPU's (CudaModel's bound, cuda_model_test); later
// steps follow different (fp32-rounded) gradients through Adam's normalised update, so they are
// checked within 1e-2 relative. With bf16 GEMMs (--gpu-gemm auto, bf16 training: activations
// rounded to bf16, about 3 significant digits) the first step within 2e-2 and the rest within
// 5e-2: a wrong operand or offset moves a tiny model's loss by far more. The
// device's own runs are deterministic (no atomics; the same cuBLAS calls), so tail pieces on the
// device Adam vs on the CPU Adam, and a CPU resume of a device checkpoint vs the device's own
// next step on the same state, are compared at 1e-5 (the next step's forward is the only
// difference: one engine's forward against the other's on identical weights).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_train_device.h"
#include "offload/train/page_vector.h"
#include "offload/train/device_check_config.h"
#include "offload/train/trainer.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload::cuda {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

fs::path WriteText(const fs::path& dir) { return WriteDeviceCheckText(dir); }

TrainConfig Config(const std::string& model, const std::string& dtype, const fs::path& data) {
  return DeviceCheckConfig(model, dtype, data, /*lr=*/1e-3, /*min_lr=*/1e-4, /*clip_grad=*/1.0);
}

RunOptions Opts(const fs::path& out, bool cuda, int tail = 0, const std::string& pipeline = "sync",
                const std::string& gemm = "auto") {
  RunOptions r;
  r.pipeline = pipeline;
  r.gpu_gemm = gemm;
  r.out = out;
  r.threads = 2;
  r.async_save = false;
  if (cuda) {
    r.device = "cuda";
    r.device_factory = MakeCudaTrainDevice;
    r.gpu_tail_buckets = tail;
  }
  return r;
}

std::vector<double> Losses(Trainer& t, int64_t until, int64_t save_at = -1) {
  std::vector<double> out;
  while (t.step() < until) {
    auto r = t.Step();
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) break;
    out.push_back(r->loss);
    if (t.step() == save_at) {
      EXPECT_TRUE(t.Save().ok());
    }
  }
  return out;
}

double Rel(double a, double b) { return std::fabs(a - b) / std::max(1e-30, std::fabs(b)); }

class CudaTrainTest : public ::testing::TestWithParam<std::pair<std::string, std::string>> {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// 4 steps on the GPU against 4 on the CPU engine from the same initialisation and batches, with
// fp32 GEMMs and with the bf16 ones (the default for bf16 training).
TEST_P(CudaTrainTest, StepsMatchTheCpuEngine) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config(GetParam().first, GetParam().second, WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", false)));
  const auto a = Losses(cpu, 4);
  ASSERT_EQ(a.size(), 4u);
  UCP_ASSERT_OK_AND_ASSIGN(double va, cpu.Validate());
  for (const auto& [gemm, first_tol, tol] :
       {std::tuple{std::string("fp32"), 1e-5, 1e-2}, std::tuple{std::string("auto"), 2e-2, 5e-2}}) {
    SCOPED_TRACE("--gpu-gemm " + gemm);
    UCP_ASSERT_OK_AND_ASSIGN(
        Trainer gpu, Trainer::Create(c, Opts(tmp.path() / ("gpu_" + gemm), true, 0, "sync", gemm)));
    std::printf("%s\n", gpu.Describe().c_str());
    const auto b = Losses(gpu, 4);
    ASSERT_EQ(b.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      std::printf("--gpu-gemm %s step %zu: cpu loss %.9g, cuda loss %.9g, rel %.3g\n",
                  gemm.c_str(), i + 1, a[i], b[i], Rel(b[i], a[i]));
      EXPECT_LE(Rel(b[i], a[i]), i == 0 ? first_tol : tol) << "step " << i + 1;
    }
    UCP_ASSERT_OK_AND_ASSIGN(double vb, gpu.Validate());
    EXPECT_LE(Rel(vb, va), tol);
  }
}

// --gpu-attention flash through the trainer: a LLaMA of two heads of 64 (the flash kernels'
// size; the tiny presets' heads are 8 wide), 4 steps against the CPU engine with the bf16 GEMMs'
// bounds, and the held-out loss.
TEST(CudaTrainFlash, StepsMatchTheCpuEngine) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ucp::testing::TempDir tmp;
  const fs::path model = tmp.path() / "llama-flash.json";
  std::ofstream(model) << R"({"name": "llama-flash", "family": "llama", "dtype": "bf16",
 "hyper": {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "ffn_hidden": 192,
           "vocab": 250, "max_positions": 64, "make_vocab_size_divisible_by": 8,
           "tied_embeddings": false}})";
  const TrainConfig c = Config(model.string(), "bf16", WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c, Opts(tmp.path() / "cpu", false)));
  const auto a = Losses(cpu, 4);
  ASSERT_EQ(a.size(), 4u);
  UCP_ASSERT_OK_AND_ASSIGN(double va, cpu.Validate());
  RunOptions o = Opts(tmp.path() / "flash", true);
  o.gpu_attention = "flash";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer gpu, Trainer::Create(c, o));
  const auto b = Losses(gpu, 4);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    std::printf("flash step %zu: cpu loss %.9g, cuda loss %.9g, rel %.3g\n", i + 1, a[i], b[i],
                Rel(b[i], a[i]));
    EXPECT_LE(Rel(b[i], a[i]), i == 0 ? 2e-2 : 5e-2) << "step " << i + 1;
  }
  UCP_ASSERT_OK_AND_ASSIGN(double vb, gpu.Validate());
  EXPECT_LE(Rel(vb, va), 5e-2);
}

// Tail buckets on the device Adam (2 groups, and all of them) give the bits of the CPU Adam:
// the same losses and every weight, master and Adam state, bitwise.
class CudaTailTest : public CudaTrainTest {};

TEST_P(CudaTailTest, DeviceAdamTailIsBitwiseTheCpuAdam) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config(GetParam().first, GetParam().second, WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer base, Trainer::Create(c, Opts(tmp.path() / "a", true, 0)));
  const auto la = Losses(base, 3);
  const auto sa = base.StateForTest();
  for (int tail : {2, 6}) {
    SCOPED_TRACE("tail " + std::to_string(tail));
    UCP_ASSERT_OK_AND_ASSIGN(
        Trainer t, Trainer::Create(c, Opts(tmp.path() / ("t" + std::to_string(tail)), true, tail)));
    EXPECT_EQ(Losses(t, 3), la);
    const auto st = t.StateForTest();
    ASSERT_EQ(st.size(), sa.size());
    for (size_t i = 0; i < st.size(); ++i) {
      EXPECT_TRUE(st[i].second == sa[i].second) << st[i].first;
    }
  }
}

// --pipeline overlap on the GPU: each bucket's gradient leaves on the copy stream once an event
// says its backward kernels have run, the CPU Adam steps it while backward goes on, validation
// commits or corrects (clip 1.0: some steps; 1e-3: every step), the weights go back bucket by
// bucket; with tail buckets (2) those cross too and the device Adam steps them after validation.
// The device is deterministic and its Adam bitwise the CPU's, so this is bitwise the sync path on
// the same GPU: every loss, norm and state. The trace shows the transfers. In bf16 validation's
// per-bucket work runs under the next step's forward (docs/adr/0009), whose kernels then overlap
// the weights' copies; once also without speculation (every bucket held for validation).
TEST_P(CudaTailTest, OverlapIsBitwiseTheSyncPath) {
  struct Case {
    double clip;
    int tail;
    bool speculate;
  };
  for (const Case& k : {Case{1.0, 0, true}, Case{1e-3, 0, true}, Case{1.0, 2, true},
                        Case{1.0, 0, false}}) {
    const double clip = k.clip;
    const int tail = k.tail;
    SCOPED_TRACE("clip " + std::to_string(clip) + ", tail " + std::to_string(tail) +
                 (k.speculate ? "" : ", no speculation"));
    ucp::testing::TempDir tmp;
    TrainConfig c = Config(GetParam().first, GetParam().second, WriteText(tmp.path()));
    c.clip_grad = clip;
    UCP_ASSERT_OK_AND_ASSIGN(Trainer sync, Trainer::Create(c, Opts(tmp.path() / "s", true)));
    RunOptions o = Opts(tmp.path() / "o", true, tail, "overlap");
    o.speculation = k.speculate ? "always" : "off";
    o.trace = tmp.path() / "trace.json";
    UCP_ASSERT_OK_AND_ASSIGN(Trainer ov, Trainer::Create(c, o));
    std::vector<double> la, lb, na, nb;
    for (int i = 0; i < 4; ++i) {
      UCP_ASSERT_OK_AND_ASSIGN(StepRecord a, sync.Step());
      UCP_ASSERT_OK_AND_ASSIGN(StepRecord b, ov.Step());
      std::printf("step %d: sync loss %.9g norm %.9g, overlap loss %.9g norm %.9g (%.1f / %.1f ms)\n",
                  i + 1, a.loss, a.grad_norm, b.loss, b.grad_norm, a.seconds * 1e3,
                  b.seconds * 1e3);
      EXPECT_EQ(a.loss, b.loss) << "step " << i + 1;
      EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << i + 1;
    }
    const auto sa = sync.StateForTest(), sb = ov.StateForTest();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_TRUE(sa[i].second == sb[i].second) << sa[i].first;
    }
    std::ifstream f(o.trace);
    const std::string json((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(json.find("grad->host "), std::string::npos);
    EXPECT_NE(json.find("weights->device"), std::string::npos);
  }
}

// Streamed weights (--weights streamed: the embeddings, the head and two layer windows on the
// GPU, each layer crossing when the graph reaches it, its gradients leaving as backward completes
// it) run the same kernels on the same values at the same alignments (WeightWindowBook::kAlign),
// so they give the resident device's bits: sync, and (bf16/fp16) overlapped, every loss, norm and
// state over 4 steps of 2 micro-batches. Prints the device memory and the bytes streamed.
TEST_P(CudaTrainTest, StreamedWeightsAreBitwiseResident) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config(GetParam().first, GetParam().second, WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer resident, Trainer::Create(c, Opts(tmp.path() / "r", true)));
  std::vector<std::string> pipelines = {"sync"};
  if (GetParam().second != "fp32") pipelines.push_back("overlap");
  std::vector<Trainer> streamed;
  for (const std::string& p : pipelines) {
    RunOptions o = Opts(tmp.path() / ("s_" + p), true, 0, p);
    o.weights = "streamed";
    UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, o));
    std::printf("%s\n", t.Describe().c_str());
    streamed.push_back(std::move(t));
  }
  for (int i = 0; i < 4; ++i) {
    UCP_ASSERT_OK_AND_ASSIGN(StepRecord a, resident.Step());
    for (size_t k = 0; k < streamed.size(); ++k) {
      UCP_ASSERT_OK_AND_ASSIGN(StepRecord b, streamed[k].Step());
      std::printf("step %d: resident loss %.9g norm %.9g (%.1f ms), streamed %s loss %.9g norm "
                  "%.9g (%.1f ms)\n",
                  i + 1, a.loss, a.grad_norm, a.seconds * 1e3, pipelines[k].c_str(), b.loss,
                  b.grad_norm, b.seconds * 1e3);
      EXPECT_EQ(a.loss, b.loss) << pipelines[k] << " step " << i + 1;
      EXPECT_EQ(a.grad_norm, b.grad_norm) << pipelines[k] << " step " << i + 1;
    }
  }
  const auto sa = resident.StateForTest();
  for (size_t k = 0; k < streamed.size(); ++k) {
    const auto sb = streamed[k].StateForTest();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_TRUE(sa[i].second == sb[i].second) << pipelines[k] << " " << sa[i].first;
    }
    std::printf("streamed %s: %lld device bytes (resident %lld), %lld bytes crossed in 4 steps\n",
                pipelines[k].c_str(), static_cast<long long>(streamed[k].DeviceBytesInUse()),
                static_cast<long long>(resident.DeviceBytesInUse()),
                static_cast<long long>(streamed[k].DeviceBytesStreamed()));
    EXPECT_LT(streamed[k].DeviceBytesInUse(), resident.DeviceBytesInUse());
    EXPECT_GT(streamed[k].DeviceBytesStreamed(), 0);
  }
}

// The device holds the memory plan's weights, compute copy and gradients byte for byte: beside
// the bf16 GEMMs the compute copy is packed (Fp32ReadRanges), with fp32 GEMMs (and in fp16 and
// fp32 training) whole.
TEST_P(CudaTrainTest, DeviceHoldsThePlansRows) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config(GetParam().first, GetParam().second, WriteText(tmp.path()));
  for (const std::string gemm : {"auto", "fp32"}) {
    const RunOptions o = Opts(tmp.path() / gemm, true, 0, "sync", gemm);
    UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan plan, Trainer::Plan(c, o, PlanMachine{}));
    UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, o));
    auto dev = [&](MemClass m) { return plan.rows[static_cast<size_t>(m)].device_bytes; };
    EXPECT_EQ(dev(MemClass::kWeights) + dev(MemClass::kComputeCopy) + dev(MemClass::kGradients),
              t.DeviceBytesInUse())
        << gemm;
    const bool packed = gemm == "auto" && GetParam().second == "bf16";
    EXPECT_EQ(dev(MemClass::kComputeCopy) < plan.params * 4, packed) << gemm;
  }
}

// Staged host buffers (--host-buffers staged: windows of 64 Ki elements, several per tiny model)
// run the same kernels on the same device buffers; only the host's copies are windows, so every
// loss, norm and state is the whole buffers' over 4 steps, and a save from the device resumes
// whole. Staging trains bf16 only, so the bf16 models.
class CudaStagedTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaStagedTest, StagedHostBuffersAreBitwiseWhole) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config(GetParam(), "bf16", WriteText(tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer whole, Trainer::Create(c, Opts(tmp.path() / "w", true)));
  RunOptions o = Opts(tmp.path() / "s", true);
  o.host_buffers = "staged";
  o.host_window = int64_t{1} << 16;
  UCP_ASSERT_OK_AND_ASSIGN(Trainer staged, Trainer::Create(c, o));
  std::printf("%s\n", staged.Describe().c_str());
  for (int i = 0; i < 4; ++i) {
    UCP_ASSERT_OK_AND_ASSIGN(StepRecord a, whole.Step());
    UCP_ASSERT_OK_AND_ASSIGN(StepRecord b, staged.Step());
    std::printf("step %d: whole loss %.9g norm %.9g (%.1f ms), staged loss %.9g norm %.9g "
                "(%.1f ms)\n", i + 1, a.loss, a.grad_norm, a.seconds * 1e3, b.loss, b.grad_norm,
                b.seconds * 1e3);
    EXPECT_EQ(a.loss, b.loss) << "step " << i + 1;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << i + 1;
  }
  const auto sa = whole.StateForTest();
  const auto sb = staged.StateForTest();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(sa[i].second == sb[i].second) << sa[i].first;
  ASSERT_TRUE(staged.Save().ok());
  RunOptions r = Opts(tmp.path() / "s", true);
  r.resume = tmp.path() / "s";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer resumed, Trainer::Create(c, r));
  const auto sr = resumed.StateForTest();
  ASSERT_EQ(sr.size(), sb.size());
  for (size_t i = 0; i < sr.size(); ++i) EXPECT_TRUE(sr[i].second == sb[i].second) << sr[i].first;
}

// A checkpoint of the CUDA engine (tail pieces on the device) resumes on the CPU engine at
// another layout (zero=2), whose next step's loss matches the CUDA engine's own next step;
// and the CPU's checkpoint resumes on the CUDA engine (zero=0), matching the CPU's next step.
TEST_P(CudaTrainTest, CheckpointsCrossEnginesAndLayouts) {
  ucp::testing::TempDir tmp;
  const TrainConfig c = Config(GetParam().first, GetParam().second, WriteText(tmp.path()));
  const int tail = GetParam().second == "fp32" ? 0 : 2;
  // fp32 GEMMs: the next steps of the two engines are compared at 1e-5.
  UCP_ASSERT_OK_AND_ASSIGN(Trainer gpu,
                           Trainer::Create(c, Opts(tmp.path() / "a", true, tail, "sync", "fp32")));
  Losses(gpu, 3, /*save_at=*/3);
  const auto gpu_next = Losses(gpu, 4);

  TrainConfig c2 = c;
  c2.layout = "tp=1,pp=1,dp=1,zero=2";
  RunOptions r2 = Opts(tmp.path() / "a", false);
  r2.resume = tmp.path() / "a";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer cpu, Trainer::Create(c2, r2));
  ASSERT_EQ(cpu.step(), 3);
  const auto cpu_next = Losses(cpu, 4, /*save_at=*/4);
  ASSERT_EQ(cpu_next.size(), 1u);
  std::printf("step 4 from the CUDA checkpoint: cuda %.9g, cpu (zero=2) %.9g\n", gpu_next[0],
              cpu_next[0]);
  EXPECT_LE(Rel(cpu_next[0], gpu_next[0]), 1e-5);

  TrainConfig c3 = c;
  c3.layout = "tp=1,pp=1,dp=1,zero=0";
  RunOptions r3 = Opts(tmp.path() / "a", true, tail, "sync", "fp32");
  r3.resume = tmp.path() / "a";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer back, Trainer::Create(c3, r3));
  ASSERT_EQ(back.step(), 4);
  const auto back_next = Losses(back, 5);
  const auto cpu_after = Losses(cpu, 5);
  ASSERT_EQ(back_next.size(), 1u);
  ASSERT_EQ(cpu_after.size(), 1u);
  std::printf("step 5 from the CPU checkpoint: cpu %.9g, cuda (zero=0) %.9g\n", cpu_after[0],
              back_next[0]);
  EXPECT_LE(Rel(back_next[0], cpu_after[0]), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Models, CudaTrainTest,
                         ::testing::Values(std::make_pair("llama-tiny", "bf16"),
                                           std::make_pair("gpt-tiny", "bf16"),
                                           std::make_pair("llama-tiny-tied", "fp16"),
                                           std::make_pair("gpt-tiny", "fp32")));

INSTANTIATE_TEST_SUITE_P(Models, CudaStagedTest,
                         ::testing::Values("llama-tiny", "gpt-tiny", "llama-tiny-tied"));

// Tail pieces and the overlapped pipeline need bf16/fp16 training (fp32 training's weights are
// the masters).
INSTANTIATE_TEST_SUITE_P(Models, CudaTailTest,
                         ::testing::Values(std::make_pair("llama-tiny", "bf16"),
                                           std::make_pair("gpt-tiny", "bf16"),
                                           std::make_pair("llama-tiny-tied", "fp16")));

// The reduction on the GPUs (ReduceGradsToHost over NCCL) with the one rank a lent machine has:
// the packing into the flat view (two pieces swapped, padding before, between and after them),
// chunk by chunk (chunks of 1000 cross both pieces), NCCL's all-to-all and the device's ordered
// sum: the block must be the device's gradients at the pieces' places, bitwise, and zero in the
// padding. Then ZeRO-0's all-reduce in place (one rank: the same gradients again), and the
// overlapped pipeline's bucket exchanges. Several GPUs run the same paths under mpirun (not
// available on a one-GPU machine).
TEST(CudaReduce, OneRankBlockIsTheGradientsBitwise) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ModelConfig mc;
  mc.family = Family::kLlama;
  mc.vocab = 301;
  mc.padded_vocab = 320;
  mc.hidden = 96;
  mc.layers = 2;
  mc.heads = 6;
  mc.kv_heads = 2;
  mc.head_dim = 16;
  mc.ffn_hidden = 160;
  mc.max_positions = 64;
  UCP_ASSERT_OK_AND_ASSIGN(Model cpu, Model::Create(mc, 1, 32, 1));
  const int64_t n = cpu.num_params(), half = n / 2;
  PageVector<float> grads(static_cast<size_t>(n));
  PageVector<uint16_t> w16(static_cast<size_t>(n));
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (uint16_t& w : w16) w = Bf16FromFloat(normal(rng));
  std::unique_ptr<Communicator> self = SelfCommunicator();
  TrainDeviceSpec spec;
  spec.model = mc;
  spec.weights = LowpDType::kBf16;
  spec.max_batch = 1;
  spec.seq_len = 32;
  spec.h_grads = grads;
  spec.h_weights16 = w16;
  spec.reduce.comm = self.get();
  spec.reduce.block = n + 40;  // 7 before, 20 between, 13 after
  spec.reduce.pieces = {{0, half, 7, n - half}, {0, 0, 7 + (n - half) + 20, half}};
  spec.reduce.chunk = 1000;
  UCP_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TrainDevice> dev, MakeCudaTrainDevice(spec));
  UCP_ASSERT_OK(dev->UploadWeights());
  UCP_ASSERT_OK(dev->ZeroGrads());
  std::vector<int32_t> in(32), tg(32);
  for (size_t i = 0; i < in.size(); ++i) {
    in[i] = static_cast<int32_t>((i * 37 + 11) % 301);
    tg[i] = static_cast<int32_t>((i * 53 + 5) % 301);
  }
  Batch b;
  b.inputs = in;
  b.targets = tg;
  b.batch = 1;
  b.seq_len = 32;
  UCP_ASSERT_OK(dev->ForwardBackward(b, 1.0f, nullptr).status());
  UCP_ASSERT_OK(dev->GradsToHost());
  std::vector<float> block(static_cast<size_t>(n + 40), NAN);
  UCP_ASSERT_OK(dev->ReduceGradsToHost(block));
  std::vector<float> want(block.size(), 0.0f);
  std::copy(grads.begin() + half, grads.end(), want.begin() + 7);
  std::copy(grads.begin(), grads.begin() + half, want.begin() + 7 + (n - half) + 20);
  EXPECT_EQ(0, std::memcmp(want.data(), block.data(), want.size() * 4));
  size_t nonzero = 0;
  for (float g : grads) nonzero += g != 0.0f ? 1 : 0;
  EXPECT_GT(nonzero, static_cast<size_t>(n / 2)) << "the gradients should not be mostly zero";
  std::vector<float> short_block(10);
  EXPECT_THAT(dev->ReduceGradsToHost(short_block),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("the block holds 10 floats")));
  EXPECT_THAT(dev->Describe(), HasSubstr("gradients reduce-scattered on the GPUs (NCCL)"));

  // ZeRO-0's all-reduce, in place in chunks of 1000: one rank's sum is its gradients.
  const std::vector<float> once(grads.begin(), grads.end());
  dev.reset();
  spec.reduce.all_reduce = true;
  spec.reduce.block = 0;
  spec.reduce.pieces.clear();
  UCP_ASSERT_OK_AND_ASSIGN(dev, MakeCudaTrainDevice(spec));
  EXPECT_THAT(dev->Describe(), HasSubstr("gradients all-reduced on the GPUs (NCCL)"));
  UCP_ASSERT_OK(dev->UploadWeights());
  UCP_ASSERT_OK(dev->ZeroGrads());
  UCP_ASSERT_OK(dev->ForwardBackward(b, 1.0f, nullptr).status());
  std::fill(grads.begin(), grads.end(), NAN);
  UCP_ASSERT_OK(dev->AllReduceGradsToHost());
  EXPECT_EQ(0, std::memcmp(once.data(), grads.data(), once.size() * 4));

  // --pipeline overlap's bucket exchanges (ZeRO 1-3's all-to-all and sum; ZeRO-0's
  // all-reduce), in chunks of 1000: each grad group's sum is its gradients.
  UCP_ASSERT_OK_AND_ASSIGN(auto ranges, GradGroupRanges(mc));
  for (const bool zero0 : {false, true}) {
    SCOPED_TRACE(zero0 ? "ZeRO-0" : "ZeRO 1-3");
    dev.reset();
    spec.reduce.all_reduce = false;
    spec.reduce.buckets.clear();
    for (const auto& [begin, end] : ranges) {
      BucketExchange ex;
      ex.pack = {{begin + (end - begin) / 2, end - begin - (end - begin) / 2},
                 {begin, (end - begin) / 2}};  // two pieces, swapped
      ex.sum_n = end - begin;
      if (!zero0) ex.send_counts = ex.recv_counts = {ex.sum_n};
      spec.reduce.buckets.push_back(ex);
    }
    UCP_ASSERT_OK_AND_ASSIGN(dev, MakeCudaTrainDevice(spec));
    EXPECT_THAT(dev->Describe(), HasSubstr("each bucket reduced on the GPUs (NCCL)"));
    UCP_ASSERT_OK(dev->UploadWeights());
    UCP_ASSERT_OK(dev->ZeroGrads());
    UCP_ASSERT_OK(dev->ForwardBackward(b, 1.0f, nullptr).status());
    for (size_t k = 0; k < ranges.size(); ++k) {
      const auto [begin, end] = ranges[k];
      const int64_t mid = begin + (end - begin) / 2;
      std::vector<float> sum(static_cast<size_t>(end - begin), NAN), bucket;
      bucket.insert(bucket.end(), once.begin() + mid, once.begin() + end);
      bucket.insert(bucket.end(), once.begin() + begin, once.begin() + mid);
      UCP_ASSERT_OK(dev->ExchangeBucketToHost(static_cast<int>(k), sum));
      EXPECT_EQ(0, std::memcmp(bucket.data(), sum.data(), sum.size() * 4)) << "group " << k;
    }
  }
}

}  // namespace
}  // namespace ucp::offload::cuda
