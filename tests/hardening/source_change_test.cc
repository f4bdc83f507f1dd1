// Issue 16 #8: a source modified during a run used to yield an output that verifies but differs
// from the checksummed source. Each reader remembers the identity (device, inode, size, mtime)
// of the files it read and reports data_loss, naming the file, when one changed before commit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/torch/torch_file.h"
#include "ucp/io/universal/universal_checkpoint.h"

namespace ucp {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

void WriteText(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

// Moves a file's mtime one second forward, as a write in place of the same size would.
void Touch(const fs::path& p) {
  struct stat st {};
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  struct timespec times[2] = {st.st_atim, st.st_mtim};
  times[1].tv_sec += 1;
  ASSERT_EQ(::utimensat(AT_FDCWD, p.c_str(), times, 0), 0);
}

TEST(SourceChange, RawFileCacheSeesSizeMtimeAndReplacement) {
  ucp::testing::TempDir tmp;
  const fs::path a = tmp.path() / "a.bin", b = tmp.path() / "b.bin", c = tmp.path() / "c.bin";
  WriteText(a, "aaaa");
  WriteText(b, "bbbb");
  WriteText(c, "cccc");
  io::RawFileCache cache(1);  // capacity 1: reopening after eviction is checked too
  UCP_ASSERT_OK(cache.Get(a).status());
  UCP_ASSERT_OK(cache.Get(b).status());
  UCP_ASSERT_OK(cache.Note(c));
  UCP_EXPECT_OK(cache.CheckUnchanged());
  WriteText(a, "aaaaa");
  EXPECT_THAT(cache.CheckUnchanged(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("a.bin changed while ucp was reading it "
                                                        "(size 4 -> 5 bytes)")));
  EXPECT_THAT(cache.Get(a).status(), StatusIs(StatusCode::kDataLoss, HasSubstr("a.bin")));
  io::RawFileCache same_size;
  UCP_ASSERT_OK(same_size.Get(b).status());
  Touch(b);  // rewritten in place, same size
  EXPECT_THAT(same_size.CheckUnchanged(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("b.bin changed while ucp was reading it "
                                                        "(modified: mtime moved by 1000000000 ns)")));
}

TEST(SourceChange, RawFileCacheSeesAFileReplacedOrRemoved) {
  ucp::testing::TempDir tmp;
  const fs::path a = tmp.path() / "a.bin";
  WriteText(a, "aaaa");
  io::RawFileCache cache;
  UCP_ASSERT_OK(cache.Get(a).status());
  WriteText(tmp.path() / "new", "aaaa");
  fs::rename(tmp.path() / "new", a);
  EXPECT_THAT(cache.CheckUnchanged(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("replaced by another file")));
  fs::remove(a);
  EXPECT_THAT(cache.CheckUnchanged(), StatusIs(StatusCode::kDataLoss, HasSubstr("(removed)")));
}

TEST(SourceChange, UniversalReaderReportsAChangedParameterFile) {
  ucp::testing::TempDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  {
    UCP_ASSERT_OK_AND_ASSIGN(io::UniversalWriter w, io::UniversalWriter::Create(dir, {}));
    UCP_ASSERT_OK_AND_ASSIGN(Tensor t, Tensor::Zeros(DType::kFp32, Shape{16}));
    io::UniversalParamInfo meta;
    meta.name = "w";
    meta.shape = Shape{16};
    std::vector<io::NamedState> states = {{"fp32", t.view()}};
    UCP_ASSERT_OK(w.WriteParameter(meta, states));
    io::UniversalManifest header;
    header.optimizer_kind = "adam";
    UCP_ASSERT_OK(w.Commit(header));
  }
  UCP_ASSERT_OK_AND_ASSIGN(io::UniversalReader r, io::UniversalReader::Open(dir));
  UCP_ASSERT_OK(r.ReadState("w", "fp32").status());
  UCP_EXPECT_OK(r.CheckSourcesUnchanged());
  const fs::path file = dir / r.FindParam("w").value()->file;
  Touch(file);
  EXPECT_THAT(r.CheckSourcesUnchanged(),
              StatusIs(StatusCode::kDataLoss, HasSubstr(file.string() + " changed")));
}

TEST(SourceChange, TorchFileReportsAChange) {
  ucp::testing::TempDir tmp;
  const fs::path file = tmp.path() / "expected.pt";
  fs::copy_file(fs::path(UCP_SOURCE_ROOT_DIR) / "tests/data/deepspeed/expected.pt", file);
  UCP_ASSERT_OK_AND_ASSIGN(torch::TorchFile f, torch::TorchFile::Open(file));
  UCP_EXPECT_OK(f.CheckSourceUnchanged());
  Touch(file);
  EXPECT_THAT(f.CheckSourceUnchanged(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("expected.pt changed")));
}

}  // namespace
}  // namespace ucp
