// Tests of the HDF5 wrapper: bitwise round trips for every dtype and storage, flat ranges of
// N-d datasets, deterministic bytes, attributes, and the errors each check returns.
#include "ucp/io/hdf5/h5_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <tuple>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/hdf5/byte_shuffle.h"
#include "ucp/io/raw_file.h"

namespace ucp::io {
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

const std::vector<Shape> kShapes = {{}, {0}, {2, 0}, {1}, {7}, {5, 3, 4}, {1000, 37}, {3, 2, 700}};

TEST(H5File, RoundTripEveryDTypeShapeAndStorage) {
  TempDir dir;
  Gen gen(1);
  for (int level : {0, 3, -1}) {
    const fs::path path = dir / ("rt" + std::to_string(level) + ".h5");
    UCP_ASSERT_OK_AND_ASSIGN(H5File f, H5File::Create(path));
    std::vector<std::pair<std::string, Tensor>> written;
    for (DType d : kAllDTypes) {
      for (size_t s = 0; s < kShapes.size(); ++s) {
        std::string name = "g/" + std::string(DTypeName(d)) + "_" + std::to_string(s);
        Tensor t = gen.RandomTensor(d, kShapes[s]);
        // Small chunks so that most datasets have many chunks and a padded edge chunk.
        UCP_ASSERT_OK(
            f.WriteDataset(name, t.view(), {.compression_level = level, .chunk_bytes = 4096}));
        written.emplace_back(name, std::move(t));
      }
    }
    UCP_ASSERT_OK(f.Close());
    UCP_ASSERT_OK_AND_ASSIGN(H5File r, H5File::Open(path));
    for (const auto& [name, t] : written) {
      SCOPED_TRACE(name + " level " + std::to_string(level));
      UCP_ASSERT_OK_AND_ASSIGN(DatasetMeta meta, r.DatasetInfo(name));
      EXPECT_EQ(meta.dtype, t.dtype());
      EXPECT_EQ(meta.shape, t.shape());
      EXPECT_EQ(meta.compressed, level != 0 && t.num_elements() > 0 && !t.shape().empty());
      UCP_ASSERT_OK_AND_ASSIGN(Tensor back, r.ReadDataset(name));
      EXPECT_TRUE(BitwiseEqual(back.view(), t.view()));
      // HDF5's own pipeline (in-process filter, its shuffle) must agree with the direct path.
      std::vector<std::byte> flat(t.num_bytes());
      UCP_ASSERT_OK(r.ReadFlatRange(name, 0, t.num_elements(), flat));
      EXPECT_TRUE(std::equal(flat.begin(), flat.end(), t.data()));
      UCP_ASSERT_OK_AND_ASSIGN(std::string dn, r.ReadStringAttribute(name, "dtype"));
      EXPECT_EQ(dn, DTypeName(t.dtype()));
    }
  }
}

TEST(H5File, FlatRangesOfNdDatasets) {
  TempDir dir;
  for (int level : {0, 5}) {
    const fs::path path = dir / ("fr" + std::to_string(level) + ".h5");
    Gen gen(7 + level);
    Tensor t = gen.RandomTensor(DType::kInt32, {6, 5, 4, 3});
    {
      UCP_ASSERT_OK_AND_ASSIGN(H5File f, H5File::Create(path));
      UCP_ASSERT_OK(
          f.WriteDataset("x", t.view(), {.compression_level = level, .chunk_bytes = 4096}));
    }
    UCP_ASSERT_OK_AND_ASSIGN(H5File r, H5File::Open(path));
    const int64_t n = t.num_elements();
    for (int i = 0; i < 200; ++i) {
      int64_t b = gen.Int(0, n), e = gen.Int(b, n);
      if (i == 0) {
        b = 0;
        e = n;
      }
      std::vector<std::byte> out(static_cast<size_t>((e - b) * 4));
      UCP_ASSERT_OK(r.ReadFlatRange("x", b, e, out));
      ASSERT_TRUE(std::equal(out.begin(), out.end(), t.data() + b * 4)) << b << ".." << e;
    }
    std::vector<std::byte> out(8);
    EXPECT_THAT(r.ReadFlatRange("x", n - 1, n + 1, out),
                StatusIs(StatusCode::kOutOfRange, HasSubstr("[359, 361)")));
    EXPECT_THAT(r.ReadFlatRange("x", 0, 1, out),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("8 bytes, expected 4")));
  }
}

TEST(H5File, SameInputSameBytes) {
  TempDir dir;
  Gen gen(3);
  Tensor a = gen.RandomTensor(DType::kFp32, {300, 17});
  Tensor b = gen.RandomTensor(DType::kBf16, {5});
  for (int level : {0, 3}) {
    for (const char* name : {"1.h5", "2.h5"}) {
      UCP_ASSERT_OK_AND_ASSIGN(H5File f, H5File::Create(dir / (std::to_string(level) + name)));
      UCP_ASSERT_OK(
          f.WriteDataset("w/a", a.view(), {.compression_level = level, .chunk_bytes = 4096}));
      UCP_ASSERT_OK(f.WriteDataset("b", b.view(), {.compression_level = level}));
      UCP_ASSERT_OK(f.WriteStringAttribute("", "name", "x"));
      UCP_ASSERT_OK(f.WriteInt64Attribute("b", "step", 5));
      UCP_ASSERT_OK(f.Close());
      std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // a timestamp would differ
    }
    EXPECT_EQ(Slurp(dir / (std::to_string(level) + "1.h5")),
              Slurp(dir / (std::to_string(level) + "2.h5")));
  }
}

TEST(H5File, AttributesAndListing) {
  TempDir dir;
  const fs::path path = dir / "a.h5";
  Tensor t = std::move(Tensor::Zeros(DType::kFp32, {2})).value();
  {
    UCP_ASSERT_OK_AND_ASSIGN(H5File f, H5File::Create(path));
    UCP_ASSERT_OK(f.WriteDataset("z", t.view()));
    UCP_ASSERT_OK(f.WriteDataset("a/b/c", t.view()));
    UCP_ASSERT_OK(f.WriteStringAttribute("", "name", "layers.0.w"));
    UCP_ASSERT_OK(f.WriteInt64Attribute("", "step", -42));
    UCP_ASSERT_OK(f.WriteInt64ArrayAttribute("", "shape", std::vector<int64_t>{3, 4}));
    UCP_ASSERT_OK(f.WriteInt64ArrayAttribute("z", "empty", std::vector<int64_t>{}));
    UCP_ASSERT_OK(f.WriteStringAttribute("a/b/c", "json", R"({"k": [1, 2]})"));
    EXPECT_THAT(f.WriteStringAttribute("", "name", "again"),
                StatusIs(StatusCode::kAlreadyExists, HasSubstr("attribute 'name' of /")));
    EXPECT_THAT(f.WriteStringAttribute("nope", "x", "y"),
                StatusIs(StatusCode::kNotFound, HasSubstr("object 'nope'")));
    EXPECT_THAT(f.WriteDataset("z", t.view()),
                StatusIs(StatusCode::kAlreadyExists, HasSubstr("'z'")));
    EXPECT_THAT(f.WriteDataset("../z", t.view()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("'..'")));
    EXPECT_THAT(f.WriteDataset("/z", t.view()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("relative")));
    EXPECT_THAT(f.WriteDataset("q", t.view(), {.compression_level = 99}),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("compression_level 99")));
    EXPECT_THAT(f.WriteDataset("q", t.view(), {.chunk_bytes = 10}),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("chunk_bytes 10")));
  }
  EXPECT_THAT(H5File::Create(path), StatusIs(StatusCode::kAlreadyExists, HasSubstr("a.h5")));
  UCP_ASSERT_OK_AND_ASSIGN(H5File r, H5File::Open(path));
  UCP_ASSERT_OK_AND_ASSIGN(auto names, r.ListDatasets());
  EXPECT_EQ(names, (std::vector<std::string>{"a/b/c", "z"}));
  EXPECT_TRUE(r.HasDataset("a/b/c"));
  EXPECT_FALSE(r.HasDataset("a/b"));
  EXPECT_FALSE(r.HasDataset("x/y"));
  UCP_ASSERT_OK_AND_ASSIGN(auto name, r.ReadStringAttribute("", "name"));
  EXPECT_EQ(name, "layers.0.w");
  UCP_ASSERT_OK_AND_ASSIGN(auto step, r.ReadInt64Attribute("", "step"));
  EXPECT_EQ(step, -42);
  UCP_ASSERT_OK_AND_ASSIGN(auto shape, r.ReadInt64ArrayAttribute("", "shape"));
  EXPECT_EQ(shape, (std::vector<int64_t>{3, 4}));
  UCP_ASSERT_OK_AND_ASSIGN(auto empty, r.ReadInt64ArrayAttribute("z", "empty"));
  EXPECT_TRUE(empty.empty());
  UCP_ASSERT_OK_AND_ASSIGN(auto json, r.ReadStringAttribute("a/b/c", "json"));
  EXPECT_EQ(json, R"({"k": [1, 2]})");
  EXPECT_TRUE(r.HasAttribute("", "step"));
  EXPECT_FALSE(r.HasAttribute("", "nope"));
  EXPECT_THAT(r.ReadStringAttribute("", "nope"),
              StatusIs(StatusCode::kNotFound, HasSubstr("'nope'")));
  EXPECT_THAT(r.ReadStringAttribute("", "step"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("not a string")));
  EXPECT_THAT(r.ReadInt64Attribute("", "name"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("scalar integer")));
  EXPECT_THAT(r.ReadDataset("nope"), StatusIs(StatusCode::kNotFound, HasSubstr("dataset 'nope'")));
  Tensor wrong = std::move(Tensor::Zeros(DType::kFp32, {3})).value();
  EXPECT_THAT(
      r.ReadDatasetInto("z", wrong.view()),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("fp32 [2] but the output is fp32 [3]")));
  EXPECT_THAT(r.WriteStringAttribute("", "new", "x"),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("read-only")));
}

TEST(H5File, RejectsNonHdf5AndTruncatedFiles) {
  TempDir dir;
  std::ofstream(dir / "text.h5") << "this is not hdf5 at all";
  EXPECT_THAT(H5File::Open(dir / "text.h5"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("not an hdf5 file")));
  EXPECT_THAT(H5File::Open(dir / "missing.h5"),
              StatusIs(StatusCode::kNotFound, HasSubstr("missing.h5")));
  Gen gen(5);
  Tensor t = gen.RandomTensor(DType::kFp32, {10000});
  {
    UCP_ASSERT_OK_AND_ASSIGN(H5File f, H5File::Create(dir / "full.h5"));
    UCP_ASSERT_OK(f.WriteDataset("x", t.view()));
  }
  fs::copy_file(dir / "full.h5", dir / "cut.h5");
  fs::resize_file(dir / "cut.h5", fs::file_size(dir / "full.h5") / 2);
  EXPECT_THAT(H5File::Open(dir / "cut.h5"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("truncated or corrupt")));
}

TEST(H5File, ParallelWritersAndReaders) {
  TempDir dir;
  std::vector<Tensor> ts;
  Gen gen(11);
  for (int i = 0; i < 8; ++i) ts.push_back(gen.RandomTensor(DType::kFp32, {256, 64}));
  std::vector<std::thread> threads;
  std::vector<Status> sts(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    threads.emplace_back([&, i] {
      auto f = H5File::Create(dir / (std::to_string(i) + ".h5"));
      if (!f.ok()) {
        sts[i] = f.status();
        return;
      }
      sts[i] =
          f->WriteDataset("x", ts[i].view(),
                          {.compression_level = static_cast<int>(i % 2) * 3, .chunk_bytes = 4096});
      if (sts[i].ok()) sts[i] = f->Close();
    });
  }
  for (auto& t : threads) t.join();
  for (auto& s : sts) UCP_ASSERT_OK(s);
  for (size_t i = 0; i < ts.size(); ++i) {
    UCP_ASSERT_OK_AND_ASSIGN(H5File r, H5File::Open(dir / (std::to_string(i) + ".h5")));
    UCP_ASSERT_OK_AND_ASSIGN(Tensor back, r.ReadDataset("x"));
    EXPECT_TRUE(BitwiseEqual(back.view(), ts[i].view()));
  }
}

TEST(ByteShuffle, TransposesBytesAndInverts) {
  std::vector<std::byte> in(11), sh(11), back(11);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::byte>(i);
  ByteShuffle(in, sh, 4);
  // Elements {0,1,2,3} {4,5,6,7}: byte 0 of each first, then byte 1, ...; the 3 tail bytes stay.
  const std::vector<int> want = {0, 4, 1, 5, 2, 6, 3, 7, 8, 9, 10};
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(static_cast<int>(sh[i]), want[i]) << i;
  ByteUnshuffle(sh, back, 4);
  EXPECT_EQ(back, in);
}

// Direct datasets: HDF5 writes the metadata and reserves the bytes; the contents are written
// later with pwrite at the reported offset, and HDF5 (and DirectOffset) read them back.
TEST(H5File, DirectDatasetsWrittenThroughRawFileReadBackBitwise) {
  TempDir dir;
  Gen gen(3);
  const fs::path path = dir / "direct.h5";
  std::vector<std::tuple<std::string, Tensor, int64_t>> written;
  {
    UCP_ASSERT_OK_AND_ASSIGN(H5File f, H5File::Create(path));
    for (DType d : kAllDTypes) {
      for (size_t s = 0; s < kShapes.size(); ++s) {
        std::string name = "d/" + std::string(DTypeName(d)) + "_" + std::to_string(s);
        Tensor t = gen.RandomTensor(d, kShapes[s]);
        UCP_ASSERT_OK_AND_ASSIGN(int64_t offset, f.CreateDirectDataset(name, d, kShapes[s]));
        EXPECT_EQ(offset < 0, t.num_elements() == 0) << name;
        written.emplace_back(name, std::move(t), offset);
      }
    }
    UCP_ASSERT_OK(f.Close());
  }
  {
    UCP_ASSERT_OK_AND_ASSIGN(RawFile raw, RawFile::OpenForWrite(path));
    for (const auto& [name, t, offset] : written) {
      if (offset >= 0) {
        EXPECT_GE(raw.size_bytes(), offset + t.num_bytes()) << name;
        UCP_ASSERT_OK(raw.WriteAt(offset, t.view().bytes));
      }
    }
    UCP_ASSERT_OK(raw.Close());
  }
  UCP_ASSERT_OK_AND_ASSIGN(H5File r, H5File::Open(path));
  for (const auto& [name, t, offset] : written) {
    SCOPED_TRACE(name);
    UCP_ASSERT_OK_AND_ASSIGN(Tensor back, r.ReadDataset(name));
    EXPECT_TRUE(BitwiseEqual(back.view(), t.view()));
    UCP_ASSERT_OK_AND_ASSIGN(int64_t found, r.DirectOffset(name));
    EXPECT_EQ(found, offset);
  }
}

TEST(H5File, DirectOffsetIsMinusOneForCompressedDatasets) {
  TempDir dir;
  Gen gen(4);
  const fs::path path = dir / "c.h5";
  Tensor t = gen.RandomTensor(DType::kFp32, {100, 10});
  {
    UCP_ASSERT_OK_AND_ASSIGN(H5File f, H5File::Create(path));
    UCP_ASSERT_OK(f.WriteDataset("z", t.view(), {.compression_level = 3, .chunk_bytes = 4096}));
    UCP_ASSERT_OK(f.WriteDataset("plain", t.view()));
    UCP_ASSERT_OK(f.Close());
  }
  UCP_ASSERT_OK_AND_ASSIGN(H5File r, H5File::Open(path));
  UCP_ASSERT_OK_AND_ASSIGN(int64_t z, r.DirectOffset("z"));
  EXPECT_EQ(z, -1);
  UCP_ASSERT_OK_AND_ASSIGN(int64_t plain, r.DirectOffset("plain"));
  ASSERT_GE(plain, 0);
  UCP_ASSERT_OK_AND_ASSIGN(RawFile raw, RawFile::OpenForRead(path));
  std::vector<std::byte> back(t.num_bytes());
  UCP_ASSERT_OK(raw.ReadAt(plain, back));
  EXPECT_EQ(std::memcmp(back.data(), t.data(), back.size()), 0);
  EXPECT_THAT(raw.ReadAt(raw.size_bytes() - 4, std::span<std::byte>(back.data(), 8)),
              StatusIs(StatusCode::kDataLoss, HasSubstr("truncated")));
  EXPECT_THAT(r.DirectOffset("nope"), StatusIs(StatusCode::kNotFound, HasSubstr("nope")));
}

}  // namespace
}  // namespace ucp::io
