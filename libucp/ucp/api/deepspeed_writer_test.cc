// `--format deepspeed`: DeepSpeed ZeRO checkpoints written from ucp distributed, universal and
// DeepSpeed sources, for several models, namings, optimizers and layouts. Each one read back is
// logically the source, bit for bit in every state (the model weights too); real torch loads its
// files with DeepSpeed's keys and classes and, independently of ucp's reader, finds the source's
// values at the fragments param_slice_mappings name (ds_writer_check.py); client state carried
// from a DeepSpeed source is rewritten for the new layout; every refused input names the
// problem and leaves nothing behind.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/api/checkpoint.h"
#include "ucp/deepspeed/deepspeed_format.h"
#include "ucp/deepspeed/pickle_values.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/torch/torch_file.h"

namespace ucp::api {
namespace {

using deepspeed::DeepSpeedOutputOptions;
using deepspeed::OpenDeepSpeedSource;
using deepspeed::ToDeepSpeed;

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

fs::path Root() { return fs::path(UCP_SOURCE_ROOT_DIR); }
fs::path Patterns() { return Root() / "patterns"; }

// Real torch, with stand-ins for DeepSpeed's classes, checks the written folder against the
// universal checkpoint `universal` of the same model.
void ExpectTorchCheck(const fs::path& save_dir, const fs::path& universal) {
  const std::string cmd = "/usr/bin/python3 " +
                          (Root() / "libucp/ucp/deepspeed/ds_writer_check.py").string() + " " +
                          save_dir.string() + " " + universal.string() + " " +
                          (Root() / "tools/fixture_standins.py").string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// Nothing is left next to `dst`: no output, no temporary sibling.
void ExpectNothingLeft(const fs::path& dst) {
  EXPECT_FALSE(fs::exists(dst));
  for (const auto& e : fs::directory_iterator(dst.parent_path())) {
    EXPECT_FALSE(e.path().filename().string().starts_with(dst.filename().string() + ".tmp-"))
        << e.path();
  }
}

struct WriteCase {
  const char* model;
  const char* dtype;
  const char* source_layout;  // ucp layout generated ("universal" for a universal source)
  const char* target;         // the DeepSpeed layout
  const char* naming;
  const char* optimizer;
};

const WriteCase kWriteCases[] = {
    // GPTModelPipe with the tied embedding on both ends (vocabulary padded 250 -> 256).
    {"gpt-tiny", "bf16", "tp=2,pp=2,dp=2,zero=1", "tp=1,pp=2,dp=3,zero=1", "megatron-pipe", "zero"},
    {"gpt-tiny", "fp16", "tp=1,pp=1,dp=1,zero=2", "tp=2,pp=4,dp=1,zero=1", "megatron-pipe", "zero"},
    {"gpt-tiny", "bf16", "universal", "tp=4,pp=1,dp=2,sp=2,zero=2", "megatron-gpt", "zero"},
    {"gpt-tiny", "fp32", "tp=2,pp=1,dp=2,zero=2", "tp=1,pp=1,dp=2,zero=2", "plain", "zero"},
    // LLaMA: GQA query groups and concat-fused SwiGLU cut by ucp's rules; BF16_Optimizer.
    {"llama-tiny", "bf16", "tp=2,pp=1,dp=2,zero=2", "tp=2,pp=2,dp=2,zero=1", "megatron-pipe",
     "bf16"},
    {"llama-tiny", "bf16", "tp=1,pp=2,dp=1,zero=1", "tp=4,pp=1,dp=1,zero=1", "megatron-gpt",
     "zero"},
    {"llama-tiny-tied", "fp16", "tp=2,pp=2,dp=1,zero=1", "tp=1,pp=2,dp=2,zero=2", "megatron-pipe",
     "zero"},
    // Mixtral-style experts as ordinary parameters (ep=1).
    {"mixtral-tiny", "bf16", "tp=1,pp=1,dp=2,zero=1", "tp=2,pp=1,dp=2,sp=2,zero=2", "plain",
     "zero"},
    {"mixtral-tiny", "bf16", "tp=2,pp=2,dp=1,ep=1,zero=1", "tp=1,pp=2,dp=2,zero=1", "megatron-pipe",
     "bf16"},
};

class DeepSpeedWriteTest : public ::testing::TestWithParam<WriteCase> {};

TEST_P(DeepSpeedWriteTest, ReadsBackAsTheSourceBitwise) {
  const WriteCase& c = GetParam();
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(auto model, LoadResolvedModel(Patterns(), c.model, c.dtype));
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout from, layout::ParseLayout(c.source_layout));
  UCP_ASSERT_OK(Generate(model.first, model.second, from, 11, tmp / "src", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto src, CheckpointSource::Open(tmp / "src", Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout to, layout::ParseLayout(c.target));
  DeepSpeedOutputOptions ds;
  ds.naming = c.naming;
  ds.optimizer = c.optimizer;
  RunOptions small;
  small.memory_limit_bytes = 256 << 10;  // windows of 64 KiB: slices cross partitions mid-window
  UCP_ASSERT_OK_AND_ASSIGN(exec::ExecStats stats, ToDeepSpeed(*src, to, tmp / "ds", small, ds));
  EXPECT_GT(stats.bytes_written, 0);

  // Read back (the model from the ucp_model the files record): the same logical checkpoint.
  UCP_ASSERT_OK_AND_ASSIGN(auto back, CheckpointSource::Open(tmp / "ds", Patterns()));
  EXPECT_EQ(back->meta().format, "deepspeed");
  EXPECT_EQ(back->meta().model.spec.dtype, model.second.spec.dtype);
  // DeepSpeed records dp * sp partitions, not sp: without Megatron args (ds_sequence_parallel_size)
  // the reader sees them as dp.
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout written, layout::ParseLayout(back->meta().source_layout));
  EXPECT_EQ(std::tuple(written.tp, written.pp, written.dp * written.sp, written.zero_stage),
            std::tuple(to.tp, to.pp, to.dp * to.sp, to.zero_stage))
      << back->meta().source_layout;
  UCP_EXPECT_OK(Verify(*back));
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult diff, Diff(*src, *back, 0, RunOptions{}));
  EXPECT_TRUE(diff.equal) << diff.first_difference;
  EXPECT_EQ(diff.tensors_compared, static_cast<int64_t>(model.second.params.size()) * 4);

  // What was written loads in real torch, with the source's values where DeepSpeed puts them.
  UCP_ASSERT_OK(Extract(*src, tmp / "universal", RunOptions{}).status());
  ExpectTorchCheck(tmp / "ds", tmp / "universal");

  // DeepSpeed -> DeepSpeed at another layout, client state carried from the first: the same.
  layout::Layout again = to;
  again.tp = 1;
  again.dp = 1;
  again.sp = 1;
  again.zero_stage = 3 - to.zero_stage;
  DeepSpeedOutputOptions keep;  // naming, optimizer and tag from the source
  UCP_ASSERT_OK(ToDeepSpeed(*back, again, tmp / "ds2", RunOptions{}, keep).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto back2, CheckpointSource::Open(tmp / "ds2", Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult diff2, Diff(*src, *back2, 0, RunOptions{}));
  EXPECT_TRUE(diff2.equal) << diff2.first_difference;
  ExpectTorchCheck(tmp / "ds2", tmp / "universal");
}

INSTANTIATE_TEST_SUITE_P(Models, DeepSpeedWriteTest, ::testing::ValuesIn(kWriteCases),
                         [](const auto& test_info) {
                           std::string n = std::string(test_info.param.model) + "_" +
                                           test_info.param.dtype + "_" + test_info.param.naming +
                                           "_" + std::to_string(test_info.index);
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

// ZeRO-3 (stage3.py's files: per-parameter pieces of ceil(numel / dp) elements, one sub-group per
// param group, no module weights): written at tp=2, dp=3 in bf16 and read back, the same
// checkpoint (the bf16 weights are the fp32 masters rounded, as the engine restores them); then
// ZeRO-3 -> ZeRO-1 at another layout, the same again. The real engine loading ucp's ZeRO-3 files
// is the peer test peer_deepspeed_loads_ucp_zero3_* (docs/peers.md).
TEST(DeepSpeedWrite, Zero3RoundTrip) {
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(auto model, LoadResolvedModel(Patterns(), "gpt-tiny", "bf16"));
  UCP_ASSERT_OK(Generate(model.first, model.second, *layout::ParseLayout("tp=1,pp=1,dp=1"), 5,
                         tmp / "src", RunOptions{})
                    .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto src, CheckpointSource::Open(tmp / "src", Patterns()));
  DeepSpeedOutputOptions ds;
  ds.naming = "megatron-gpt";
  RunOptions small;
  small.memory_limit_bytes = 256 << 10;
  UCP_ASSERT_OK(
      ToDeepSpeed(*src, *layout::ParseLayout("tp=2,pp=1,dp=3,zero=3"), tmp / "ds", small, ds)
          .status());
  UCP_ASSERT_OK_AND_ASSIGN(std::string latest, io::ReadFileToString(tmp / "ds" / "latest", 256));
  const fs::path tag = tmp / "ds" / latest;
  for (const char* f : {"zero_pp_rank_2_mp_rank_01_model_states.pt",
                        "bf16_zero_pp_rank_2_mp_rank_01_optim_states.pt"}) {
    EXPECT_TRUE(fs::exists(tag / f)) << f;
  }
  EXPECT_FALSE(fs::exists(tag / "mp_rank_00_model_states.pt"));
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile optim,
                           torch::TorchFile::Open(tag / "bf16_zero_pp_rank_2_mp_rank_01_optim_states.pt"));
  const torch::PyValue* osd = optim.root().Get("optimizer_state_dict");
  ASSERT_NE(osd, nullptr);
  ASSERT_NE(osd->Get("fp32_flat_groups"), nullptr);
  EXPECT_EQ(osd->Get("fp32_flat_groups")->items().size(), 2u);  // Megatron's two groups
  EXPECT_EQ(osd->Get("partition_count")->int_value(), 3);
  EXPECT_EQ(osd->Get("param_slice_mappings"), nullptr);

  UCP_ASSERT_OK_AND_ASSIGN(auto back, CheckpointSource::Open(tmp / "ds", Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout written, layout::ParseLayout(back->meta().source_layout));
  EXPECT_EQ(std::tuple(written.tp, written.pp, written.dp, written.zero_stage),
            std::tuple(2, 1, 3, 3));
  UCP_EXPECT_OK(Verify(*back));
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult diff, Diff(*src, *back, 0, RunOptions{}));
  EXPECT_TRUE(diff.equal) << diff.first_difference;
  EXPECT_EQ(diff.tensors_compared, static_cast<int64_t>(model.second.params.size()) * 4);

  DeepSpeedOutputOptions keep;
  UCP_ASSERT_OK(ToDeepSpeed(*back, *layout::ParseLayout("tp=1,pp=1,dp=2,zero=1"), tmp / "ds2",
                            RunOptions{}, keep)
                    .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto back2, CheckpointSource::Open(tmp / "ds2", Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult diff2, Diff(*src, *back2, 0, RunOptions{}));
  EXPECT_TRUE(diff2.equal) << diff2.first_difference;
}

// From a DeepSpeed fixture (Megatron GPTModelPipe, tp=2, pp=2, sp=2, fp16, ZeRO-1, with Megatron
// args, RNG state and scheduler): the written checkpoint is the fixture's content; its client
// state is the fixture's with the parallel sizes of the new layout, and its
// universal_checkpoint_info is made for the new tp.
TEST(DeepSpeedWrite, CarriesAndRewritesClientStateFromADeepSpeedSource) {
  ucp::testing::TempDir tmp;
  const fs::path fixture = Root() / "tests/data/deepspeed/megatron_tp2_pp2_sp2_fp16_zero1";
  UCP_ASSERT_OK_AND_ASSIGN(auto src, CheckpointSource::Open(fixture, Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout to, layout::ParseLayout("tp=1,pp=2,dp=2,zero=2"));
  UCP_ASSERT_OK(ToDeepSpeed(*src, to, tmp / "ds", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto back, CheckpointSource::Open(tmp / "ds", Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult diff, Diff(*src, *back, 0, RunOptions{}));
  EXPECT_TRUE(diff.equal) << diff.first_difference;
  EXPECT_EQ(back->meta().step, src->meta().step);

  UCP_ASSERT_OK_AND_ASSIGN(
      torch::TorchFile theirs,
      torch::TorchFile::Open(fixture / "global_step7" / "mp_rank_00_model_states.pt"));
  UCP_ASSERT_OK_AND_ASSIGN(
      torch::TorchFile ours,
      torch::TorchFile::Open(tmp / "ds" / "global_step7" / "mp_rank_01_model_states.pt"));
  const torch::PyValue& root = ours.root();
  EXPECT_EQ(root.Get("dp_world_size")->int_value(), 2);
  EXPECT_EQ(root.Get("mp_world_size")->int_value(), 2);
  EXPECT_EQ(root.Get("iteration")->int_value(), theirs.root().Get("iteration")->int_value());
  const torch::PyValue* args = deepspeed::ObjectState(root.Get("args"));
  ASSERT_NE(args, nullptr);
  EXPECT_EQ(root.Get("args")->class_name(), "argparse.Namespace");
  EXPECT_EQ(args->Get("tensor_model_parallel_size")->int_value(), 1);
  EXPECT_EQ(args->Get("pipeline_model_parallel_size")->int_value(), 2);
  // Everything else in args is the fixture's.
  const torch::PyValue* their_args = deepspeed::ObjectState(theirs.root().Get("args"));
  EXPECT_EQ(args->Get("hidden_size")->int_value(), their_args->Get("hidden_size")->int_value());
  EXPECT_EQ(args->entries().size(), their_args->entries().size());
  // Client keys the writer does not know travel as they are (the RNG states included).
  for (const auto& [k, v] : theirs.root().entries()) {
    EXPECT_NE(root.Get(k->str()), nullptr) << k->str();
  }
  const torch::PyValue* info = root.Get("universal_checkpoint_info");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(
      info->Get("original_vocab_size")->int_value(),
      theirs.root().Get("universal_checkpoint_info")->Get("original_vocab_size")->int_value());
  EXPECT_EQ(info->Get("tp_replicated_parameter_patterns"), nullptr);  // tp=1 now
  EXPECT_NE(info->Get("pipeline_replicated_parameter_patterns"), nullptr);
  // The optimizer's loss scaler and clip_grad are the fixture's.
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile optim,
                           torch::TorchFile::Open(tmp / "ds" / "global_step7" /
                                                  "zero_pp_rank_1_mp_rank_01_optim_states.pt"));
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile their_optim,
                           torch::TorchFile::Open(fixture / "global_step7" /
                                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt"));
  const torch::PyValue* osd = optim.root().Get("optimizer_state_dict");
  const torch::PyValue* their_osd = their_optim.root().Get("optimizer_state_dict");
  ASSERT_NE(osd, nullptr);
  EXPECT_EQ(osd->Get("loss_scaler")->class_name(), their_osd->Get("loss_scaler")->class_name());
  EXPECT_EQ(osd->Get("loss_scaler")->state()->Get("cur_scale")->float_value(),
            their_osd->Get("loss_scaler")->state()->Get("cur_scale")->float_value());
  EXPECT_EQ(osd->Get("clip_grad")->float_value(), their_osd->Get("clip_grad")->float_value());
  EXPECT_EQ(osd->Get("zero_stage")->class_name(), "deepspeed.runtime.zero.config.ZeroStageEnum");
  EXPECT_EQ(osd->Get("zero_stage")->items()[1]->str(), "gradients");
}

// From a universal checkpoint extracted from DeepSpeed: the client state its JSON kept (Megatron
// args as a Namespace with the new sizes, iteration, scheduler, param-group hyper-parameters,
// loss scaler, clip_grad, one param group for a one-group run), not the RNG tensors.
TEST(DeepSpeedWrite, CarriesTheClientStateAnExtractionRecorded) {
  ucp::testing::TempDir tmp;
  const fs::path fixture = Root() / "tests/data/deepspeed/megatron_tp2_pp2_sp2_fp16_zero1";
  UCP_ASSERT_OK_AND_ASSIGN(auto ds, CheckpointSource::Open(fixture, Patterns()));
  UCP_ASSERT_OK(Extract(*ds, tmp / "u", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto uni, CheckpointSource::Open(tmp / "u", Patterns()));
  UCP_ASSERT_OK(
      ToDeepSpeed(*uni, *layout::ParseLayout("tp=2,pp=1,dp=2,zero=1"), tmp / "ds", RunOptions{})
          .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto back, CheckpointSource::Open(tmp / "ds", Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult diff, Diff(*ds, *back, 0, RunOptions{}));
  EXPECT_TRUE(diff.equal) << diff.first_difference;

  const fs::path tag = tmp / "ds" / "global_step7";  // the source's tag
  UCP_ASSERT_OK_AND_ASSIGN(
      torch::TorchFile theirs,
      torch::TorchFile::Open(fixture / "global_step7" / "mp_rank_00_model_states.pt"));
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile ours,
                           torch::TorchFile::Open(tag / "mp_rank_01_model_states.pt"));
  const torch::PyValue& root = ours.root();
  EXPECT_EQ(root.Get("args")->class_name(), "argparse.Namespace");
  const torch::PyValue* args = deepspeed::ObjectState(root.Get("args"));
  const torch::PyValue* their_args = deepspeed::ObjectState(theirs.root().Get("args"));
  ASSERT_NE(args, nullptr);
  EXPECT_EQ(args->Get("tensor_model_parallel_size")->int_value(), 2);
  EXPECT_EQ(args->Get("pipeline_model_parallel_size")->int_value(), 1);
  EXPECT_EQ(args->Get("num_attention_heads")->int_value(),
            their_args->Get("num_attention_heads")->int_value());
  EXPECT_EQ(root.Get("iteration")->int_value(), theirs.root().Get("iteration")->int_value());
  EXPECT_EQ(root.Get("global_steps")->int_value(), theirs.root().Get("global_steps")->int_value());
  EXPECT_EQ(root.Get("lr_scheduler")->entries().size(),
            theirs.root().Get("lr_scheduler")->entries().size());
  if (theirs.root().Get("rng_state") != nullptr) {
    EXPECT_EQ(root.Get("rng_state"), nullptr);
  }
  UCP_ASSERT_OK_AND_ASSIGN(
      torch::TorchFile optim,
      torch::TorchFile::Open(tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt"));
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile their_optim,
                           torch::TorchFile::Open(fixture / "global_step7" /
                                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt"));
  const torch::PyValue* osd = optim.root().Get("optimizer_state_dict");
  const torch::PyValue* their_osd = their_optim.root().Get("optimizer_state_dict");
  EXPECT_EQ(osd->Get("loss_scaler")->class_name(), their_osd->Get("loss_scaler")->class_name());
  EXPECT_EQ(osd->Get("clip_grad")->float_value(), their_osd->Get("clip_grad")->float_value());
  const torch::PyValue* groups = osd->Get("base_optimizer_state")->Get("param_groups");
  const torch::PyValue* their_groups = their_osd->Get("base_optimizer_state")->Get("param_groups");
  ASSERT_EQ(groups->items().size(), their_groups->items().size());
  for (size_t g = 0; g < groups->items().size(); ++g) {
    EXPECT_EQ(groups->items()[g]->entries().size(), their_groups->items()[g]->entries().size());
    EXPECT_EQ(groups->items()[g]->Get("weight_decay")->float_value(),
              their_groups->items()[g]->Get("weight_decay")->float_value());
  }

  // A run with one param group (the plain-DeepSpeed Mixtral fixture) is written with one.
  const fs::path mixtral = Root() / "tests/data/deepspeed/deepspeed_mixtral_tp1_pp1_dp2_bf16_zero1";
  UCP_ASSERT_OK_AND_ASSIGN(
      auto mx, CheckpointSource::Open(
                   mixtral, Patterns(),
                   {(Root() / "tests/data/deepspeed/models/mixtral-plain.json").string()}));
  UCP_ASSERT_OK(Extract(*mx, tmp / "mu", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto mu, CheckpointSource::Open(tmp / "mu", Patterns()));
  UCP_ASSERT_OK(
      ToDeepSpeed(*mu, *layout::ParseLayout("tp=2,pp=1,dp=2,zero=2"), tmp / "mds", RunOptions{})
          .status());
  UCP_ASSERT_OK_AND_ASSIGN(
      torch::TorchFile mfile,
      torch::TorchFile::Open(tmp / "mds" / "global_step7" / "mp_rank_00_model_states.pt"));
  EXPECT_EQ(mfile.root().Get("param_shapes")->items().size(), 1u);
  EXPECT_NE(mfile.root().Get("module")->Get("layers.0.mlp.experts.3.linear_fc1.weight"), nullptr);
  UCP_ASSERT_OK_AND_ASSIGN(auto mback, CheckpointSource::Open(tmp / "mds", Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult mdiff, Diff(*mx, *mback, 0, RunOptions{}));
  EXPECT_TRUE(mdiff.equal) << mdiff.first_difference;
}

// A source that fails after some reads: the run fails and leaves nothing.
class FailingSource final : public CheckpointSource {
 public:
  explicit FailingSource(std::unique_ptr<CheckpointSource> inner) : inner_(std::move(inner)) {}
  const CheckpointMeta& meta() const override { return inner_->meta(); }
  std::vector<convert::TensorInfo> StoredTensors() const override {
    return inner_->StoredTensors();
  }
  Status VerifyChecksums() const override { return Status::Ok(); }
  Status ReadFlatRange(const convert::TensorInfo& t, int64_t begin, int64_t end,
                       std::span<std::byte> out) const override {
    if (++reads_ > 20) return DataLossError("injected read failure");
    return inner_->ReadFlatRange(t, begin, end, out);
  }

 private:
  std::unique_ptr<CheckpointSource> inner_;
  mutable std::atomic<int> reads_{0};
};

TEST(DeepSpeedWrite, RefusesBadInputAndLeavesNothing) {
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(auto model, LoadResolvedModel(Patterns(), "gpt-tiny", "fp16"));
  UCP_ASSERT_OK(Generate(model.first, model.second, *layout::ParseLayout("tp=1,pp=1,dp=1"), 3,
                         tmp / "src", RunOptions{})
                    .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto src, CheckpointSource::Open(tmp / "src", Patterns()));
  const fs::path dst = tmp / "out";
  struct Bad {
    const char* layout;
    const char* naming;
    const char* optimizer;
    StatusCode code;
    const char* message;
  };
  const Bad bad[] = {
      {"tp=1,pp=1,dp=2,zero=0", "", "", StatusCode::kInvalidArgument, "zero=0 has no ZeRO"},
      {"tp=1,pp=2,dp=2,zero=3", "", "", StatusCode::kInvalidArgument,
       "pipeline engine does not run ZeRO-3"},
      {"tp=1,pp=1,dp=2,zero=3", "megatron-pipe", "", StatusCode::kInvalidArgument,
       "pipeline engine does not run ZeRO-3"},
      {"tp=1,pp=1,dp=2,ep=2,zero=1", "", "", StatusCode::kUnimplemented,
       "DeepSpeed-MoE is written for fp32 training only, not fp16"},
      {"tp=3,pp=1,dp=1,zero=1", "", "", StatusCode::kFailedPrecondition, "tp=3"},
      {"tp=1,pp=3,dp=1,zero=1", "", "", StatusCode::kFailedPrecondition, "pp=3"},
      {"tp=1,pp=2,dp=1,zero=1", "plain", "", StatusCode::kInvalidArgument, "cannot express pp=2"},
      {"tp=1,pp=2,dp=1,zero=1", "megatron-gpt", "", StatusCode::kInvalidArgument,
       "cannot express pp=2"},
      {"tp=1,pp=1,dp=1,zero=1", "gpt2", "", StatusCode::kInvalidArgument, "--naming must be"},
      {"tp=1,pp=1,dp=1,zero=1", "", "bf16", StatusCode::kInvalidArgument,
       "BF16_Optimizer checkpoints need bf16 training at zero=1; this is fp16"},
      {"tp=1,pp=1,dp=1,zero=1", "", "adam", StatusCode::kInvalidArgument, "--optimizer must be"},
      {"universal", "", "", StatusCode::kInvalidArgument, "not universal"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.layout + std::string(" ") + b.naming + b.optimizer);
    DeepSpeedOutputOptions ds;
    ds.naming = b.naming;
    ds.optimizer = b.optimizer;
    EXPECT_THAT(ToDeepSpeed(*src, *layout::ParseLayout(b.layout), dst, RunOptions{}, ds).status(),
                StatusIs(b.code, HasSubstr(b.message)));
    ExpectNothingLeft(dst);
  }
  // An existing output is never touched.
  fs::create_directory(dst);
  EXPECT_THAT(
      ToDeepSpeed(*src, *layout::ParseLayout("tp=1,pp=1,dp=1,zero=1"), dst, RunOptions{}).status(),
      StatusIs(StatusCode::kAlreadyExists, HasSubstr("exists")));
  EXPECT_TRUE(fs::is_empty(dst));
  fs::remove(dst);
  // A read failure midway: the error, and no output or temporary folder.
  UCP_ASSERT_OK_AND_ASSIGN(auto inner, CheckpointSource::Open(tmp / "src", Patterns()));
  FailingSource failing(std::move(inner));
  EXPECT_THAT(ToDeepSpeed(failing, *layout::ParseLayout("tp=2,pp=2,dp=2,zero=1"), dst, RunOptions{})
                  .status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("injected read failure")));
  ExpectNothingLeft(dst);
}

}  // namespace
}  // namespace ucp::api
