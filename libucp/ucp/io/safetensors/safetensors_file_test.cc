// Round trips through SafetensorsWriter and SafetensorsFile: every ucp dtype (swept from the
// X-list), 0-d and empty tensors, seeded random sets; and the reader's API (entries in file order,
// ReadRange on sub-ranges, its argument errors, Open vs OpenBuffer).
#include "ucp/io/safetensors/safetensors_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <thread>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/safetensors/safetensors_writer.h"

namespace ucp::safetensors {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::Gen;
using ::ucp::testing::StatusIs;
using ::ucp::testing::TempDir;

std::string Slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

TEST(SafetensorsDType, EveryUcpDTypeHasANameThatMapsBack) {
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(DTypeName(d));
    UCP_ASSERT_OK_AND_ASSIGN(DType back, DTypeFromSafetensorsName(SafetensorsDTypeName(d), "t"));
    EXPECT_EQ(back, d);
  }
}

TEST(SafetensorsDType, CrateDTypesWithoutAUcpTwinAreUnimplemented) {
  for (const char* name : {"U16", "U32", "U64", "F4", "F6_E2M3", "F6_E3M2", "F8_E8M0",
                           "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64"}) {
    EXPECT_THAT(
        DTypeFromSafetensorsName(name, "tensor 'w' field dtype"),
        StatusIs(StatusCode::kUnimplemented,
                 HasSubstr("safetensors dtype '" + std::string(name) + "' is not supported")));
  }
  EXPECT_THAT(DTypeFromSafetensorsName("f32", "t"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("unknown dtype 'f32'")));
}

class RoundTripTest : public ::testing::TestWithParam<DType> {};

TEST_P(RoundTripTest, EveryShapeKindIsBitwiseEqual) {
  const DType dtype = GetParam();
  TempDir dir;
  Gen gen(7);
  const std::vector<std::pair<std::string, Shape>> shapes = {{"scalar", {}},
                                                             {"empty", {0}},
                                                             {"empty_inner", {3, 0, 2}},
                                                             {"vector", {5}},
                                                             {"matrix", {2, 3, 4}}};
  std::vector<Tensor> tensors;
  std::vector<NamedTensorView> views;
  for (const auto& [name, shape] : shapes) tensors.push_back(gen.RandomTensor(dtype, shape));
  for (size_t i = 0; i < shapes.size(); ++i) views.push_back({shapes[i].first, tensors[i].view()});
  const fs::path path = dir / "m.safetensors";
  UCP_ASSERT_OK(WriteSafetensorsFile(path, views));

  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(path));
  ASSERT_EQ(f.entries().size(), shapes.size());
  ASSERT_TRUE(f.metadata().has_value());
  EXPECT_EQ(*f.metadata(), DefaultMetadata());
  for (size_t i = 0; i < shapes.size(); ++i) {
    SCOPED_TRACE(shapes[i].first);
    UCP_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* e, f.Find(shapes[i].first));
    EXPECT_EQ(e->dtype, dtype);
    EXPECT_EQ(e->shape, shapes[i].second);
    UCP_ASSERT_OK_AND_ASSIGN(Tensor back, f.ReadTensor(*e));
    EXPECT_TRUE(BitwiseEqual(back.view(), tensors[i].view()));
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, RoundTripTest, ::testing::ValuesIn(kAllDTypes),
                         [](const auto& p) { return std::string(DTypeName(p.param)); });

TEST(SafetensorsRoundTrip, SeededRandomSetsAreBitwiseEqual) {
  for (int seed = 0; seed < ::ucp::testing::NumSeeds(); ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    TempDir dir;
    Gen gen(static_cast<uint64_t>(seed));
    std::vector<Tensor> tensors;
    std::vector<std::string> names;
    const int64_t count = gen.Int(0, 12);
    for (int64_t i = 0; i < count; ++i) {
      Shape shape;
      for (int64_t r = gen.Int(0, 3); r > 0; --r) shape.push_back(gen.Int(0, 5));
      tensors.push_back(gen.RandomTensor(gen.AnyDType(), shape));
      names.push_back("layers." + std::to_string(gen.Int(0, 1000)) + "." + std::to_string(i));
    }
    std::vector<NamedTensorView> views;
    for (size_t i = 0; i < tensors.size(); ++i) views.push_back({names[i], tensors[i].view()});
    const fs::path path = dir / "r.safetensors";
    SafetensorsWriteOptions options;
    options.metadata =
        std::map<std::string, std::string>{{"seed", std::to_string(seed)}, {"format", "pt"}};
    UCP_ASSERT_OK(WriteSafetensorsFile(path, views, options));
    UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(path));
    EXPECT_EQ(f.metadata(), options.metadata);
    ASSERT_EQ(f.entries().size(), tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      UCP_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* e, f.Find(names[i]));
      UCP_ASSERT_OK_AND_ASSIGN(Tensor back, f.ReadTensor(*e));
      EXPECT_TRUE(BitwiseEqual(back.view(), tensors[i].view())) << names[i];
    }
    // Writing the same tensors again gives the same bytes (determinism).
    UCP_ASSERT_OK(WriteSafetensorsFile(dir / "again.safetensors", views, options));
    EXPECT_EQ(Slurp(path), Slurp(dir / "again.safetensors"));
  }
}

class ReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Gen gen(3);
    w_ = gen.RandomTensor(DType::kFp32, {4, 8});
    b_ = gen.RandomTensor(DType::kBf16, {8});
    NamedTensorView views[] = {{"w", w_.view()}, {"b", b_.view()}};
    path_ = dir_ / "x.safetensors";
    ASSERT_THAT(WriteSafetensorsFile(path_, views), ::ucp::testing::IsOk());
  }
  TempDir dir_;
  fs::path path_;
  Tensor w_, b_;
};

TEST_F(ReaderTest, EntriesAreInFileOrderAndTileTheDataArea) {
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(path_));
  ASSERT_EQ(f.entries().size(), 2u);
  EXPECT_EQ(f.entries()[0].name, "w");  // F32 sorts before BF16
  EXPECT_EQ(f.entries()[0].data_begin, 0);
  EXPECT_EQ(f.entries()[0].data_end, 128);
  EXPECT_EQ(f.entries()[1].name, "b");
  EXPECT_EQ(f.entries()[1].data_begin, 128);
  EXPECT_EQ(f.entries()[1].data_end, 144);
  EXPECT_EQ(f.header().data_offset() % 8, 0);
  EXPECT_EQ(f.header().data_offset() + 144, f.file_size_bytes());
}

TEST_F(ReaderTest, ReadRangeReadsSubRangesFromManyThreads) {
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(path_));
  UCP_ASSERT_OK_AND_ASSIGN(const SafetensorsEntry* w, f.Find("w"));
  std::vector<std::byte> out(128);
  std::vector<std::thread> threads;
  std::vector<Status> results(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      results[i] = f.ReadRange(*w, i * 16, i * 16 + 16, std::span(out).subspan(i * 16, 16));
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) UCP_EXPECT_OK(s);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), w_.view().bytes.begin()));
}

TEST_F(ReaderTest, ReadRangeRefusesBadArguments) {
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(path_));
  const SafetensorsEntry& b = f.entries()[1];
  std::vector<std::byte> out(16);
  EXPECT_THAT(f.ReadRange(b, 8, 24, std::span(out)),
              StatusIs(StatusCode::kOutOfRange, HasSubstr("are not within tensor 'b' (16 bytes)")));
  EXPECT_THAT(f.ReadRange(b, 4, 2, std::span(out).first(0)),
              StatusIs(StatusCode::kOutOfRange, HasSubstr("bytes [4, 2)")));
  EXPECT_THAT(f.ReadRange(b, 0, 8, std::span(out)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("into 16 bytes")));
  SafetensorsEntry copy = b;
  EXPECT_THAT(f.ReadRange(copy, 0, 16, std::span(out)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not an entry of")));
  EXPECT_THAT(f.Find("nope"), StatusIs(StatusCode::kNotFound, HasSubstr("tensor 'nope'")));
}

TEST_F(ReaderTest, OpenBufferAgreesWithOpen) {
  const std::string bytes = Slurp(path_);
  UCP_ASSERT_OK_AND_ASSIGN(
      SafetensorsFile m,
      SafetensorsFile::OpenBuffer(std::as_bytes(std::span(bytes.data(), bytes.size())), "mem"));
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(path_));
  EXPECT_EQ(m.entries(), f.entries());
  UCP_ASSERT_OK_AND_ASSIGN(Tensor w, m.ReadTensor(m.entries()[0]));
  EXPECT_TRUE(BitwiseEqual(w.view(), w_.view()));
}

TEST_F(ReaderTest, AFileThatShrankAfterOpenIsDataLoss) {
  UCP_ASSERT_OK_AND_ASSIGN(SafetensorsFile f, SafetensorsFile::Open(path_));
  fs::resize_file(path_, f.header().data_offset() + 64);
  std::vector<std::byte> out(16);
  EXPECT_THAT(f.ReadRange(f.entries()[1], 0, 16, std::span(out)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("shrank since it was opened")));
}

TEST(SafetensorsOpen, MissingFileIsNotFound) {
  EXPECT_THAT(SafetensorsFile::Open("/nonexistent/x.safetensors"),
              StatusIs(StatusCode::kNotFound, HasSubstr("does not exist")));
}

}  // namespace
}  // namespace ucp::safetensors
