// Issue 16 #3 and #10: a full disk. Each writer (H5File, UniversalWriter, DistWriter) writes onto
// a 2 MiB tmpfs until it fails; the failure must be one io_error line, and the process must then
// exit normally: HDF5's exit handlers used to crash (SIGSEGV in H5F__close_cb) on a file whose
// flush or close had failed. The writes run in a forked child that returns from its body with
// std::exit, so the exit handlers run as they do in `ucp`; the parent asserts a clean exit 0.
// Mounting needs root (CAP_SYS_ADMIN); elsewhere the tests are skipped, saying why.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "tests/testutil/temp_dir.h"
#include "ucp/dist/dist_checkpoint.h"
#include "ucp/io/hdf5/h5_file.h"
#include "ucp/io/universal/universal_checkpoint.h"
#include "ucp/tensor/tensor.h"

namespace ucp {
namespace {
namespace fs = std::filesystem;

class FullDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    mnt_ = tmp_.path() / "mnt";
    fs::create_directory(mnt_);
    if (::mount("tmpfs", mnt_.c_str(), "tmpfs", 0, "size=2m") != 0) {
      GTEST_SKIP() << "cannot mount a 2 MiB tmpfs at " << mnt_ << " (needs root or "
                   << "CAP_SYS_ADMIN): " << std::strerror(errno);
    }
    mounted_ = true;
  }
  void TearDown() override {
    if (mounted_) ::umount2(mnt_.c_str(), MNT_DETACH);
  }

  // Runs `body` in a child that then calls std::exit(body's code), running the exit handlers.
  // Returns the child's raw wait status.
  static int RunInChild(const std::function<int()>& body) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) std::exit(body());
    int st = 0;
    ::waitpid(pid, &st, 0);
    return st;
  }

  static void ExpectCleanExit(int st) {
    ASSERT_FALSE(WIFSIGNALED(st)) << "the child died by signal " << WTERMSIG(st)
                                  << " (HDF5's exit handlers on a failed file)";
    ASSERT_TRUE(WIFEXITED(st));
    EXPECT_EQ(WEXITSTATUS(st), 0) << "the child's checks failed (see its stderr)";
  }

  // Checks a failure is one io_error line; prints it otherwise. Returns 0 when it is.
  static int CheckIoErrorLine(const Status& s, const char* what) {
    if (std::getenv("UCP_TEST_VERBOSE")) std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    if (s.code() == StatusCode::kIoError && s.message().find('\n') == std::string::npos) return 0;
    std::fprintf(stderr, "%s: want one io_error line, got: %s\n", what, s.ToString().c_str());
    return 1;
  }

  // Fills the filesystem up to ENOSPC with one file, then frees `leave_bytes` of it.
  void FillDisk(int64_t leave_bytes = 0) const {
    const fs::path filler = mnt_ / "filler";
    {
      std::ofstream f(filler, std::ios::binary);
      std::vector<char> block(4096, 'x');
      while (f.write(block.data(), block.size())) {
      }
    }
    std::error_code ec;
    const auto size = static_cast<int64_t>(fs::file_size(filler, ec));
    fs::resize_file(filler, static_cast<uintmax_t>(std::max<int64_t>(0, size - leave_bytes)), ec);
  }

  ucp::testing::TempDir tmp_;
  fs::path mnt_;
  bool mounted_ = false;
};

Tensor Ones(int64_t n) {
  auto t = Tensor::Zeros(DType::kFp32, Shape{n});
  return std::move(t).value();
}

TEST_F(FullDiskTest, Hdf5DataWriteFailureExitsCleanly) {
  ExpectCleanExit(RunInChild([&] {
    auto f = io::H5File::Create(mnt_ / "a.h5");
    if (!f.ok()) return CheckIoErrorLine(f.status(), "create");
    Tensor t = Ones(64 << 10);  // 256 KiB per dataset
    for (int i = 0; i < 64; ++i) {
      Status s = f->WriteDataset("d" + std::to_string(i), t.view());
      if (!s.ok()) return CheckIoErrorLine(s, "write");  // the file closes in its destructor
    }
    std::fprintf(stderr, "64 datasets of 256 KiB fit in a 2 MiB tmpfs\n");
    return 1;
  }));
}

TEST_F(FullDiskTest, Hdf5FlushFailureAtCloseExitsCleanly) {
  ExpectCleanExit(RunInChild([&] {
    auto f = io::H5File::Create(mnt_ / "a.h5");
    if (!f.ok()) return CheckIoErrorLine(f.status(), "create");
    FillDisk();  // after the superblock is written: the cached metadata has nowhere to go
    for (int i = 0; i < 200; ++i) {
      Status s = f->WriteInt64Attribute("", "attribute_" + std::to_string(i), i);
      if (!s.ok()) return CheckIoErrorLine(s, "attribute");
    }
    Status s = f->Close();  // the metadata cache's flush hits ENOSPC
    if (s.ok()) {
      std::fprintf(stderr, "closing an hdf5 file on a full disk succeeded\n");
      return 1;
    }
    return CheckIoErrorLine(s, "close");
  }));
}

TEST_F(FullDiskTest, UniversalWriterFailsCleanlyAndLeavesNothing) {
  ExpectCleanExit(RunInChild([&] {
    auto w = io::UniversalWriter::Create(mnt_ / "out", {});
    if (!w.ok()) return CheckIoErrorLine(w.status(), "create");
    Tensor t = Ones(32 << 10);  // 128 KiB per state
    Status s;
    for (int i = 0; i < 64 && s.ok(); ++i) {
      io::UniversalParamInfo meta;
      meta.name = "p" + std::to_string(i);
      meta.shape = Shape{32 << 10};
      std::vector<io::NamedState> states = {{"fp32", t.view()}, {"exp_avg", t.view()}};
      s = w->WriteParameter(meta, states);
    }
    if (s.ok()) return 1;
    if (int rc = CheckIoErrorLine(s, "write parameter")) return rc;
    { auto gone = std::move(*w); }  // removes the temporary folder
    if (!fs::is_empty(mnt_)) {
      std::fprintf(stderr, "the failed write left files behind\n");
      return 1;
    }
    return 0;
  }));
}

// The disk fills at every stage of a parameter file: creation, metadata, data, flush at close.
TEST_F(FullDiskTest, UniversalWriterOnAFullDiskAtEveryStageExitsCleanly) {
  ExpectCleanExit(RunInChild([&] {
    Tensor t = Ones(4 << 10);  // 16 KiB per state
    for (int64_t gap = 0; gap <= (64 << 10); gap += 2048) {
      const fs::path out = mnt_ / ("out" + std::to_string(gap));
      auto w = io::UniversalWriter::Create(out, {});
      if (!w.ok()) {
        if (int rc = CheckIoErrorLine(w.status(), "create")) return rc;
        continue;
      }
      FillDisk(gap);
      Status s;
      for (int i = 0; i < 8 && s.ok(); ++i) {
        io::UniversalParamInfo meta;
        meta.name = "p" + std::to_string(i);
        meta.shape = Shape{4 << 10};
        std::vector<io::NamedState> states = {{"fp32", t.view()}, {"exp_avg", t.view()}};
        s = w->WriteParameter(meta, states);
      }
      if (s.ok()) continue;
      if (int rc = CheckIoErrorLine(s, "write parameter")) return rc;
    }
    return 0;
  }));
}

TEST_F(FullDiskTest, DistWriterFailsCleanlyAndLeavesNothing) {
  ExpectCleanExit(RunInChild([&] {
    std::vector<dist::DistTensorDecl> decls;
    for (int r = 0; r < 2; ++r) {
      for (int i = 0; i < 16; ++i) {
        decls.push_back({r, "t" + std::to_string(i), DType::kFp32, Shape{32 << 10}});
      }
    }
    auto w = dist::DistWriter::Create(mnt_ / "out", 2, decls);
    if (!w.ok()) return CheckIoErrorLine(w.status(), "create");
    Tensor t = Ones(32 << 10);
    Status s;
    for (const auto& d : decls) {
      s = w->WriteTensor(d.rank, d.name, t.view());
      if (!s.ok()) break;
    }
    if (s.ok()) return 1;
    if (int rc = CheckIoErrorLine(s, "write tensor")) return rc;
    { auto gone = std::move(*w); }
    if (!fs::is_empty(mnt_)) {
      std::fprintf(stderr, "the failed write left files behind\n");
      return 1;
    }
    return 0;
  }));
}

}  // namespace
}  // namespace ucp
