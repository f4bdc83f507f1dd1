// What a running checkpoint command shows on stderr while it works, and what it reports at the
// end (docs/cli.md, "Progress and summaries"). The library counts bytes per phase
// (ucp/base/progress.h: "verify" the source's checksum pass, "convert" the executor's streaming,
// "commit"); a ProgressDisplay thread reads the counters and draws one line redrawn in place on
// a terminal, or prints a plain line every few seconds (and at each phase change) when stderr is
// a file or a pipe (logs, Slurm, mpirun). Under MPI only the root draws, and for the commands
// whose processes share one job (generate, convert, extract, reshard) it shows the whole job:
// the other processes' ProgressReporter threads post their counters to it over the group's
// report channel (api::ProcessGroup::PostProgressReport), and the root adds them up.
#pragma once

#include <atomic>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "ucp/api/process_group.h"
#include "ucp/base/progress.h"

namespace ucp::cli {

/// The end-of-run facts a command reports (text or, with --json, fields).
struct RunSummary {
  std::string format;       ///< written format
  std::string layout;       ///< written layout
  int64_t files = 0;        ///< files in the output
  int64_t bytes = 0;        ///< bytes of the output's files
  double elapsed_s = 0;     ///< wall time of the command
  int64_t peak_rss_bytes = 0;  ///< getrusage(RUSAGE_SELF).ru_maxrss
};

/// This process's peak resident memory so far (getrusage maxrss), in bytes.
int64_t PeakRssBytes();

/// Files and bytes under `root` (the output's size for the summary).
void CountTree(const std::string& root, int64_t& files, int64_t& bytes);

/// A duration as "m:ss" (or "h:mm:ss"), for an ETA.
std::string Duration(double seconds);

/// The seconds between two plain progress lines: env UCP_PROGRESS_EVERY when it is a number
/// in [0.05, 3600], else 5.
double PlainLineInterval();

/// A process's counters as one report (lines "P<TAB>phase<TAB>done<TAB>total" for the finished
/// phases, oldest first, then "C<TAB>..." for the current one, and "E" once it reports no more).
std::string EncodeProgress(const progress::Snapshot& s, bool last);
/// The inverse; false for a malformed report (then ignored).
bool DecodeProgress(const std::string& text, progress::Snapshot& out, bool& last);

/// One phase of a job as its root sees it: the bytes of every process in that phase.
struct JobPhase {
  std::string phase;
  int64_t done = 0;
  int64_t total = 0;
};
/// The job's phases in the root's order (its finished phases, then its current one), each with
/// the sum over `root` and `others` of that phase's counts (a phase's k-th occurrence matched by
/// name and k), and `shown`: the phase the job is in, the earliest one any process is still in.
struct JobView {
  std::vector<JobPhase> phases;
  size_t shown = 0;
  int64_t serial = 0;  ///< changes when `shown` does
};
/// What the root knows of the other processes when it combines their counts.
enum class JobState {
  kRunning,      ///< every process has reported a phase: the job is in the earliest one
  kSomeUnheard,  ///< a process has not reported a phase yet: the job is at its first phase
  kEnded,        ///< the operation is over everywhere: the job is in the root's last phase
};
JobView CombineProgress(const progress::Snapshot& root,
                        const std::map<int, progress::Snapshot>& others,
                        JobState state = JobState::kRunning);

/// Not the root: posts this process's counters to the root every `every_s` seconds (when they
/// changed) until destroyed, then a last report, waiting a moment for it to leave.
class ProgressReporter {
 public:
  ProgressReporter(api::ProcessGroup& group, double every_s = 0.25);
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

 private:
  void Loop();
  api::ProcessGroup& group_;
  double every_s_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class ProgressDisplay {
 public:
  /// Starts drawing on `err` (`terminal`: redraw in place; else a line every `every_s` seconds,
  /// one at each phase change and a last one of each phase's final counts). With `job` (the
  /// root of a group that carries progress reports) the counts are the whole job's.
  ProgressDisplay(std::ostream& err, std::string label, bool terminal,
                  double every_s = PlainLineInterval(), api::ProcessGroup* job = nullptr);
  /// Stops (the root of a job first waits up to 6 s for every process's last report); a
  /// terminal's line is cleared so what follows starts on a clean line.
  ~ProgressDisplay();
  ProgressDisplay(const ProgressDisplay&) = delete;
  ProgressDisplay& operator=(const ProgressDisplay&) = delete;

 private:
  void Loop();
  // This process's counters, and the others' reports when a job's root (`ended`: the
  // operation is over, so no process holds the job in an earlier phase).
  JobView View(bool ended);
  std::string Line(const JobPhase& p, double secs) const;
  std::ostream& err_;
  std::string label_;
  bool terminal_;
  double every_s_;
  api::ProcessGroup* job_;
  std::map<int, progress::Snapshot> others_;  // the latest report of each other process
  std::map<int, bool> ended_;                 // the processes whose last report came
  std::atomic<int> ended_count_{0};
  int unheard_ = 0;  // other processes not heard from in any phase yet (the display thread's)
  std::atomic<bool> stop_{false};
  bool drew_ = false;
  std::thread thread_;
};

}  // namespace ucp::cli
