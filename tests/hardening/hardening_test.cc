// Issue 16 #5: a FIFO (or another special file) where a checkpoint file belongs is refused at
// once by every reader, instead of blocking forever in open(2). An alarm turns a regression (a
// hang) into a failure.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>

#include "tests/testutil/status_matchers.h"
#include "tests/testutil/temp_dir.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/hdf5/h5_file.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/torch/torch_file.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;
namespace fs = std::filesystem;

class FifoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fifo_ = tmp_.path() / "mp_rank_00_model_states.pt";
    ASSERT_EQ(::mkfifo(fifo_.c_str(), 0600), 0);
    std::signal(SIGALRM, [](int) {
      static const char kMsg[] = "hardening_test: a reader blocked on a FIFO\n";
      (void)!::write(2, kMsg, sizeof(kMsg) - 1);
      _exit(3);
    });
    ::alarm(20);
  }
  void TearDown() override { ::alarm(0); }

  ucp::testing::TempDir tmp_;
  fs::path fifo_;
};

TEST_F(FifoTest, RawFileRefusesAFifo) {
  EXPECT_THAT(io::RawFile::OpenForRead(fifo_).status(),
              StatusIs(StatusCode::kIoError, HasSubstr("is not a regular file")));
}

TEST_F(FifoTest, ReadFileToStringRefusesAFifo) {
  EXPECT_THAT(io::ReadFileToString(fifo_, 1 << 20).status(),
              StatusIs(StatusCode::kIoError, HasSubstr("is not a regular file")));
}

TEST_F(FifoTest, TorchFileRefusesAFifo) {
  EXPECT_THAT(torch::TorchFile::Open(fifo_).status(),
              StatusIs(StatusCode::kIoError, HasSubstr("is not a regular file")));
}

TEST_F(FifoTest, Hdf5RefusesAFifo) {
  Status s = io::H5File::Open(fifo_).status();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("not a regular file"));
}

}  // namespace
}  // namespace ucp

namespace ucp {
namespace {

// Issue 16 #4: with every file descriptor in use (as under `ulimit -n 32`), opening a healthy
// file is resource_exhausted, never "not an hdf5 file" (data_loss). Runs in a child.
TEST(LowFdLimit, HealthyHdf5FileIsNotReportedAsCorrupt) {
  ucp::testing::TempDir tmp;
  const fs::path file = tmp.path() / "ok.h5";
  {
    UCP_ASSERT_OK_AND_ASSIGN(io::H5File f, io::H5File::Create(file));
    UCP_ASSERT_OK(f.Close());
  }
  UCP_ASSERT_OK(io::H5File::Open(file).status());
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    struct rlimit lim;
    getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = 64;
    setrlimit(RLIMIT_NOFILE, &lim);
    while (::open("/dev/null", O_RDONLY) >= 0) {
    }
    Status h5 = io::H5File::Open(file).status();
    Status raw = io::RawFile::OpenForRead(file).status();
    Status created = io::H5File::Create(file.parent_path() / "new.h5").status();
    if (created.code() != StatusCode::kResourceExhausted) {
      std::fprintf(stderr, "create: %s\n", created.ToString().c_str());
      _exit(1);
    }
    const bool ok = h5.code() == StatusCode::kResourceExhausted &&
                    h5.message().find("not an hdf5 file") == std::string::npos &&
                    raw.code() == StatusCode::kResourceExhausted;
    if (!ok) {
      std::fprintf(stderr, "h5: %s\nraw: %s\n", h5.ToString().c_str(), raw.ToString().c_str());
    }
    _exit(ok ? 0 : 1);
  }
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0);
}

}  // namespace
}  // namespace ucp
