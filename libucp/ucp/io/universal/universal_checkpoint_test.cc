// Tests of the universal checkpoint: bitwise round trips for every dtype (plain and zstd),
// parallel writers, atomicity (nothing at dst until Commit, never overwrite) and reader errors.
#include "ucp/io/universal/universal_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/atomic_file.h"

namespace ucp::io {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::Gen;
using ::ucp::testing::StatusIs;
using ::ucp::testing::TempDir;

UniversalManifest Header(int64_t step) {
  UniversalManifest h;
  h.step = step;
  h.optimizer_kind = "adamw";
  h.hyper = {{"lr", 3e-4}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}};
  h.optimizer_states = {"exp_avg", "exp_avg_sq"};
  h.source_layout = "tp=2,pp=1,dp=2,zero=1";
  h.source_model = "gpt2";
  h.source_framework = "megatron-deepspeed";
  h.client_state_json = R"({"iteration":7,"args":{"seq_length":1024}})";
  return h;
}

struct Written {
  std::string param;
  std::vector<std::pair<std::string, Tensor>> states;
};

// One parameter per dtype: fp32 master, fp32 exp_avg, and a state "raw" in that dtype.
std::vector<Written> MakeParams(Gen& gen) {
  std::vector<Written> out;
  int i = 0;
  for (DType d : kAllDTypes) {
    Shape shape = (i % 3 == 0) ? Shape{gen.Int(1, 40), gen.Int(1, 300)} : Shape{gen.Int(0, 5000)};
    if (d == DType::kInt16) shape = {};  // a scalar
    Written w;
    w.param = "layers." + std::to_string(i++) + "/" + std::string(DTypeName(d)) + ".weight";
    w.states.emplace_back("fp32", gen.RandomTensor(DType::kFp32, shape));
    w.states.emplace_back("exp_avg", gen.RandomTensor(DType::kFp32, shape));
    w.states.emplace_back("raw", gen.RandomTensor(d, shape));
    out.push_back(std::move(w));
  }
  return out;
}

Status WriteAll(UniversalWriter& w, const std::vector<Written>& params) {
  for (const auto& p : params) {
    std::vector<NamedState> views;
    for (const auto& [n, t] : p.states) views.emplace_back(n, t.view());
    UniversalParamInfo meta{.name = p.param,
                            .shape = p.states[0].second.shape(),
                            .dtype = p.states[2].second.dtype(),
                            .pattern_json = R"({"kind":"shard","dim":0})"};
    UCP_RETURN_IF_ERROR(w.WriteParameter(meta, views));
  }
  return Status::Ok();
}

TEST(Universal, RoundTripEveryDTypeBitwise) {
  for (int level : {0, 3}) {
    SCOPED_TRACE("level " + std::to_string(level));
    TempDir dir;
    Gen gen(100 + level);
    auto params = MakeParams(gen);
    const fs::path dst = dir / "sub" / "ckpt";
    {
      UCP_ASSERT_OK_AND_ASSIGN(
          UniversalWriter w,
          UniversalWriter::Create(dst,
                                  {.step = 7, .compression_level = level, .chunk_bytes = 4096}));
      UCP_ASSERT_OK(WriteAll(w, params));
      EXPECT_FALSE(fs::exists(dst));
      UCP_ASSERT_OK(w.Commit(Header(7)));
    }
    UCP_ASSERT_OK_AND_ASSIGN(UniversalReader r, UniversalReader::Open(dst));
    const UniversalManifest& m = r.manifest();
    EXPECT_EQ(m.step, 7);
    EXPECT_EQ(m.optimizer_kind, "adamw");
    EXPECT_EQ(m.hyper, Header(7).hyper);
    EXPECT_EQ(m.optimizer_states, Header(7).optimizer_states);
    EXPECT_EQ(m.source_layout, "tp=2,pp=1,dp=2,zero=1");
    EXPECT_EQ(m.client_state_json, R"({"args":{"seq_length":1024},"iteration":7})");
    ASSERT_EQ(m.params.size(), params.size());
    for (const auto& p : params) {
      UCP_ASSERT_OK_AND_ASSIGN(const UniversalParamInfo* info, r.FindParam(p.param));
      EXPECT_EQ(info->pattern_json, R"({"dim":0,"kind":"shard"})");
      EXPECT_EQ(info->dtype, p.states[2].second.dtype());
      EXPECT_TRUE(fs::path(info->file).parent_path() == "params") << info->file;
      for (const auto& [state, t] : p.states) {
        UCP_ASSERT_OK_AND_ASSIGN(Tensor back, r.ReadState(p.param, state));
        EXPECT_TRUE(BitwiseEqual(back.view(), t.view())) << p.param << " " << state;
      }
    }
    UCP_EXPECT_OK(r.Verify());
    EXPECT_THAT(r.ReadState("nope", "fp32"), StatusIs(StatusCode::kNotFound, HasSubstr("'nope'")));
    EXPECT_THAT(r.ReadState(params[0].param, "exp_avg_sq"),
                StatusIs(StatusCode::kNotFound, HasSubstr("no state 'exp_avg_sq'")));
    // Flat ranges (what the conversion engine reads ZeRO fragments with).
    const auto& t = params[0].states[0].second;
    const int64_t n = t.num_elements();
    std::vector<std::byte> part(static_cast<size_t>(n / 2) * 4);
    UCP_ASSERT_OK(r.ReadStateFlatRange(params[0].param, "fp32", n / 4, n / 4 + n / 2, part));
    EXPECT_TRUE(std::equal(part.begin(), part.end(), t.data() + (n / 4) * 4));
    Tensor wrong = std::move(Tensor::Zeros(DType::kFp64, t.shape())).value();
    EXPECT_THAT(r.ReadStateInto(params[0].param, "fp32", wrong.view()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("is fp64")));
  }
}

TEST(Universal, SameInputSameManifest) {
  TempDir dir;
  std::string texts[2];
  for (int k = 0; k < 2; ++k) {
    Gen gen(5);
    auto params = MakeParams(gen);
    const fs::path dst = dir / ("c" + std::to_string(k));
    UCP_ASSERT_OK_AND_ASSIGN(UniversalWriter w, UniversalWriter::Create(dst, {.step = 1}));
    std::reverse(params.begin() + k, params.end());  // order of writes must not matter
    UCP_ASSERT_OK(WriteAll(w, params));
    UCP_ASSERT_OK(w.Commit(Header(1)));
    UCP_ASSERT_OK_AND_ASSIGN(texts[k], ReadFileToString(dst / "manifest.json", 1 << 20));
  }
  EXPECT_EQ(texts[0], texts[1]);
}

TEST(Universal, ParallelWriteParameter) {
  TempDir dir;
  Gen gen(9);
  std::vector<Tensor> ts;
  for (int i = 0; i < 16; ++i) ts.push_back(gen.RandomTensor(DType::kFp32, {64, 33}));
  const fs::path dst = dir / "p";
  UCP_ASSERT_OK_AND_ASSIGN(UniversalWriter w, UniversalWriter::Create(dst, {.compression_level = 1,
                                                                            .chunk_bytes = 4096}));
  std::vector<std::thread> threads;
  std::vector<Status> sts(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    threads.emplace_back([&, i] {
      NamedState s{"fp32", ts[i].view()};
      sts[i] = w.WriteParameter({.name = "p" + std::to_string(i), .shape = {64, 33}}, {&s, 1});
    });
  }
  for (auto& t : threads) t.join();
  for (auto& s : sts) UCP_ASSERT_OK(s);
  UCP_ASSERT_OK(w.Commit(Header(0)));
  UCP_ASSERT_OK_AND_ASSIGN(UniversalReader r, UniversalReader::Open(dst));
  UCP_ASSERT_OK(r.Verify());
  for (size_t i = 0; i < ts.size(); ++i) {
    UCP_ASSERT_OK_AND_ASSIGN(Tensor back, r.ReadState("p" + std::to_string(i), "fp32"));
    EXPECT_TRUE(BitwiseEqual(back.view(), ts[i].view()));
  }
}

TEST(Universal, AtomicAndNeverOverwrites) {
  TempDir dir;
  Tensor t = std::move(Tensor::Zeros(DType::kFp32, {4})).value();
  NamedState s{"fp32", t.view()};
  const fs::path dst = dir / "ckpt";
  fs::path tmp;
  {
    UCP_ASSERT_OK_AND_ASSIGN(UniversalWriter w, UniversalWriter::Create(dst));
    tmp = w.temp_dir();
    UCP_ASSERT_OK(w.WriteParameter({.name = "a", .shape = {4}}, {&s, 1}));
    EXPECT_TRUE(fs::exists(tmp));
    // A reader never takes the unfinished folder for a checkpoint.
    EXPECT_THAT(UniversalReader::Open(tmp),
                StatusIs(StatusCode::kFailedPrecondition, HasSubstr("unfinished write")));
  }  // no Commit
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_FALSE(fs::exists(dst));
  EXPECT_THAT(UniversalReader::Open(dst),
              StatusIs(StatusCode::kNotFound, HasSubstr("does not exist")));
  fs::create_directory(dst);
  EXPECT_THAT(UniversalReader::Open(dst),
              StatusIs(StatusCode::kNotFound, HasSubstr("no manifest.json")));
  EXPECT_THAT(UniversalWriter::Create(dst),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("never overwrites")));
  fs::remove(dst);

  UCP_ASSERT_OK_AND_ASSIGN(UniversalWriter w, UniversalWriter::Create(dst, {.step = 3}));
  UCP_ASSERT_OK(w.WriteParameter({.name = "../escape", .shape = {4}}, {&s, 1}));
  EXPECT_THAT(w.WriteParameter({.name = "../escape", .shape = {4}}, {&s, 1}),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("'../escape' was already written")));
  EXPECT_THAT(w.WriteParameter({.name = "..", .shape = {4}}, {&s, 1}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("'..' is not allowed")));
  EXPECT_THAT(w.WriteParameter({.name = "b", .shape = {5}}, {&s, 1}),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("shape [4] but the parameter's logical shape is [5]")));
  EXPECT_THAT(w.WriteParameter({.name = "c", .shape = {4}}, {}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("no states")));
  NamedState twice[2] = {s, s};
  EXPECT_THAT(w.WriteParameter({.name = "d", .shape = {4}}, twice),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("'fp32' twice")));
  EXPECT_THAT(w.WriteParameter({.name = "e", .shape = {4}, .pattern_json = "[1]"}, {&s, 1}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("not an object")));
  UniversalManifest with_params = Header(3);
  with_params.params.push_back({});
  EXPECT_THAT(w.Commit(with_params),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("header.params must be empty")));
  EXPECT_THAT(w.Commit(Header(4)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("header.step 4")));
  UCP_ASSERT_OK(w.Commit(Header(3)));
  EXPECT_THAT(w.Commit(Header(3)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("already committed")));
  EXPECT_THAT(w.WriteParameter({.name = "f", .shape = {4}}, {&s, 1}),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("after Commit")));
  UCP_ASSERT_OK_AND_ASSIGN(UniversalReader r, UniversalReader::Open(dst));
  ASSERT_EQ(r.manifest().params.size(), 1u);
  EXPECT_EQ(r.manifest().params[0].file, "params/..%2Fescape.h5");
  UCP_EXPECT_OK(r.Verify());
  int entries = 0;
  for (auto& e : fs::directory_iterator(dir.path())) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 1) << "a temporary folder was left behind";
}

}  // namespace
}  // namespace ucp::io
