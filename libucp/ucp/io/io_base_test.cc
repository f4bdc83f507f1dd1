// Tests of atomic files and folders, safe names and checksums.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/checksum.h"
#include "ucp/io/interrupt.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/safe_name.h"

namespace ucp::io {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
using ::ucp::testing::TempDir;

TEST(Checksum, KnownVectorsAndFormat) {
  // XXH3-64 of the empty input with seed 0, from the xxHash specification's test vectors.
  EXPECT_EQ(Xxh3_64({}), 0x2D06800538D394C2ull);
  EXPECT_EQ(FormatXxh3(0x2D06800538D394C2ull), "xxh3-64:2d06800538d394c2");
  UCP_ASSERT_OK_AND_ASSIGN(uint64_t v, ParseXxh3("xxh3-64:2d06800538d394c2", "checksum"));
  EXPECT_EQ(v, 0x2D06800538D394C2ull);
  EXPECT_THAT(ParseXxh3("xxh3-64:2D06800538D394C2", "states[0].checksum"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("states[0].checksum")));
  EXPECT_THAT(ParseXxh3("crc32:00000000", "c"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("xxh3-64:")));
  EXPECT_THAT(ParseXxh3("xxh3-64:2d06", "c"), StatusIs(StatusCode::kDataLoss, HasSubstr("16")));
}

TEST(Checksum, IncrementalEqualsOneShot) {
  std::vector<std::byte> data(100003);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 131 + 7);
  Xxh3Hasher h;
  h.Update(std::span(data).first(1));
  h.Update(std::span(data).subspan(1, 5000));
  h.Update(std::span(data).subspan(5001));
  EXPECT_EQ(h.Digest(), Xxh3_64(data));
  EXPECT_NE(Xxh3_64(std::span(data).first(100002)), Xxh3_64(data));
}

TEST(SafeName, EscapesEverythingOutsideTheSafeSet) {
  UCP_ASSERT_OK_AND_ASSIGN(auto a, EscapeName("layers.0.attn-qkv_weight"));
  EXPECT_EQ(a, "layers.0.attn-qkv_weight");
  UCP_ASSERT_OK_AND_ASSIGN(auto b, EscapeName("../x/y%z é"));
  EXPECT_EQ(b, "..%2Fx%2Fy%25z%20%C3%A9");
  UCP_ASSERT_OK_AND_ASSIGN(auto f, ParamFileName("a/b"));
  EXPECT_EQ(f, "params/a%2Fb.h5");
  EXPECT_THAT(EscapeName(""), StatusIs(StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(EscapeName("."), StatusIs(StatusCode::kInvalidArgument, HasSubstr("'.'")));
  EXPECT_THAT(EscapeName(".."), StatusIs(StatusCode::kInvalidArgument, HasSubstr("'..'")));
}

TEST(SafeName, LongNamesAreCutAndStayDistinct) {
  std::string n1(300, 'a'), n2(300, 'a');
  n2.back() = 'b';
  UCP_ASSERT_OK_AND_ASSIGN(auto e1, EscapeName(n1));
  UCP_ASSERT_OK_AND_ASSIGN(auto e2, EscapeName(n2));
  EXPECT_LE(e1.size(), 200u);
  EXPECT_NE(e1, e2);
  // A cut never splits a %XX escape.
  // 182 safe bytes then "%2F..." : the cut at 183 would split "%2F", so it backs off to 182.
  UCP_ASSERT_OK_AND_ASSIGN(auto e3, EscapeName(std::string(182, 'a') + std::string(50, '/')));
  EXPECT_EQ(e3.substr(0, 182), std::string(182, 'a'));
  EXPECT_EQ(e3[182], '~');
}

TEST(SafeName, RelativePathsMustStayInside) {
  TempDir dir;
  fs::create_directories(dir / "params");
  UCP_EXPECT_OK(ResolveInside(dir.path(), "params/a.h5", "file").status());
  EXPECT_THAT(
      ResolveInside(dir.path(), "/etc/passwd", "params[0].file"),
      StatusIs(StatusCode::kDataLoss, HasSubstr("params[0].file '/etc/passwd' is an absolute")));
  EXPECT_THAT(ResolveInside(dir.path(), "params/../../x", "file"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("'..'")));
  EXPECT_THAT(ResolveInside(dir.path(), "params//a", "file"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("empty path component")));
  EXPECT_THAT(ResolveInside(dir.path(), "", "file"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("empty")));
  // A symlink inside the folder that leads outside it.
  fs::create_directory_symlink("/tmp", dir / "params" / "out");
  EXPECT_THAT(ResolveInside(dir.path(), "params/out/x.h5", "file"),
              StatusIs(StatusCode::kDataLoss, HasSubstr("outside the checkpoint folder")));
}

TEST(AtomicFile, WritesAndReplacesWithoutLeftovers) {
  TempDir dir;
  const fs::path p = dir / "m.json";
  UCP_ASSERT_OK(WriteFileAtomic(p, std::string_view("first")));
  UCP_ASSERT_OK(WriteFileAtomic(p, std::string_view("second")));
  UCP_ASSERT_OK_AND_ASSIGN(std::string text, ReadFileToString(p, 100));
  EXPECT_EQ(text, "second");
  int entries = 0;
  for (auto& e : fs::directory_iterator(dir.path())) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 1);
  EXPECT_THAT(ReadFileToString(p, 3),
              StatusIs(StatusCode::kResourceExhausted, HasSubstr("6 bytes")));
  EXPECT_THAT(ReadFileToString(dir / "none", 3),
              StatusIs(StatusCode::kNotFound, HasSubstr("none")));
  EXPECT_THAT(WriteFileAtomic(dir / "no" / "x", std::string_view("a")),
              StatusIs(StatusCode::kIoError, HasSubstr("temporary file")));
}

TEST(AtomicFile, TempSiblingAndNoReplaceRename) {
  TempDir dir;
  const fs::path dst = dir / "ckpt";
  UCP_ASSERT_OK_AND_ASSIGN(fs::path tmp, MakeTempSiblingDir(dst));
  EXPECT_TRUE(IsTempName(tmp.filename().string()));
  EXPECT_EQ(tmp.parent_path(), dst.parent_path());
  std::ofstream(tmp / "f") << "x";
  UCP_ASSERT_OK(FsyncTree(tmp));
  UCP_ASSERT_OK(RenameNoReplace(tmp, dst));
  EXPECT_TRUE(fs::exists(dst / "f"));
  UCP_ASSERT_OK_AND_ASSIGN(fs::path tmp2, MakeTempSiblingDir(dst));
  EXPECT_THAT(RenameNoReplace(tmp2, dst),
              StatusIs(StatusCode::kAlreadyExists, HasSubstr("never overwrites")));
  EXPECT_TRUE(fs::exists(tmp2));
  RemoveTreeBestEffort(tmp2);
  EXPECT_FALSE(fs::exists(tmp2));
  EXPECT_THAT(MakeTempSiblingDir(dir / "no" / "ckpt"),
              StatusIs(StatusCode::kNotFound, HasSubstr("parent folder")));
  EXPECT_FALSE(IsTempName("ckpt"));
}

// The soft open-file limit is raised as far as the hard limit allows, the raised limit really
// lets that many files open, and a need beyond the hard limit is refused with the numbers.
// Issue 16 #10: outputs honour the umask (mkstemp's 0600 and mkdtemp's 0700 used to stay).
TEST(AtomicFile, ModesHonourTheUmask) {
  TempDir tmp;
  for (mode_t mask : {mode_t{022}, mode_t{027}, mode_t{077}, mode_t{002}}) {
    const mode_t old = ::umask(mask);
    EXPECT_EQ(ProcessUmask(), mask);
    const fs::path file = tmp.path() / ("f" + std::to_string(mask));
    Status written = WriteFileAtomic(file, std::string_view("x"));
    auto dir = MakeTempSiblingDir(tmp.path() / ("d" + std::to_string(mask)));
    ::umask(old);
    UCP_ASSERT_OK(written);
    UCP_ASSERT_OK(dir.status());
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0666 & ~mask) << "umask " << std::oct << mask;
    ASSERT_EQ(::stat(dir->c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0777 & ~mask) << "umask " << std::oct << mask;
  }
}

// Issue 16 #10: `out/` names the folder `out`: its temporary sibling sits next to it (not inside
// a folder `out` that would then "already exist"), and the rename lands on `out`.
TEST(AtomicFile, TrailingSlashNamesTheFolder) {
  TempDir tmp;
  const fs::path dst = tmp.path() / "out";
  EXPECT_EQ(WithoutTrailingSlash(fs::path("a/b//")), fs::path("a/b"));
  EXPECT_EQ(WithoutTrailingSlash(fs::path("/")), fs::path("/"));
  UCP_ASSERT_OK_AND_ASSIGN(fs::path t, MakeTempSiblingDir(fs::path(dst.string() + "/")));
  EXPECT_EQ(t.parent_path(), tmp.path());
  EXPECT_FALSE(fs::exists(dst));
  UCP_ASSERT_OK(RenameNoReplace(t, fs::path(dst.string() + "/")));
  EXPECT_TRUE(fs::is_directory(dst));
}

// What SIGINT/SIGTERM remove (interrupt.h): the live temporaries, never a committed output.
TEST(Interrupt, RemovesLiveTemporariesOnlyAndTheirContent) {
  RemoveRegisteredTempPathsForTest();  // what earlier tests left recorded (their folders are gone)
  TempDir tmp;
  UCP_ASSERT_OK_AND_ASSIGN(fs::path live, MakeTempSiblingDir(tmp / "live"));
  fs::create_directories(live / "sub");
  std::ofstream(live / "sub" / "f.h5") << "data";
  UCP_ASSERT_OK_AND_ASSIGN(fs::path done, MakeTempSiblingDir(tmp / "done"));
  UCP_ASSERT_OK(RenameNoReplace(done, tmp / "done"));
  UCP_ASSERT_OK_AND_ASSIGN(fs::path failed, MakeTempSiblingDir(tmp / "failed"));
  RemoveTreeBestEffort(failed);
  UCP_ASSERT_OK(WriteFileAtomic(tmp / "done" / "latest", "tag"));
  // A folder joined from another process (MPI): registered by name, removed all the same.
  const fs::path joined = tmp / "joined.tmp-abcdef";
  fs::create_directories(joined / "x");
  RegisterTempPath(joined);
  EXPECT_EQ(RemoveRegisteredTempPathsForTest(), 2);
  EXPECT_FALSE(fs::exists(live));
  EXPECT_FALSE(fs::exists(joined));
  EXPECT_TRUE(fs::exists(tmp / "done" / "latest"));
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(tmp.path())) left.push_back(e.path().filename());
  EXPECT_THAT(left, ::testing::UnorderedElementsAre("done"));
  EXPECT_EQ(InterruptExitCode(2), 130);
  EXPECT_EQ(InterruptExitCode(15), 143);
}

// A temporary is created and recorded in one step: a cleanup that starts while it is being
// created waits for it and removes it (no window in which a signal finds nothing to remove and
// the new folder stays behind); a failed creation records nothing.
TEST(Interrupt, CreationAndRecordingAreOneStep) {
  RemoveRegisteredTempPathsForTest();
  TempDir tmp;
  std::atomic<bool> cleaned{false};
  std::thread cleanup;
  std::string templ = (tmp / "out").string() + ".tmp-XXXXXX";
  const int err = CreateRegisteredTempPath(templ, [&](std::string& t) {
    cleanup = std::thread([&] {
      RemoveRegisteredTempPathsForTest();
      cleaned = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(cleaned.load()) << "the cleanup ran while the folder was being created";
    return ::mkdtemp(t.data()) == nullptr ? errno : 0;
  });
  cleanup.join();
  EXPECT_EQ(err, 0);
  EXPECT_TRUE(cleaned.load());
  EXPECT_FALSE(fs::exists(templ)) << "created, then left behind by the cleanup";
  std::string bad = (tmp / "missing" / "x").string() + ".tmp-XXXXXX";
  EXPECT_EQ(CreateRegisteredTempPath(bad, [](std::string& t) {
              return ::mkdtemp(t.data()) == nullptr ? errno : 0;
            }),
            ENOENT);
  EXPECT_EQ(RemoveRegisteredTempPathsForTest(), 0);
}

TEST(OpenFileLimit, RaisesTheSoftLimitUpToTheHardOne) {
  struct rlimit before {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  if (before.rlim_max == RLIM_INFINITY || before.rlim_max < 600) GTEST_SKIP() << "hard limit";
  struct rlimit low = before;
  low.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  UCP_ASSERT_OK(io::EnsureOpenFileLimit(400));
  struct rlimit now {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &now), 0);
  EXPECT_GE(now.rlim_cur, 400u);
  std::vector<int> fds;
  for (int i = 0; i < 400; ++i) {
    const int fd = ::open("/dev/null", O_RDONLY);
    ASSERT_GE(fd, 0) << "open " << i;
    fds.push_back(fd);
  }
  for (int fd : fds) ::close(fd);
  EXPECT_THAT(io::EnsureOpenFileLimit(static_cast<int64_t>(before.rlim_max) + 1),
              StatusIs(StatusCode::kResourceExhausted, HasSubstr("raise ulimit -n")));
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
}

}  // namespace
}  // namespace ucp::io
