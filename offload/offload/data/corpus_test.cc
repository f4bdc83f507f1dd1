// Corpora: fortune file selection, records, the by-document split, determinism and reuse, and the
// real Debian corpus when it is installed.
#include "offload/data/corpus.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "offload/data/token_file.h"
#include "offload/data/tokenizer.h"
#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"

namespace ucp::offload {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
using ::ucp::testing::TempDir;

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  ASSERT_TRUE(f.good()) << path;
}

std::string ReadRaw(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string Decode(const fs::path& token_file) {
  auto file = TokenFile::Open(token_file);
  EXPECT_TRUE(file.ok()) << file.status();
  return file.ok() ? Detokenize(file->tokens()) : "";
}

// A fortune folder as Debian lays it out, plus the cases FortuneFiles must decide.
void MakeFortuneFolder(const fs::path& dir) {
  fs::create_directories(dir / "off");
  WriteText(dir / "alpha", "one\n%\ntwo\nlines\n%\nthree\n");
  WriteText(dir / "alpha.dat", "index");
  fs::create_symlink("alpha", dir / "alpha.u8");  // Debian: an alias, not a second copy
  WriteText(dir / "beta", "%\nfour\n%\n\n%\nfive \xE2\x82\xAC\n%\n");  // blank records dropped
  WriteText(dir / "beta.dat", "index");
  WriteText(dir / "README", "not a fortune file: no .dat\n");
  WriteText(dir / "latin", "caf\xE9\n%\n");  // latin-1, no UTF-8 copy: skipped
  WriteText(dir / "latin.dat", "index");
  WriteText(dir / "legacy", "na\xEFve\n%\n");  // latin-1 with a separate UTF-8 copy beside it
  WriteText(dir / "legacy.u8", "na\xC3\xAFve\n%\n");
  WriteText(dir / "legacy.dat", "index");
  WriteText(dir / "off" / "rot", "bar\n%\n");  // subfolders are not searched
  WriteText(dir / "off" / "rot.dat", "index");
}

TEST(CorpusTest, FortuneFilesPicksSourcesOnce) {
  TempDir tmp;
  MakeFortuneFolder(tmp.path());
  std::vector<std::string> skipped;
  UCP_ASSERT_OK_AND_ASSIGN(std::vector<fs::path> files, FortuneFiles(tmp.path(), &skipped));
  EXPECT_THAT(files, ElementsAre(tmp / "alpha", tmp / "beta", tmp / "legacy.u8"));
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_THAT(skipped[0], HasSubstr((tmp / "latin").string() +
                                    ": invalid UTF-8 at byte offset 3 (byte 0xE9); skipped"));
  // Without the out-parameter the result is the same.
  UCP_ASSERT_OK_AND_ASSIGN(std::vector<fs::path> again, FortuneFiles(tmp.path()));
  EXPECT_EQ(again, files);
}

TEST(CorpusTest, FortuneFilesNotFound) {
  TempDir tmp;
  EXPECT_THAT(FortuneFiles(tmp / "none"),
              StatusIs(StatusCode::kNotFound, HasSubstr("install the Debian package `fortunes`")));
  WriteText(tmp / "plain", "x\n");
  EXPECT_THAT(FortuneFiles(tmp.path()),
              StatusIs(StatusCode::kNotFound, HasSubstr("no fortune file")));
}

TEST(CorpusTest, RecordsAndSplit) {
  TempDir tmp;
  MakeFortuneFolder(tmp / "src");
  UCP_ASSERT_OK_AND_ASSIGN(std::vector<fs::path> files, FortuneFiles(tmp / "src"));
  // Documents in order: one, two\nlines, three, four, five €, naïve.
  UCP_ASSERT_OK_AND_ASSIGN(CorpusFiles c, BuildCorpus(files, tmp / "out", /*val_every=*/3));
  EXPECT_EQ(c.documents, 6);
  EXPECT_EQ(c.train, tmp / "out" / "train.bin");
  EXPECT_EQ(c.val, tmp / "out" / "val.bin");
  const std::string end = "\n<|end|>\n";
  const std::string train =
      "one\n" + end + "two\nlines\n" + end + "four\n" + end + "five \xE2\x82\xAC\n" + end;
  const std::string val = "three\n" + end + "na\xC3\xAFve\n" + end;
  EXPECT_EQ(Decode(c.train), train);
  EXPECT_EQ(Decode(c.val), val);
  EXPECT_EQ(c.train_tokens, static_cast<int64_t>(train.size() - 4 * end.size() + 4));
  EXPECT_EQ(c.val_tokens, static_cast<int64_t>(val.size() - 2 * end.size() + 2));
}

TEST(CorpusTest, DeterministicAndReusable) {
  TempDir tmp;
  MakeFortuneFolder(tmp / "src");
  UCP_ASSERT_OK_AND_ASSIGN(std::vector<fs::path> files, FortuneFiles(tmp / "src"));
  UCP_ASSERT_OK_AND_ASSIGN(CorpusFiles a, BuildCorpus(files, tmp / "a", 2));
  UCP_ASSERT_OK_AND_ASSIGN(CorpusFiles b, BuildCorpus(files, tmp / "b", 2));
  EXPECT_EQ(ReadRaw(a.train), ReadRaw(b.train));
  EXPECT_EQ(ReadRaw(a.val), ReadRaw(b.val));

  // A second call on the same folder reuses the files (a run calls it on every start).
  const auto mtime = fs::last_write_time(a.train);
  UCP_ASSERT_OK_AND_ASSIGN(CorpusFiles again, BuildCorpus(files, tmp / "a", 2));
  EXPECT_EQ(again.documents, a.documents);
  EXPECT_EQ(again.train_tokens, a.train_tokens);
  EXPECT_EQ(again.val_tokens, a.val_tokens);
  EXPECT_EQ(fs::last_write_time(a.train), mtime);

  // A missing half is written again.
  fs::remove(a.val);
  UCP_ASSERT_OK(BuildCorpus(files, tmp / "a", 2));
  EXPECT_EQ(ReadRaw(a.val), ReadRaw(b.val));

  // Other inputs against existing files: refused, never silently trained on.
  EXPECT_THAT(BuildCorpus(files, tmp / "a", 3),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("corpus file " + a.train.string() + " exists with other tokens")));
  // A corrupt existing file is reported, not replaced.
  WriteText(tmp / "b" / "train.bin", "junk");
  EXPECT_THAT(BuildCorpus(files, tmp / "b", 2),
              StatusIs(StatusCode::kDataLoss, HasSubstr("short header")));
}

TEST(CorpusTest, PlainTextIsOneDocumentPerFile) {
  TempDir tmp;
  WriteText(tmp / "a.txt", "first\n%\nstill first\n");
  WriteText(tmp / "b.txt", "second\n");
  UCP_ASSERT_OK_AND_ASSIGN(CorpusFiles c,
                           BuildCorpus({tmp / "a.txt", tmp / "b.txt"}, tmp / "out", 2, false));
  EXPECT_EQ(c.documents, 2);
  EXPECT_EQ(Decode(c.train), "first\n%\nstill first\n\n<|end|>\n");
  EXPECT_EQ(Decode(c.val), "second\n\n<|end|>\n");
}

TEST(CorpusTest, Errors) {
  TempDir tmp;
  WriteText(tmp / "ok", "a\n%\nb\n%\nc\n");
  WriteText(tmp / "bad", "fine\n%\nna\xEFve\n");
  EXPECT_THAT(BuildCorpus({tmp / "ok"}, tmp / "out", 1),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("val_every is 1")));
  EXPECT_THAT(
      BuildCorpus({tmp / "ok", tmp / "bad"}, tmp / "out", 2),
      StatusIs(StatusCode::kInvalidArgument,
               HasSubstr((tmp / "bad").string() + ": invalid UTF-8 at byte offset 9 (byte 0xEF)")));
  EXPECT_THAT(BuildCorpus({tmp / "ok"}, tmp / "out", 4),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("3 documents with val_every=4 leave the held-out set empty")));
  EXPECT_THAT(BuildCorpus({}, tmp / "out", 2),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("no document")));
  EXPECT_THAT(BuildCorpus({tmp / "missing"}, tmp / "out", 2),
              StatusIs(StatusCode::kNotFound, HasSubstr("missing")));
  EXPECT_FALSE(fs::exists(tmp / "out" / "train.bin"));
}

// The real corpus: the figures the docs quote. Skipped where the packages are not installed.
TEST(CorpusTest, RealFortunes) {
  const fs::path dir = "/usr/share/games/fortunes";
  if (!fs::is_directory(dir)) GTEST_SKIP() << dir << " is absent (install `fortunes`)";
  std::vector<std::string> skipped;
  UCP_ASSERT_OK_AND_ASSIGN(std::vector<fs::path> files, FortuneFiles(dir, &skipped));
  for (const std::string& s : skipped) std::printf("skipped: %s\n", s.c_str());
  TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(CorpusFiles c, BuildCorpus(files, tmp.path()));
  UCP_ASSERT_OK_AND_ASSIGN(TokenFile train, TokenFile::Open(c.train));
  UCP_ASSERT_OK_AND_ASSIGN(TokenFile val, TokenFile::Open(c.val));
  EXPECT_EQ(static_cast<int64_t>(train.tokens().size()), c.train_tokens);
  EXPECT_EQ(static_cast<int64_t>(val.tokens().size()), c.val_tokens);
  const int64_t ends = std::count(train.tokens().begin(), train.tokens().end(), kEndOfText) +
                       std::count(val.tokens().begin(), val.tokens().end(), kEndOfText);
  EXPECT_EQ(ends, c.documents);

  std::array<int64_t, 65536> counts{};
  for (uint16_t t : train.tokens()) ++counts[t];
  uint16_t max_token = 0;
  for (uint16_t t : val.tokens()) max_token = std::max(max_token, t);
  double entropy_nats = 0;
  int distinct = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    if (counts[t] == 0) continue;
    max_token = std::max(max_token, static_cast<uint16_t>(t));
    ++distinct;
    const double p = static_cast<double>(counts[t]) / static_cast<double>(c.train_tokens);
    entropy_nats -= p * std::log(p);
  }
  EXPECT_LT(max_token, 245) << "UTF-8 text must stay below token 245";
  std::printf("fortune files: %zu, skipped: %zu\n", files.size(), skipped.size());
  std::printf("documents: %lld, train tokens: %lld, val tokens: %lld\n",
              static_cast<long long>(c.documents), static_cast<long long>(c.train_tokens),
              static_cast<long long>(c.val_tokens));
  std::printf("train.bin: %lld bytes, val.bin: %lld bytes\n",
              static_cast<long long>(fs::file_size(c.train)),
              static_cast<long long>(fs::file_size(c.val)));
  std::printf("distinct training tokens: %d, max token: %d\n", distinct, int{max_token});
  std::printf("unigram entropy of the training tokens: %.4f nats (%.4f bits)\n", entropy_nats,
              entropy_nats / std::log(2.0));
  EXPECT_GT(c.documents, 1000);
  EXPECT_GT(entropy_nats, 2.0);
  EXPECT_LT(entropy_nats, std::log(245.0));
}

}  // namespace
}  // namespace ucp::offload
