// Tests of the per-rank format: round trip, atomicity, strict manifest, corruption.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/dist/dist_checkpoint.h"
#include "ucp/dist/dist_manifest.h"
#include "ucp/io/atomic_file.h"

namespace ucp::dist {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
namespace fs = std::filesystem;

Tensor Iota(DType dtype, Shape shape) {
  Tensor t = *Tensor::Zeros(dtype, shape);
  for (int64_t i = 0; i < t.num_bytes(); ++i) t.data()[i] = std::byte(i * 7 + 1);
  return t;
}

DistManifest Header() {
  DistManifest m;
  m.model = {"gpt-tiny", "gpt", DType::kBf16, {{"hidden", 64}, {"layers", 2}}};
  m.layout = "tp=2,pp=1,dp=1,sp=1,ep=1,zero=0";
  m.step = 7;
  m.optimizer_hyper = {{"lr", 0.001}};
  m.optimizer_states = {"fp32", "exp_avg"};
  m.params = {{"w", {4, 3}, DType::kBf16}};
  return m;
}

TEST(DistTest, RoundTripBitwise) {
  ucp::testing::TempDir tmp;
  const fs::path dst = tmp / "ckpt";
  Tensor a = Iota(DType::kBf16, {2, 3});
  Tensor b = Iota(DType::kFp32, {5});
  {
    UCP_ASSERT_OK_AND_ASSIGN(
        DistWriter w, DistWriter::Create(dst, 2,
                                         {{0, "pp0.tp0/model/w", DType::kBf16, {2, 3}},
                                          {1, "pp0.tp1/model/w", DType::kBf16, {2, 3}},
                                          {1, "pp0.tp1/zero/g0.f0/fp32", DType::kFp32, {5}}}));
    UCP_ASSERT_OK(w.WriteTensor(0, "pp0.tp0/model/w", a.view()));
    UCP_ASSERT_OK(w.WriteTensor(1, "pp0.tp1/model/w", a.view()));
    // Streamed in two pieces.
    UCP_ASSERT_OK(w.WriteRange(1, "pp0.tp1/zero/g0.f0/fp32", 0, b.view().bytes.first(8)));
    EXPECT_THAT(w.WriteRange(1, "pp0.tp1/zero/g0.f0/fp32", 3, b.view().bytes.subspan(12)),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("2 were written so far")));
    UCP_ASSERT_OK(w.WriteRange(1, "pp0.tp1/zero/g0.f0/fp32", 2, b.view().bytes.subspan(8)));
    EXPECT_THAT(w.WriteTensor(1, "pp0.tp1/model/w", a.view()),
                StatusIs(StatusCode::kAlreadyExists, HasSubstr("already complete")));
    EXPECT_THAT(w.WriteTensor(1, "pp0.tp1/model/x", a.view()),
                StatusIs(StatusCode::kNotFound, HasSubstr("not declared on rank 1")));
    EXPECT_THAT(w.WriteTensor(0, "pp0.tp0/model/w", b.view()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("was declared bf16[2, 3]")));
    EXPECT_FALSE(fs::exists(dst));
    UCP_ASSERT_OK(w.Commit(Header()));
  }
  UCP_ASSERT_OK_AND_ASSIGN(DistReader r, DistReader::Open(dst));
  EXPECT_EQ(r.manifest().step, 7);
  EXPECT_EQ(r.manifest().ranks.size(), 2u);
  UCP_ASSERT_OK_AND_ASSIGN(Tensor back, r.ReadTensor(1, "pp0.tp1/zero/g0.f0/fp32"));
  EXPECT_TRUE(BitwiseEqual(back.view(), b.view()));
  std::vector<std::byte> part(2 * 4);
  UCP_ASSERT_OK(r.ReadFlatRange(1, "pp0.tp1/zero/g0.f0/fp32", 1, 3, part));
  EXPECT_EQ(std::memcmp(part.data(), b.data() + 4, 8), 0);
  UCP_EXPECT_OK(r.Verify());
  EXPECT_THAT(r.ReadTensor(0, "nope").status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("tensor \"nope\" not in rank_00000.h5")));
}

TEST(DistTest, UncommittedLeavesNothing) {
  ucp::testing::TempDir tmp;
  const fs::path dst = tmp / "ckpt";
  {
    UCP_ASSERT_OK_AND_ASSIGN(
        DistWriter w,
        DistWriter::Create(dst, 1, {{0, "x", DType::kFp32, {3}}, {0, "y", DType::kFp32, {3}}}));
    Tensor a = Iota(DType::kFp32, {3});
    UCP_ASSERT_OK(w.WriteTensor(0, "x", a.view()));
    EXPECT_THAT(w.Commit(Header()),
                StatusIs(StatusCode::kFailedPrecondition,
                         HasSubstr("tensor \"y\" of rank 0 is incomplete: 0 of 3 elements")));
  }
  EXPECT_TRUE(fs::is_empty(tmp.path()));
  fs::create_directory(dst);
  EXPECT_THAT(DistWriter::Create(dst, 1, {}).status(),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("refusing to overwrite")));
  EXPECT_THAT(DistReader::Open(dst).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("not a complete distributed checkpoint")));
}

TEST(DistTest, CorruptionDetected) {
  ucp::testing::TempDir tmp;
  const fs::path dst = tmp / "ckpt";
  Tensor a = Iota(DType::kFp32, {1024});
  {
    UCP_ASSERT_OK_AND_ASSIGN(DistWriter w,
                             DistWriter::Create(dst, 2, {{0, "x", DType::kFp32, {1024}}}));
    UCP_ASSERT_OK(w.WriteTensor(0, "x", a.view()));
    UCP_ASSERT_OK(w.Commit(Header()));
  }
  // Flip the last byte of the data: the checksum catches it.
  const fs::path f0 = dst / "rank_00000.h5";
  {
    std::fstream f(f0, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const auto size = f.tellg();
    std::string all(static_cast<size_t>(size), '\0');
    f.seekg(0);
    f.read(all.data(), size);
    const size_t pos = all.rfind(std::string(reinterpret_cast<const char*>(a.data()) + 4000, 16));
    ASSERT_NE(pos, std::string::npos);
    f.seekp(static_cast<std::streamoff>(pos));
    f.put(static_cast<char>(all[pos] ^ 0x55));
  }
  UCP_ASSERT_OK_AND_ASSIGN(DistReader r, DistReader::Open(dst));
  EXPECT_THAT(r.Verify(), StatusIs(StatusCode::kDataLoss, HasSubstr("checksum")));
  fs::resize_file(f0, 100);
  UCP_ASSERT_OK_AND_ASSIGN(DistReader r2, DistReader::Open(dst));
  EXPECT_THAT(r2.ReadTensor(0, "x").status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("rank_00000.h5")));
  fs::remove(dst / "rank_00001.h5");
  EXPECT_THAT(DistReader::Open(dst).status(),
              StatusIs(StatusCode::kNotFound, HasSubstr("rank_00001.h5 is missing")));
}

// Equal input gives equal bytes, whatever order the tensors are written in.
TEST(DistTest, DeterministicBytes) {
  ucp::testing::TempDir tmp;
  std::vector<DistTensorDecl> decls;
  std::vector<Tensor> data;
  for (int i = 0; i < 6; ++i) {
    decls.push_back({i % 2, "t" + std::to_string(i), DType::kFp32, {7 + i, 3}});
    data.push_back(Iota(DType::kFp32, {7 + i, 3}));
  }
  for (const char* name : {"a", "b"}) {
    UCP_ASSERT_OK_AND_ASSIGN(DistWriter w, DistWriter::Create(tmp / name, 2, decls));
    for (int k = 0; k < 6; ++k) {
      const int i = std::string(name) == "a" ? k : 5 - k;
      UCP_ASSERT_OK(w.WriteTensor(decls[i].rank, decls[i].name, data[i].view()));
    }
    UCP_ASSERT_OK(w.Commit(Header()));
  }
  for (const char* f : {"rank_00000.h5", "rank_00001.h5", "ucp_layout.json"}) {
    std::ifstream x(tmp / "a" / f, std::ios::binary), y(tmp / "b" / f, std::ios::binary);
    std::string xs((std::istreambuf_iterator<char>(x)), {}),
        ys((std::istreambuf_iterator<char>(y)), {});
    EXPECT_FALSE(xs.empty());
    EXPECT_EQ(xs, ys) << f;
  }
}

TEST(DistTest, StrictManifest) {
  std::string text = *SerializeDistManifest(Header());
  UCP_ASSERT_OK_AND_ASSIGN(DistManifest back, ParseDistManifest(text, "m.json"));
  EXPECT_EQ(*SerializeDistManifest(back), text);
  std::string dup = text;
  dup.replace(dup.find("\"step\""), 6, "\"layout\": \"x\", \"step\"");
  EXPECT_THAT(ParseDistManifest(dup, "m.json").status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("duplicate key \"layout\"")));
  std::string unknown = text;
  unknown.replace(unknown.find("\"step\""), 6, "\"extra\": 1, \"step\"");
  EXPECT_THAT(ParseDistManifest(unknown, "m.json").status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("m.json: $: unknown key \"extra\"")));
  std::string version = text;
  version.replace(version.find("\"version\": 1"), 12, "\"version\": 2");
  EXPECT_THAT(ParseDistManifest(version, "m.json").status(),
              StatusIs(StatusCode::kUnimplemented, HasSubstr("format version 2")));
  // Issue 16 #1: model.family becomes a rule-file name; a path there is corruption.
  for (const char* fam : {"../../x", "/etc/passwd", "a/b", "a.json", ""}) {
    std::string f = text;
    f.replace(f.find("\"gpt\""), 5, std::string("\"") + fam + "\"");
    EXPECT_THAT(ParseDistManifest(f, "m.json").status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("m.json: $.model.family: not a rule-set name")))
        << fam;
  }
  std::string dtype = text;
  dtype.replace(dtype.find("\"bf16\""), 6, "\"bf17\"");
  EXPECT_THAT(ParseDistManifest(dtype, "m.json").status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("unknown dtype \"bf17\"")));
}

// The optional client_state (a trainer's own state) round-trips as an object, sorted; it cannot
// be anything but an object nor smuggle a second model description.
TEST(DistTest, ClientState) {
  DistManifest m = Header();
  m.client_state_json = R"({"ucp_train":{"consumed_samples":96,"seed":1},"a":[1,2]})";
  UCP_ASSERT_OK_AND_ASSIGN(std::string text, SerializeDistManifest(m));
  UCP_ASSERT_OK_AND_ASSIGN(DistManifest back, ParseDistManifest(text, "m.json"));
  EXPECT_EQ(back.client_state_json, R"({"a":[1,2],"ucp_train":{"consumed_samples":96,"seed":1}})");
  EXPECT_EQ(*SerializeDistManifest(back), text);
  // Absent stays absent; a ucp_model member is dropped on write (the model is $.model).
  m.client_state_json = R"({"ucp_model":{"name":"x"}})";
  UCP_ASSERT_OK_AND_ASSIGN(text, SerializeDistManifest(m));
  EXPECT_EQ(text.find("client_state"), std::string::npos);
  UCP_ASSERT_OK_AND_ASSIGN(back, ParseDistManifest(text, "m.json"));
  EXPECT_EQ(back.client_state_json, "");
  std::string bad = text;
  bad.replace(bad.find("\"step\""), 6, "\"client_state\": [1], \"step\"");
  EXPECT_THAT(ParseDistManifest(bad, "m.json").status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("m.json: $.client_state: expected an object")));
  bad = text;
  bad.replace(bad.find("\"step\""), 6, "\"client_state\": {\"ucp_model\": {}}, \"step\"");
  EXPECT_THAT(ParseDistManifest(bad, "m.json").status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("$.client_state.ucp_model: not allowed")));
  m.client_state_json = "[1]";
  EXPECT_THAT(SerializeDistManifest(m).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("not a JSON object")));
}

}  // namespace
}  // namespace ucp::dist
