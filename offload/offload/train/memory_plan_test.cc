// The memory plan against the buffers a live trainer allocates (every tensor class, every byte),
// ActivationBytes against a created model, and the placement and cast decisions.
#include "offload/train/memory_plan.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "offload/model/gpu_sizes.h"
#include "offload/train/device.h"
#include "offload/train/trainer.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"

namespace ucp::offload {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

fs::path WriteText(const fs::path& dir) {
  const fs::path p = dir / "text.txt";
  std::ofstream f(p);
  for (int i = 0; i < 80; ++i) {
    f << "All that glitters is not gold; all who wander are not lost. " << i << "\n";
  }
  return p;
}

ModelConfig Llama() {
  ModelConfig c;
  c.family = Family::kLlama;
  c.vocab = 100;
  c.padded_vocab = 128;
  c.hidden = 64;
  c.layers = 6;  // more than the two windows of streaming
  c.heads = 8;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.ffn_hidden = 96;
  c.max_positions = 64;
  c.tied_embeddings = false;
  return c;
}

// ActivationBytes is the allocation of Model::Create, with and without sequence parallelism's
// buffers (those need a communicator, so only the formula's sp > 1 refusal is checked here).
TEST(ActivationBytes, EqualsWhatTheModelAllocates) {
  for (int threads : {1, 3}) {
    for (int64_t batch : {1, 4}) {
      UCP_ASSERT_OK_AND_ASSIGN(Model m, Model::Create(Llama(), batch, 32, threads));
      UCP_ASSERT_OK_AND_ASSIGN(int64_t predicted, ActivationBytes(Llama(), batch, 32, threads));
      EXPECT_EQ(m.activation_bytes(), predicted) << "batch " << batch << " threads " << threads;
      EXPECT_GT(predicted, 0);
    }
  }
  EXPECT_FALSE(ActivationBytes(Llama(), 1, 32, 1, /*sp=*/3).ok());  // heads % 3 != 0
  EXPECT_FALSE(ActivationBytes(Llama(), 0, 32, 1).ok());
}

// A tiny run in `dir`: 2 steps of 4 samples of 32 tokens, micro-batches of 2, 2 threads.
std::pair<TrainConfig, RunOptions> TinyRun(const fs::path& dir, const std::string& model,
                                           const std::string& dtype, const std::string& layout,
                                           const std::string& pipeline) {
  TrainConfig c;
  c.model = model;
  c.dtype = dtype;
  c.data = WriteText(dir).string();
  c.seq_len = 32;
  c.global_batch = 4;
  c.micro_batch = 2;
  c.steps = 2;
  c.layout = layout;
  RunOptions o;
  o.out = dir / "run";
  o.threads = 2;
  // "overlap-nospec": the overlapped pipeline without speculation (no snapshots); "staged" and
  // "staged-one": --pipeline sync with staged host buffers, windows of 64 Ki elements or one
  // window of the whole model; "overlap-tail": overlapped, the last 2 grad groups on the
  // device Adam (--gpu-tail-buckets 2).
  o.pipeline = pipeline == "overlap-nospec" || pipeline == "overlap-tail" ? "overlap"
               : pipeline.rfind("staged", 0) == 0 ? "sync" : pipeline;
  if (pipeline == "overlap-tail") o.gpu_tail_buckets = 2;
  o.speculation = pipeline == "overlap-nospec" ? "off" : "auto";
  if (pipeline.rfind("staged", 0) == 0) {
    o.host_buffers = "staged";
    o.host_window = pipeline == "staged" ? int64_t{1} << 16 : 0;
  }
  return {c, o};
}

// The run's plan, and what its trainer holds after a step and a save.
struct PlannedAndUsed {
  MemoryPlan plan;
  std::vector<int64_t> used;  // Trainer::MemoryInUse
  int64_t device = 0;         // Trainer::DeviceBytesInUse
  int64_t params = 0;
};
void PlanAndRun(const TrainConfig& c, const RunOptions& o, PlannedAndUsed* out) {
  UCP_ASSERT_OK_AND_ASSIGN(out->plan, Trainer::Plan(c, o, PlanMachine{}));
  UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, o));
  ASSERT_TRUE(t.Step().ok());
  ASSERT_TRUE(t.Save().ok());
  ASSERT_TRUE(t.Wait().ok());
  out->used = t.MemoryInUse();
  out->device = t.DeviceBytesInUse();
  out->params = t.num_params();
  ASSERT_EQ(out->plan.rows.size(), out->used.size());
}

// Each row's `column` against the bytes in use, class by class; returns their sum.
int64_t ExpectColumn(const PlannedAndUsed& r, int64_t MemoryRow::*column) {
  int64_t total = 0;
  for (size_t k = 0; k < r.used.size(); ++k) {
    EXPECT_EQ(static_cast<size_t>(r.plan.rows[k].cls), k);
    EXPECT_EQ(r.plan.rows[k].*column, r.used[k]) << r.plan.rows[k].name;
    total += r.used[k];
  }
  return total;
}

// Every class of the plan equals what a trainer of the same config holds after a step and a save.
class PlanMatchesTrainer
    : public ::testing::TestWithParam<
          std::tuple<std::string, std::string, std::string, std::string, bool>> {};

TEST_P(PlanMatchesTrainer, EveryClassEveryByte) {
  const auto& [model, dtype, layout, pipeline, async_save] = GetParam();
  ucp::testing::TempDir tmp;
  auto [c, o] = TinyRun(tmp.path(), model, dtype, layout, pipeline);
  o.async_save = async_save;
  PlannedAndUsed r;
  ASSERT_NO_FATAL_FAILURE(PlanAndRun(c, o, &r));
  const MemoryPlan& plan = r.plan;
  const std::vector<int64_t>& used = r.used;
  EXPECT_EQ(plan.cpu_total, ExpectColumn(r, &MemoryRow::cpu_bytes));
  EXPECT_EQ(plan.params, r.params);
  const int64_t staged = used[static_cast<size_t>(MemClass::kSaveStaging)];
  EXPECT_EQ(staged > 0, async_save) << "a foreground save stages nothing";
}

INSTANTIATE_TEST_SUITE_P(
    Configs, PlanMatchesTrainer,
    ::testing::Values(std::make_tuple("gpt-tiny", "bf16", "dp=1,zero=1", "sync", true),
                      std::make_tuple("gpt-tiny", "fp32", "dp=1,zero=0", "overlap", true),
                      std::make_tuple("llama-tiny", "fp16", "dp=1,zero=3", "overlap", false),
                      std::make_tuple("llama-tiny", "bf16", "dp=1,zero=2", "overlap", false),
                      std::make_tuple("llama-tiny", "bf16", "dp=1,zero=1", "overlap-nospec",
                                      false)));

// With --recompute (some layers, all of them) the CPU column still equals a live trainer's
// bytes, class by class, the activations' included.
TEST(PlanMatchesTrainerRecomputing, EveryClassEveryByte) {
  for (const char* rc : {"2", "all"}) {
    SCOPED_TRACE(std::string("--recompute ") + rc);
    ucp::testing::TempDir tmp;
    auto [c, o] = TinyRun(tmp.path(), "llama-tiny", "bf16", "dp=1,zero=1", "sync");
    o.recompute = rc;
    PlannedAndUsed r;
    ASSERT_NO_FATAL_FAILURE(PlanAndRun(c, o, &r));
    EXPECT_EQ(r.plan.cpu_total, ExpectColumn(r, &MemoryRow::cpu_bytes));
    EXPECT_THAT(r.plan.rows[static_cast<size_t>(MemClass::kActivations)].note,
                HasSubstr("recomputed in backward"));
  }
}

// The GPU columns against a trainer on the CPU twin device (the trainer's code path of
// --device cuda): every host class byte for byte, and the device's weights, compute copy,
// gradients and (with tail groups on the device Adam) optimizer state against the device's own
// buffers.
class GpuPlanMatchesTwinTrainer
    : public ::testing::TestWithParam<std::tuple<std::string, std::string, std::string>> {};

TEST_P(GpuPlanMatchesTwinTrainer, HostEveryClassDeviceStateBuffers) {
  const auto& [model, dtype, pipeline] = GetParam();
  ucp::testing::TempDir tmp;
  auto [c, o] = TinyRun(tmp.path(), model, dtype, "dp=1,zero=1", pipeline);
  o.device = "twin";
  PlannedAndUsed r;
  ASSERT_NO_FATAL_FAILURE(PlanAndRun(c, o, &r));
  const MemoryPlan& plan = r.plan;
  EXPECT_EQ(plan.host_total, ExpectColumn(r, &MemoryRow::host_bytes));
  auto dev = [&](MemClass m) { return plan.rows[static_cast<size_t>(m)].device_bytes; };
  EXPECT_EQ(dev(MemClass::kWeights) + dev(MemClass::kComputeCopy) + dev(MemClass::kGradients) +
                dev(MemClass::kOptimizer),
            r.device);
  // Offloaded, but for the tail groups' (12 B for each of some of the parameters).
  if (pipeline == "overlap-tail") {
    EXPECT_GT(dev(MemClass::kOptimizer), 0);
    EXPECT_LT(dev(MemClass::kOptimizer), 12 * plan.params);
    EXPECT_EQ(dev(MemClass::kOptimizer) % 12, 0);
  } else {
    EXPECT_EQ(dev(MemClass::kOptimizer), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, GpuPlanMatchesTwinTrainer,
                         ::testing::Values(std::make_tuple("gpt-tiny", "bf16", "sync"),
                                           std::make_tuple("llama-tiny", "fp16", "overlap"),
                                           std::make_tuple("llama-tiny", "bf16", "overlap"),
                                           std::make_tuple("llama-tiny", "bf16", "overlap-nospec"),
                                           std::make_tuple("llama-tiny", "bf16", "overlap-tail"),
                                           std::make_tuple("llama-tiny", "bf16", "staged"),
                                           std::make_tuple("gpt-tiny", "bf16", "staged-one"),
                                           std::make_tuple("gpt-tiny", "fp32", "sync")));

// --weights auto on a device with a byte less than the resident weights need: the plan picks
// streamed weights and the twin trainer streams, holding on its device exactly the plan's
// streamed weights, compute copy and gradients (the embeddings, the head and two layer windows),
// its host side unchanged.
class GpuPlanStreamedMatchesTwinTrainer
    : public ::testing::TestWithParam<std::tuple<std::string, std::string, std::string>> {};

TEST_P(GpuPlanStreamedMatchesTwinTrainer, AutoPicksStreamedAndTheDeviceHoldsItsRows) {
  const auto& [model, dtype, pipeline] = GetParam();
  ucp::testing::TempDir tmp;
  auto [c, o] = TinyRun(tmp.path(), model, dtype, "dp=1,zero=1", pipeline);
  o.device = "twin";
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan resident, Trainer::Plan(c, o, PlanMachine{}));
  PlanMachine m;  // the trainer's default reserve
  m.device_bytes = m.device_reserve_bytes + resident.device_total - 1;
  o.device_memory = m.device_bytes;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan plan, Trainer::Plan(c, o, m));
  ASSERT_EQ(plan.placement, WeightPlacement::kStreamed) << plan.verdict;
  EXPECT_TRUE(plan.device_fits) << plan.verdict;
  EXPECT_EQ(plan.host_total, resident.host_total);
  UCP_ASSERT_OK_AND_ASSIGN(Trainer t, Trainer::Create(c, o));
  ASSERT_TRUE(t.Step().ok());
  auto dev = [&](MemClass k) { return plan.rows[static_cast<size_t>(k)].device_bytes; };
  EXPECT_EQ(dev(MemClass::kWeights) + dev(MemClass::kComputeCopy) + dev(MemClass::kGradients),
            t.DeviceBytesInUse());
  EXPECT_LT(t.DeviceBytesInUse(), resident.rows[0].device_bytes + resident.rows[1].device_bytes +
                                      resident.rows[2].device_bytes);
  EXPECT_GT(t.DeviceBytesStreamed(), 0);
  EXPECT_THAT(t.Describe(), HasSubstr("weights streamed"));

  // With device-Adam tail buckets auto keeps the weights resident (streaming holds none).
  if (o.pipeline == "overlap" && dtype != "fp32") {
    RunOptions tail = o;
    tail.gpu_tail_buckets = 1;
    tail.out = tmp.path() / "tail";
    UCP_ASSERT_OK_AND_ASSIGN(Trainer tt, Trainer::Create(c, tail));
    EXPECT_EQ(tt.DeviceBytesStreamed(), 0);
    EXPECT_THAT(tt.Describe(), ::testing::Not(HasSubstr("weights streamed")));
  }
  // "resident" overrides the plan; an unknown placement is refused.
  o.weights = "resident";
  o.out = tmp.path() / "resident";
  UCP_ASSERT_OK_AND_ASSIGN(Trainer r, Trainer::Create(c, o));
  EXPECT_EQ(r.DeviceBytesStreamed(), 0);
  o.weights = "paged";
  o.out = tmp.path() / "paged";
  EXPECT_THAT(Trainer::Create(c, o).status().message(), HasSubstr("--weights paged"));
}

INSTANTIATE_TEST_SUITE_P(Configs, GpuPlanStreamedMatchesTwinTrainer,
                         ::testing::Values(std::make_tuple("gpt-tiny", "bf16", "sync"),
                                           std::make_tuple("llama-tiny", "fp16", "overlap"),
                                           std::make_tuple("llama-tiny-tied", "bf16", "overlap"),
                                           std::make_tuple("gpt-tiny", "fp32", "sync")));

PlanInput Input(int64_t micro_batch) {
  PlanInput in;
  in.config = Llama();
  Result<ParamTable> t = ModelParamTable(in.config);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (t.ok()) {
    for (const ParamInfo& p : t->params) in.optimizer_group.push_back(p.shape.size() >= 2 ? 0 : 1);
  }
  in.micro_batch = micro_batch;
  in.seq_len = 64;
  return in;
}

// Weights resident while they fit; streamed per layer once the activations need the space; and
// a verdict naming the shortfall when even streaming does not fit.
TEST(PlanPlacement, ResidentThenStreamedThenTooSmall) {
  PlanMachine m;
  m.device_reserve_bytes = 0;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan unbounded, PlanMemory(Input(1), m));
  EXPECT_EQ(unbounded.placement, WeightPlacement::kResident);
  EXPECT_THAT(unbounded.verdict, HasSubstr("no device capacity"));

  m.device_bytes = unbounded.device_total;  // exactly enough
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan fits, PlanMemory(Input(1), m));
  EXPECT_EQ(fits.placement, WeightPlacement::kResident);
  EXPECT_TRUE(fits.device_fits);

  // A longer micro-batch: its activations push the weights out to the host.
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan big_unbounded, PlanMemory(Input(8), PlanMachine{}));
  m.device_bytes = big_unbounded.device_total - 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan streamed, PlanMemory(Input(8), m));
  EXPECT_EQ(streamed.placement, WeightPlacement::kStreamed);
  EXPECT_TRUE(streamed.device_fits) << streamed.verdict;
  EXPECT_LT(streamed.device_total, big_unbounded.device_total);
  EXPECT_EQ(streamed.rows[0].host_bytes, streamed.params * 2);  // all weights pinned on the host
  EXPECT_THAT(streamed.verdict, HasSubstr("streamed per layer"));

  m.device_bytes = 1 << 20;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan small, PlanMemory(Input(8), m));
  EXPECT_FALSE(small.device_fits);
  EXPECT_THAT(small.verdict, HasSubstr("does not fit: streamed"));

  // --weights resident or streamed overrides the capacity's choice (and names itself).
  PlanInput in = Input(8);
  in.weights = WeightChoice::kResident;
  m.device_bytes = big_unbounded.device_total - 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan forced_resident, PlanMemory(in, m));
  EXPECT_EQ(forced_resident.placement, WeightPlacement::kResident);
  EXPECT_THAT(forced_resident.verdict, HasSubstr("does not fit: resident"));
  in.weights = WeightChoice::kStreamed;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan forced_streamed, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(forced_streamed.placement, WeightPlacement::kStreamed);
  EXPECT_EQ(forced_streamed.device_total, streamed.device_total);
  EXPECT_THAT(forced_streamed.verdict, HasSubstr("streamed per layer (as --weights asks)"));
  EXPECT_FALSE(ParseWeightChoice("paged").ok());
}

// Staged host buffers: the host's weights and gradients shrink to a window each, the weights
// stay resident, and where whole buffers do not fit the host the verdict says whether staged
// ones would.
TEST(PlanHostBuffers, StagedKeepsWindowsAndTheVerdictSaysWhenItFits) {
  PlanInput in = Input(1);
  in.config.hidden = 2048;  // 1.1B parameters: more than one default window
  in.config.layers = 22;
  in.config.heads = 32;
  in.config.kv_heads = 4;
  in.config.head_dim = 64;
  in.config.ffn_hidden = 5632;
  in.config.vocab = 32000;
  in.config.padded_vocab = 32000;
  UCP_ASSERT_OK_AND_ASSIGN(ParamTable table, ModelParamTable(in.config));
  in.optimizer_group.clear();
  for (const ParamInfo& p : table.params) in.optimizer_group.push_back(p.shape.size() >= 2 ? 0 : 1);
  in.async_save = false;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan whole, PlanMemory(in, PlanMachine{}));
  const int64_t n = whole.params;
  ASSERT_GT(n, kStagedSlots * kDefaultHostWindow);
  EXPECT_EQ(whole.rows[0].host_bytes, n * 2);
  EXPECT_EQ(whole.rows[2].host_bytes, n * 4);
  in.host_window = kDefaultHostWindow;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan staged, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(staged.rows[0].host_bytes, kStagedSlots * kDefaultHostWindow * 2);
  EXPECT_EQ(staged.rows[2].host_bytes, kStagedSlots * kDefaultHostWindow * 4);
  EXPECT_EQ(whole.host_total - staged.host_total, (n - kStagedSlots * kDefaultHostWindow) * 6);
  EXPECT_EQ(staged.device_total, whole.device_total);  // the device holds the same

  PlanMachine m;
  in.host_window = 0;
  m.host_bytes = whole.host_total - 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan tight, PlanMemory(in, m));
  EXPECT_FALSE(tight.host_fits);
  EXPECT_THAT(tight.verdict, HasSubstr("(it fits with --host-buffers staged: "));
  m.host_bytes = staged.host_total - 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan tighter, PlanMemory(in, m));
  EXPECT_THAT(tighter.verdict, HasSubstr("(not even with --host-buffers staged: "));
  // With background saves, foreground ones are the first remedy, then both.
  in.async_save = true;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan saving, PlanMemory(in, PlanMachine{}));
  const int64_t save_row = saving.rows[static_cast<size_t>(MemClass::kSaveStaging)].host_bytes;
  ASSERT_GT(save_row, 0);
  m.host_bytes = saving.host_total - 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan sync_fits, PlanMemory(in, m));
  EXPECT_THAT(sync_fits.verdict, HasSubstr("(it fits with --sync-save: "));
  m.host_bytes = whole.host_total - 1;  // the foreground whole plan does not fit; staged does
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan both, PlanMemory(in, m));
  EXPECT_THAT(both.verdict, HasSubstr("(it fits with --sync-save --host-buffers staged: "));
  in.async_save = false;
  in.host_window = kDefaultHostWindow;
  m.host_bytes = staged.host_total;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan fits, PlanMemory(in, m));
  EXPECT_TRUE(fits.host_fits);
  EXPECT_THAT(fits.verdict, HasSubstr("buffers staged as --host-buffers asks)"));
  EXPECT_THAT(fits.verdict, ::testing::Not(HasSubstr("with --host-buffers staged")));

  // Staged buffers keep the weights resident: --weights auto does not stream them.
  m.device_bytes = whole.device_total / 2;
  m.device_reserve_bytes = 0;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan small, PlanMemory(in, m));
  EXPECT_EQ(small.placement, WeightPlacement::kResident);
  EXPECT_FALSE(small.device_fits);
}

// An overlapped run whose host side does not fit: without speculation it drops the snapshots
// (12 B per state element), before staging, which the overlapped pipeline does not run; with
// background saves, foreground ones come first, then both.
TEST(PlanHostBuffers, AnOverlappedRunFitsWithoutSpeculation) {
  PlanInput in = Input(1);
  in.overlap = true;
  in.async_save = false;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan spec, PlanMemory(in, PlanMachine{}));
  in.speculate = false;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan off, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(spec.host_total - off.host_total, spec.params * 12);  // one block at dp=1
  in.speculate = true;
  PlanMachine m;
  m.host_bytes = off.host_total;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan tight, PlanMemory(in, m));
  EXPECT_FALSE(tight.host_fits);
  EXPECT_THAT(tight.verdict, HasSubstr("(it fits with --speculation off: "));
  EXPECT_THAT(tight.verdict, ::testing::Not(HasSubstr("--host-buffers staged")));
  m.host_bytes = off.host_total - 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan tighter, PlanMemory(in, m));
  EXPECT_THAT(tighter.verdict, HasSubstr("(not even with --speculation off: "));
  in.async_save = true;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan saving, PlanMemory(in, PlanMachine{}));
  const int64_t save_row = saving.rows[static_cast<size_t>(MemClass::kSaveStaging)].host_bytes;
  m.host_bytes = saving.host_total - 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan sync_fits, PlanMemory(in, m));
  EXPECT_THAT(sync_fits.verdict, HasSubstr("(it fits with --sync-save: "));
  m.host_bytes = saving.host_total - save_row - 1;  // the snapshots must go too
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan both, PlanMemory(in, m));
  EXPECT_THAT(both.verdict, HasSubstr("(it fits with --sync-save --speculation off: "));
}

// The GPU column's activations are the CUDA model's: its activations (the CPU model's buffers)
// and its scratch, sized by gpu_sizes.h (what CudaModel::Create allocates with). The GEMM
// attention holds at least one KV group of T x T pass buffers, however long the sequence.
TEST(PlanDeviceActivations, AreTheCudaModelsBuffersAndScratch) {
  PlanInput in = Input(2);
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan plan, PlanMemory(in, PlanMachine{}));
  UCP_ASSERT_OK_AND_ASSIGN(int64_t bf16, DeviceActivationBytes(in.config, 2, 64, true));
  UCP_ASSERT_OK_AND_ASSIGN(int64_t fp32, DeviceActivationBytes(in.config, 2, 64, false));
  EXPECT_EQ(plan.rows[static_cast<size_t>(MemClass::kActivations)].device_bytes, bf16);
  const ModelConfig& c = in.config;
  const gpu::ModelScratch s16 = gpu::CudaModelScratch(c, true, 2, 64, true);
  const gpu::ModelScratch s32 = gpu::CudaModelScratch(c, true, 2, 64, false);
  EXPECT_EQ(bf16 - fp32, s16.gemm16 * 2 + s16.attn_gemm_bytes);
  EXPECT_EQ(s32.gemm16, 0);
  EXPECT_EQ(s16.classifier_floats, 2 * 64 * c.vocab + 2 * 2 * 64 + 2);  // the logits
  in.gpu_gemm_bf16 = false;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan plan32, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(plan32.rows[static_cast<size_t>(MemClass::kActivations)].device_bytes, fp32);
  // The flash kernels hold their own scratch (the bf16 qkv and dout, each query's D: no T x T
  // buffers) in place of the GEMM attention's; beside fp32 GEMMs they change nothing.
  in.gpu_gemm_bf16 = true;
  in.gpu_flash_attention = true;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan flash, PlanMemory(in, PlanMachine{}));
  const int64_t flash_bytes =
      gpu::FlashAttentionScratchBytes(2, 64, c.heads, c.kv_heads, c.head_dim);
  EXPECT_EQ(flash_bytes, gpu::AttnAlignUp(2 * 64 * (c.heads + 2 * c.kv_heads) * c.head_dim * 2) +
                             gpu::AttnAlignUp(2 * 64 * c.heads * c.head_dim * 2) +
                             gpu::AttnAlignUp(2 * c.heads * 64 * 4));
  EXPECT_EQ(flash.rows[static_cast<size_t>(MemClass::kActivations)].device_bytes,
            bf16 - s16.attn_gemm_bytes + flash_bytes);
  EXPECT_EQ(gpu::CudaModelScratch(c, true, 2, 64, true, true).attn_gemm_bytes, 0);
  EXPECT_EQ(gpu::CudaModelScratch(c, true, 2, 64, false, true).bytes(), s32.bytes());
  // At a long sequence the GEMM attention's pass buffers dwarf the flash scratch.
  EXPECT_LT(gpu::FlashAttentionScratchBytes(1, 32768, c.heads, c.kv_heads, c.head_dim),
            gpu::AttentionGemmScratchBytes(1, 32768, c.heads, c.kv_heads, c.head_dim) / 4);
  // A long sequence: one KV group of pairs (heads / kv_heads of them) even past the 2 GiB pass.
  const int64_t T = 32768, hpg = c.heads / c.kv_heads;
  const int64_t pass = gpu::AttentionGemmScratchBytes(1, T, c.heads, c.kv_heads, c.head_dim);
  EXPECT_GE(pass, hpg * gpu::AttnPairBytes(T, c.head_dim));
  EXPECT_GT(pass, gpu::kAttnPassBytes);
}

// --recompute: both columns' activations are the recomputing models' (ActivationBytes and
// DeviceActivationBytes with the same Recompute), falling as more layers are recomputed, and the
// row says how many; a device that streams the weights without it keeps them resident with it.
TEST(PlanRecompute, CountsTheRecomputingModelsActivations) {
  PlanInput in = Input(4);
  const int64_t L = in.config.layers;
  const auto act = static_cast<size_t>(MemClass::kActivations);
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan kept, PlanMemory(in, PlanMachine{}));
  EXPECT_THAT(kept.rows[act].note, ::testing::Not(HasSubstr("recomputed")));
  int64_t last_cpu = kept.rows[act].cpu_bytes, last_gpu = kept.rows[act].device_bytes;
  for (int64_t r = 2; r <= L; ++r) {
    in.recompute = Recompute{r};
    UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan rc, PlanMemory(in, PlanMachine{}));
    UCP_ASSERT_OK_AND_ASSIGN(int64_t cpu, ActivationBytes(in.config, 4, 64, in.threads, 1,
                                                          in.recompute));
    UCP_ASSERT_OK_AND_ASSIGN(int64_t gpu, DeviceActivationBytes(in.config, 4, 64, true, false, 1,
                                                                in.recompute));
    EXPECT_EQ(rc.rows[act].cpu_bytes, cpu);
    EXPECT_EQ(rc.rows[act].device_bytes, gpu);
    EXPECT_LT(cpu, last_cpu) << r;
    EXPECT_LT(gpu, last_gpu) << r;
    last_cpu = cpu, last_gpu = gpu;
    EXPECT_THAT(rc.rows[act].note,
                HasSubstr(r == L ? "all 6 layers recomputed in backward"
                                 : "the first " + std::to_string(r) + " of 6 layers recomputed"));
  }
  in.recompute = Recompute::All();
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan all, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(all.rows[act].device_bytes, last_gpu);

  PlanMachine m;
  m.device_reserve_bytes = 0;
  m.device_bytes = (kept.device_total + all.device_total) / 2;
  in.recompute = Recompute::None();
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan tight, PlanMemory(in, m));
  in.recompute = Recompute::All();
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan tight_rc, PlanMemory(in, m));
  EXPECT_EQ(tight.placement, WeightPlacement::kStreamed);
  EXPECT_EQ(tight_rc.placement, WeightPlacement::kResident);
  EXPECT_TRUE(tight_rc.device_fits);
}

// --recompute auto (ChooseRecompute): the fewest layers for the side to fit: none where it fits
// without (streaming first, as --weights auto picks) or the capacity is unknown, all where
// nothing fits; and a plan that does not fit names that count in its verdict.
TEST(PlanRecompute, ChoosesTheFewestLayersThatFit) {
  PlanInput in = Input(4);
  const int64_t L = in.config.layers;
  PlanMachine m;
  m.device_reserve_bytes = 0;
  UCP_ASSERT_OK_AND_ASSIGN(Recompute unknown, ChooseRecompute(in, m, true));
  EXPECT_EQ(unknown, Recompute::None());
  // Each count's device need (weights resident), and the device of exactly r's need: r fits,
  // r - 1 does not (r >= 3: r = 1 keeps every slot, so 2 is the first that saves).
  std::vector<int64_t> need(static_cast<size_t>(L + 1));
  for (int64_t r = 0; r <= L; ++r) {
    in.recompute = Recompute{r};
    UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan p, PlanMemory(in, m));
    need[static_cast<size_t>(r)] = p.device_total;
  }
  EXPECT_EQ(need[1], need[0]);
  in.weights = WeightChoice::kResident;  // so the need is the resident one at every count
  for (int64_t r = 2; r <= L; ++r) {
    m.device_bytes = need[static_cast<size_t>(r)];
    in.recompute = Recompute::All();  // ignored: the choice starts from none
    UCP_ASSERT_OK_AND_ASSIGN(Recompute got, ChooseRecompute(in, m, true));
    EXPECT_EQ(got.Of(L), r) << "device of " << m.device_bytes << " B";
    EXPECT_EQ(got == Recompute::All(), r == L);
  }
  m.device_bytes = need[0];
  UCP_ASSERT_OK_AND_ASSIGN(Recompute none, ChooseRecompute(in, m, true));
  EXPECT_EQ(none, Recompute::None());
  m.device_bytes = need[static_cast<size_t>(L)] - 1;
  UCP_ASSERT_OK_AND_ASSIGN(Recompute most, ChooseRecompute(in, m, true));
  EXPECT_EQ(most, Recompute::All());

  // --weights auto: recomputing layers comes before streaming the weights. On a device the run
  // fits streamed without recomputing, the fewest layers that fit resident; on one where no
  // count fits resident, the fewest that fit streamed.
  std::vector<int64_t> streamed_need(static_cast<size_t>(L + 1));
  in.weights = WeightChoice::kStreamed;
  for (int64_t r = 0; r <= L; ++r) {
    in.recompute = Recompute{r};
    UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan p, PlanMemory(in, PlanMachine{}));
    streamed_need[static_cast<size_t>(r)] = p.device_total;
  }
  auto fewest = [&](const std::vector<int64_t>& needs, int64_t bytes) {
    int64_t r = 0;
    while (r <= L && needs[static_cast<size_t>(r)] > bytes) ++r;
    return r;
  };
  in.weights = WeightChoice::kAuto;
  m.device_bytes = streamed_need[0];
  const int64_t resident_r = fewest(need, m.device_bytes);
  ASSERT_GE(resident_r, 2);
  ASSERT_LE(resident_r, L);
  UCP_ASSERT_OK_AND_ASSIGN(Recompute before_streaming, ChooseRecompute(in, m, true));
  EXPECT_EQ(before_streaming.Of(L), resident_r);
  m.device_bytes = need[static_cast<size_t>(L)] - 1;  // resident never fits
  const int64_t streamed_r = fewest(streamed_need, m.device_bytes);
  ASSERT_LE(streamed_r, L);
  UCP_ASSERT_OK_AND_ASSIGN(Recompute streaming, ChooseRecompute(in, m, true));
  EXPECT_EQ(streaming.Of(L), streamed_r);
  in.weights = WeightChoice::kResident;

  // The verdicts: the count that fits, or that even all do not.
  in.recompute = Recompute::None();
  m.device_bytes = need[3];
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan three, PlanMemory(in, m));
  ASSERT_FALSE(three.device_fits);
  EXPECT_THAT(three.verdict, HasSubstr("or recompute layers (--recompute 3: it fits, " +
                                       FormatBytes(need[3]) + " with weights resident)"));
  m.device_bytes = need[static_cast<size_t>(L)] - 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan short_of_all, PlanMemory(in, m));
  EXPECT_THAT(short_of_all.verdict,
              HasSubstr("(not even with --recompute all: " + FormatBytes(need[L]) + ")"));
  in.recompute = Recompute::All();
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan all_short, PlanMemory(in, m));
  EXPECT_FALSE(all_short.device_fits);
  EXPECT_THAT(all_short.verdict, ::testing::Not(HasSubstr("--recompute")));

  // The CPU engine: by the host's capacity.
  in.recompute = Recompute::None();
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan cpu0, PlanMemory(in, PlanMachine{}));
  in.recompute = Recompute{4};
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan cpu4, PlanMemory(in, PlanMachine{}));
  PlanMachine h;
  h.host_bytes = cpu4.cpu_total;
  UCP_ASSERT_OK_AND_ASSIGN(Recompute host, ChooseRecompute(in, h, false));
  EXPECT_EQ(host, Recompute{4});
  in.recompute = Recompute::None();
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan cpu_short, PlanMemory(in, h));
  EXPECT_FALSE(cpu_short.cpu_fits);
  EXPECT_THAT(cpu_short.verdict,
              HasSubstr("the CPU engine does NOT fit (" + FormatBytes(cpu0.cpu_total) +
                        ") (it fits with --recompute 4: " + FormatBytes(cpu4.cpu_total) + ")"));
}

// --gpu-tail-buckets auto: the most grad groups (from the last) whose masters and Adam states
// fit beside everything else with kTailHeadroom of the device free; none where the capacity is
// unknown, the weights are streamed (asked, or --weights auto's choice) or buffers staged.
TEST(PlanTail, ChoosesTheMostGroupsThatFit) {
  PlanInput in = Input(1);
  UCP_ASSERT_OK_AND_ASSIGN(const ParamTable table, ModelParamTable(in.config));
  const int groups = static_cast<int>(table.groups.size());
  ASSERT_EQ(groups, 8);  // head, 6 layers, embedding
  // Each count's device need, and the device each needs with the headroom kept.
  std::vector<int64_t> need;
  int64_t last_elements = -1;
  for (int n = 0; n <= groups; ++n) {
    UCP_ASSERT_OK_AND_ASSIGN(const int64_t e, TailBucketElements(in.config, n));
    EXPECT_GT(e, last_elements) << n;
    last_elements = e;
    PlanInput with = in;
    with.device_optimizer_elements = e;
    UCP_ASSERT_OK_AND_ASSIGN(const MemoryPlan p, PlanMemory(with, PlanMachine{}));
    need.push_back(p.device_total);
  }
  EXPECT_EQ(need[static_cast<size_t>(groups)] - need[0], 12 * table.total);
  EXPECT_FALSE(TailBucketElements(in.config, groups + 1).ok());
  EXPECT_FALSE(TailBucketElements(in.config, -1).ok());
  PlanMachine m;
  m.device_reserve_bytes = 1 << 20;
  auto device_for = [&](int64_t bytes) {  // the least device whose room after both holds bytes
    int64_t d = static_cast<int64_t>(static_cast<double>(bytes + m.device_reserve_bytes) /
                                     (1.0 - kTailHeadroom));
    while (d - m.device_reserve_bytes - static_cast<int64_t>(kTailHeadroom * d) < bytes) ++d;
    return d;
  };
  UCP_ASSERT_OK_AND_ASSIGN(const int unknown, ChooseTailBuckets(in, m));
  EXPECT_EQ(unknown, 0);
  for (int n = 0; n <= groups; ++n) {
    m.device_bytes = device_for(need[static_cast<size_t>(n)]);
    in.device_optimizer_elements = 123;  // ignored
    UCP_ASSERT_OK_AND_ASSIGN(const int got, ChooseTailBuckets(in, m));
    EXPECT_EQ(got, n) << "device of " << m.device_bytes << " B";
    if (n > 0) {  // one byte less: one group less
      --m.device_bytes;
      UCP_ASSERT_OK_AND_ASSIGN(const int fewer, ChooseTailBuckets(in, m));
      EXPECT_EQ(fewer, n - 1) << "device of " << m.device_bytes << " B";
    }
  }
  // Room for every group: none where the weights are streamed or the host buffers staged.
  m.device_bytes = device_for(need[static_cast<size_t>(groups)]) * 2;
  PlanInput streamed = in;
  streamed.weights = WeightChoice::kStreamed;
  UCP_ASSERT_OK_AND_ASSIGN(const int none_streamed, ChooseTailBuckets(streamed, m));
  EXPECT_EQ(none_streamed, 0);
  PlanInput staged = in;
  staged.host_window = 1024;
  UCP_ASSERT_OK_AND_ASSIGN(const int none_staged, ChooseTailBuckets(staged, m));
  EXPECT_EQ(none_staged, 0);
  // --weights auto where a longer micro-batch's activations push the weights out: none.
  UCP_ASSERT_OK_AND_ASSIGN(const MemoryPlan big, PlanMemory(Input(8), PlanMachine{}));
  m.device_bytes = big.device_total - 1 + m.device_reserve_bytes;
  UCP_ASSERT_OK_AND_ASSIGN(const MemoryPlan pushed, PlanMemory(Input(8), m));
  ASSERT_EQ(pushed.placement, WeightPlacement::kStreamed);
  UCP_ASSERT_OK_AND_ASSIGN(const int none_pushed, ChooseTailBuckets(Input(8), m));
  EXPECT_EQ(none_pushed, 0);
}

// The CUDA classifier's logits are a block of rows at a time (at most 1 GiB): at 64K tokens and
// a 128K vocabulary the scratch is one block's logits and the per-row losses, not 32 GiB; blocks
// are equal (no thin last GEMM), and every shorter batch fits the scratch of the longest.
TEST(PlanClassifier, LogitsABlockAtATime) {
  const int64_t V = 128256, N = 65536;
  const int64_t most = gpu::ClassifierMostRows(V);
  EXPECT_EQ(most, (int64_t{1} << 28) / V);
  EXPECT_LE(gpu::ClassifierScratch(N, V) * 4, (int64_t{1} << 30) + 16 * N + 8);
  EXPECT_EQ(gpu::ClassifierScratch(100, V), ((100 * V + 1) / 2) * 2 + 2 * 100 + 2);  // one block
  for (const int64_t n : {int64_t{1}, most - 1, most, most + 1, 3 * most + 7, N}) {
    const int64_t r = gpu::ClassifierBlockRows(n, V);
    const int64_t blocks = (n + r - 1) / r;
    EXPECT_LE(r, most) << n;
    EXPECT_EQ(blocks, (n + most - 1) / most) << n;  // no more blocks than needed
    EXPECT_LE(r * blocks - n, blocks - 1) << n;     // equal: the last short by < 1 row a block
    const int64_t R = ((r * V + 1) / 2) * 2;        // where the op puts the row losses
    EXPECT_LE(R + 2 * n + 2, gpu::ClassifierScratch(N, V)) << n;
  }
  EXPECT_EQ(gpu::ClassifierBlockRows(87, 1000, 10), 10);  // a test's block size: 9 blocks
  EXPECT_EQ(gpu::ClassifierBlockRows(0, V), 0);
}

// Under Ulysses (sp = 2) the device holds this rank's shard of the positions: the position-wise
// ops' buffers and scratch for half the rows, attention's scratch for the whole sequence of half
// the heads, and Ulysses' buffers; beside the flash kernels also the output by heads their
// backward reads. The plan's GPU column counts the same.
TEST(PlanDeviceActivations, UnderSequenceParallelismAShardAndUlysses) {
  PlanInput in = Input(2);
  const ModelConfig& c = in.config;
  const int64_t B = 2, T = 64, P = 2, rows = B * T / P;
  const int64_t NHl = c.heads / P, KVl = c.kv_heads % P == 0 ? c.kv_heads / P : 1;
  const gpu::ModelScratch whole = gpu::CudaModelScratch(c, true, B, T, true, false);
  const gpu::ModelScratch shard = gpu::CudaModelScratch(c, true, B, T, true, false, P);
  EXPECT_EQ(shard.classifier_floats, gpu::ClassifierScratch(rows, c.vocab));
  EXPECT_EQ(shard.token_ints, 4 * rows + 1);
  EXPECT_EQ(shard.attn_floats, B * NHl * T);
  EXPECT_EQ(shard.attn_gemm_bytes,
            gpu::AttentionGemmScratchBytes(B, T, NHl, KVl, c.head_dim));
  EXPECT_LT(shard.bytes(), whole.bytes());
  // The flash kernels in place of the GEMM attention: their scratch for the local heads, and
  // the output by heads (rows x heads x head_dim floats).
  UCP_ASSERT_OK_AND_ASSIGN(int64_t gemm_attn, DeviceActivationBytes(c, B, T, true, false, P));
  UCP_ASSERT_OK_AND_ASSIGN(int64_t flash_attn, DeviceActivationBytes(c, B, T, true, true, P));
  EXPECT_EQ(flash_attn - gemm_attn,
            4 * rows * c.heads * c.head_dim +
                gpu::FlashAttentionScratchBytes(B, T, NHl, KVl, c.head_dim) -
                shard.attn_gemm_bytes);
  in.sp = P;
  in.dp = 1;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan plan, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(plan.rows[static_cast<size_t>(MemClass::kActivations)].device_bytes, gemm_attn);
  // The host column: the parameter table's model and the exchanges' pinned staging (send and
  // receive of the largest, qkv's: rows x P x (heads/P + 2 x 1 KV head) x head_dim floats).
  UCP_ASSERT_OK_AND_ASSIGN(int64_t exchange, UlyssesExchangeFloats(c, B, T, P));
  EXPECT_EQ(exchange, rows * P * (NHl + 2 * KVl) * c.head_dim);
  UCP_ASSERT_OK_AND_ASSIGN(int64_t table, ActivationBytes(c, 1, 1, in.threads, 1));
  EXPECT_EQ(plan.rows[static_cast<size_t>(MemClass::kActivations)].host_bytes,
            table + 2 * exchange * 4);
  UCP_ASSERT_OK_AND_ASSIGN(int64_t none, UlyssesExchangeFloats(c, B, T, 1));
  EXPECT_EQ(none, 0);
  // The sequence-parallel rules hold on the device too.
  EXPECT_THAT(DeviceActivationBytes(c, B, 63, true, false, P),
              ::ucp::testing::StatusIs(StatusCode::kInvalidArgument, HasSubstr("seq_len=63")));
}

// Beside the bf16 GEMMs the device's fp32 compute copy holds only what they do not read (the
// embeddings and the norms of this untied LLaMA), as CudaTrainDevice allocates it
// (cuda_train_test checks the allocation on a GPU); fp32 GEMMs, fp16 and streamed windows keep
// it whole. The CPU column never packs.
TEST(PlanComputeCopy, PackedBesideTheBf16Gemms) {
  PlanInput in = Input(1);
  const ModelConfig& c = in.config;
  const int64_t kept = c.padded_vocab * c.hidden + (2 * c.layers + 1) * c.hidden;
  auto copy = [](const MemoryPlan& p) {
    return p.rows[static_cast<size_t>(MemClass::kComputeCopy)];
  };
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan bf16, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(copy(bf16).device_bytes, kept * 4);
  EXPECT_EQ(copy(bf16).cpu_bytes, bf16.params * 4);
  EXPECT_EQ(copy(bf16).host_bytes, 0);
  EXPECT_THAT(copy(bf16).note, HasSubstr("packed"));
  in.gpu_gemm_bf16 = false;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan fp32_gemms, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(copy(fp32_gemms).device_bytes, bf16.params * 4);
  EXPECT_EQ(fp32_gemms.device_total - bf16.device_total,
            (bf16.params - kept) * 4 + fp32_gemms.rows[static_cast<size_t>(MemClass::kActivations)]
                                               .device_bytes -
                bf16.rows[static_cast<size_t>(MemClass::kActivations)].device_bytes);
  in.gpu_gemm_bf16 = true;
  in.dtype = LowpDType::kFp16;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan fp16, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(copy(fp16).device_bytes, bf16.params * 4);
  in.dtype = LowpDType::kBf16;
  in.weights = WeightChoice::kStreamed;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan streamed, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(copy(streamed).device_bytes,
            streamed.rows[static_cast<size_t>(MemClass::kGradients)].device_bytes);
}

TEST(PlanCast, FollowsTheLinkAndTheCastRates) {
  PlanMachine m;
  EXPECT_EQ(ChooseCastSide(m, 1000).side, CastSide::kHost);  // no rates: half the bytes cross
  EXPECT_FALSE(ChooseCastSide(m, 1000).measured);
  m.host_cast_per_s = 1e9;
  m.device_cast_per_s = 1e12;
  m.link_bytes_per_s = 1e9;  // slow link: bf16 crossing wins despite the host's slower cast
  EXPECT_EQ(ChooseCastSide(m, 1 << 20).side, CastSide::kHost);
  m.link_bytes_per_s = 1e12;  // fast link: fp32 crosses, the device casts
  const CastChoice fast = ChooseCastSide(m, 1 << 20);
  EXPECT_EQ(fast.side, CastSide::kDevice);
  EXPECT_LT(fast.device_seconds, fast.host_seconds);
  EXPECT_TRUE(fast.measured);
}

TEST(PlanMemory, RefusesWhatTheEngineDoesNotRun) {
  PlanInput in = Input(1);
  in.optimizer_group.pop_back();
  EXPECT_FALSE(PlanMemory(in, PlanMachine{}).ok());
  in = Input(1);
  in.sp = 3;
  EXPECT_FALSE(PlanMemory(in, PlanMachine{}).ok());
  in = Input(1);
  in.zero_stage = 4;
  EXPECT_FALSE(PlanMemory(in, PlanMachine{}).ok());
}

TEST(PlanMemory, ZeroShrinksTheHostSideByTheRanks) {
  PlanInput in = Input(1);
  in.zero_stage = 0;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan one, PlanMemory(in, PlanMachine{}));
  in.dp = 4;
  in.zero_stage = 3;
  UCP_ASSERT_OK_AND_ASSIGN(MemoryPlan four, PlanMemory(in, PlanMachine{}));
  EXPECT_EQ(one.block, one.params);
  EXPECT_LE(four.block * 4, one.block + 4 * 64);  // a quarter, up to per-parameter padding
  EXPECT_LT(four.rows[3].host_bytes, one.rows[3].host_bytes);
}

TEST(MeasureHost, GivesPositiveRates) {
  const PlanMachine m = MeasureHost();
  EXPECT_GT(m.link_bytes_per_s, 0);
  EXPECT_GT(m.host_cast_per_s, 0);
  EXPECT_GT(m.host_bytes, 0);
  EXPECT_EQ(m.device_bytes, 0);
}

}  // namespace
}  // namespace ucp::offload
