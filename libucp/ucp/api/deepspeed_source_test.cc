// DeepSpeed folders as ordinary checkpoint sources (tests/data/deepspeed, real torch files):
// extraction is the truth (expected*.pt) bit for bit in every state, conversion to ucp layouts
// of another tp / pp / dp / zero is logically the DeepSpeed checkpoint, extract -> reshard ->
// extract round-trips, RestoreRank reads a rank straight from DeepSpeed files, and DeepSpeed's
// universal layout written from the extraction loads in torch.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/api/checkpoint.h"
#include "ucp/api/trainer.h"
#include "ucp/deepspeed/deepspeed_format.h"
#include "ucp/deepspeed/deepspeed_universal.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/universal/universal_checkpoint.h"

namespace ucp::api {
namespace {

using deepspeed::DeepSpeedOutputOptions;
using deepspeed::OpenDeepSpeedSource;
using deepspeed::ToDeepSpeed;

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

fs::path Root() { return fs::path(UCP_SOURCE_ROOT_DIR); }
fs::path DataDir() { return Root() / "tests" / "data" / "deepspeed"; }
fs::path Patterns() { return Root() / "patterns"; }

struct Case {
  const char* name;
  const char* expected;
  const char* model;  // --model, relative to DataDir(); "" for Megatron layouts
  DType dtype;
  const char* framework;
  const char* source_layout;
  std::vector<const char*> layouts;  // ucp layouts the model fits, one with another tp
};

const Case kCases[] = {
    {"megatron_tp2_pp1_dp2_bf16",
     "expected.pt",
     "",
     DType::kBf16,
     "megatron-deepspeed",
     "tp=2,pp=1,dp=2,sp=1,zero=1",
     {"tp=4,pp=1,dp=1", "tp=1,pp=2,dp=3,zero=1"}},
    {"megatron_tp1_pp2_dp2_bf16",
     "expected.pt",
     "",
     DType::kBf16,
     "megatron-deepspeed",
     "tp=1,pp=2,dp=2,sp=1,zero=1",
     {"tp=2,pp=1,dp=2,zero=2", "tp=1,pp=1,dp=2,zero=3"}},
    {"megatron_tp2_pp2_sp2_fp16_zero1",
     "expected.pt",
     "",
     DType::kFp16,
     "megatron-deepspeed",
     "tp=2,pp=2,dp=1,sp=2,zero=1",
     {"tp=1,pp=1,dp=1", "tp=4,pp=2,dp=2,zero=1"}},
    {"deepspeed_tp1_pp1_dp4_fp16_zero2",
     "expected.pt",
     "models/gpt-plain.json",
     DType::kFp16,
     "deepspeed",
     "tp=1,pp=1,dp=4,sp=1,zero=2",
     {"tp=2,pp=2,dp=1,zero=1"}},
    {"megatron_llama_tp2_pp2_dp2_bf16",
     "expected_llama.pt",
     "",
     DType::kBf16,
     "megatron-deepspeed",
     "tp=2,pp=2,dp=2,sp=1,zero=1",
     {"tp=1,pp=1,dp=2,zero=1", "tp=2,pp=1,dp=3,zero=2"}},
    {"megatron_llama_tp2_pp1_dp2_fp16_zero1",
     "expected_llama.pt",
     "",
     DType::kFp16,
     "megatron-deepspeed",
     "tp=2,pp=1,dp=2,sp=1,zero=1",
     {"tp=1,pp=2,dp=1", "tp=2,pp=2,dp=2,zero=3"}},
    // GPTModel's `module` nested as Megatron-DeepSpeed saves it (language_model -> embedding ->
    // word_embeddings -> weight, encoder -> flat layers.N keys, output_layer).
    {"megatron_llama_nested_tp2_pp1_dp2_fp16_zero1",
     "expected_llama.pt",
     "",
     DType::kFp16,
     "megatron-deepspeed",
     "tp=2,pp=1,dp=2,sp=1,zero=1",
     {"tp=1,pp=1,dp=2,zero=1"}},
    // ZeRO-3 with TP (Megatron-DeepSpeed GPTModel): per-parameter pieces over dp=3, several
    // sub-groups per param group (sub_group_size 100), bf16 weights = the fp32 masters rounded.
    {"megatron_llama_zero3_tp2_dp3_bf16",
     "expected_llama.pt",
     "",
     DType::kBf16,
     "megatron-deepspeed",
     "tp=2,pp=1,dp=3,sp=1,zero=3",
     {"tp=1,pp=1,dp=2,zero=1"}},
    {"deepspeed_mixtral_tp1_pp1_dp2_bf16_zero1",
     "expected_mixtral.pt",
     "models/mixtral-plain.json",
     DType::kBf16,
     "deepspeed",
     "tp=1,pp=1,dp=2,sp=1,zero=1",
     {"tp=2,pp=1,dp=2,ep=2,zero=1", "tp=1,pp=2,dp=4,ep=4,zero=2"}},
};

Result<std::unique_ptr<CheckpointSource>> OpenCase(const Case& c) {
  SourceOptions o;
  if (*c.model != '\0') o.model = (DataDir() / c.model).string();
  return CheckpointSource::Open(DataDir() / c.name, Patterns(), o);
}

Result<std::unique_ptr<CheckpointSource>> OpenUcp(const fs::path& dir) {
  return CheckpointSource::Open(dir, Patterns());
}

void ExpectEqual(const CheckpointSource& a, const CheckpointSource& b) {
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult d, Diff(a, b, 0.0, RunOptions{}));
  EXPECT_TRUE(d.equal) << d.first_difference;
  EXPECT_EQ(d.tensors_compared, static_cast<int64_t>(a.meta().model.params.size()) * 4);
}

class DeepSpeedSourceTest : public ::testing::TestWithParam<Case> {};

// Every parameter state of the extraction, the training-dtype weights included, is expected*.pt
// bit for bit; the manifest records DeepSpeed's layout and client state beside the ucp model.
TEST_P(DeepSpeedSourceTest, ExtractionIsBitwiseExpected) {
  const Case& c = GetParam();
  UCP_ASSERT_OK_AND_ASSIGN(auto src, OpenCase(c));
  EXPECT_EQ(src->meta().format, "deepspeed");
  EXPECT_EQ(src->meta().framework, c.framework);
  EXPECT_EQ(src->meta().source_layout, c.source_layout);
  UCP_ASSERT_OK(Verify(*src));
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK(Extract(*src, tmp / "u", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(io::UniversalReader reader, io::UniversalReader::Open(tmp / "u"));
  UCP_ASSERT_OK(reader.Verify());
  const io::UniversalManifest& m = reader.manifest();
  EXPECT_EQ(m.step, 7);
  EXPECT_EQ(m.source_layout, c.source_layout);
  EXPECT_EQ(m.source_framework, c.framework);
  const nlohmann::json client = nlohmann::json::parse(m.client_state_json);
  EXPECT_EQ(client.at("ucp_model").at("family"), src->meta().spec.family);
  EXPECT_EQ(client.at("deepspeed").at("layout"), c.source_layout);
  EXPECT_EQ(client.at("deepspeed").at("tag"), "global_step7");
  if (std::string(c.framework) == "megatron-deepspeed") {
    EXPECT_EQ(client.at("deepspeed").at("iteration"), 7);
    EXPECT_EQ(client.at("deepspeed").at("args").at("hidden_size"), 16);
  }
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile expected,
                           torch::TorchFile::Open(DataDir() / c.expected));
  ASSERT_EQ(expected.root().entries().size(), m.params.size());
  const std::string model_key = "model_" + std::string(DTypeName(c.dtype));
  for (const auto& [k, states] : expected.root().entries()) {
    SCOPED_TRACE(k->str());
    for (const char* s : {"fp32", "exp_avg", "exp_avg_sq", "model"}) {
      const std::string key = std::string(s) == "model" ? model_key : s;
      UCP_ASSERT_OK_AND_ASSIGN(Tensor want, expected.ReadTensor(states->Get(key)->tensor()));
      UCP_ASSERT_OK_AND_ASSIGN(Tensor got, reader.ReadState(k->str(), s));
      ASSERT_EQ(got.dtype(), want.dtype()) << s;
      ASSERT_EQ(got.shape(), want.shape()) << s;
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.num_bytes()), 0) << s;
    }
  }
  // The universal copy is an ordinary ucp checkpoint: it opens with its model and equals the
  // DeepSpeed folder.
  UCP_ASSERT_OK_AND_ASSIGN(auto u, OpenUcp(tmp / "u"));
  ExpectEqual(*u, *src);
}

// convert DS -> ucp layout L streams without a universal copy and holds the same model; so does
// reshard of the extraction, and extracting that again reproduces the extraction.
TEST_P(DeepSpeedSourceTest, ConvertReshardAndExtractAgree) {
  const Case& c = GetParam();
  UCP_ASSERT_OK_AND_ASSIGN(auto src, OpenCase(c));
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK(Extract(*src, tmp / "u", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto u, OpenUcp(tmp / "u"));
  int i = 0;
  for (const char* text : c.layouts) {
    SCOPED_TRACE(text);
    UCP_ASSERT_OK_AND_ASSIGN(layout::Layout l, layout::ParseLayout(text));
    const fs::path converted = tmp / ("c" + std::to_string(i));
    const fs::path resharded = tmp / ("r" + std::to_string(i));
    const fs::path again = tmp / ("u" + std::to_string(i++));
    UCP_ASSERT_OK(ToLayout(*src, l, converted, RunOptions{}).status());
    UCP_ASSERT_OK_AND_ASSIGN(auto conv, OpenUcp(converted));
    UCP_ASSERT_OK(Verify(*conv));
    ExpectEqual(*conv, *src);
    ExpectEqual(*conv, *u);
    UCP_ASSERT_OK(ToLayout(*u, l, resharded, RunOptions{}).status());
    UCP_ASSERT_OK_AND_ASSIGN(auto resh, OpenUcp(resharded));
    UCP_ASSERT_OK(Extract(*resh, again, RunOptions{}).status());
    UCP_ASSERT_OK_AND_ASSIGN(auto u2, OpenUcp(again));
    ExpectEqual(*u2, *u);
  }
}

// A trainer at another layout restores its rank straight from the DeepSpeed folder, getting the
// bytes it would get from the universal copy.
TEST_P(DeepSpeedSourceTest, RestoreRankEqualsRestoreFromUniversal) {
  const Case& c = GetParam();
  UCP_ASSERT_OK_AND_ASSIGN(auto src, OpenCase(c));
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK(Extract(*src, tmp / "u", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto u, OpenUcp(tmp / "u"));
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout l, layout::ParseLayout(c.layouts.back()));
  for (int64_t rank : {int64_t{0}, layout::WorldSize(l) - 1}) {
    SCOPED_TRACE(rank);
    UCP_ASSERT_OK_AND_ASSIGN(std::vector<convert::TensorInfo> mine,
                             RankTensors(src->meta().model, l, rank, src->meta().plan_options()));
    ASSERT_FALSE(mine.empty());
    std::vector<std::vector<std::byte>> from_ds, from_u;
    std::vector<std::pair<std::string, TensorView>> ds_views, u_views;
    for (const convert::TensorInfo& t : mine) {
      const size_t bytes = static_cast<size_t>(NumElementsOrDie(t.shape) * DTypeSizeBytes(t.dtype));
      from_ds.emplace_back(bytes, std::byte{0x5a});
      from_u.emplace_back(bytes, std::byte{0xa5});
    }
    for (size_t i = 0; i < mine.size(); ++i) {
      ds_views.emplace_back(mine[i].name, TensorView{mine[i].dtype, mine[i].shape, from_ds[i]});
      u_views.emplace_back(mine[i].name, TensorView{mine[i].dtype, mine[i].shape, from_u[i]});
    }
    UCP_ASSERT_OK(RestoreRank(*src, l, rank, ds_views));
    UCP_ASSERT_OK(RestoreRank(*u, l, rank, u_views));
    for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(from_ds[i], from_u[i]) << mine[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepSpeedSourceTest, ::testing::ValuesIn(kCases),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

TEST(DeepSpeedSource, ModelOptionReachesTheReader) {
  SourceOptions o;
  o.model = "gpt-tiny";
  EXPECT_THAT(
      CheckpointSource::Open(DataDir() / "megatron_tp2_pp1_dp2_bf16", Patterns(), o).status(),
      StatusIs(StatusCode::kFailedPrecondition, HasSubstr("model \"gpt-tiny\"")));
  EXPECT_THAT(
      CheckpointSource::Open(DataDir() / "deepspeed_tp1_pp1_dp4_fp16_zero2", Patterns()).status(),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("pass --model")));
}

// A corrupt module weight fails the checksum pass Extract runs first, and nothing is written.
TEST(DeepSpeedSource, CorruptRecordStopsExtraction) {
  ucp::testing::TempDir tmp;
  const fs::path src_dir = tmp / "ds";
  fs::copy(DataDir() / "megatron_tp2_pp1_dp2_bf16", src_dir, fs::copy_options::recursive);
  const fs::path f = src_dir / "global_step7" / "mp_rank_01_model_states.pt";
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile file, torch::TorchFile::Open(f));
  const std::string key = file.root()
                              .Get("module")
                              ->Get("language_model.embedding.word_embeddings.weight")
                              ->tensor()
                              .storage.key;
  torch::StorageRecord rec;
  for (const torch::StorageRecord& r : file.storages()) {
    if (r.key == key) rec = r;
  }
  ASSERT_GT(rec.num_bytes, 1);
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(rec.data_offset + 1);
    io.put('\x7f');
  }
  UCP_ASSERT_OK_AND_ASSIGN(auto src, CheckpointSource::Open(src_dir, Patterns()));
  EXPECT_THAT(Extract(*src, tmp / "u", RunOptions{}).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("crc32 mismatch in record 'data/" +
                                                        rec.key + "' of " + f.string())));
  EXPECT_FALSE(fs::exists(tmp / "u"));
}

// DeepSpeed's universal layout, checked by real torch (ds_universal_check.py), from a universal
// checkpoint extracted from DeepSpeed. The TP=1 source saved universal_checkpoint_info without the
// row-parallel rule; cat_dim must still be 1 for the attention dense and 4h->h weights, since
// ucp's rules decide.
class DeepSpeedUniversalTest : public ::testing::TestWithParam<std::pair<const char*, int>> {};

TEST_P(DeepSpeedUniversalTest, TorchLoadsWhatUcpWrote) {
  ucp::testing::TempDir tmp;
  const fs::path src_dir = DataDir() / GetParam().first;
  UCP_ASSERT_OK_AND_ASSIGN(auto src, CheckpointSource::Open(src_dir, Patterns()));
  UCP_ASSERT_OK(Extract(*src, tmp / "ucp", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(io::UniversalReader reader, io::UniversalReader::Open(tmp / "ucp"));
  deepspeed::DeepSpeedUniversalOptions options;
  options.model_states_from = src_dir;
  options.data_dir = Patterns();
  const fs::path out = tmp / "ds" / "global_step7_universal";
  fs::create_directories(out.parent_path());
  UCP_ASSERT_OK(deepspeed::WriteDeepSpeedUniversal(reader, out, options));
  EXPECT_THAT(deepspeed::WriteDeepSpeedUniversal(reader, out, options),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("exists")));
  const fs::path script = Root() / "libucp/ucp/deepspeed/ds_universal_check.py";
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
}  // namespace ucp::api
