// The root's view of an MPI job's progress (progress.h), with the other process's reports
// delivered when the test says: the orders of arrival that a loaded machine produces.
#include "ucp-cli/progress.h"

#include <gtest/gtest.h>

#include <chrono>
#include <deque>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ucp-cli/output_folder.h"
#include "ucp/base/progress.h"

namespace ucp::cli {
namespace {

// A two-process job seen from its root: the other process's reports are whatever the test
// queued, taken in order by the display.
class TwoProcessRoot final : public api::ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Result<std::string> Broadcast(const std::string& text) override { return text; }
  Result<std::vector<std::string>> Gather(const std::string& text) override {
    return std::vector<std::string>{text};
  }
  bool CarriesProgressReports() const override { return true; }
  std::vector<std::pair<int, std::string>> TakeProgressReports() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<int, std::string>> out(queued_.begin(), queued_.end());
    queued_.clear();
    return out;
  }
  void Arrive(const std::string& report) {
    std::lock_guard<std::mutex> lock(mu_);
    queued_.emplace_back(1, report);
  }

 private:
  std::mutex mu_;
  std::deque<std::pair<int, std::string>> queued_;
};

constexpr int64_t kMiB = 1 << 20;

progress::Snapshot Finished(std::vector<progress::PhaseCount> done, progress::PhaseCount now) {
  progress::Snapshot s;
  s.finished = std::move(done);
  s.phase = now.phase;
  s.done = now.done;
  s.total = now.total;
  s.serial = static_cast<int64_t>(s.finished.size()) + 1;
  return s;
}

// The last line of `phase` in a plain log.
std::string LastLine(const std::string& log, const std::string& phase) {
  std::istringstream in(log);
  std::string line, last;
  while (std::getline(in, line)) {
    if (line.rfind("ucp convert: " + phase, 0) == 0) last = line;
  }
  return last;
}

void Sleep(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

TEST(CombineProgress, AProcessNotHeardFromHoldsTheJobAtItsFirstPhase) {
  const progress::Snapshot root =
      Finished({{"convert", 4, 4}, {"verify", 2, 0}}, {"commit", 0, 0});
  const JobView held = CombineProgress(root, {}, JobState::kSomeUnheard);
  EXPECT_EQ(held.shown, 0u);
  EXPECT_EQ(held.phases[0].total, 4);
  const JobView free = CombineProgress(root, {}, JobState::kRunning);
  EXPECT_EQ(free.shown, 2u);
  // The serial moves when the hold ends, so a display prints the phases it passes.
  EXPECT_NE(held.serial, free.serial);
}

TEST(CombineProgress, TheSlowestProcessHoldsTheJobUntilItEnds) {
  const progress::Snapshot root = Finished({{"convert", 4, 4}}, {"commit", 0, 0});
  const std::map<int, progress::Snapshot> others = {{1, Finished({}, {"convert", 1, 5})}};
  const JobView running = CombineProgress(root, others, JobState::kRunning);
  EXPECT_EQ(running.shown, 0u);
  EXPECT_EQ(running.phases[0].done, 5);
  EXPECT_EQ(running.phases[0].total, 9);
  const JobView ended = CombineProgress(root, others, JobState::kEnded);
  EXPECT_EQ(ended.shown, 1u);
  EXPECT_EQ(ended.phases[0].total, 9);  // its last counts still count
}

// The case that once failed in CI: the root finishes its whole share before the other
// process's first report arrives. Its log must still end each phase on the job's counts.
TEST(ProgressDisplay, ReportsArrivingAfterTheRootFinishedStillGiveTheJobsTotals) {
  TwoProcessRoot job;
  std::ostringstream log;
  {
    ProgressDisplay display(log, "ucp convert", /*terminal=*/false, /*every_s=*/0.05, &job);
    progress::BeginPhase("convert", 3 * kMiB);
    progress::AddBytes(3 * kMiB);
    Sleep(0.3);
    progress::BeginPhase("verify", 0);
    progress::AddBytes(kMiB);
    Sleep(0.3);
    progress::BeginPhase("commit", 0);
    Sleep(0.3);
    // Only now does the other process's first report come, already past its convert share.
    progress::Snapshot other = Finished({{"convert", 5 * kMiB, 5 * kMiB}}, {"verify", kMiB, 0});
    job.Arrive(EncodeProgress(other, false));
    Sleep(0.3);
    other = Finished({{"convert", 5 * kMiB, 5 * kMiB}, {"verify", 2 * kMiB, 0}}, {"commit", 0, 0});
    job.Arrive(EncodeProgress(other, true));
  }
  const std::string text = log.str();
  const std::string convert = LastLine(text, "convert ");
  EXPECT_NE(convert.find(HumanBytes(8 * kMiB) + " of " + HumanBytes(8 * kMiB) + " (100%)"),
            std::string::npos)
      << text;
  // Before the report came, the lines said whose counts they held, with no percentage.
  EXPECT_EQ(text.find(HumanBytes(3 * kMiB) + " of " + HumanBytes(3 * kMiB) + " ("),
            std::string::npos)
      << "a line gave the root's share as the job's:\n" << text;
  EXPECT_NE(text.find(HumanBytes(3 * kMiB) + " of " + HumanBytes(3 * kMiB) +
                      " from 1 of 2 processes\n"),
            std::string::npos)
      << text;
  EXPECT_NE(LastLine(text, "verify ").find(HumanBytes(3 * kMiB)), std::string::npos) << text;
  EXPECT_NE(LastLine(text, "commit"), "") << text;
}

// A process that never reports (it died, or its reports were lost) costs the root's display a
// bounded wait, and the log still goes through every phase the root went through.
TEST(ProgressDisplay, AProcessThatNeverReportsStillLetsTheLogReachTheEnd) {
  TwoProcessRoot job;
  std::ostringstream log;
  const auto start = std::chrono::steady_clock::now();
  {
    ProgressDisplay display(log, "ucp convert", /*terminal=*/false, /*every_s=*/0.05, &job);
    progress::BeginPhase("convert", 3 * kMiB);
    progress::AddBytes(3 * kMiB);
    Sleep(0.3);
    progress::BeginPhase("verify", 0);
    Sleep(0.3);
    progress::BeginPhase("commit", 0);
    Sleep(0.2);
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 10.0);
  const std::string text = log.str();
  EXPECT_NE(LastLine(text, "convert ").find(HumanBytes(3 * kMiB) + " of " + HumanBytes(3 * kMiB)),
            std::string::npos)
      << text;
  EXPECT_NE(LastLine(text, "verify"), "") << text;
  EXPECT_NE(LastLine(text, "commit"), "") << text;
}

}  // namespace
}  // namespace ucp::cli
