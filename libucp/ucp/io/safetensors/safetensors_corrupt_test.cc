// The corruption catalogue of the safetensors reader: one handcrafted bad file per validation rule
// of docs/safetensors_format.md, each opened from disk and from memory and asserting its code and
// the message fragment that names the rule, the tensor and the field. Then the edge cases the
// crate accepts, which ucp must accept too, and the refusal of files that are not regular.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/safetensors/safetensors_file.h"

namespace ucp::safetensors {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
using ::ucp::testing::TempDir;

// A file: the 8-byte size of `header` (or `declared_size` when set), `header`, `data_bytes` zeros.
std::string MakeFile(const std::string& header, int64_t data_bytes,
                     std::optional<uint64_t> declared_size = std::nullopt) {
  const uint64_t n = declared_size.value_or(header.size());
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(static_cast<size_t>(data_bytes), '\0');
}

// A well-formed tensor entry.
std::string T(const std::string& name, const std::string& dtype, const std::string& shape,
              int64_t begin, int64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(end) + "]}";
}

// "[1,1,...,1]" with 65 ones.
std::string Rank65() {
  std::string s = "[1";
  for (int i = 1; i < 65; ++i) s += ",1";
  return s + "]";
}

struct Case {
  const char* name;
  std::string file;
  StatusCode code;
  const char* fragment;
};

std::vector<Case> Cases() {
  const std::string w = T("w", "F32", "[2]", 0, 8);
  return {
      {"FileShorterThanSize", std::string("\x02\x00\x00", 3), StatusCode::kDataLoss,
       "the file is 3 bytes, shorter than the 8-byte header size"},
      {"HeaderTooLarge", MakeFile("{}", 0, 100'000'001), StatusCode::kDataLoss,
       "header size 100000001 bytes exceeds the limit of 100000000 bytes"},
      {"HeaderSizeHuge", MakeFile("{}", 0, ~uint64_t{0}), StatusCode::kDataLoss,
       "header size 18446744073709551615 bytes exceeds the limit"},
      {"HeaderPastEof", MakeFile("{}", 0, 4096), StatusCode::kDataLoss,
       "header size 4096 bytes reaches past the end of the file (10 bytes)"},
      {"NotUtf8", MakeFile("{\"w\xff\":{}}", 0), StatusCode::kDataLoss,
       "header is not valid utf-8 (byte 3 of 9)"},
      {"Overlong", MakeFile("{\"\xc0\xaf\":{}}", 0), StatusCode::kDataLoss,
       "header is not valid utf-8 (byte 2"},
      {"Empty", MakeFile("", 0), StatusCode::kDataLoss, "header is not a json object (it is empty"},
      {"NotAnObject", MakeFile("[1, 2]  ", 0), StatusCode::kDataLoss,
       "header is not a json object (it starts with byte 91)"},
      {"ByteOrderMark", MakeFile("\xef\xbb\xbf{}", 0), StatusCode::kDataLoss,
       "header is not a json object (it starts with byte 239)"},
      {"InvalidJson", MakeFile("{\"w\":{\"dtype\":", 0), StatusCode::kDataLoss,
       "header is not valid json"},
      {"TrailingGarbage", MakeFile("{}x", 0), StatusCode::kDataLoss, "header is not valid json"},
      {"NulPadding", MakeFile(std::string("{}\0\0", 4), 0), StatusCode::kDataLoss,
       "header holds a nul byte at byte 2 of 4"},
      {"NulThenMore", MakeFile(std::string("{}\0{\"w\":1}", 10), 0), StatusCode::kDataLoss,
       "header holds a nul byte at byte 2 of 10"},
      {"DuplicateKey", MakeFile("{" + w + "," + w + "}", 8), StatusCode::kDataLoss,
       "duplicate key \"w\" at /"},
      {"DuplicateField", MakeFile("{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\"}}", 0),
       StatusCode::kDataLoss, "duplicate key \"dtype\" at /w"},
      {"TooDeep", MakeFile("{\"w\":[[[[[[[[[[1]]]]]]]]]]}", 0), StatusCode::kDataLoss,
       "nesting deeper than 8 levels"},
      {"TensorNotObject", MakeFile("{\"w\":3}", 0), StatusCode::kDataLoss,
       "tensor 'w' is 3, not an object"},
      {"UnknownDType", MakeFile("{" + T("w", "F17", "[2]", 0, 8) + "}", 8), StatusCode::kDataLoss,
       "tensor 'w' field dtype: unknown dtype 'F17'"},
      {"UnsupportedDType", MakeFile("{" + T("w", "U16", "[2]", 0, 4) + "}", 4),
       StatusCode::kUnimplemented,
       "tensor 'w' field dtype: safetensors dtype 'U16' is not supported"},
      {"DTypeNotString", MakeFile("{\"w\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,8]}}", 8),
       StatusCode::kDataLoss, "tensor 'w' field dtype: 7 is not a string"},
      {"MissingField", MakeFile("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8),
       StatusCode::kDataLoss, "tensor 'w' field shape: missing field"},
      {"ExtraField",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"foo\":1}}", 8),
       StatusCode::kDataLoss, "tensor 'w' field foo: unknown field"},
      {"ShapeNotArray", MakeFile("{" + T("w", "F32", "2", 0, 8) + "}", 8), StatusCode::kDataLoss,
       "tensor 'w' field shape: 2 is not an array"},
      {"ShapeNegative", MakeFile("{" + T("w", "F32", "[-2]", 0, 8) + "}", 8), StatusCode::kDataLoss,
       "tensor 'w' field shape: dim 0 is -2, not an integer in [0, 2^63)"},
      {"ShapeFloat", MakeFile("{" + T("w", "F32", "[1,2.0]", 0, 8) + "}", 8), StatusCode::kDataLoss,
       "tensor 'w' field shape: dim 1 is 2.0"},
      {"ShapeRank", MakeFile("{" + T("w", "F32", Rank65(), 0, 4) + "}", 4),
       StatusCode::kUnimplemented, "tensor 'w' field shape: 65 dims, more than the 64"},
      {"ShapeOverflow", MakeFile("{" + T("w", "F32", "[4294967296,4294967296]", 0, 8) + "}", 8),
       StatusCode::kDataLoss,
       "tensor 'w' field shape: [4294967296, 4294967296] of F32 has a byte size that overflows"},
      {"ShapeBytesOverflow", MakeFile("{" + T("w", "F64", "[2305843009213693952]", 0, 8) + "}", 8),
       StatusCode::kDataLoss, "tensor 'w' field shape: [2305843009213693952] of F64 has a byte"},
      {"OffsetsNotPair",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8]}}", 8),
       StatusCode::kDataLoss,
       "tensor 'w' field data_offsets: must be [begin, end] with two "
       "integers in [0, 2^63), got [8]"},
      {"OffsetsNegative", MakeFile("{" + T("w", "F32", "[2]", -8, 0) + "}", 8),
       StatusCode::kDataLoss, "got [-8,0]"},
      {"OffsetsReversed", MakeFile("{" + T("w", "F32", "[0]", 8, 0) + "}", 8),
       StatusCode::kDataLoss, "tensor 'w' field data_offsets: [8, 0] ends before it begins"},
      {"ShapeSizeMismatch", MakeFile("{" + T("w", "F32", "[2,3]", 0, 20) + "}", 20),
       StatusCode::kDataLoss,
       "tensor 'w' field data_offsets: [0, 20] holds 20 bytes but shape [2, 3] of F32 needs 24"},
      {"FirstNotAtZero", MakeFile("{" + T("w", "F32", "[2]", 4, 12) + "}", 12),
       StatusCode::kDataLoss,
       "tensor 'w' field data_offsets: [4, 12] leaves a hole of 4 bytes before it (the data area "
       "starts at 0)"},
      {"Hole", MakeFile("{" + w + "," + T("v", "F32", "[2]", 12, 20) + "}", 20),
       StatusCode::kDataLoss,
       "tensor 'v' field data_offsets: [12, 20] leaves a hole of 4 bytes before it (tensor 'w' "
       "ends at 8)"},
      {"Overlap", MakeFile("{" + w + "," + T("v", "F32", "[2]", 4, 12) + "}", 12),
       StatusCode::kDataLoss, "tensor 'v' field data_offsets: [4, 12] overlaps tensor 'w' [0, 8]"},
      {"SameRange", MakeFile("{" + w + "," + T("v", "F32", "[2]", 0, 8) + "}", 8),
       StatusCode::kDataLoss, "tensor 'w' field data_offsets: [0, 8] overlaps tensor 'v' [0, 8]"},
      {"PastTheEnd", MakeFile("{" + w + "}", 4), StatusCode::kDataLoss,
       "tensor 'w' field data_offsets: [0, 8] ends past the end of the data area (4 bytes): the "
       "file is truncated"},
      {"TrailingBytes", MakeFile("{" + w + "}", 12), StatusCode::kDataLoss,
       "4 trailing bytes after the last tensor (the data area is 12 bytes, the tensors end at 8)"},
      {"DataWithoutTensors", MakeFile("{}", 3), StatusCode::kDataLoss,
       "3 trailing bytes after the last tensor"},
      {"MetadataNotObject", MakeFile("{\"__metadata__\":\"pt\"}", 0), StatusCode::kDataLoss,
       "field __metadata__ is \"pt\", not an object of strings"},
      {"MetadataNull", MakeFile("{\"__metadata__\":null}", 0), StatusCode::kDataLoss,
       "field __metadata__ is null, not an object of strings"},
      {"MetadataValueNotString", MakeFile("{\"__metadata__\":{\"format\":1}}", 0),
       StatusCode::kDataLoss, "field __metadata__ key 'format' is 1, not a string"},
      {"MetadataNested", MakeFile("{\"__metadata__\":{\"a\":{\"b\":\"c\"}}}", 0),
       StatusCode::kDataLoss, "field __metadata__ key 'a' is a json object, not a string"},
  };
}

class CorruptTest : public ::testing::TestWithParam<Case> {};

TEST_P(CorruptTest, IsRejectedWithItsOwnError) {
  const Case& c = GetParam();
  TempDir dir;
  const fs::path path = dir / "bad.safetensors";
  {
    std::ofstream f(path, std::ios::binary);
    f << c.file;
  }
  EXPECT_THAT(SafetensorsFile::Open(path),
              StatusIs(c.code, ::testing::AllOf(HasSubstr(c.fragment),
                                                HasSubstr("safetensors file " + path.string()))));
  EXPECT_THAT(SafetensorsFile::OpenBuffer(std::as_bytes(std::span(c.file.data(), c.file.size())),
                                          "mem.safetensors"),
              StatusIs(c.code, HasSubstr(c.fragment)));
}

INSTANTIATE_TEST_SUITE_P(Catalogue, CorruptTest, ::testing::ValuesIn(Cases()),
                         [](const auto& p) { return std::string(p.param.name); });

// What the crate accepts (formats.md §2.4 edge_ok), ucp accepts too.
TEST(SafetensorsEdgeCases, CrateAcceptedHeadersOpen) {
  const std::string w = T("w", "F32", "[2]", 0, 8);
  const std::vector<std::pair<std::string, std::string>> ok = {
      {"EmptyHeader", MakeFile("{}", 0)},
      {"LeadingWhitespace", MakeFile(" \n\t{" + w + "}", 8)},
      {"TrailingSpacesAndNewline", MakeFile("{" + w + "}\n      ", 8)},
      {"UnpaddedLength", MakeFile("{" + w + "}", 8)},
      {"KeysNotInOffsetOrder",
       MakeFile("{" + T("z", "F32", "[1]", 0, 4) + "," + T("a", "I8", "[4]", 4, 8) + "}", 8)},
      {"EmptyTensorsShareAnOffset",
       MakeFile("{" + T("e1", "F32", "[0]", 8, 8) + "," + w + "," + T("e2", "F16", "[3,0]", 8, 8) +
                    "," + T("e0", "F64", "[0]", 0, 0) + "}",
                8)},
      {"EmptyMetadata", MakeFile("{\"__metadata__\":{}," + w + "}", 8)},
      {"ZeroDim", MakeFile("{" + T("s", "BF16", "[]", 0, 2) + "}", 2)},
  };
  for (const auto& [name, file] : ok) {
    SCOPED_TRACE(name);
    EXPECT_THAT(
        SafetensorsFile::OpenBuffer(std::as_bytes(std::span(file.data(), file.size())), name),
        ::ucp::testing::IsOk());
  }
  const std::string file =
      MakeFile("{" + T("z", "F32", "[1]", 4, 8) + "," + T("e", "F32", "[0]", 4, 4) + "," +
                   T("a", "I8", "[4]", 0, 4) + "}",
               8);
  UCP_ASSERT_OK_AND_ASSIGN(
      SafetensorsFile f,
      SafetensorsFile::OpenBuffer(std::as_bytes(std::span(file.data(), file.size())), "f"));
  std::vector<std::string> order;
  for (const auto& e : f.entries()) order.push_back(e.name);
  EXPECT_THAT(order, ::testing::ElementsAre("a", "e", "z"));  // file order, not key order
  EXPECT_FALSE(f.metadata().has_value());
}

TEST(SafetensorsNotRegular, AFifoIsRefusedWithoutBlocking) {
  TempDir dir;
  const fs::path fifo = dir / "pipe.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(
      SafetensorsFile::Open(fifo),
      StatusIs(StatusCode::kDataLoss, HasSubstr("pipe.safetensors is a fifo, not a regular file")));
  EXPECT_THAT(SafetensorsFile::Open(dir.path()),
              StatusIs(StatusCode::kDataLoss, HasSubstr("is a directory, not a regular file")));
}

TEST(SafetensorsLimits, MaxHeaderBytesIsAnOption) {
  TempDir dir;
  const fs::path path = dir / "m.safetensors";
  {
    std::ofstream f(path, std::ios::binary);
    f << MakeFile("{" + T("w", "F32", "[2]", 0, 8) + "}", 8);
  }
  SafetensorsReadOptions options;
  options.max_header_bytes = 16;
  EXPECT_THAT(SafetensorsFile::Open(path, options),
              StatusIs(StatusCode::kDataLoss, HasSubstr("exceeds the limit of 16 bytes")));
}

}  // namespace
}  // namespace ucp::safetensors
