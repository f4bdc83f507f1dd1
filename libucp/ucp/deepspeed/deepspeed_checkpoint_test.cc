// Tests of the DeepSpeed reader, its model binding and its tensor source against
// tests/data/deepspeed (made with real torch by tools/make_deepspeed_fixtures.py): every view
// tensor, planned to the universal layout, must reproduce expected*.pt bit for bit (fp32, Adam
// moments and the training-dtype weights); every malformed input is a named error.
#include "ucp/deepspeed/deepspeed_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/deepspeed/deepspeed_source.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/torch/torch_writer.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

fs::path DataDir() { return fs::path(UCP_SOURCE_ROOT_DIR) / "tests" / "data" / "deepspeed"; }

struct LayoutCase {
  const char* name;
  const char* expected;  // the truth the fixture was sharded from
  const char* model;     // --model ("" for Megatron layouts, whose args give it)
  int tp, pp, dp, sp;
  Naming naming;
  DType dtype;
  const char* optimizer;
  const char* family;
  size_t num_params;
  const char* origin;
  int ep = 1;  // DeepSpeed-MoE's expert-parallel size (expp_rank files)
};

const LayoutCase kLayouts[] = {
    {"megatron_tp2_pp1_dp2_bf16", "expected.pt", "", 2, 1, 2, 1, Naming::kMegatronGpt, DType::kBf16,
     "bf16_optimizer", "gpt", 28, "Megatron args"},
    {"megatron_tp1_pp2_dp2_bf16", "expected.pt", "", 1, 2, 2, 1, Naming::kMegatronPipe,
     DType::kBf16, "bf16_optimizer", "gpt", 28, "Megatron args"},
    {"megatron_tp2_pp2_sp2_fp16_zero1", "expected.pt", "", 2, 2, 1, 2, Naming::kMegatronPipe,
     DType::kFp16, "zero1", "gpt", 28, "Megatron args"},
    {"deepspeed_tp1_pp1_dp4_fp16_zero2", "expected.pt", "models/gpt-plain.json", 1, 1, 4, 1,
     Naming::kPlain, DType::kFp16, "zero2", "gpt", 28, "model file"},
    {"megatron_llama_tp2_pp2_dp2_bf16", "expected_llama.pt", "", 2, 2, 2, 1, Naming::kMegatronPipe,
     DType::kBf16, "bf16_optimizer", "llama", 15, "Megatron args"},
    {"megatron_llama_tp2_pp1_dp2_fp16_zero1", "expected_llama.pt", "", 2, 1, 2, 1,
     Naming::kMegatronGpt, DType::kFp16, "zero1", "llama", 15, "Megatron args"},
    {"deepspeed_mixtral_tp1_pp1_dp2_bf16_zero1", "expected_mixtral.pt", "models/mixtral-plain.json",
     1, 1, 2, 1, Naming::kPlain, DType::kBf16, "zero1", "mixtral", 29, "model file"},
    // Written by the real DeepSpeed 0.14.4 engine (tests/peer/ds_moe_peer.py fixture): MoE layers
    // with 4 experts at ep=2 over dp=4, so each expert group is cut into 2 partitions.
    {"deepspeed_moe_tp1_pp1_dp4_ep2_fp32_zero1", "expected_moe.pt", "models/mixtral-plain.json", 1,
     1, 4, 1, Naming::kPlain, DType::kFp32, "zero1", "mixtral", 29, "model file", 2},
};

OpenOptions Options(const LayoutCase& c) {
  OpenOptions o;
  if (*c.model != '\0') o.model = (DataDir() / c.model).string();
  return o;
}

class LayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(LayoutTest, OpenReportsTopologyAndModel) {
  const LayoutCase& c = GetParam();
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(DataDir() / c.name, Options(c)));
  EXPECT_EQ(ck.dir().filename(), "global_step7");  // found through `latest`
  EXPECT_EQ(ck.tp(), c.tp);
  EXPECT_EQ(ck.pp(), c.pp);
  EXPECT_EQ(ck.dp(), c.dp);
  EXPECT_EQ(ck.sp(), c.sp);
  EXPECT_EQ(ck.naming(), c.naming);
  EXPECT_EQ(ck.dtype(), c.dtype);
  EXPECT_EQ(ck.optimizer(), c.optimizer);
  EXPECT_EQ(ck.step(), 7);
  EXPECT_EQ(ck.iteration(), 7);
  EXPECT_EQ(ck.family(), c.family);  // Megatron: recognised from the names
  EXPECT_THAT(ck.model_origin(), HasSubstr(c.origin));
  EXPECT_EQ(ck.params().size(), c.num_params);
  ASSERT_EQ(ck.model().params.size(), c.num_params);
  EXPECT_EQ(ck.spec().dtype, c.dtype);
  EXPECT_EQ(ck.spec().hyper.at("layers"), 2);
  EXPECT_EQ(ck.spec().hyper.at("hidden"), 16);
  EXPECT_EQ(ck.spec().hyper.at("heads"), 4);
  for (size_t i = 0; i < ck.model().params.size(); ++i) {
    EXPECT_EQ(ck.params()[static_cast<size_t>(ck.ds_index(i))].name, ck.model().params[i].name);
  }
  EXPECT_EQ(layout::ToString(ck.view()), "tp=" + std::to_string(c.tp) + ",pp=" +
                                             std::to_string(c.pp) + ",dp=1,sp=1,ep=1,zero=0");
  EXPECT_EQ(ck.LayoutString(), "tp=" + std::to_string(c.tp) + ",pp=" + std::to_string(c.pp) +
                                   ",dp=" + std::to_string(c.dp) + ",sp=" + std::to_string(c.sp) +
                                   (c.ep > 1 ? ",ep=" + std::to_string(c.ep) : "") +
                                   ",zero=" + (std::string(c.optimizer) == "zero2" ? "2" : "1"));
  EXPECT_EQ(ck.ep(), c.ep);
  EXPECT_EQ(ck.moe(), c.ep > 1);
  EXPECT_THAT(ck.client_state_json(),
              HasSubstr("\"naming\":\"" + std::string(NamingName(c.naming)) + "\""));
  // What a DeepSpeed writer carries of the optimizer: its groups' hyper-parameters, the form of
  // Adam's step, and for DeepSpeedZeroOptimizer the loss scaler by class and attributes.
  const nlohmann::json client = nlohmann::json::parse(ck.client_state_json());
  const nlohmann::json& opt = client.at("optimizer_state");
  EXPECT_FALSE(opt.at("param_groups").empty());
  EXPECT_FALSE(opt.at("param_groups")[0].contains("params"));
  EXPECT_TRUE(opt.at("param_groups")[0].contains("lr"));
  EXPECT_TRUE(opt.contains("step")) << opt.dump();
  if (std::string(c.optimizer) != "bf16_optimizer") {
    EXPECT_THAT(opt.at("loss_scaler").at("class").get<std::string>(),
                HasSubstr("deepspeed.runtime.fp16.loss_scaler."));
    EXPECT_TRUE(opt.at("loss_scaler").at("state").contains("cur_scale"));
  }
  EXPECT_TRUE(LooksLikeDeepSpeedCheckpoint(DataDir() / c.name));
  EXPECT_TRUE(LooksLikeDeepSpeedCheckpoint(ck.dir()));
}

// The view, planned to the universal layout and run by the executor over the DeepSpeed files,
// is the truth bit for bit: all four states of every parameter.
TEST_P(LayoutTest, ViewPlannedToUniversalIsBitwiseExpected) {
  const LayoutCase& c = GetParam();
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(DataDir() / c.name, Options(c)));
  UCP_ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeepSpeedTensorSource> src,
                           DeepSpeedTensorSource::Open(ck));
  UCP_ASSERT_OK(src->VerifyChecksums());
  EXPECT_GT(src->num_records(), 0);
  UCP_ASSERT_OK_AND_ASSIGN(convert::Plan plan, convert::PlanConversion(ck.model(), ck.view(),
                                                                       layout::UniversalLayout()));
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile expected,
                           torch::TorchFile::Open(DataDir() / c.expected));
  ASSERT_EQ(plan.targets.size(), expected.root().entries().size() * 4);
  const std::string model_key = "model_" + std::string(DTypeName(c.dtype));
  for (int32_t i = 0; i < static_cast<int32_t>(plan.targets.size()); ++i) {
    const convert::TensorInfo& t = plan.targets[static_cast<size_t>(i)];
    SCOPED_TRACE(t.name);
    UCP_ASSERT_OK_AND_ASSIGN(Tensor got, exec::MaterializeTarget(plan, i, *src));
    const torch::PyValue* states = expected.root().Get(t.param);
    ASSERT_NE(states, nullptr);
    const torch::PyValue* want_ref = states->Get(t.state == "model" ? model_key : t.state);
    ASSERT_NE(want_ref, nullptr);
    UCP_ASSERT_OK_AND_ASSIGN(Tensor want, expected.ReadTensor(want_ref->tensor()));
    ASSERT_EQ(got.dtype(), want.dtype());
    ASSERT_EQ(got.shape(), want.shape());
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.num_bytes()), 0);
  }
  // The replicated copies agree: the plan's check ops pass over the DeepSpeed files.
  for (const convert::Op& op : plan.ops) {
    if (op.kind != convert::OpKind::kCheckEqual) continue;
    convert::Plan checks = plan;
    checks.ops = {op};
    checks.targets.clear();
    class Discard final : public exec::TensorSink {
      Status WriteRange(const convert::TensorInfo&, int64_t, int64_t,
                        std::span<const std::byte>) override {
        return Status::Ok();
      }
    } sink;
    UCP_ASSERT_OK(exec::ExecutePlan(checks, *src, sink).status());
  }
}

// Any sub-range reads the same bytes as the whole tensor, across fragment boundaries (the
// executor may read a column slice row by row).
TEST_P(LayoutTest, RangesReadAsTheWhole) {
  const LayoutCase& c = GetParam();
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(DataDir() / c.name, Options(c)));
  UCP_ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeepSpeedTensorSource> src,
                           DeepSpeedTensorSource::Open(ck));
  UCP_ASSERT_OK_AND_ASSIGN(std::vector<convert::TensorInfo> view,
                           convert::DescribeLayout(ck.model(), ck.view()));
  ASSERT_EQ(src->tensors().size(), view.size());
  for (const convert::TensorInfo& t : src->tensors()) {
    SCOPED_TRACE(t.name);
    const int64_t n = NumElementsOrDie(t.shape);
    const int64_t item = DTypeSizeBytes(t.dtype);
    std::vector<std::byte> whole(static_cast<size_t>(n * item)), parts(whole.size());
    UCP_ASSERT_OK(src->ReadFlatRange(t, 0, n, whole));
    for (int64_t at = 0; at < n; at += 7) {
      const int64_t end = std::min(n, at + 7);
      UCP_ASSERT_OK(src->ReadFlatRange(
          t, at, end, std::span<std::byte>(parts).subspan(at * item, (end - at) * item)));
    }
    ASSERT_EQ(whole, parts);
  }
}

// Reads from many threads at once (as the executor makes them) return what one thread reads.
TEST_P(LayoutTest, ConcurrentReadsAgree) {
  const LayoutCase& c = GetParam();
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(DataDir() / c.name, Options(c)));
  UCP_ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeepSpeedTensorSource> src,
                           DeepSpeedTensorSource::Open(ck));
  const std::vector<convert::TensorInfo>& tensors = src->tensors();
  std::vector<std::vector<std::byte>> want(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const convert::TensorInfo& t = tensors[i];
    const int64_t n = NumElementsOrDie(t.shape);
    want[i].resize(static_cast<size_t>(n * DTypeSizeBytes(t.dtype)));
    UCP_ASSERT_OK(src->ReadFlatRange(t, 0, n, want[i]));
  }
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 8; ++w) {
    threads.emplace_back([&, w] {
      for (int round = 0; round < 4; ++round) {
        for (size_t k = 0; k < tensors.size(); ++k) {
          const size_t i = (k + static_cast<size_t>(w) * 7) % tensors.size();
          const convert::TensorInfo& t = tensors[i];
          const int64_t n = NumElementsOrDie(t.shape);
          std::vector<std::byte> got(want[i].size());
          if (!src->ReadFlatRange(t, 0, n, got).ok() || got != want[i]) ++mismatches;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LayoutTest, ::testing::ValuesIn(kLayouts),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

fs::path CopyLayout(const ucp::testing::TempDir& tmp, const char* name) {
  const fs::path dst = tmp / name;
  fs::copy(DataDir() / name, dst, fs::copy_options::recursive);
  return dst;
}

TEST(DeepSpeedSource, ReadErrorsAreNamed) {
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(DataDir() / "megatron_tp2_pp1_dp2_bf16"));
  UCP_ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeepSpeedTensorSource> src,
                           DeepSpeedTensorSource::Open(ck));
  convert::TensorInfo t = src->tensors().front();
  std::vector<std::byte> buf(64);
  convert::TensorInfo unknown = t;
  unknown.name = "pp0.tp0/optim/nope/fp32";
  EXPECT_THAT(src->ReadFlatRange(unknown, 0, 1, std::span(buf).first(4)),
              StatusIs(StatusCode::kNotFound, HasSubstr("not part of the DeepSpeed checkpoint")));
  convert::TensorInfo wrong = t;
  wrong.dtype = DType::kFp64;
  EXPECT_THAT(src->ReadFlatRange(wrong, 0, 1, std::span(buf).first(8)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("not fp64")));
  const int64_t n = NumElementsOrDie(t.shape);
  EXPECT_THAT(src->ReadFlatRange(t, n, n + 1, std::span(buf).first(DTypeSizeBytes(t.dtype))),
              StatusIs(StatusCode::kOutOfRange, HasSubstr(t.name)));
}

TEST(DeepSpeedErrors, MissingOptimFileIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "megatron_tp2_pp1_dp2_bf16");
  fs::remove(src / "global_step7" / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt");
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src).status(),
              StatusIs(StatusCode::kNotFound,
                       HasSubstr("lacks bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt")));
}

TEST(DeepSpeedErrors, MissingModelStatesFileIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "megatron_tp2_pp2_sp2_fp16_zero1");
  fs::rename(src / "global_step7" / "mp_rank_01_model_states.pt",
             src / "global_step7" / "mp_rank_04_model_states.pt");
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("no mp_rank_01_model_states.pt")));
}

TEST(DeepSpeedErrors, MissingLayerFileIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "megatron_llama_tp2_pp2_dp2_bf16");
  fs::remove(src / "global_step7" / "layer_05-model_01-model_states.pt");
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck, DeepSpeedCheckpoint::Open(src));
  EXPECT_THAT(DeepSpeedTensorSource::Open(ck).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("layer_05-model_01-model_states.pt")));
}

TEST(DeepSpeedErrors, TruncatedOptimFileIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "megatron_tp2_pp1_dp2_bf16");
  const fs::path f = src / "global_step7" / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt";
  fs::resize_file(f, fs::file_size(f) / 2);
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck, DeepSpeedCheckpoint::Open(src));
  EXPECT_THAT(
      DeepSpeedTensorSource::Open(ck).status(),
      StatusIs(StatusCode::kDataLoss, HasSubstr("bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt")));
}

// One flipped byte in a partition's record: the pickle still opens, reads of byte ranges cannot
// notice, the record's CRC-32 does.
TEST(DeepSpeedErrors, CorruptRecordFailsItsChecksum) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "megatron_llama_tp2_pp1_dp2_fp16_zero1");
  const fs::path f = src / "global_step7" / "zero_pp_rank_1_mp_rank_00_optim_states.pt";
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile file, torch::TorchFile::Open(f));
  // The largest record: a partition (the first ones are 0-d step tensors, which are not read).
  torch::StorageRecord rec = file.storages().front();
  for (const torch::StorageRecord& r : file.storages()) {
    if (r.num_bytes > rec.num_bytes) rec = r;
  }
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(rec.data_offset + 5);
    char b = 0;
    io.read(&b, 1);
    b = static_cast<char>(b ^ 0x10);
    io.seekp(rec.data_offset + 5);
    io.write(&b, 1);
  }
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck, DeepSpeedCheckpoint::Open(src));
  UCP_ASSERT_OK_AND_ASSIGN(std::unique_ptr<DeepSpeedTensorSource> ds,
                           DeepSpeedTensorSource::Open(ck));
  EXPECT_THAT(ds->VerifyChecksums(),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("crc32 mismatch in record 'data/" + rec.key + "'"),
                             HasSubstr("zero_pp_rank_1_mp_rank_00_optim_states.pt"))));
}

// Rewrites one optimizer file with the fragment of `param` in group `group` one element short.
void ShortenFragment(const fs::path& file, int group, const std::string& param) {
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile in, torch::TorchFile::Open(file));
  torch::TorchWriter w;
  UCP_ASSERT_OK_AND_ASSIGN(const torch::PyValue* root, w.CopyFrom(in, in.root()));
  const torch::PyValue* maps = root->Get("optimizer_state_dict")->Get("param_slice_mappings");
  const torch::PyValue* fa = maps->items()[static_cast<size_t>(group)]->Get(param);
  ASSERT_NE(fa, nullptr) << param;
  // The copy is this test's own arena: editing it in place is the point.
  auto* state = const_cast<torch::PyValue*>(fa->state());
  state->SetItem(w.arena().Str("numel"), w.arena().Int(state->Get("numel")->int_value() - 1));
  UCP_ASSERT_OK(w.Write(file, *root));
}

TEST(DeepSpeedErrors, FragmentsThatDoNotTileTheShard) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "megatron_tp2_pp1_dp2_bf16");
  ShortenFragment(src / "global_step7" / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", 0,
                  "language_model.embedding.word_embeddings.weight");
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck, DeepSpeedCheckpoint::Open(src));
  EXPECT_THAT(DeepSpeedTensorSource::Open(ck).status(),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("\"language_model.embedding.word_embeddings.weight\" on "
                                       "pipeline stage 0, tp rank 1"),
                             HasSubstr("hold 511 elements, its TP shard [32, 16] has 512"))));
}

TEST(DeepSpeedErrors, LatestNamingAMissingTag) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "megatron_tp1_pp2_dp2_bf16");
  fs::rename(src / "global_step7", src / "global_step8");
  EXPECT_TRUE(LooksLikeDeepSpeedCheckpoint(src));  // so Open says what is wrong
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("names tag \"global_step7\"")));
}

TEST(DeepSpeedErrors, NotACheckpoint) {
  const fs::path data = fs::path(UCP_SOURCE_ROOT_DIR) / "tests" / "data";
  EXPECT_FALSE(LooksLikeDeepSpeedCheckpoint(data));
  EXPECT_FALSE(LooksLikeDeepSpeedCheckpoint(data / "no_such_folder"));
  EXPECT_THAT(DeepSpeedCheckpoint::Open(data).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("has no mp_rank_*_model_states.pt")));
}

constexpr const char* kMoe = "deepspeed_moe_tp1_pp1_dp4_ep2_fp32_zero1";

OpenOptions MoeOptions() {
  OpenOptions o;
  o.model = (DataDir() / "models" / "mixtral-plain.json").string();
  return o;
}

TEST(DeepSpeedMoe, ExpertsAreReadUnderCanonicalNames) {
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(DataDir() / kMoe, MoeOptions()));
  EXPECT_EQ(ck.num_experts(), (std::vector<int64_t>{4, 4}));
  int experts = 0;
  for (const DeepSpeedParam& p : ck.params()) {
    if (p.expert < 0) continue;
    ++experts;
    const std::string canonical_prefix =
        "layers." + std::to_string(p.moe_layer) + ".mlp.experts." + std::to_string(p.expert) + ".";
    EXPECT_TRUE(p.name.starts_with(canonical_prefix)) << p.name;
    EXPECT_THAT(p.engine_name, HasSubstr(".mlp.deepspeed_moe.experts.deepspeed_experts." +
                                         std::to_string(p.expert) + "."));
  }
  EXPECT_EQ(experts, 16);
}

TEST(DeepSpeedErrors, MissingExpertFileIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, kMoe);
  fs::remove(src / "global_step7" / "layer_1_expert_2_mp_rank_00_model_states.pt");
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src, MoeOptions()).status(),
              StatusIs(StatusCode::kNotFound,
                       AllOf(HasSubstr("lacks layer_1_expert_2_mp_rank_00_model_states.pt"),
                             HasSubstr("MoE layer 1 has 4 experts"))));
}

TEST(DeepSpeedErrors, MissingExpertParallelFileIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, kMoe);
  fs::rename(src / "global_step7" / "expp_rank_0_mp_rank_00_optim_states.pt",
             src / "global_step7" / "expp_rank_2_mp_rank_00_optim_states.pt");
  EXPECT_THAT(
      DeepSpeedCheckpoint::Open(src, MoeOptions()).status(),
      StatusIs(StatusCode::kNotFound, HasSubstr("lacks expp_rank_0_mp_rank_00_optim_states.pt")));
}

TEST(DeepSpeedErrors, LegacyExpertFilesAreRefused) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "deepspeed_mixtral_tp1_pp1_dp2_bf16_zero1");
  std::ofstream(src / "global_step7" / "expert_1_mp_rank_00_model_states.pt") << "x";
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src).status(),
              StatusIs(StatusCode::kUnimplemented,
                       AllOf(HasSubstr("expert_1_mp_rank_00_model_states.pt"),
                             HasSubstr("legacy form without the MoE layer index"))));
}

// An expert file whose linear_fc2 holds a tensor of linear_fc1's shape.
TEST(DeepSpeedErrors, ExpertOfTheWrongShapeIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, kMoe);
  const fs::path f = src / "global_step7" / "layer_1_expert_3_mp_rank_00_model_states.pt";
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile in, torch::TorchFile::Open(f));
  torch::TorchWriter w;
  UCP_ASSERT_OK_AND_ASSIGN(const torch::PyValue* root, w.CopyFrom(in, in.root()));
  const std::string fc1 =
      "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.linear_fc1.weight";
  const std::string fc2 =
      "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.linear_fc2.weight";
  ASSERT_NE(root->Get(fc1), nullptr);
  torch::PyValue* bad = w.arena().Dict();
  bad->SetItem(w.arena().Str(fc1), root->Get(fc1));
  bad->SetItem(w.arena().Str(fc2), root->Get(fc1));
  UCP_ASSERT_OK(w.Write(f, *bad));
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src, MoeOptions()).status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("\"" + fc2 + "\""),
                             HasSubstr("layer_1_expert_3_mp_rank_00_model_states.pt is [16, 16]"),
                             HasSubstr("holds [16, 8]"))));
}

// An expert group whose partitions hold fewer elements than the experts of its ep rank.
TEST(DeepSpeedErrors, ExpertFileOfAnotherExpertIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, kMoe);
  fs::copy_file(src / "global_step7" / "layer_0_expert_0_mp_rank_00_model_states.pt",
                src / "global_step7" / "layer_0_expert_1_mp_rank_00_model_states.pt",
                fs::copy_options::overwrite_existing);
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src, MoeOptions()).status(),
              StatusIs(StatusCode::kDataLoss,
                       AllOf(HasSubstr("layer_0_expert_1_mp_rank_00_model_states.pt"),
                             HasSubstr("is not a parameter of expert 1"))));
}

// tests/data/torch holds one DeepSpeed-shaped pair of files of a toy model of no family.
TEST(DeepSpeedModel, NamesOfNoFamily) {
  const fs::path torch_dir = fs::path(UCP_SOURCE_ROOT_DIR) / "tests" / "data" / "torch";
  EXPECT_THAT(DeepSpeedCheckpoint::Open(torch_dir).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("fit no rule set"),
                             HasSubstr("gpt: parameter \"embed.weight\" is no instance"),
                             HasSubstr("--model"))));
  OpenOptions names_only;
  names_only.bind_model = false;
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(torch_dir, names_only));
  EXPECT_EQ(ck.params().size(), 3u);
}

TEST(DeepSpeedModel, PresetOfAnotherFamily) {
  const fs::path src = DataDir() / "megatron_tp2_pp1_dp2_bf16";
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src, OpenOptions{"mixtral-tiny"}).status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("not a model of family \"mixtral\""),
                             HasSubstr("embedding.position_embeddings.weight"))));
  EXPECT_THAT(DeepSpeedCheckpoint::Open(src, OpenOptions{"nope"}).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("nope.json")));
}

TEST(DeepSpeedModel, PresetThatDoesNotFit) {
  EXPECT_THAT(
      DeepSpeedCheckpoint::Open(DataDir() / "megatron_tp2_pp1_dp2_bf16", OpenOptions{"gpt-tiny"})
          .status(),
      StatusIs(StatusCode::kFailedPrecondition,
               HasSubstr("model \"gpt-tiny\" has layers=4 but the checkpoint's parameter names "
                         "give 2")));
}

// A model file written next to the test, from `base` with one hyper-parameter replaced.
fs::path EditedModelFile(const ucp::testing::TempDir& tmp, const char* base,
                         const std::string& from, const std::string& to) {
  std::ifstream in(DataDir() / "models" / base);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const size_t pos = text.find(from);
  EXPECT_NE(pos, std::string::npos) << from;
  if (pos != std::string::npos) text.replace(pos, from.size(), to);
  const fs::path out = tmp / base;
  std::ofstream(out) << text;
  return out;
}

TEST(DeepSpeedModel, ParamShapesDisagreeingWithThePreset) {
  ucp::testing::TempDir tmp;
  const fs::path model =
      EditedModelFile(tmp, "gpt-plain.json", "\"ffn_hidden\": 64", "\"ffn_hidden\": 48");
  EXPECT_THAT(DeepSpeedCheckpoint::Open(DataDir() / "deepspeed_tp1_pp1_dp4_fp16_zero2",
                                        OpenOptions{model.string()})
                  .status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("parameter \"layers.0.mlp.dense_h_to_4h.weight\": "
                                       "param_shapes in mp_rank_00_model_states.pt say [64, 16]"),
                             HasSubstr("holds [48, 16] on tp rank 0 of tp=1"))));
}

// Head counts are invisible in the shapes (QKV rows are (heads + 2 kv_heads) * head_dim), so a
// preset is also checked against the Megatron args.
TEST(DeepSpeedModel, PresetDisagreeingWithTheArgs) {
  ucp::testing::TempDir tmp;
  std::ofstream(tmp / "llama.json")
      << R"({"name": "llama-ds", "family": "llama", "hyper": {"hidden": 16, "layers": 2,
            "heads": 2, "kv_heads": 1, "head_dim": 8, "ffn_hidden": 24, "vocab": 50,
            "make_vocab_size_divisible_by": 8}})";
  EXPECT_THAT(DeepSpeedCheckpoint::Open(DataDir() / "megatron_llama_tp2_pp2_dp2_bf16",
                                        OpenOptions{(tmp / "llama.json").string()})
                  .status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("has head_dim=8 but the checkpoint's Megatron args give 4")));
}

TEST(DeepSpeedModel, MissingHyperParameterWithoutModel) {
  const fs::path src = DataDir() / "deepspeed_tp1_pp1_dp4_fp16_zero2";
  for (const char* model : {"", "gpt"}) {
    SCOPED_TRACE(model);
    EXPECT_THAT(DeepSpeedCheckpoint::Open(src, OpenOptions{model}).status(),
                StatusIs(StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("hyper-parameter \"heads\" of family gpt is unknown"),
                               HasSubstr("no Megatron args"), HasSubstr("hidden=16"),
                               HasSubstr("vocab=50"), HasSubstr("pass --model"))));
  }
}

// A data dir holding patterns/gpt.json with `from` replaced by `to` in the first rule whose text
// follows `anchor` (the whole file when `anchor` is empty).
fs::path EditedRuleSetDir(const ucp::testing::TempDir& tmp, const std::string& anchor,
                          const std::string& from, const std::string& to) {
  std::ifstream in(fs::path(UCP_SOURCE_ROOT_DIR) / "patterns" / "gpt.json");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const size_t at = text.find(anchor);
  const size_t pos = at == std::string::npos ? at : text.find(from, at);
  EXPECT_NE(pos, std::string::npos) << "gpt.json no longer holds " << anchor << " ... " << from;
  if (pos != std::string::npos) text.replace(pos, from.size(), to);
  const fs::path dir = tmp / "patterns";
  fs::create_directories(dir);
  std::ofstream(dir / "gpt.json") << text;
  return dir;
}

// The rules come from the rule set in the data dir: a trimmed copy of gpt.json lacking the
// row-parallel bias rule for dense_4h_to_h leaves that parameter without a rule.
TEST(DeepSpeedRules, ParameterWithoutRuleIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path dir =
      EditedRuleSetDir(tmp, "", R"(|layers\\.\\d+\\.mlp\\.dense_4h_to_h\\.bias")", "\"");
  const fs::path src = DataDir() / "megatron_tp2_pp1_dp2_bf16";
  for (const char* model : {"", "gpt"}) {
    SCOPED_TRACE(model);
    EXPECT_THAT(DeepSpeedCheckpoint::Open(src, OpenOptions{model, dir}).status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("parameter \"layers.0.mlp.dense_4h_to_h.bias\" matches no "
                                   "rule of family gpt")));
  }
}

TEST(DeepSpeedRules, ParameterMatchingTwoRulesIsNamed) {
  ucp::testing::TempDir tmp;
  const fs::path dir =
      EditedRuleSetDir(tmp, R"("match": "embedding\\.position)",
                       R"(embedding\\.position_embeddings\\.weight)", R"(embedding\\..*)");
  EXPECT_THAT(
      DeepSpeedCheckpoint::Open(DataDir() / "megatron_tp2_pp1_dp2_bf16", OpenOptions{"gpt", dir})
          .status(),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr("parameter \"embedding.word_embeddings.weight\" matches two rules")));
}

// ucp's rules decide what each TP shard must be: calling the column-parallel h->4h weight
// replicated makes the tp=2 shards the wrong shape for that model.
TEST(DeepSpeedRules, RuleSetDecidesTheShards) {
  ucp::testing::TempDir tmp;
  const fs::path dir =
      EditedRuleSetDir(tmp, R"x(mlp\\.dense_h_to_4h\\.(weight|bias)")x",
                       R"("kind": "shard", "dim": 0, "axis": "tp")", R"("kind": "replicate")");
  EXPECT_THAT(
      DeepSpeedCheckpoint::Open(DataDir() / "megatron_tp2_pp1_dp2_bf16", OpenOptions{"", dir})
          .status(),
      StatusIs(StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("\"language_model.encoder.layers.0.mlp.dense_h_to_4h.weight\": "
                               "param_shapes in mp_rank_00_model_states.pt say [32, 16]"),
                     HasSubstr("holds [64, 16] on tp rank 0 of tp=2"))));
}

}  // namespace
}  // namespace ucp::deepspeed
