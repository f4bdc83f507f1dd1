// What a running checkpoint command shows on stderr while it works, and what it reports at the
// end (docs/cli.md, "Progress and summaries"). The library counts bytes per phase
// (ucp/base/progress.h: "verify" the source's checksum pass, "convert" the executor's streaming,
// "commit"); a ProgressDisplay thread reads the counters and draws one line redrawn in place on
// a terminal, or prints a plain line every few seconds (and at each phase change) when stderr is
// a file or a pipe (logs, Slurm, mpirun). Under MPI only the root draws, and it counts its own
// share of the job.
#pragma once

#include <atomic>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <thread>

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

class ProgressDisplay {
 public:
  /// Starts drawing on `err` (`terminal`: redraw in place; else a line every `every_s` seconds).
  ProgressDisplay(std::ostream& err, std::string label, bool terminal, double every_s = 5.0);
  /// Stops; a terminal's line is cleared so what follows starts on a clean line.
  ~ProgressDisplay();
  ProgressDisplay(const ProgressDisplay&) = delete;
  ProgressDisplay& operator=(const ProgressDisplay&) = delete;

 private:
  void Loop();
  std::ostream& err_;
  std::string label_;
  bool terminal_;
  double every_s_;
  std::atomic<bool> stop_{false};
  bool drew_ = false;
  std::thread thread_;
};

}  // namespace ucp::cli
