// Hugging Face folders: the shard split and size parsing, round trips of GPT and LLaMA models
// through --format hf and back at several layouts (bitwise, and byte-identical re-exports),
// bf16 export rounding, prefix-less keys, and one refusal per import rule. The same paths
// against the real transformers are tests/peer/hf_peer_test.sh.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <sstream>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/api/checkpoint.h"
#include "ucp/hf/hf_format.h"
#include "ucp/hf/hf_map.h"
#include "ucp/io/safetensors/safetensors_file.h"
#include "ucp/io/safetensors/safetensors_writer.h"
#include "ucp/json/strict_json.h"

namespace ucp::hf {
namespace {

namespace fs = std::filesystem;
namespace st = ::ucp::safetensors;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

std::string Slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void Spit(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
}

TEST(HfMapTest, SplitShardsIsHubsGreedyRule) {
  // An oversize tensor gets its own shard, placed before the one being filled.
  EXPECT_EQ(SplitShards({4, 4, 4}, 10), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(SplitShards({4, 20, 4, 4}, 10), (std::vector<int>{1, 0, 1, 2}));
  EXPECT_EQ(SplitShards({10, 10}, 10), (std::vector<int>{0, 1}));
  EXPECT_EQ(SplitShards({}, 10), (std::vector<int>{}));
}

TEST(HfMapTest, ShardSizesAreDecimal) {
  EXPECT_EQ(*ParseShardSize("5GB"), 5'000'000'000);
  EXPECT_EQ(*ParseShardSize("60KB"), 60'000);
  EXPECT_EQ(*ParseShardSize("123"), 123);
  EXPECT_THAT(ParseShardSize("5GiB").status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("max-shard-size")));
  EXPECT_THAT(ParseShardSize("0").status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("max-shard-size")));
  EXPECT_EQ(ShardFileName(0, 1), "model.safetensors");
  EXPECT_EQ(ShardFileName(2, 12), "model-00003-of-00012.safetensors");
}

class HfRoundTripTest : public ::testing::TestWithParam<std::string> {};

// preset -> ucp at tp=2,pp=2 -> hf -> ucp at tp=2,pp=2, tp=1 and a tp above the KV heads (where
// the rule set has them: Megatron-Core's split inside a query group) -> hf: the model state is
// kept bitwise, the second export is byte-identical to the first, and the imported fp32 state is
// the weights themselves.
TEST_P(HfRoundTripTest, ExportImportExportIsIdentity) {
  ::ucp::testing::TempDir tmp;
  const fs::path data = api::UcpDataDir();
  UCP_ASSERT_OK_AND_ASSIGN(auto model, api::LoadResolvedModel(data, GetParam(), "fp32"));
  UCP_ASSERT_OK(api::Generate(model.first, model.second, *layout::ParseLayout("tp=2,pp=2"), 7,
                              tmp.path() / "gen", {})
                    .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto gen, api::CheckpointSource::Open(tmp.path() / "gen", data));
  HfWriteOptions small;
  small.max_shard_bytes = 20'000;
  UCP_ASSERT_OK(WriteHf(*gen, tmp.path() / "hf1", {}, small).status());
  EXPECT_TRUE(fs::exists(tmp.path() / "hf1" / kIndexFileName));
  UCP_ASSERT_OK_AND_ASSIGN(auto hf1, api::CheckpointSource::Open(tmp.path() / "hf1", data));
  EXPECT_EQ(hf1->meta().format, "hf");
  EXPECT_EQ(hf1->meta().optimizer_states, std::vector<std::string>{"fp32"});
  UCP_ASSERT_OK(api::Verify(*hf1));
  // mixtral-tiny has 2 KV heads of 4, the llama presets 4 of 8.
  const std::string above = GetParam() == "mixtral-tiny" ? "tp=4,pp=2" : "tp=8,pp=2,dp=2,zero=1";
  for (const char* l : {"tp=2,pp=2", "tp=1,pp=1,dp=2,zero=1", above.c_str()}) {
    SCOPED_TRACE(l);
    const fs::path dist =
        tmp.path() / ("d" + std::string(l).substr(3, 1) + std::string(l).substr(8, 1));
    UCP_ASSERT_OK(api::ToLayout(*hf1, *layout::ParseLayout(l), dist, {}).status());
    UCP_ASSERT_OK_AND_ASSIGN(auto d, api::CheckpointSource::Open(dist, data));
    UCP_ASSERT_OK_AND_ASSIGN(api::DiffResult diff, api::Diff(*hf1, *d, 0, {}));
    EXPECT_TRUE(diff.equal) << diff.first_difference;
    const fs::path again = dist.string() + ".hf";
    UCP_ASSERT_OK(WriteHf(*d, again, {}, small).status());
    for (const auto& e : fs::directory_iterator(tmp.path() / "hf1")) {
      EXPECT_EQ(Slurp(e.path()), Slurp(again / e.path().filename())) << e.path();
    }
  }
  // The generated model's weights went out and came back bitwise: compare against the source's
  // own model state through a universal extraction of both.
  UCP_ASSERT_OK(api::Extract(*gen, tmp.path() / "u_gen", {}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto ug, api::CheckpointSource::Open(tmp.path() / "u_gen", data));
  for (const auto& p : ug->meta().model.params) {
    convert::TensorInfo a, b;
    a.name = p.name + "/model";
    a.param = p.name;
    a.state = "model";
    a.dtype = DType::kFp32;
    b = a;
    const int64_t n = NumElementsOrDie(p.shape);
    std::vector<float> x(n), y(n), z(n);
    UCP_ASSERT_OK(ug->ReadFlatRange(a, 0, n, std::as_writable_bytes(std::span(x))));
    UCP_ASSERT_OK(hf1->ReadFlatRange(b, 0, n, std::as_writable_bytes(std::span(y))));
    b.name = p.name + "/fp32";
    b.state = "fp32";
    UCP_ASSERT_OK(hf1->ReadFlatRange(b, 0, n, std::as_writable_bytes(std::span(z))));
    ASSERT_EQ(std::memcmp(x.data(), y.data(), n * 4), 0) << p.name;
    ASSERT_EQ(std::memcmp(x.data(), z.data(), n * 4), 0) << p.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HfRoundTripTest,
                         ::testing::Values("gpt-tiny", "llama-tiny", "llama-tiny-tied",
                                           "mixtral-tiny"));

class HfImportTest : public ::testing::Test {
 protected:
  // A llama-tiny (untied) or gpt-tiny fp32 export in folder `name`.
  fs::path Export(const std::string& preset, const std::string& name, int64_t shard_bytes = 0) {
    const fs::path data = api::UcpDataDir();
    auto model = api::LoadResolvedModel(data, preset, "fp32");
    EXPECT_TRUE(model.ok());
    const fs::path gen = tmp_.path() / (name + ".gen");
    EXPECT_TRUE(
        api::Generate(model->first, model->second, layout::UniversalLayout(), 3, gen, {}).ok());
    auto src = api::CheckpointSource::Open(gen, data);
    EXPECT_TRUE(src.ok());
    HfWriteOptions o;
    if (shard_bytes > 0) o.max_shard_bytes = shard_bytes;
    EXPECT_TRUE(WriteHf(**src, tmp_.path() / name, {}, o).ok());
    return tmp_.path() / name;
  }
  Status Open(const fs::path& dir) { return OpenHfSource(dir, api::UcpDataDir()).status(); }
  // Rewrites model.safetensors with its tensors renamed (or dropped: empty name) by `rename`,
  // plus `extra` tensors (new name -> copy of the tensor of that name).
  void Rewrite(const fs::path& dir, const std::function<std::string(const std::string&)>& rename,
               const std::map<std::string, std::string>& extra = {}) {
    std::vector<Tensor> keep;
    std::vector<st::NamedTensorView> views;
    {
      auto f = st::SafetensorsFile::Open(dir / kSingleFileName);
      ASSERT_TRUE(f.ok());
      for (const auto& e : f->entries()) {
        for (const auto& [name, from] : extra) {
          if (from != e.name) continue;
          keep.push_back(*f->ReadTensor(e));
          views.push_back({name, {}});
        }
        const std::string n = rename(e.name);
        if (n.empty()) continue;
        keep.push_back(*f->ReadTensor(e));
        views.push_back({n, {}});
      }
    }
    for (size_t i = 0; i < keep.size(); ++i) views[i].view = keep[i].view();
    st::SafetensorsWriteOptions o;
    o.overwrite = true;
    ASSERT_TRUE(st::WriteSafetensorsFile(dir / kSingleFileName, views, o).ok());
  }
  void EditConfig(const fs::path& dir, const std::function<void(json::Json&)>& edit) {
    json::Json c = *json::ParseStrict(Slurp(dir / kConfigFileName), "c", StatusCode::kDataLoss);
    edit(c);
    Spit(dir / kConfigFileName, c.dump(2));
  }
  ::ucp::testing::TempDir tmp_;
};

TEST_F(HfImportTest, KeysWithoutPrefixAndLegacyBuffersAreRead) {
  const fs::path dir = Export("gpt-tiny", "gpt");
  Rewrite(dir,
          [](const std::string& n) { return n.starts_with("transformer.") ? n.substr(12) : n; });
  UCP_EXPECT_OK(Open(dir));
  // Legacy causal-mask buffers are skipped; an unknown tensor is not; a missing one is named.
  auto same = [](const std::string& n) { return n; };
  const fs::path dir2 = Export("gpt-tiny", "gpt2");
  Rewrite(dir2, same,
          {{"transformer.h.0.attn.masked_bias", "transformer.h.0.ln_1.bias"},
           {"transformer.h.1.attn.bias", "transformer.h.0.ln_1.bias"}});
  UCP_EXPECT_OK(Open(dir2));
  const fs::path dir3 = Export("gpt-tiny", "gpt3");
  Rewrite(dir3, same, {{"transformer.h.0.extra.bias", "transformer.h.0.ln_1.bias"}});
  EXPECT_THAT(Open(dir3), StatusIs(StatusCode::kDataLoss, HasSubstr("is not a weight of")));
  const fs::path dir4 = Export("gpt-tiny", "gpt4");
  Rewrite(dir4, [](const std::string& n) {
    return n == "transformer.h.0.ln_1.bias" ? std::string() : n;
  });
  EXPECT_THAT(Open(dir4), StatusIs(StatusCode::kDataLoss, HasSubstr("ln_1.bias of GPT2LMHeadModel "
                                                                    "is missing")));
}

TEST_F(HfImportTest, UntiedConfigWithoutHeadIsRefused) {
  const fs::path dir = Export("llama-tiny", "llama");
  Rewrite(dir, [](const std::string& n) { return n == "lm_head.weight" ? std::string() : n; });
  EXPECT_THAT(Open(dir), StatusIs(StatusCode::kDataLoss, HasSubstr("refusing to tie")));
}

TEST_F(HfImportTest, ConfigRulesAreEnforced) {
  const fs::path dir = Export("llama-tiny", "llama");
  EditConfig(dir, [](json::Json& c) { c["attention_bias"] = true; });
  EXPECT_THAT(Open(dir), StatusIs(StatusCode::kUnimplemented, HasSubstr("attention_bias")));
  EditConfig(dir, [](json::Json& c) {
    c["attention_bias"] = false;
    c["architectures"] = {"Phi3ForCausalLM"};
  });
  EXPECT_THAT(Open(dir), StatusIs(StatusCode::kUnimplemented, HasSubstr("Phi3ForCausalLM")));
  EditConfig(dir, [](json::Json& c) {
    c["architectures"] = {"LlamaForCausalLM"};
    c["vocab_size"] = 256;  // the tensors hold 250 rows
  });
  EXPECT_THAT(Open(dir), StatusIs(StatusCode::kDataLoss, HasSubstr("config.json gives [256")));
  EditConfig(dir, [](json::Json& c) {
    c["vocab_size"] = 250;
    c["dtype"] = c["torch_dtype"];  // TF5 spelling accepted
    c.erase("torch_dtype");
  });
  UCP_EXPECT_OK(Open(dir));
}

// The index half of the corruption catalogue (the safetensors half is
// io/safetensors/safetensors_corrupt_test.cc): one bad sharded folder per rule of the index, each
// refused with its own code and the message naming the file and what is wrong.
TEST_F(HfImportTest, IndexCorruptionCatalogue) {
  const fs::path dir = Export("llama-tiny", "llama", 20'000);
  UCP_ASSERT_OK(Open(dir));
  const std::string index = Slurp(dir / kIndexFileName);
  const json::Json j = *json::ParseStrict(index, "i", StatusCode::kDataLoss);
  const std::string norm_shard = j["weight_map"]["model.norm.weight"].get<std::string>();
  const std::string first_shard = "model-00001-of-00026.safetensors";
  ASSERT_TRUE(fs::exists(dir / first_shard));
  ASSERT_NE(norm_shard, first_shard);
  auto with = [&](const std::function<void(json::Json&)>& edit) {
    json::Json k = j;
    edit(k);
    return k.dump();
  };
  struct Case {
    std::string name, index_text;
    StatusCode code;
    std::string fragment;
  };
  const std::string idx(kIndexFileName);
  const std::vector<Case> cases = {
      {"InvalidJson", index.substr(0, index.size() / 2), StatusCode::kDataLoss, idx},
      {"DuplicateKey",
       "{\"metadata\": {}, \"weight_map\": {\"a\": \"" + first_shard + "\", \"a\": \"" +
           first_shard + "\"}}",
       StatusCode::kDataLoss, "duplicate key \"a\""},
      {"NotAnObject", "[1, 2]", StatusCode::kDataLoss, "not a JSON object"},
      {"NoMetadata", with([](json::Json& k) { k.erase("metadata"); }), StatusCode::kDataLoss,
       "field metadata is missing"},
      {"NoWeightMap", with([](json::Json& k) { k.erase("weight_map"); }), StatusCode::kDataLoss,
       "field weight_map is missing"},
      {"ShardNotAFileName",
       with([](json::Json& k) { k["weight_map"]["model.norm.weight"] = "../model.safetensors"; }),
       StatusCode::kDataLoss, "not a file name in the folder"},
      {"NamesAMissingShard", with([](json::Json& k) {
         k["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors";
       }),
       StatusCode::kNotFound, "shard model-00099-of-00099.safetensors is missing"},
      {"NamesAMissingTensor",
       with([&](json::Json& k) { k["weight_map"]["model.layers.0.extra.weight"] = norm_shard; }),
       StatusCode::kDataLoss,
       "tensor model.layers.0.extra.weight is not in its shard " + norm_shard},
      {"ShardTensorNotInIndex",
       with([](json::Json& k) { k["weight_map"].erase("model.norm.weight"); }),
       StatusCode::kDataLoss, "tensor model.norm.weight is not in the index"},
      {"TensorInAnotherShard",
       with([&](json::Json& k) { k["weight_map"]["model.norm.weight"] = first_shard; }),
       StatusCode::kDataLoss, "tensor model.norm.weight is in the index as " + first_shard},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Spit(dir / kIndexFileName, c.index_text);
    EXPECT_THAT(Open(dir), StatusIs(c.code, HasSubstr(c.fragment)));
  }
  // A shard file in the folder that the index does not name.
  Spit(dir / kIndexFileName, index);
  UCP_ASSERT_OK(Open(dir));
  fs::copy_file(dir / first_shard, dir / "model-00007-of-00009.safetensors");
  EXPECT_THAT(Open(dir),
              StatusIs(StatusCode::kDataLoss,
                       HasSubstr("shard model-00007-of-00009.safetensors in the folder is not "
                                 "in the index")));
  fs::remove(dir / "model-00007-of-00009.safetensors");
  // A shard of the index whose own header is corrupt: the safetensors rule's error, naming it.
  Spit(dir / first_shard, std::string("\x02\x00\x00", 3));
  EXPECT_THAT(Open(dir), StatusIs(StatusCode::kDataLoss, HasSubstr(first_shard)));
}

TEST_F(HfImportTest, Bf16ExportRoundsToNearestEven) {
  const fs::path data = api::UcpDataDir();
  const fs::path dir = Export("gpt-tiny", "gpt");
  UCP_ASSERT_OK_AND_ASSIGN(auto src, api::CheckpointSource::Open(dir, data));
  HfWriteOptions o;
  o.dtype = "bf16";
  UCP_ASSERT_OK(WriteHf(*src, tmp_.path() / "bf16", {}, o).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto a, st::SafetensorsFile::Open(dir / kSingleFileName));
  UCP_ASSERT_OK_AND_ASSIGN(auto b,
                           st::SafetensorsFile::Open(tmp_.path() / "bf16" / kSingleFileName));
  for (const auto& e : a.entries()) {
    UCP_ASSERT_OK_AND_ASSIGN(const st::SafetensorsEntry* f, b.Find(e.name));
    EXPECT_EQ(f->dtype, DType::kBf16);
    UCP_ASSERT_OK_AND_ASSIGN(Tensor x, a.ReadTensor(e));
    UCP_ASSERT_OK_AND_ASSIGN(Tensor y, b.ReadTensor(*f));
    const auto* xf = reinterpret_cast<const uint32_t*>(x.data());
    const auto* yb = reinterpret_cast<const uint16_t*>(y.data());
    for (int64_t i = 0; i < NumElementsOrDie(e.shape); ++i) {
      const uint32_t u = xf[i];
      const uint16_t rne = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
      ASSERT_EQ(yb[i], rne) << e.name << " element " << i;
    }
  }
  json::Json c =
      *json::ParseStrict(Slurp(tmp_.path() / "bf16" / kConfigFileName), "c", StatusCode::kDataLoss);
  EXPECT_EQ(c["torch_dtype"], "bfloat16");
}

// The import reads short pieces of a tensor (a transposed Conv1D weight's columns) from whole
// tensors held in memory (hf_format.cc, TensorCache): the universal rows read one at a time
// (a piece per element) and five at a time (a transposed tile per 16 source rows) are the file's
// columns bitwise, and a file that shrank after it was opened is still kDataLoss when its
// tensor is first read into the cache, not a crash.
TEST_F(HfImportTest, TransposedPiecesMatchTheFileAndAShrunkFileIsAnError) {
  const fs::path dir = Export("gpt-tiny", "gpt");
  UCP_ASSERT_OK_AND_ASSIGN(auto src, OpenHfSource(dir, api::UcpDataDir()));
  UCP_ASSERT_OK_AND_ASSIGN(auto file, st::SafetensorsFile::Open(dir / kSingleFileName));
  UCP_ASSERT_OK_AND_ASSIGN(const st::SafetensorsEntry* e,
                           file.Find("transformer.h.0.mlp.c_fc.weight"));
  UCP_ASSERT_OK_AND_ASSIGN(Tensor hf, file.ReadTensor(*e));  // [in, out]
  ASSERT_EQ(e->dtype, DType::kFp32);
  const int64_t in = e->shape[0], out = e->shape[1];
  std::vector<convert::TensorInfo> stored = src->StoredTensors();
  auto target = [&](const std::string& name) {
    auto it = std::find_if(stored.begin(), stored.end(),
                           [&](const convert::TensorInfo& t) { return t.name == name; });
    EXPECT_NE(it, stored.end()) << name;
    return *it;
  };
  const auto* want = reinterpret_cast<const uint32_t*>(hf.data());
  for (const std::string state : {"model", "fp32"}) {
    const convert::TensorInfo t = target("layers.0.mlp.dense_h_to_4h.weight/" + state);
    for (int64_t rows : {int64_t{1}, int64_t{5}}) {
      for (int64_t r0 = 0; r0 < out; r0 += rows) {
        const int64_t r1 = std::min(out, r0 + rows);
        std::vector<uint32_t> got(static_cast<size_t>((r1 - r0) * in));
        UCP_ASSERT_OK(src->ReadFlatRange(t, r0 * in, r1 * in,
                                         std::as_writable_bytes(std::span<uint32_t>(got))));
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t i = 0; i < in; ++i) {
            ASSERT_EQ(got[static_cast<size_t>((r - r0) * in + i)],
                      want[static_cast<size_t>(i * out + r)])
                << state << " row " << r << " column " << i;
          }
        }
      }
    }
  }
  const convert::TensorInfo dense = target("layers.0.self_attention.dense.weight/model");
  fs::resize_file(dir / kSingleFileName, static_cast<uintmax_t>(file.header().data_offset()));
  std::vector<uint32_t> row(static_cast<size_t>(dense.shape[1]));
  EXPECT_THAT(src->ReadFlatRange(dense, 0, dense.shape[1],
                                 std::as_writable_bytes(std::span<uint32_t>(row))),
              StatusIs(StatusCode::kDataLoss, HasSubstr("shrank since it was opened")));
}

// Interleaved rotary (issue 13): a model recording rotary_interleaved = 1 is written with each
// q and k head's rows permuted as transformers' convert_llama_weights_to_hf permutes Meta's
// (HF row s*d/2 + i = ucp row 2i + s), v and every other tensor unchanged; an HF source opened
// with --rotary-layout interleaved serves the rows back in that order (bitwise the generated
// model), and without it does not; a model without rotary rows (GPT) is refused.
TEST(HfRotaryTest, InterleavedQkRowsArePermutedPerHead) {
  ::ucp::testing::TempDir tmp;
  const fs::path data = api::UcpDataDir();
  UCP_ASSERT_OK_AND_ASSIGN(auto model, api::LoadResolvedModel(data, "llama-tiny", "fp32"));
  const std::string key(patterns::kRotaryInterleavedHyper);
  model.first.hyper[key] = 1;
  model.second.spec.hyper[key] = 1;
  UCP_ASSERT_OK(api::Generate(model.first, model.second, *layout::ParseLayout("tp=2,pp=2"), 7,
                              tmp.path() / "gen", {})
                    .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto gen, api::CheckpointSource::Open(tmp.path() / "gen", data));
  ASSERT_EQ(gen->meta().spec.hyper.at(key), 1);  // recorded with the model
  UCP_ASSERT_OK(WriteHf(*gen, tmp.path() / "hf", {}, {}).status());
  UCP_ASSERT_OK(api::Extract(*gen, tmp.path() / "u", {}).status());
  UCP_ASSERT_OK_AND_ASSIGN(auto u, api::CheckpointSource::Open(tmp.path() / "u", data));
  UCP_ASSERT_OK_AND_ASSIGN(auto f, st::SafetensorsFile::Open(tmp.path() / "hf" / kSingleFileName));

  const auto& hy = model.first.hyper;
  const int64_t hidden = hy.at("hidden"), heads = hy.at("heads"), groups = hy.at("kv_heads");
  const int64_t d = hidden / heads, per = heads / groups;
  for (int64_t layer : {0, 3}) {
    const std::string l = std::to_string(layer);
    convert::TensorInfo qkv;
    qkv.param = "layers." + l + ".self_attention.query_key_value.weight";
    qkv.name = qkv.param + "/model";
    qkv.state = "model";
    qkv.dtype = DType::kFp32;
    const int64_t n = (heads + 2 * groups) * d * hidden;
    std::vector<float> fused(n);
    UCP_ASSERT_OK(u->ReadFlatRange(qkv, 0, n, std::as_writable_bytes(std::span(fused))));
    // The fused per-group rows [q heads of g | k_g | v_g]: HF head h's rows in ucp.
    auto ucp_row = [&](const std::string& part, int64_t head, int64_t row) {
      const int64_t g = part == "q" ? head / per : head;
      const int64_t at = part == "q" ? head % per : part == "k" ? per : per + 1;
      return &fused[((g * (per + 2) + at) * d + row) * hidden];
    };
    for (const std::string part : {"q", "k", "v"}) {
      SCOPED_TRACE(part + " layer " + l);
      UCP_ASSERT_OK_AND_ASSIGN(const st::SafetensorsEntry* e,
                               f.Find("model.layers." + l + ".self_attn." + part + "_proj.weight"));
      UCP_ASSERT_OK_AND_ASSIGN(Tensor t, f.ReadTensor(*e));
      const auto* x = reinterpret_cast<const float*>(t.data());
      const int64_t nh = part == "q" ? heads : groups;
      int64_t moved = 0;
      for (int64_t h = 0; h < nh; ++h) {
        for (int64_t s = 0; s < 2; ++s) {
          for (int64_t i = 0; i < d / 2; ++i) {
            const int64_t hf_row = h * d + s * (d / 2) + i;
            // v keeps its order; q and k pair (2i, 2i+1) in ucp with (i, i + d/2) in HF.
            const int64_t from = part == "v" ? s * (d / 2) + i : 2 * i + s;
            ASSERT_EQ(std::memcmp(x + hf_row * hidden, ucp_row(part, h, from), hidden * 4), 0)
                << "head " << h << " HF row " << s * (d / 2) + i;
            moved += from != s * (d / 2) + i;
          }
        }
      }
      EXPECT_EQ(moved > 0, part != "v");
    }
  }
  // Back: the HF folder read as interleaved is the generated model; read as half-split it is not.
  api::SourceOptions interleaved;
  interleaved.rotary_layout = "interleaved";
  UCP_ASSERT_OK_AND_ASSIGN(auto back,
                           api::CheckpointSource::Open(tmp.path() / "hf", data, interleaved));
  EXPECT_EQ(back->meta().spec.hyper.at(key), 1);
  // The parameters whose model state differs between the generated model and a source.
  auto differing = [&](const api::CheckpointSource& other) {
    std::vector<std::string> out;
    for (const auto& p : u->meta().model.params) {
      convert::TensorInfo t;
      t.name = p.name + "/model";
      t.param = p.name;
      t.state = "model";
      t.dtype = DType::kFp32;
      const int64_t n = NumElementsOrDie(p.shape);
      std::vector<float> x(n), y(n);
      EXPECT_TRUE(u->ReadFlatRange(t, 0, n, std::as_writable_bytes(std::span(x))).ok());
      EXPECT_TRUE(other.ReadFlatRange(t, 0, n, std::as_writable_bytes(std::span(y))).ok());
      if (std::memcmp(x.data(), y.data(), n * 4) != 0) out.push_back(p.name);
    }
    return out;
  };
  EXPECT_THAT(differing(*back), ::testing::IsEmpty());
  UCP_ASSERT_OK(api::ToLayout(*back, *layout::ParseLayout("tp=2,pp=2"), tmp.path() / "ilv", {})
                    .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto ilv, api::CheckpointSource::Open(tmp.path() / "ilv", data));
  EXPECT_EQ(ilv->meta().spec.hyper.at(key), 1);
  UCP_ASSERT_OK(WriteHf(*ilv, tmp.path() / "hf2", {}, {}).status());
  for (const auto& e : fs::directory_iterator(tmp.path() / "hf")) {
    EXPECT_EQ(Slurp(e.path()), Slurp(tmp.path() / "hf2" / e.path().filename())) << e.path();
  }
  UCP_ASSERT_OK_AND_ASSIGN(auto half, api::CheckpointSource::Open(tmp.path() / "hf", data));
  EXPECT_FALSE(half->meta().spec.hyper.contains(key));
  const std::vector<std::string> moved = differing(*half);
  EXPECT_EQ(moved.size(), static_cast<size_t>(hy.at("layers")));  // every layer's fused QKV
  EXPECT_THAT(moved, ::testing::Each(HasSubstr("query_key_value")));
  api::SourceOptions bad;
  bad.rotary_layout = "adjacent";
  EXPECT_THAT(api::CheckpointSource::Open(tmp.path() / "hf", data, bad).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("--rotary-layout")));

  // GPT has learned positions: nothing to permute, so an interleaved record is refused.
  UCP_ASSERT_OK_AND_ASSIGN(auto gpt, api::LoadResolvedModel(data, "gpt-tiny", "fp32"));
  gpt.first.hyper[key] = 1;
  gpt.second.spec.hyper[key] = 1;
  UCP_ASSERT_OK(api::Generate(gpt.first, gpt.second, *layout::ParseLayout("tp=1,pp=1"), 7,
                              tmp.path() / "gpt", {})
                    .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto g, api::CheckpointSource::Open(tmp.path() / "gpt", data));
  EXPECT_THAT(WriteHf(*g, tmp.path() / "gpt_hf", {}, {}).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no rotary q/k rows")));
  EXPECT_FALSE(fs::exists(tmp.path() / "gpt_hf"));
}

}  // namespace
}  // namespace ucp::hf
