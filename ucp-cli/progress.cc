// The progress line and the summary's measurements (progress.h).
#include "ucp-cli/progress.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <ostream>
#include <system_error>

#include "ucp-cli/output_folder.h"
#include "ucp/base/progress.h"

namespace ucp::cli {
namespace fs = std::filesystem;

int64_t PeakRssBytes() {
  struct rusage u;
  if (::getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return static_cast<int64_t>(u.ru_maxrss) * 1024;  // Linux reports KiB
}

void CountTree(const std::string& root, int64_t& files, int64_t& bytes) {
  files = 0;
  bytes = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code e2;
    if (it->is_regular_file(e2)) {
      ++files;
      bytes += static_cast<int64_t>(it->file_size(e2));
    }
  }
}

std::string Duration(double seconds) {
  if (seconds < 0) seconds = 0;
  const long s = static_cast<long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  }
  return buf;
}

ProgressDisplay::ProgressDisplay(std::ostream& err, std::string label, bool terminal,
                                 double every_s)
    : err_(err), label_(std::move(label)), terminal_(terminal), every_s_(every_s) {
  thread_ = std::thread([this] { Loop(); });
}

ProgressDisplay::~ProgressDisplay() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (terminal_ && drew_) err_ << "\r\033[K" << std::flush;
}

void ProgressDisplay::Loop() {
  using Clock = std::chrono::steady_clock;
  int64_t serial = -1, printed_serial = -1;
  const Clock::time_point started = Clock::now();
  Clock::time_point phase_start = started, last_line = started;
  const auto tick = std::chrono::milliseconds(terminal_ ? 200 : 100);
  while (!stop_) {
    std::this_thread::sleep_for(tick);
    const progress::Snapshot s = progress::Read();
    if (s.phase.empty()) continue;
    const Clock::time_point now = Clock::now();
    const bool new_phase = s.serial != serial;
    if (new_phase) {
      serial = s.serial;
      phase_start = now;
    }
    const double secs = std::chrono::duration<double>(now - phase_start).count();
    // Plain lines (logs): none for a run shorter than 2 s, then one per phase and every
    // every_s_ seconds.
    if (!terminal_ && (std::chrono::duration<double>(now - started).count() < 2.0 ||
                       (s.serial == printed_serial &&
                        std::chrono::duration<double>(now - last_line).count() < every_s_))) {
      continue;
    }
    last_line = now;
    printed_serial = s.serial;
    std::string line = label_ + ": " + s.phase;
    if (s.total > 0 || s.done > 0) {
      line += " " + HumanBytes(s.done);
      if (s.total > 0) {
        const int64_t done = std::min(s.done, s.total);
        char pct[16];
        std::snprintf(pct, sizeof pct, " (%d%%)", static_cast<int>(100.0 * done / s.total));
        line += " of " + HumanBytes(s.total) + pct;
      }
      if (secs > 0.5 && s.done > 0) {
        const double rate = s.done / secs;
        line += ", " + HumanBytes(static_cast<int64_t>(rate)) + "/s";
        if (s.total > s.done) line += ", ETA " + Duration((s.total - s.done) / rate);
      }
    }
    if (terminal_) {
      err_ << "\r\033[K" << line << std::flush;
    } else {
      err_ << line << "\n" << std::flush;
    }
    drew_ = true;
  }
}

}  // namespace ucp::cli
