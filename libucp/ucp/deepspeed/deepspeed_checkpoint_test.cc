// Tests of the DeepSpeed reader and writers against tests/data/deepspeed (made with real torch by
// tools/make_deepspeed_fixtures.py): extraction must reproduce expected.pt bit for bit at every
// layout, and what WriteDeepSpeedUniversal writes must load in real torch with the right values.
#include "ucp/deepspeed/deepspeed_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/universal/universal_checkpoint.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

fs::path DataDir() { return fs::path(UCP_SOURCE_ROOT_DIR) / "tests" / "data" / "deepspeed"; }

struct LayoutCase {
  const char* name;
  int tp, pp, dp, sp;
  Naming naming;
  DType dtype;
  const char* optimizer;
};

const LayoutCase kLayouts[] = {
    {"megatron_tp2_pp1_dp2_bf16", 2, 1, 2, 1, Naming::kMegatronGpt, DType::kBf16, "bf16_optimizer"},
    {"megatron_tp1_pp2_dp2_bf16", 1, 2, 2, 1, Naming::kMegatronPipe, DType::kBf16,
     "bf16_optimizer"},
    {"megatron_tp2_pp2_sp2_fp16_zero1", 2, 2, 1, 2, Naming::kMegatronPipe, DType::kFp16, "zero1"},
    {"deepspeed_tp1_pp1_dp4_fp16_zero2", 1, 1, 4, 1, Naming::kPlain, DType::kFp16, "zero2"},
};

class LayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(LayoutTest, OpenReportsTopology) {
  const LayoutCase& c = GetParam();
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck, DeepSpeedCheckpoint::Open(DataDir() / c.name));
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
  EXPECT_EQ(ck.family(), "gpt");  // recognised from the names: only patterns/gpt.json fits
  ASSERT_EQ(ck.params().size(), 28u);
  EXPECT_EQ(ck.params().front().name, "embedding.word_embeddings.weight");
  EXPECT_EQ(ck.params().back().name, "final_layernorm.bias");
  EXPECT_TRUE(LooksLikeDeepSpeedCheckpoint(DataDir() / c.name));
  EXPECT_TRUE(LooksLikeDeepSpeedCheckpoint(ck.dir()));
}

// Every state of every parameter equals the full tensors the fixture was sharded from.
TEST_P(LayoutTest, ExtractionIsBitwiseEqualToExpected) {
  const LayoutCase& c = GetParam();
  ucp::testing::TempDir tmp;
  const fs::path out = tmp / "universal";
  ExtractOptions options;
  options.threads = 2;
  UCP_ASSERT_OK(ExtractDeepSpeedToUniversal(DataDir() / c.name, out, options));
  UCP_ASSERT_OK_AND_ASSIGN(io::UniversalReader reader, io::UniversalReader::Open(out));
  UCP_ASSERT_OK(reader.Verify());
  EXPECT_EQ(reader.manifest().step, 7);
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile expected,
                           torch::TorchFile::Open(DataDir() / "expected.pt"));
  ASSERT_EQ(expected.root().entries().size(), reader.manifest().params.size());
  for (const auto& [k, states] : expected.root().entries()) {
    SCOPED_TRACE(k->str());
    UCP_ASSERT_OK_AND_ASSIGN(const io::UniversalParamInfo* info, reader.FindParam(k->str()));
    EXPECT_EQ(info->dtype, c.dtype);
    for (const char* s : {"fp32", "exp_avg", "exp_avg_sq"}) {
      UCP_ASSERT_OK_AND_ASSIGN(Tensor want, expected.ReadTensor(states->Get(s)->tensor()));
      UCP_ASSERT_OK_AND_ASSIGN(Tensor got, reader.ReadState(k->str(), s));
      ASSERT_EQ(got.shape(), want.shape()) << s;
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.num_bytes()), 0) << s;
    }
  }
  const std::string& client = reader.manifest().client_state_json;
  EXPECT_THAT(client, HasSubstr("\"layout\":\"tp=" + std::to_string(c.tp)));
  if (c.naming != Naming::kPlain) {
    EXPECT_THAT(client, HasSubstr("\"iteration\":7"));
    EXPECT_THAT(client, HasSubstr("\"hidden_size\":16"));  // from argparse.Namespace
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LayoutTest, ::testing::ValuesIn(kLayouts),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

fs::path CopyLayout(const ucp::testing::TempDir& tmp, const char* name) {
  const fs::path dst = tmp / name;
  fs::copy(DataDir() / name, dst, fs::copy_options::recursive);
  return dst;
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

TEST(DeepSpeedErrors, LatestNamingAMissingTag) {
  ucp::testing::TempDir tmp;
  const fs::path src = CopyLayout(tmp, "megatron_tp1_pp2_dp2_bf16");
  fs::rename(src / "global_step7", src / "global_step8");
  EXPECT_FALSE(LooksLikeDeepSpeedCheckpoint(src));
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

// tests/data/torch holds one DeepSpeed-shaped pair of files of a non-GPT toy model.
TEST(DeepSpeedErrors, ParameterOutsideTheFamily) {
  const fs::path torch_dir = fs::path(UCP_SOURCE_ROOT_DIR) / "tests" / "data" / "torch";
  EXPECT_THAT(DeepSpeedCheckpoint::Open(torch_dir).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("matches no rule of family gpt")));
}

// --model picks the rule set: mixtral's has no rule for GPT's learned position embeddings.
TEST(DeepSpeedErrors, ModelOfAnotherFamily) {
  EXPECT_THAT(DeepSpeedCheckpoint::Open(DataDir() / "megatron_tp2_pp1_dp2_bf16",
                                        OpenOptions{"mixtral-tiny"})
                  .status(),
              StatusIs(StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("matches no rule of family mixtral"),
                                        HasSubstr("model \"mixtral-tiny\""))));
  EXPECT_THAT(
      DeepSpeedCheckpoint::Open(DataDir() / "megatron_tp2_pp1_dp2_bf16", OpenOptions{"nope"})
          .status(),
      StatusIs(StatusCode::kNotFound, HasSubstr("nope.json")));
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

// The merge rules come from the rule set in the data dir: a trimmed copy of gpt.json lacking the
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
  ExtractOptions options;
  options.data_dir = dir;
  EXPECT_THAT(ExtractDeepSpeedToUniversal(src, tmp / "out", options),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("\"layers.0.mlp.dense_4h_to_h.bias\" matches no rule")));
  EXPECT_FALSE(fs::exists(tmp / "out"));
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

// A fuse rule in concat order would need each TP slice's parts regrouped: refused, not defaulted.
TEST(DeepSpeedRules, FuseInConcatOrderIsUnimplemented) {
  ucp::testing::TempDir tmp;
  const fs::path dir = EditedRuleSetDir(
      tmp, "query_key_value",
      R"("order": "interleaved_groups", "groups": "heads", "group_name": "query groups",)",
      R"("order": "concat",)");
  EXPECT_THAT(
      DeepSpeedCheckpoint::Open(DataDir() / "megatron_tp2_pp1_dp2_bf16", OpenOptions{"", dir})
          .status(),
      StatusIs(StatusCode::kUnimplemented,
               ::testing::AllOf(HasSubstr("parameter \"layers.0.self_attention."
                                          "query_key_value."),
                                HasSubstr("rule kind fuse"), HasSubstr("order concat"))));
}

// The rule set decides the merge: calling the column-parallel h->4h weight replicated makes
// the reader keep one shard's shape and the extractor compare the (different) TP slices.
TEST(DeepSpeedRules, RuleSetDecidesTheMerge) {
  ucp::testing::TempDir tmp;
  const fs::path dir =
      EditedRuleSetDir(tmp, R"x(mlp\\.dense_h_to_4h\\.(weight|bias)")x",
                       R"("kind": "shard", "dim": 0, "axis": "tp")", R"("kind": "replicate")");
  const fs::path src = DataDir() / "megatron_tp2_pp1_dp2_bf16";
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint ck,
                           DeepSpeedCheckpoint::Open(src, OpenOptions{"", dir}));
  UCP_ASSERT_OK_AND_ASSIGN(DeepSpeedCheckpoint stock, DeepSpeedCheckpoint::Open(src));
  ASSERT_EQ(ck.params().size(), stock.params().size());
  int changed = 0;
  for (size_t i = 0; i < ck.params().size(); ++i) {
    const DeepSpeedParam& p = ck.params()[i];
    if (p.name.find("dense_h_to_4h") == std::string::npos) {
      EXPECT_EQ(p.merge, stock.params()[i].merge) << p.name;
      continue;
    }
    ++changed;
    EXPECT_EQ(stock.params()[i].merge, MergeKind::kShard) << p.name;
    EXPECT_EQ(p.merge, MergeKind::kReplicate) << p.name;
    EXPECT_EQ(p.shape, p.tp_shape) << p.name;
    EXPECT_EQ(p.rule, R"(layers\.\d+\.mlp\.dense_h_to_4h\.(weight|bias))");
  }
  EXPECT_EQ(changed, 4);  // weight and bias of 2 layers
  ExtractOptions options;
  options.data_dir = dir;
  EXPECT_THAT(
      ExtractDeepSpeedToUniversal(src, tmp / "out", options),
      StatusIs(StatusCode::kDataLoss,
               ::testing::AllOf(HasSubstr("dense_h_to_4h"), HasSubstr("differs from tp rank 0"))));
}

TEST(DeepSpeedErrors, ExtractRefusesExistingOutput) {
  ucp::testing::TempDir tmp;
  fs::create_directories(tmp / "out");
  EXPECT_THAT(ExtractDeepSpeedToUniversal(DataDir() / "megatron_tp2_pp1_dp2_bf16", tmp / "out"),
              StatusIs(StatusCode::kAlreadyExists, ::testing::_));
}

// DeepSpeed's universal layout, checked by real torch (ds_universal_check.py). The TP=1 source
// saved universal_checkpoint_info without the row-parallel rule; cat_dim must still be 1 for
// the attention dense and 4h->h weights, since ucp's rules decide.
class DeepSpeedUniversalTest : public ::testing::TestWithParam<std::pair<const char*, int>> {};

TEST_P(DeepSpeedUniversalTest, TorchLoadsWhatUcpWrote) {
  ucp::testing::TempDir tmp;
  const fs::path src = DataDir() / GetParam().first;
  UCP_ASSERT_OK(ExtractDeepSpeedToUniversal(src, tmp / "ucp"));
  UCP_ASSERT_OK_AND_ASSIGN(io::UniversalReader reader, io::UniversalReader::Open(tmp / "ucp"));
  DeepSpeedUniversalOptions options;
  options.model_states_from = src;
  const fs::path out = tmp / "ds" / "global_step7_universal";
  fs::create_directories(out.parent_path());
  UCP_ASSERT_OK(WriteDeepSpeedUniversal(reader, out, options));
  EXPECT_THAT(WriteDeepSpeedUniversal(reader, out, options),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("exists")));
  const fs::path script =
      fs::path(UCP_SOURCE_ROOT_DIR) / "libucp/ucp/deepspeed/ds_universal_check.py";
  const std::string cmd = "/usr/bin/python3 " + script.string() + " " + out.string() + " " +
                          (DataDir() / "expected.pt").string() + " " +
                          std::to_string(GetParam().second);
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

INSTANTIATE_TEST_SUITE_P(Sources, DeepSpeedUniversalTest,
                         ::testing::Values(std::pair{"megatron_tp2_pp2_sp2_fp16_zero1", 4},
                                           std::pair{"megatron_tp1_pp2_dp2_bf16", 2}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.first);
                         });

}  // namespace
}  // namespace ucp::deepspeed
