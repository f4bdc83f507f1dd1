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
#include "ucp/api/checkpoint.h"
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

// Moves the mtime of every regular file under `dir` forward.
void TouchAll(const fs::path& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) Touch(e.path());
  }
}

// Runs an extraction of `src_dir` that changes every source file at its first progress report,
// i.e. after reading began and before the commit: each api source (ucp, DeepSpeed, HF) must
// forward the executor's pre-commit identity check, so the run fails and nothing is committed.
void ExpectExtractFailsWhenSourceChanges(const fs::path& src_dir, const fs::path& dst) {
  UCP_ASSERT_OK_AND_ASSIGN(auto src, api::CheckpointSource::Open(src_dir, api::UcpDataDir()));
  api::RunOptions options;
  bool touched = false;
  options.progress = [&](int64_t, int64_t) {
    if (!touched) TouchAll(src_dir);
    touched = true;
  };
  EXPECT_THAT(api::Extract(*src, dst, options).status(),
              StatusIs(StatusCode::kDataLoss, HasSubstr("changed while ucp was reading it")))
      << src->meta().format;
  EXPECT_TRUE(touched);
  EXPECT_FALSE(fs::exists(dst));
  // The same source, unchanged since it was opened, extracts.
  UCP_ASSERT_OK_AND_ASSIGN(auto again, api::CheckpointSource::Open(src_dir, api::UcpDataDir()));
  UCP_EXPECT_OK(api::Extract(*again, dst, {}).status());
}

TEST(SourceChange, UcpSourceFailsTheRun) {
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(auto m, api::LoadResolvedModel(api::UcpDataDir(), "gpt-tiny", ""));
  UCP_ASSERT_OK_AND_ASSIGN(layout::Layout l, layout::ParseLayout("tp=2,pp=2,dp=1"));
  UCP_ASSERT_OK(api::Generate(m.first, m.second, l, 1, tmp.path() / "ucp", {}).status());
  ExpectExtractFailsWhenSourceChanges(tmp.path() / "ucp", tmp.path() / "out");
}

TEST(SourceChange, DeepSpeedSourceFailsTheRun) {
  ucp::testing::TempDir tmp;
  const fs::path ck = tmp.path() / "ds";
  fs::copy(fs::path(UCP_SOURCE_ROOT_DIR) / "tests/data/deepspeed/megatron_tp2_pp1_dp2_bf16", ck,
           fs::copy_options::recursive);
  ExpectExtractFailsWhenSourceChanges(ck, tmp.path() / "out");
}

TEST(SourceChange, HfSourceFailsTheRun) {
  ucp::testing::TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(auto m, api::LoadResolvedModel(api::UcpDataDir(), "llama-tiny", ""));
  UCP_ASSERT_OK(api::Generate(m.first, m.second, layout::UniversalLayout(), 1,
                              tmp.path() / "universal", {})
                    .status());
  UCP_ASSERT_OK_AND_ASSIGN(auto universal,
                           api::CheckpointSource::Open(tmp.path() / "universal", api::UcpDataDir()));
  api::WriteRequest request;
  request.layout = layout::UniversalLayout();
  UCP_ASSERT_OK(api::WriteCheckpoint(*universal, "hf", tmp.path() / "hf", request).status());
  ExpectExtractFailsWhenSourceChanges(tmp.path() / "hf", tmp.path() / "out");
}

}  // namespace
}  // namespace ucp
