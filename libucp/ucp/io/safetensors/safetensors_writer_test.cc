// SafetensorsWriter: byte-identity with files `safetensors.torch.save_file` (0.4.5) wrote, the
// header layout rules, atomicity (temporary file, no replacing), ranges written in pieces and
// from threads, and the argument errors.
#include "ucp/io/safetensors/safetensors_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/safetensors/safetensors_file.h"

namespace ucp::safetensors {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::Gen;
using ::ucp::testing::StatusIs;
using ::ucp::testing::TempDir;

// Written by safetensors 0.4.5 save_file over torch 1.13 (bf16 0-d, an empty F64, every dtype
// torch 1.13 has, a name with a quote, a backslash, a newline, U+0001 and U+00E9):
//   save_file({"b": arange(2, f32), "a": [1.5] f32, "c": [1, -2, 3] i8, "d": tensor(2.0, bf16),
//              "e": zeros(0, 3, f64), "f": [True, False], "q\"\\\n\x01\u00e9": [7] i64,
//              "h": [1, 2] i16, "g": [1, 2] u8, "i": [1] i32, "j": [1] f16},
//             path, metadata={"format": "pt"})
constexpr const char* kSaveFileMixedHex =
    "88020000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a227074227d2c22715c225c5c"
    "5c6e5c7530303031c3a9223a7b226474797065223a22493634222c227368617065223a5b315d2c22646174615f6f"
    "666673657473223a5b302c385d7d2c2265223a7b226474797065223a22463634222c227368617065223a5b302c33"
    "5d2c22646174615f6f666673657473223a5b382c385d7d2c2261223a7b226474797065223a22463332222c227368"
    "617065223a5b315d2c22646174615f6f666673657473223a5b382c31325d7d2c2262223a7b226474797065223a22"
    "463332222c227368617065223a5b325d2c22646174615f6f666673657473223a5b31322c32305d7d2c2269223a7b"
    "226474797065223a22493332222c227368617065223a5b315d2c22646174615f6f666673657473223a5b32302c32"
    "345d7d2c2264223a7b226474797065223a2242463136222c227368617065223a5b5d2c22646174615f6f66667365"
    "7473223a5b32342c32365d7d2c226a223a7b226474797065223a22463136222c227368617065223a5b315d2c2264"
    "6174615f6f666673657473223a5b32362c32385d7d2c2268223a7b226474797065223a22493136222c2273686170"
    "65223a5b325d2c22646174615f6f666673657473223a5b32382c33325d7d2c2263223a7b226474797065223a2249"
    "38222c227368617065223a5b335d2c22646174615f6f666673657473223a5b33322c33355d7d2c2267223a7b2264"
    "74797065223a225538222c227368617065223a5b325d2c22646174615f6f666673657473223a5b33352c33375d7d"
    "2c2266223a7b226474797065223a22424f4f4c222c227368617065223a5b325d2c22646174615f6f666673657473"
    "223a5b33372c33395d7d7d2007000000000000000000c03f000000000000803f010000000040003c0100020001fe"
    "0301020100";
// save_file({"x": ones(3)}, path): no metadata.
constexpr const char* kSaveFileNoMetadataHex =
    "38000000000000007b2278223a7b226474797065223a22463332222c227368617065223a5b335d2c22646174615f"
    "6f666673657473223a5b302c31325d7d7d200000803f0000803f0000803f";

std::string FromHex(std::string_view hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out += static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16));
  }
  return out;
}

std::string Slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// Reads every tensor of `golden` with ucp and writes them back with ucp, with the same metadata.
std::string Rewrite(const std::string& golden, const fs::path& out) {
  auto f = SafetensorsFile::OpenBuffer(AsBytes(golden), "golden");
  EXPECT_THAT(f, ::ucp::testing::IsOk());
  if (!f.ok()) return "";
  std::vector<Tensor> tensors;
  std::vector<NamedTensorView> views;
  for (const SafetensorsEntry& e : f->entries()) tensors.push_back(*f->ReadTensor(e));
  for (size_t i = 0; i < tensors.size(); ++i) {
    views.push_back({f->entries()[i].name, tensors[i].view()});
  }
  SafetensorsWriteOptions options;
  options.metadata = f->metadata();
  EXPECT_THAT(WriteSafetensorsFile(out, views, options), ::ucp::testing::IsOk());
  return Slurp(out);
}

TEST(SafetensorsWriterGolden, MixedDTypesMatchSaveFileByteForByte) {
  TempDir dir;
  const std::string golden = FromHex(kSaveFileMixedHex);
  EXPECT_EQ(Rewrite(golden, dir / "m.safetensors"), golden);
}

TEST(SafetensorsWriterGolden, NoMetadataMatchesSaveFileByteForByte) {
  TempDir dir;
  const std::string golden = FromHex(kSaveFileNoMetadataHex);
  EXPECT_EQ(Rewrite(golden, dir / "m.safetensors"), golden);
}

TEST(SafetensorsWriterGolden, ReaderSeesTheValuesSaveFileWrote) {
  const std::string golden = FromHex(kSaveFileMixedHex);
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::OpenBuffer(AsBytes(golden), "g"));
  UCP_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* b, f.Find("b"));
  UCP_ASSERT_OK_AND_ASSIGN(Tensor bt, f.ReadTensor(*b));
  EXPECT_THAT(bt.as<float>(), ::testing::ElementsAre(0.0f, 1.0f));
  UCP_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* c, f.Find("c"));
  UCP_ASSERT_OK_AND_ASSIGN(Tensor ct, f.ReadTensor(*c));
  EXPECT_THAT(ct.as<int8_t>(), ::testing::ElementsAre(1, -2, 3));
  UCP_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* d, f.Find("d"));
  EXPECT_EQ(d->dtype, DType::kBf16);
  EXPECT_TRUE(d->shape.empty());
  UCP_ASSERT_OK_AND_ASSIGN(Tensor dt, f.ReadTensor(*d));
  EXPECT_THAT(dt.as<uint16_t>(), ::testing::ElementsAre(0x4000));  // bf16 2.0
  UCP_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* q, f.Find("q\"\\\n\x01\xc3\xa9"));
  EXPECT_EQ(q->dtype, DType::kInt64);
  UCP_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* e, f.Find("e"));
  EXPECT_EQ(e->shape, (Shape{0, 3}));
  EXPECT_EQ(e->num_bytes(), 0);
}

TEST(SafetensorsLayOut, SortsByDTypeAlignmentThenNameAndPadsWithSpaces) {
  const SafetensorsTensorSpec specs[] = {{"z", DType::kBool, {1}},   {"b", DType::kFp32, {1}},
                                         {"a", DType::kFp32, {1}},   {"m", DType::kFp64, {}},
                                         {"B", DType::kFp32, {2}},   {"k", DType::kFp8E5m2, {1}},
                                         {"l", DType::kFp8E4m3, {1}}};
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsLayout l, LayOut(specs, std::nullopt));
  std::vector<std::string> order;
  for (const auto& e : l.entries) order.push_back(e.name);
  // 'B' < 'a' bytewise; F8_E4M3 sorts before F8_E5M2 (the crate's enum, descending).
  EXPECT_THAT(order, ::testing::ElementsAre("m", "B", "a", "b", "l", "k", "z"));
  EXPECT_EQ(l.prefix.size() % 8, 0u);
  uint64_t n = 0;
  std::memcpy(&n, l.prefix.data(), 8);
  EXPECT_EQ(n + 8, l.prefix.size());
  EXPECT_EQ(l.prefix.substr(8, 9), "{\"m\":{\"dt");
  EXPECT_EQ(l.prefix.back(), ' ');
  EXPECT_EQ(l.data_size_bytes, 8 + 8 + 4 + 4 + 1 + 1 + 1);
}

TEST(SafetensorsLayOut, RefusesBadNamesAndShapes) {
  const auto refuse = [](std::vector<SafetensorsTensorSpec> specs, const std::string& fragment) {
    EXPECT_THAT(LayOut(specs, DefaultMetadata()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr(fragment)));
  };
  refuse({{"", DType::kFp32, {1}}}, "must not be empty");
  refuse({{"__metadata__", DType::kFp32, {1}}}, "reserved for the metadata map");
  refuse({{"a", DType::kFp32, {1}}, {"a", DType::kFp16, {1}}}, "'a' is given twice");
  refuse({{"bad\xff", DType::kFp32, {1}}}, "not valid utf-8");
  refuse({{"neg", DType::kFp32, {-1}}}, "tensor 'neg' shape");
  refuse({{"big", DType::kFp32, {int64_t{1} << 62}}}, "byte size overflows int64");
  refuse({{"wide", DType::kFp32, Shape(65, 1)}}, "65 dims");
  EXPECT_THAT(LayOut({}, std::map<std::string, std::string>{{"k", "\xc0\x80"}}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("metadata key 'k'")));
}

TEST(SafetensorsWriter, RefusesToReplaceAnExistingFileUnlessAsked) {
  TempDir dir;
  Gen gen(1);
  Tensor t = gen.RandomTensor(DType::kFp32, {3});
  NamedTensorView views[] = {{"t", t.view()}};
  const fs::path path = dir / "m.safetensors";
  UCP_ASSERT_OK(WriteSafetensorsFile(path, views));
  const std::string first = Slurp(path);
  Tensor u = gen.RandomTensor(DType::kFp32, {3});
  NamedTensorView other[] = {{"t", u.view()}};
  EXPECT_THAT(WriteSafetensorsFile(path, other),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("already exists")));
  EXPECT_EQ(Slurp(path), first);
  SafetensorsWriteOptions replace;
  replace.overwrite = true;
  UCP_ASSERT_OK(WriteSafetensorsFile(path, other, replace));
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(path));
  UCP_ASSERT_OK_AND_ASSIGN(Tensor back, f.ReadTensor(f.entries()[0]));
  EXPECT_TRUE(BitwiseEqual(back.view(), u.view()));
  // Nothing is left behind, and the file is world-readable like save_file's.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

TEST(SafetensorsWriter, AFileNeverCommittedLeavesNothing) {
  TempDir dir;
  const SafetensorsTensorSpec specs[] = {{"t", DType::kFp32, {4}}};
  {
    UCP_ASSERT_OK_AND_ASSIGN(SafetensorsWriter w,
                             SafetensorsWriter::Create(dir / "m.safetensors", specs));
    EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 0);
}

TEST(SafetensorsWriter, PiecesFromThreadsInAnyOrderMakeTheSameFile) {
  TempDir dir;
  Gen gen(5);
  Tensor a = gen.RandomTensor(DType::kFp32, {64, 16});
  Tensor b = gen.RandomTensor(DType::kBf16, {33});
  NamedTensorView views[] = {{"a", a.view()}, {"b", b.view()}};
  UCP_ASSERT_OK(WriteSafetensorsFile(dir / "whole.safetensors", views));

  const SafetensorsTensorSpec specs[] = {{"a", DType::kFp32, {64, 16}}, {"b", DType::kBf16, {33}}};
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsWriter w,
                           SafetensorsWriter::Create(dir / "pieces.safetensors", specs));
  UCP_ASSERT_OK_AND_ASSIGN(size_t ia, w.IndexOf("a"));
  const auto bytes = a.view().bytes;  // 4096 bytes in 16 pieces, written back to front
  std::vector<std::thread> threads;
  std::vector<Status> results(16);
  for (int i = 15; i >= 0; --i) {
    threads.emplace_back(
        [&, i] { results[i] = w.WriteRange(ia, i * 256, bytes.subspan(i * 256, 256)); });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) UCP_EXPECT_OK(s);
  UCP_ASSERT_OK(w.WriteTensor("b", b.view()));
  UCP_ASSERT_OK(w.Commit());
  EXPECT_EQ(Slurp(dir / "pieces.safetensors"), Slurp(dir / "whole.safetensors"));
  EXPECT_THAT(w.Commit(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("already committed")));
}

TEST(SafetensorsWriter, RefusesOverlapsAndCommitsOnlyCompleteFiles) {
  TempDir dir;
  const SafetensorsTensorSpec specs[] = {{"t", DType::kFp32, {4}}, {"e", DType::kFp16, {0}}};
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsWriter w,
                           SafetensorsWriter::Create(dir / "m.safetensors", specs));
  std::byte buf[16] = {};
  UCP_ASSERT_OK(w.WriteRange(0, 4, std::span(buf, 4)));
  EXPECT_THAT(w.WriteRange(0, 6, std::span(buf, 4)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlap bytes [4, 8)")));
  EXPECT_THAT(w.WriteRange(0, 0, std::span(buf, 6)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlap bytes [4, 8)")));
  EXPECT_THAT(w.WriteRange(0, 12, std::span(buf, 8)),
              StatusIs(StatusCode::kOutOfRange, HasSubstr("not within tensor 't' (16 bytes)")));
  EXPECT_THAT(w.WriteRange(7, 0, std::span(buf, 1)),
              StatusIs(StatusCode::kOutOfRange, HasSubstr("tensor index 7")));
  EXPECT_THAT(w.Commit(), StatusIs(StatusCode::kFailedPrecondition,
                                   HasSubstr("tensor 't' of " + (dir / "m.safetensors").string() +
                                             ": bytes from 0 on were never written")));
  UCP_ASSERT_OK(w.WriteRange(0, 0, std::span(buf, 4)));
  EXPECT_THAT(w.Commit(), StatusIs(StatusCode::kFailedPrecondition, HasSubstr("bytes from 8 on")));
  UCP_ASSERT_OK(w.WriteRange(0, 8, std::span(buf, 8)));
  UCP_ASSERT_OK(w.Commit());  // the empty tensor needs no write
  EXPECT_TRUE(fs::exists(dir / "m.safetensors"));
}

TEST(SafetensorsWriter, WriteTensorChecksTheView) {
  TempDir dir;
  const SafetensorsTensorSpec specs[] = {{"t", DType::kFp32, {4}}};
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsWriter w,
                           SafetensorsWriter::Create(dir / "m.safetensors", specs));
  Tensor wrong = *Tensor::Zeros(DType::kFp16, {4});
  EXPECT_THAT(w.WriteTensor("t", wrong.view()),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("laid out as fp32")));
  EXPECT_THAT(w.WriteTensor("u", wrong.view()),
              StatusIs(StatusCode::kNotFound, HasSubstr("tensor 'u'")));
  EXPECT_THAT(SafetensorsWriter::Create(dir / "no" / "m.safetensors", specs),
              StatusIs(StatusCode::kNotFound, HasSubstr("does not exist")));
}

}  // namespace
}  // namespace ucp::safetensors
