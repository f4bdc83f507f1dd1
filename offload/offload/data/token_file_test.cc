// Token files: the round trip, and the corruption catalogue (one bad file per reader rule).
#include "offload/data/token_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"

namespace ucp::offload {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
using ::ucp::testing::TempDir;

// llm.c's layout, written independently of the code under test: 256 int32 then uint16 tokens.
std::string LlmcBytes(int32_t magic, int32_t version, int32_t count,
                      const std::vector<uint16_t>& tokens) {
  std::string out(1024, '\0');
  const int32_t head[3] = {magic, version, count};
  for (int i = 0; i < 3; ++i) {
    for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<char>(uint32_t(head[i]) >> (8 * b));
  }
  for (uint16_t t : tokens) {
    out.push_back(static_cast<char>(t & 0xFF));
    out.push_back(static_cast<char>(t >> 8));
  }
  return out;
}

void WriteRaw(const fs::path& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

std::string ReadRaw(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(TokenFileTest, RoundTripMatchesLlmcLayout) {
  TempDir dir;
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{1000}, size_t{65536}}) {
    SCOPED_TRACE(n);
    std::vector<uint16_t> tokens(n);
    uint32_t x = 12345;
    for (auto& t : tokens) t = static_cast<uint16_t>((x = x * 1664525u + 1013904223u) >> 16);
    const fs::path path = dir / ("t" + std::to_string(n) + ".bin");
    UCP_ASSERT_OK(WriteTokenFile(path, tokens));
    EXPECT_EQ(ReadRaw(path),
              LlmcBytes(kTokenFileMagic, kTokenFileVersion, static_cast<int32_t>(n), tokens));
    UCP_ASSERT_OK_AND_ASSIGN(TokenFile file, TokenFile::Open(path));
    EXPECT_EQ(file.path(), path);
    EXPECT_TRUE(
        std::equal(file.tokens().begin(), file.tokens().end(), tokens.begin(), tokens.end()));
    TokenFile moved = std::move(file);  // the mapping moves with it
    EXPECT_EQ(moved.tokens().size(), n);
  }
  // Nothing but the outputs is left in the folder (no temporary names).
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
    ++entries;
  }
  EXPECT_EQ(entries, 5);
}

TEST(TokenFileTest, ReadsAFileWrittenByLlmc) {
  TempDir dir;
  const std::vector<uint16_t> tokens = {50256, 15496, 11, 995, 0, 65535};
  WriteRaw(dir / "llmc.bin", LlmcBytes(20240520, 1, 6, tokens));
  UCP_ASSERT_OK_AND_ASSIGN(TokenFile file, TokenFile::Open(dir / "llmc.bin"));
  EXPECT_EQ(std::vector<uint16_t>(file.tokens().begin(), file.tokens().end()), tokens);
}

TEST(TokenFileTest, WriterNeverOverwrites) {
  TempDir dir;
  const std::vector<uint16_t> tokens = {1, 2, 3};
  UCP_ASSERT_OK(WriteTokenFile(dir / "a.bin", tokens));
  EXPECT_THAT(WriteTokenFile(dir / "a.bin", tokens),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("a.bin already exists")));
}

TEST(TokenFileTest, WriterNeedsTheFolder) {
  TempDir dir;
  const std::vector<uint16_t> tokens = {1};
  Status st = WriteTokenFile(dir / "missing" / "a.bin", tokens);
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(st.message(), HasSubstr("a.bin"));
}

// The corruption catalogue: one file per rule of TokenFile::Open, each with its code and the
// fragment that names the file and the field.
struct BadFile {
  const char* name;
  std::string bytes;
  StatusCode code;
  const char* fragment;
};

TEST(TokenFileTest, CorruptionCatalogue) {
  const std::vector<uint16_t> three = {7, 8, 9};
  const std::string good = LlmcBytes(kTokenFileMagic, 1, 3, three);
  const std::vector<BadFile> cases = {
      {"empty.bin", "", StatusCode::kDataLoss, "short header: the file is 0 bytes"},
      {"short_header.bin", good.substr(0, 1023), StatusCode::kDataLoss,
       "short header: the file is 1023 bytes, the header alone is 1024 bytes"},
      {"magic.bin", LlmcBytes(12345, 1, 3, three), StatusCode::kDataLoss,
       "header[0] (magic) is 12345, expected 20240520"},
      {"llama3.bin", LlmcBytes(20240801, 7, 3, three), StatusCode::kUnimplemented,
       "header[0] (magic) is 20240801, llm.c's llama-3 format"},
      {"version.bin", LlmcBytes(kTokenFileMagic, 2, 3, three), StatusCode::kDataLoss,
       "header[1] (version) is 2, expected 1"},
      {"negative_count.bin", LlmcBytes(kTokenFileMagic, 1, -3, three), StatusCode::kDataLoss,
       "header[2] (token count) is -3, negative"},
      {"too_small.bin", LlmcBytes(kTokenFileMagic, 1, 4, three), StatusCode::kDataLoss,
       "truncated: header[2] (token count) is 4, which needs 1032 bytes, but the file is 1030"},
      {"too_large.bin", LlmcBytes(kTokenFileMagic, 1, 2, three), StatusCode::kDataLoss,
       "trailing bytes: header[2] (token count) is 2, which needs 1028 bytes, but the file is "
       "1030 bytes (2 bytes too many)"},
      {"odd.bin", good + "x", StatusCode::kDataLoss,
       "odd size: 7 bytes after the header are not a whole number of uint16 tokens"},
  };
  TempDir dir;
  for (const BadFile& c : cases) {
    SCOPED_TRACE(c.name);
    WriteRaw(dir / c.name, c.bytes);
    EXPECT_THAT(TokenFile::Open(dir / c.name),
                StatusIs(c.code, AllOf(HasSubstr("token file " + (dir / c.name).string()),
                                       HasSubstr(c.fragment))));
  }
}

TEST(TokenFileTest, MissingFile) {
  TempDir dir;
  EXPECT_THAT(TokenFile::Open(dir / "nope.bin"),
              StatusIs(StatusCode::kNotFound, HasSubstr("nope.bin does not exist")));
}

TEST(TokenFileTest, RefusesDirectory) {
  TempDir dir;
  fs::create_directory(dir / "d.bin");
  EXPECT_THAT(TokenFile::Open(dir / "d.bin"),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("d.bin is a directory, not a regular file")));
}

TEST(TokenFileTest, RefusesFifoWithoutBlocking) {
  TempDir dir;
  const fs::path fifo = dir / "fifo.bin";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // No writer ever opens it: a blocking open would hang here until the ctest timeout.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(TokenFile::Open(fifo), StatusIs(StatusCode::kFailedPrecondition,
                                              HasSubstr("fifo.bin is a FIFO, not a regular file")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(TokenFileTest, RefusesCharacterDevice) {
  if (!fs::exists("/dev/null")) GTEST_SKIP() << "no /dev/null";
  EXPECT_THAT(TokenFile::Open("/dev/null"),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("a character device")));
}

}  // namespace
}  // namespace ucp::offload
