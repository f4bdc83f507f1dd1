// The corruption catalogue of the universal checkpoint: one handcrafted bad checkpoint per
// validation rule of docs/format.md, each built from a good one and asserting its code and the
// message fragment that names the file, parameter or field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/hdf5/h5_file.h"
#include "ucp/io/universal/universal_checkpoint.h"

namespace ucp::io {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::Gen;
using ::ucp::testing::TempDir;

enum class Corruption {
  kTruncatedHdf5,
  kNotHdf5,
  kChecksumMismatch,
  kMissingState,
  kMissingParamFile,
  kShapeMismatch,
  kShapeAttributeMismatch,
  kDTypeMismatch,
  kDuplicateKey,
  kUnknownKey,
  kMissingKey,
  kWrongVersion,
  kWrongFormat,
  kBadChecksumSyntax,
  kUnknownDType,
  kEscapeDotDot,
  kEscapeAbsolute,
  kFileOutsideViaSymlink,
  kNoManifest,
  kTempFolder,
  kStepAttributeMismatch,
  kTruncatedManifest,
};

struct Case {
  Corruption corruption;
  const char* name;
  bool at_open;  // detected by Open (else by Verify, or by ReadState when read_state is set)
  StatusCode code;
  const char* fragment;
  const char* read_state = nullptr;
};

const Case kCases[] = {
    {Corruption::kTruncatedHdf5, "TruncatedHdf5", false, StatusCode::kDataLoss,
     "w.h5 (2048 bytes) is truncated or corrupt"},
    {Corruption::kNotHdf5, "NotHdf5", false, StatusCode::kDataLoss,
     "parameter 'w' field file: file"},
    {Corruption::kChecksumMismatch, "ChecksumMismatch", false, StatusCode::kDataLoss,
     "parameter 'w', state 'exp_avg': field checksum"},
    {Corruption::kMissingState, "MissingState", false, StatusCode::kDataLoss,
     "state 'exp_avg_sq': state dataset is missing"},
    {Corruption::kMissingParamFile, "MissingParamFile", true, StatusCode::kDataLoss,
     "parameter 'w' field file 'params/w.h5' does not exist"},
    {Corruption::kShapeMismatch, "ShapeMismatch", false, StatusCode::kDataLoss,
     "state 'exp_avg': field shape: manifest says [64, 9] but the dataset is [64, 8]", "exp_avg"},
    {Corruption::kShapeAttributeMismatch, "ShapeAttributeMismatch", false, StatusCode::kDataLoss,
     "parameter 'w': attribute shape is [64, 8] but the manifest says [64, 9]"},
    {Corruption::kDTypeMismatch, "DTypeMismatch", false, StatusCode::kDataLoss,
     "field dtype: manifest says bf16 but the dataset holds fp32"},
    {Corruption::kDuplicateKey, "DuplicateKey", true, StatusCode::kDataLoss,
     "duplicate key \"step\" at /"},
    {Corruption::kUnknownKey, "UnknownKey", true, StatusCode::kDataLoss,
     "unknown key 'extra' at /params/0"},
    {Corruption::kMissingKey, "MissingKey", true, StatusCode::kDataLoss,
     "missing key 'file' at /params/0"},
    {Corruption::kWrongVersion, "WrongVersion", true, StatusCode::kUnimplemented,
     "format version 2 is not supported"},
    {Corruption::kWrongFormat, "WrongFormat", true, StatusCode::kDataLoss, "format is 'ucp-other'"},
    {Corruption::kBadChecksumSyntax, "BadChecksumSyntax", true, StatusCode::kDataLoss,
     "/params/0 (parameter 'w')/states/0/checksum"},
    {Corruption::kUnknownDType, "UnknownDType", true, StatusCode::kDataLoss,
     "unknown dtype 'float32'"},
    {Corruption::kEscapeDotDot, "EscapeDotDot", true, StatusCode::kDataLoss,
     "'../w.h5' contains '..'"},
    {Corruption::kEscapeAbsolute, "EscapeAbsolute", true, StatusCode::kDataLoss,
     "'/tmp/w.h5' is an absolute path"},
    {Corruption::kFileOutsideViaSymlink, "FileOutsideViaSymlink", true, StatusCode::kDataLoss,
     "outside the checkpoint folder"},
    {Corruption::kNoManifest, "NoManifest", true, StatusCode::kNotFound, "no manifest.json"},
    {Corruption::kTempFolder, "TempFolder", true, StatusCode::kFailedPrecondition,
     "unfinished write"},
    {Corruption::kStepAttributeMismatch, "StepAttributeMismatch", false, StatusCode::kDataLoss,
     "attribute step is 5 but the manifest says 6"},
    {Corruption::kTruncatedManifest, "TruncatedManifest", true, StatusCode::kDataLoss,
     "is not valid json"},
};

std::string Slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void Spit(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}
void Replace(const fs::path& p, const std::string& from, const std::string& to) {
  std::string s = Slurp(p);
  size_t at = s.find(from);
  ASSERT_NE(at, std::string::npos) << "'" << from << "' not in " << p;
  s.replace(at, from.size(), to);
  Spit(p, s);
}

class CorruptTest : public ::testing::TestWithParam<Case> {
 protected:
  // A good checkpoint: parameter "w" [64, 8] with fp32, exp_avg, exp_avg_sq, at step 5.
  fs::path MakeGood(int64_t step = 5, const std::string& name = "ckpt") {
    Gen gen(42);
    fp32_ = gen.RandomTensor(DType::kFp32, {64, 8});
    avg_ = gen.RandomTensor(DType::kFp32, {64, 8});
    sq_ = gen.RandomTensor(DType::kFp32, {64, 8});
    const fs::path dst = dir_ / name;
    auto w = UniversalWriter::Create(dst, {.step = step});
    EXPECT_TRUE(w.ok());
    std::vector<NamedState> st = {
        {"fp32", fp32_.view()}, {"exp_avg", avg_.view()}, {"exp_avg_sq", sq_.view()}};
    EXPECT_THAT(w->WriteParameter({.name = "w", .shape = {64, 8}}, st), ::ucp::testing::IsOk());
    UniversalManifest h;
    h.step = step;
    h.optimizer_kind = "adam";
    h.optimizer_states = {"exp_avg", "exp_avg_sq"};
    EXPECT_THAT(w->Commit(h), ::ucp::testing::IsOk());
    return dst;
  }

  TempDir dir_;
  Tensor fp32_, avg_, sq_;
};

TEST_P(CorruptTest, IsRejectedWithItsOwnError) {
  const Case& c = GetParam();
  fs::path ckpt = MakeGood();
  const fs::path manifest = ckpt / "manifest.json";
  const fs::path file = ckpt / "params" / "w.h5";
  switch (c.corruption) {
    case Corruption::kTruncatedHdf5:
      fs::resize_file(file, 2048);
      break;
    case Corruption::kNotHdf5:
      Spit(file, "PK\x03\x04 this is a zip, not hdf5");
      break;
    case Corruption::kChecksumMismatch: {
      // Flip one byte inside exp_avg's data, found by its unique random bytes.
      std::string s = Slurp(file);
      std::string needle(reinterpret_cast<const char*>(avg_.data()), 64);
      size_t at = s.find(needle);
      ASSERT_NE(at, std::string::npos);
      s[at + 100] ^= 0x01;
      Spit(file, s);
      break;
    }
    case Corruption::kMissingState: {
      // Rewrite a file without exp_avg_sq, keep the manifest listing it.
      fs::remove(file);
      auto f = H5File::Create(file);
      ASSERT_TRUE(f.ok());
      ASSERT_THAT(f->WriteStringAttribute("", "name", "w"), ::ucp::testing::IsOk());
      ASSERT_THAT(f->WriteInt64ArrayAttribute("", "shape", std::vector<int64_t>{64, 8}),
                  ::ucp::testing::IsOk());
      ASSERT_THAT(f->WriteInt64Attribute("", "step", 5), ::ucp::testing::IsOk());
      ASSERT_THAT(f->WriteDataset("fp32", fp32_.view()), ::ucp::testing::IsOk());
      ASSERT_THAT(f->WriteDataset("exp_avg", avg_.view()), ::ucp::testing::IsOk());
      ASSERT_THAT(f->Close(), ::ucp::testing::IsOk());
      break;
    }
    case Corruption::kMissingParamFile:
      fs::remove(file);
      break;
    case Corruption::kShapeMismatch:
    case Corruption::kShapeAttributeMismatch:
      Replace(manifest, "\"shape\": [\n        64,\n        8\n      ]",
              "\"shape\": [\n        64,\n        9\n      ]");
      break;
    case Corruption::kDTypeMismatch:
      Replace(manifest, "\"dtype\": \"fp32\",\n          \"name\": \"exp_avg\"",
              "\"dtype\": \"bf16\",\n          \"name\": \"exp_avg\"");
      break;
    case Corruption::kDuplicateKey:
      Replace(manifest, "\"step\": 5", "\"step\": 5,\n  \"step\": 6");
      break;
    case Corruption::kUnknownKey:
      Replace(manifest, "\"file\": ", "\"extra\": 1,\n      \"file\": ");
      break;
    case Corruption::kMissingKey:
      Replace(manifest, "\"file\": \"params/w.h5\",", "");
      break;
    case Corruption::kWrongVersion:
      Replace(manifest, "\"version\": 1", "\"version\": 2");
      break;
    case Corruption::kWrongFormat:
      Replace(manifest, "\"ucp-universal\"", "\"ucp-other\"");
      break;
    case Corruption::kBadChecksumSyntax:
      Replace(manifest, "\"checksum\": \"xxh3-64:", "\"checksum\": \"crc32:");
      break;
    case Corruption::kUnknownDType:
      Replace(manifest, "\"dtype\": \"fp32\",\n      \"file\"",
              "\"dtype\": \"float32\",\n      \"file\"");
      break;
    case Corruption::kEscapeDotDot:
      Replace(manifest, "\"params/w.h5\"", "\"../w.h5\"");
      break;
    case Corruption::kEscapeAbsolute:
      Replace(manifest, "\"params/w.h5\"", "\"/tmp/w.h5\"");
      break;
    case Corruption::kFileOutsideViaSymlink: {
      fs::path outside = dir_ / "outside";
      fs::create_directory(outside);
      fs::copy_file(file, outside / "w.h5");
      fs::create_directory_symlink(outside, ckpt / "params" / "link");
      Replace(manifest, "\"params/w.h5\"", "\"params/link/w.h5\"");
      break;
    }
    case Corruption::kNoManifest:
      fs::remove(manifest);
      break;
    case Corruption::kTempFolder: {
      fs::path tmp = dir_ / "ckpt.tmp-abc123";
      fs::rename(ckpt, tmp);
      ckpt = tmp;
      break;
    }
    case Corruption::kStepAttributeMismatch:
      Replace(manifest, "\"step\": 5", "\"step\": 6");
      break;
    case Corruption::kTruncatedManifest: {
      std::string s = Slurp(manifest);
      Spit(manifest, s.substr(0, s.size() / 2));
      break;
    }
  }
  auto r = UniversalReader::Open(ckpt);
  Status st = !r.ok()        ? r.status()
              : c.read_state ? r->ReadState("w", c.read_state).status()
                             : r->Verify();
  EXPECT_EQ(!r.ok(), c.at_open) << st.ToString();
  EXPECT_THAT(st, ::ucp::testing::StatusIs(c.code, HasSubstr(c.fragment)));
}

INSTANTIATE_TEST_SUITE_P(Catalogue, CorruptTest, ::testing::ValuesIn(kCases),
                         [](const auto& test_info) { return std::string(test_info.param.name); });

TEST_F(CorruptTest, GoodCheckpointVerifies) {
  auto r = UniversalReader::Open(MakeGood());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->Verify(), ::ucp::testing::IsOk());
}

}  // namespace
}  // namespace ucp::io
