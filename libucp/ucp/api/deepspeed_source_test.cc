// DeepSpeed folders as ordinary checkpoint sources (tests/data/deepspeed, real torch files):
// extraction is the truth (expected*.pt) bit for bit in every state, conversion to ucp layouts
// of another tp / pp / dp / zero is logically the DeepSpeed checkpoint, extract -> reshard ->
// extract round-trips, RestoreRank reads a rank straight from DeepSpeed files, and DeepSpeed's
// universal layout written from the extraction loads in torch.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
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
#include "ucp/io/manifest/universal_manifest.h"
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
  const char* qkv_layout = "";       // --qkv-layout
  const char* qkv_recorded = "";     // the manifest's source.qkv_layout
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
    // The fused QKV in Megatron-DeepSpeed's order since PR #441 ([Q_r | K_r | V_r] per tp rank):
    // detected from the args (ds_sequence_parallel_fpdt), and given by --qkv-layout for a run
    // whose args do not say it.
    {"megatron_qkv441_tp2_pp1_dp2_bf16",
     "expected.pt",
     "",
     DType::kBf16,
     "megatron-deepspeed",
     "tp=2,pp=1,dp=2,sp=1,zero=1",
     {"tp=1,pp=1,dp=1", "tp=4,pp=1,dp=2,zero=1"},
     "",
     "per-rank-blocks"},
    {"megatron_qkvblocks_tp1_pp1_dp2_fp16_zero1",
     "expected.pt",
     "",
     DType::kFp16,
     "megatron-deepspeed",
     "tp=1,pp=1,dp=2,sp=1,zero=1",
     {"tp=2,pp=1,dp=1"},
     "per-rank-blocks",
     "per-rank-blocks"},
    // torch.optim.SGD with momentum: its one state, momentum_buffer, carried under its name.
    {"megatron_sgd_tp2_pp1_dp2_fp16_zero2",
     "expected_sgd.pt",
     "",
     DType::kFp16,
     "megatron-deepspeed",
     "tp=2,pp=1,dp=2,sp=1,zero=2",
     {"tp=1,pp=2,dp=3,zero=1", "tp=4,pp=1,dp=1"}},
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
  o.qkv_layout = c.qkv_layout;
  return CheckpointSource::Open(DataDir() / c.name, Patterns(), o);
}

Result<std::unique_ptr<CheckpointSource>> OpenUcp(const fs::path& dir) {
  return CheckpointSource::Open(dir, Patterns());
}

void ExpectEqual(const CheckpointSource& a, const CheckpointSource& b) {
  UCP_ASSERT_OK_AND_ASSIGN(DiffResult d, Diff(a, b, 0.0, RunOptions{}));
  EXPECT_TRUE(d.equal) << d.first_difference;
  // Every optimizer state and the model weight of every parameter.
  EXPECT_EQ(d.tensors_compared, static_cast<int64_t>(a.meta().model.params.size()) *
                                    static_cast<int64_t>(a.meta().optimizer_states.size() + 1));
}

// The optimizer states an expected*.pt holds for each parameter (all but the model_* weights).
std::vector<std::string> ExpectedStates(const torch::PyValue* states) {
  std::vector<std::string> out;
  for (const auto& [k, v] : states->entries()) {
    if (!k->str().starts_with("model_")) out.push_back(k->str());
  }
  return out;
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
  // The states are the source optimizer's own, under their names.
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile truth, torch::TorchFile::Open(DataDir() / c.expected));
  EXPECT_EQ(m.optimizer_states, ExpectedStates(truth.root().entries().front().second));
  // Megatron fixtures default to per-group (their args predate PR #441); plain ones too.
  EXPECT_EQ(m.source_qkv_layout, *c.qkv_recorded ? c.qkv_recorded : "per-group");
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
    std::vector<std::string> all = ExpectedStates(states);
    all.push_back("model");
    for (const std::string& s : all) {
      const std::string key = s == "model" ? model_key : s;
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


// --- The fused QKV's row order (Megatron-DeepSpeed before / since PR #441) -------------------

bool IsQkv(const std::string& name) { return name.find("query_key_value") != std::string::npos; }

// A weight of a `module` dict under its engine name: a flat key, or nested dicts whose keys join
// with '.' to it (Megatron-DeepSpeed's GPTModel save).
const torch::PyValue* ModuleTensor(const torch::PyValue* d, const std::string& key) {
  if (d == nullptr || d->kind() != torch::PyKind::kDict) return nullptr;
  if (const torch::PyValue* v = d->Get(key); v != nullptr) return v;
  for (const auto& [k, v] : d->entries()) {
    const std::string& p = k->str();
    if (key.size() > p.size() && key.starts_with(p + ".")) {
      if (const torch::PyValue* t = ModuleTensor(v, key.substr(p.size() + 1))) return t;
    }
  }
  return nullptr;
}

// The args of post-#441 code say the order, so a contradicting --qkv-layout is refused; the
// order is in the source notes and the manifest.
TEST(DeepSpeedQkvLayout, DetectedFromTheArgsOfPost441Code) {
  UCP_ASSERT_OK_AND_ASSIGN(
      auto src, CheckpointSource::Open(DataDir() / "megatron_qkv441_tp2_pp1_dp2_bf16", Patterns()));
  EXPECT_EQ(src->meta().qkv_layout, "per-rank-blocks");
  EXPECT_THAT(src->meta().source_notes,
              HasSubstr("QKV per-rank-blocks (detected: mp_rank_00_model_states.pt args hold "
                        "ds_sequence_parallel_fpdt"));
  SourceOptions o;
  o.qkv_layout = "per-group";
  EXPECT_THAT(
      CheckpointSource::Open(DataDir() / "megatron_qkv441_tp2_pp1_dp2_bf16", Patterns(), o)
          .status(),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr("--qkv-layout per-group contradicts the checkpoint")));
  o.qkv_layout = "contiguous";
  EXPECT_THAT(CheckpointSource::Open(DataDir() / "megatron_qkvblocks_tp1_pp1_dp2_fp16_zero1",
                                     Patterns(), o)
                  .status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("per-group (Megatron-LM")));
  // Post-#441 code cuts equal thirds: no GQA checkpoint has that order.
  o.qkv_layout = "per-rank-blocks";
  EXPECT_THAT(
      CheckpointSource::Open(DataDir() / "megatron_llama_tp2_pp1_dp2_fp16_zero1", Patterns(), o)
          .status(),
      StatusIs(StatusCode::kFailedPrecondition, HasSubstr("grouped-query attention")));
}

// Read in the wrong order (the default, per-group, where the args do not say it), the post-#441
// checkpoint is another model: every fused QKV state is a row permutation of the truth that
// differs from it, everything else is the truth. The right order is checked bitwise by the
// Fixtures cases above.
TEST(DeepSpeedQkvLayout, TheWrongOrderVisiblyChangesTheModel) {
  UCP_ASSERT_OK_AND_ASSIGN(
      auto src, CheckpointSource::Open(DataDir() / "megatron_qkvblocks_tp1_pp1_dp2_fp16_zero1",
                                       Patterns()));
  EXPECT_EQ(src->meta().qkv_layout, "per-group");
  EXPECT_THAT(src->meta().source_notes, HasSubstr("QKV per-group (default: "));
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK(Extract(*src, tmp / "u", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(io::UniversalReader reader, io::UniversalReader::Open(tmp / "u"));
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile expected,
                           torch::TorchFile::Open(DataDir() / "expected.pt"));
  int qkv = 0;
  for (const auto& [k, states] : expected.root().entries()) {
    SCOPED_TRACE(k->str());
    for (const char* s : {"fp32", "exp_avg", "exp_avg_sq", "model"}) {
      const std::string key = std::string(s) == "model" ? "model_fp16" : s;
      UCP_ASSERT_OK_AND_ASSIGN(Tensor want, expected.ReadTensor(states->Get(key)->tensor()));
      UCP_ASSERT_OK_AND_ASSIGN(Tensor got, reader.ReadState(k->str(), s));
      ASSERT_EQ(got.num_bytes(), want.num_bytes());
      const bool same = std::memcmp(got.data(), want.data(), want.num_bytes()) == 0;
      if (!IsQkv(k->str())) {
        EXPECT_TRUE(same) << s;
        continue;
      }
      EXPECT_FALSE(same) << s;
      // The same rows, in another order.
      const int64_t rows = got.shape()[0], row = want.num_bytes() / rows;
      std::vector<std::string> a, b;
      for (int64_t r = 0; r < rows; ++r) {
        a.emplace_back(reinterpret_cast<const char*>(got.data()) + r * row, row);
        b.emplace_back(reinterpret_cast<const char*>(want.data()) + r * row, row);
      }
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      EXPECT_EQ(a, b) << s;
      ++qkv;
    }
  }
  EXPECT_EQ(qkv, 2 * 2 * 4);  // weight and bias of 2 layers, 4 states
}

// The model as PyTorch computes it (tests/engine/torch_ref.py's forward, ds_qkv_check.py): read
// in the right order the post-#441 checkpoint gives the truth's logits bit for bit, in the wrong
// one logits far from them.
TEST(DeepSpeedQkvLayout, TorchLogitsRightOrderTruthWrongOrderNot) {
  const fs::path from = DataDir() / "megatron_qkvblocks_tp1_pp1_dp2_fp16_zero1";
  ucp::testing::TempDir tmp;
  SourceOptions o;
  o.qkv_layout = "per-rank-blocks";
  UCP_ASSERT_OK_AND_ASSIGN(auto right, CheckpointSource::Open(from, Patterns(), o));
  UCP_ASSERT_OK(Extract(*right, tmp / "right", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto wrong, CheckpointSource::Open(from, Patterns()));
  UCP_ASSERT_OK(Extract(*wrong, tmp / "wrong", RunOptions{}).status());
  const fs::path script = Root() / "libucp/ucp/deepspeed/ds_qkv_check.py";
  const std::string cmd = "/usr/bin/python3 " + script.string() + " " + (tmp / "right").string() +
                          " " + (tmp / "wrong").string() + " " +
                          (DataDir() / "expected.pt").string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// The manifest's source.qkv_layout: written only where a source has one, parsed back, and any
// other value than the two orders refused with its JSON path.
TEST(DeepSpeedQkvLayout, ManifestRecordsTheOrder) {
  UCP_ASSERT_OK_AND_ASSIGN(
      auto src, CheckpointSource::Open(DataDir() / "megatron_qkv441_tp2_pp1_dp2_bf16", Patterns()));
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK(Extract(*src, tmp / "u", RunOptions{}).status());
  std::ifstream in(tmp / "u" / "manifest.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  UCP_ASSERT_OK_AND_ASSIGN(io::UniversalManifest m, io::ParseUniversalManifest(text, "m.json"));
  EXPECT_EQ(m.source_qkv_layout, "per-rank-blocks");
  UCP_ASSERT_OK_AND_ASSIGN(std::string again, io::SerializeUniversalManifest(m));
  EXPECT_EQ(again, text);
  m.source_qkv_layout.clear();
  UCP_ASSERT_OK_AND_ASSIGN(std::string none, io::SerializeUniversalManifest(m));
  EXPECT_FALSE(nlohmann::json::parse(none).at("source").contains("qkv_layout"));
  const size_t at = text.find("\"per-rank-blocks\"", text.find("\"source\""));
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 17, "\"contiguous\"");
  EXPECT_THAT(io::ParseUniversalManifest(text, "m.json").status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("/source/qkv_layout")));
}

// --format deepspeed keeps the source's order (recorded as ucp_qkv_layout), writing the rows
// where post-#441 code has them (the module weight is the torch-made fixture's, byte for byte);
// --write-qkv-layout per-group writes Megatron-LM's order, and both read back as the same model.
TEST(DeepSpeedQkvLayout, WrittenInTheSourcesOrderOrTheOneAskedFor) {
  const fs::path from = DataDir() / "megatron_qkvblocks_tp1_pp1_dp2_fp16_zero1";
  SourceOptions o;
  o.qkv_layout = "per-rank-blocks";
  UCP_ASSERT_OK_AND_ASSIGN(auto src, CheckpointSource::Open(from, Patterns(), o));
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout l, layout::ParseLayout("tp=1,pp=1,dp=2,zero=1"));
  UCP_ASSERT_OK(ToDeepSpeed(*src, l, tmp / "blocks", RunOptions{}).status());
  DeepSpeedOutputOptions ds;
  ds.qkv_layout = "per-group";
  UCP_ASSERT_OK(ToDeepSpeed(*src, l, tmp / "group", RunOptions{}, ds).status());
  ds.qkv_layout = "rows";
  EXPECT_THAT(ToDeepSpeed(*src, l, tmp / "bad", RunOptions{}, ds).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--write-qkv-layout must be")));
  const std::string w = "language_model.encoder.layers.1.self_attention.query_key_value.weight";
  const std::string f = "global_step7/mp_rank_00_model_states.pt";
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile original, torch::TorchFile::Open(from / f));
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile blocks, torch::TorchFile::Open(tmp / "blocks" / f));
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile group, torch::TorchFile::Open(tmp / "group" / f));
  EXPECT_EQ(blocks.root().Get("ucp_qkv_layout")->str(), "per-rank-blocks");
  EXPECT_EQ(group.root().Get("ucp_qkv_layout")->str(), "per-group");
  auto weight = [&](const torch::TorchFile& file) -> Result<Tensor> {
    const torch::PyValue* t = ModuleTensor(file.root().Get("module"), w);
    if (t == nullptr) return NotFoundError(w);
    return file.ReadTensor(t->tensor());
  };
  UCP_ASSERT_OK_AND_ASSIGN(Tensor want, weight(original));
  UCP_ASSERT_OK_AND_ASSIGN(Tensor got_blocks, weight(blocks));
  UCP_ASSERT_OK_AND_ASSIGN(Tensor got_group, weight(group));
  ASSERT_EQ(got_blocks.num_bytes(), want.num_bytes());
  EXPECT_EQ(std::memcmp(got_blocks.data(), want.data(), want.num_bytes()), 0);
  EXPECT_NE(std::memcmp(got_group.data(), want.data(), want.num_bytes()), 0);
  // Read back without options: each is the source's model (its recorded order wins).
  UCP_ASSERT_OK_AND_ASSIGN(auto b, CheckpointSource::Open(tmp / "blocks", Patterns()));
  UCP_ASSERT_OK_AND_ASSIGN(auto g, CheckpointSource::Open(tmp / "group", Patterns()));
  EXPECT_EQ(b->meta().qkv_layout, "per-rank-blocks");
  EXPECT_EQ(g->meta().qkv_layout, "per-group");
  ExpectEqual(*b, *src);
  ExpectEqual(*g, *src);
  // A universal checkpoint records the order and gives it back to --format deepspeed.
  UCP_ASSERT_OK(Extract(*src, tmp / "u", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto u, OpenUcp(tmp / "u"));
  EXPECT_EQ(u->meta().qkv_layout, "per-rank-blocks");
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout l2, layout::ParseLayout("tp=2,pp=1,dp=1,zero=2"));
  UCP_ASSERT_OK(ToDeepSpeed(*u, l2, tmp / "again", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto again, CheckpointSource::Open(tmp / "again", Patterns()));
  EXPECT_EQ(again->meta().qkv_layout, "per-rank-blocks");
  ExpectEqual(*again, *src);
  // ZeRO-3 (the weights are the fp32 masters rounded, read through the same row blocks).
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout z3, layout::ParseLayout("tp=2,pp=1,dp=2,zero=3"));
  UCP_ASSERT_OK(ToDeepSpeed(*src, z3, tmp / "zero3", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto zero3, CheckpointSource::Open(tmp / "zero3", Patterns()));
  EXPECT_EQ(zero3->meta().qkv_layout, "per-rank-blocks");
  ExpectEqual(*zero3, *src);
  // No GQA checkpoint has post-#441's order.
  UCP_ASSERT_OK_AND_ASSIGN(
      auto llama,
      CheckpointSource::Open(DataDir() / "megatron_llama_tp2_pp1_dp2_fp16_zero1", Patterns()));
  ds.qkv_layout = "per-rank-blocks";
  EXPECT_THAT(ToDeepSpeed(*llama, l, tmp / "gqa", RunOptions{}, ds).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("grouped-query attention")));
  EXPECT_FALSE(fs::exists(tmp / "gqa"));
}


// --- Optimizers other than Adam: their states carried under their own names ----------------

// torch SGD with momentum read, extracted, and written back as DeepSpeed files at another layout
// that hold SGD's state (momentum_buffer, no step) and param groups, straight from the folder
// and from the universal extraction (whose client state records the groups).
TEST(DeepSpeedOptimizerStates, SgdMomentumRoundTrips) {
  const fs::path from = DataDir() / "megatron_sgd_tp2_pp1_dp2_fp16_zero2";
  UCP_ASSERT_OK_AND_ASSIGN(auto src, CheckpointSource::Open(from, Patterns()));
  EXPECT_EQ(src->meta().optimizer_states, (std::vector<std::string>{"fp32", "momentum_buffer"}));
  EXPECT_EQ(src->meta().optimizer_kind, "torch");  // a client optimizer: ds_config names none
  EXPECT_EQ(src->meta().optimizer_hyper.at("momentum"), 0.9);
  EXPECT_EQ(src->meta().optimizer_hyper.at("nesterov"), 0.0);
  EXPECT_FALSE(src->meta().optimizer_hyper.contains("beta1"));
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK(Extract(*src, tmp / "u", RunOptions{}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto u, OpenUcp(tmp / "u"));
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout l, layout::ParseLayout("tp=1,pp=1,dp=3,zero=1"));
  UCP_ASSERT_OK(ToDeepSpeed(*src, l, tmp / "ds", RunOptions{}).status());
  UCP_ASSERT_OK(ToDeepSpeed(*u, l, tmp / "from-u", RunOptions{}).status());
  for (const char* out : {"ds", "from-u"}) {
    SCOPED_TRACE(out);
    UCP_ASSERT_OK_AND_ASSIGN(auto back, CheckpointSource::Open(tmp / out, Patterns()));
    EXPECT_EQ(back->meta().optimizer_states, src->meta().optimizer_states);
    ExpectEqual(*back, *src);
    UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile f,
                             torch::TorchFile::Open(tmp / out / "global_step7" /
                                                    "zero_pp_rank_2_mp_rank_00_optim_states.pt"));
    const torch::PyValue* base = f.root().Get("optimizer_state_dict")->Get("base_optimizer_state");
    const torch::PyValue* s0 = base->Get("state")->Get(int64_t{0});
    std::vector<std::string> keys;
    for (const auto& [k, v] : s0->entries()) keys.push_back(k->str());
    EXPECT_EQ(keys, std::vector<std::string>{"momentum_buffer"});  // SGD keeps no step
    const torch::PyValue* g0 = base->Get("param_groups")->items()[0];
    ASSERT_NE(g0->Get("momentum"), nullptr);
    EXPECT_EQ(g0->Get("momentum")->float_value(), 0.9);
    EXPECT_EQ(g0->Get("exp_avg"), nullptr);
    EXPECT_EQ(g0->Get("betas"), nullptr);
  }
}

}  // namespace
}  // namespace ucp::api
