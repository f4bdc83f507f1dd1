// The progress line and the summary's measurements (progress.h).
#include "ucp-cli/progress.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

double PlainLineInterval() {
  const char* env = std::getenv("UCP_PROGRESS_EVERY");
  if (env == nullptr || *env == '\0') return 5.0;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  return end != env && *end == '\0' && v >= 0.05 && v <= 3600 ? v : 5.0;
}

std::string EncodeProgress(const progress::Snapshot& s, bool last) {
  std::string out = "S\t" + std::to_string(s.serial) + "\n";
  for (const progress::PhaseCount& p : s.finished) {
    out += "P\t" + p.phase + "\t" + std::to_string(p.done) + "\t" + std::to_string(p.total) + "\n";
  }
  if (!s.phase.empty()) {
    out += "C\t" + s.phase + "\t" + std::to_string(s.done) + "\t" + std::to_string(s.total) + "\n";
  }
  if (last) out += "E\n";
  return out;
}

bool DecodeProgress(const std::string& text, progress::Snapshot& out, bool& last) {
  out = progress::Snapshot{};
  last = false;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) return false;
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    std::vector<std::string> f;
    for (size_t a = 0;;) {
      const size_t t = line.find('\t', a);
      f.push_back(line.substr(a, t == std::string::npos ? std::string::npos : t - a));
      if (t == std::string::npos) break;
      a = t + 1;
    }
    auto num = [](const std::string& x, int64_t& v) {
      char* end = nullptr;
      v = std::strtoll(x.c_str(), &end, 10);
      return !x.empty() && *end == '\0';
    };
    if (f[0] == "E" && f.size() == 1) {
      last = true;
    } else if (f[0] == "S" && f.size() == 2) {
      if (!num(f[1], out.serial)) return false;
    } else if ((f[0] == "P" || f[0] == "C") && f.size() == 4 && !f[1].empty()) {
      progress::PhaseCount c{f[1], 0, 0};
      if (!num(f[2], c.done) || !num(f[3], c.total)) return false;
      if (f[0] == "P") {
        if (!out.phase.empty()) return false;  // finished phases come first
        out.finished.push_back(std::move(c));
      } else {
        out.phase = c.phase;
        out.done = c.done;
        out.total = c.total;
      }
    } else {
      return false;
    }
  }
  return true;
}

namespace {

// A process's phases in order (finished, then current), and each one's key: its name and how
// many phases of that name came before it (a second "verify" is not the first).
std::vector<JobPhase> PhasesOf(const progress::Snapshot& s) {
  std::vector<JobPhase> out;
  for (const progress::PhaseCount& p : s.finished) out.push_back({p.phase, p.done, p.total});
  if (!s.phase.empty()) out.push_back({s.phase, s.done, s.total});
  return out;
}

std::vector<std::pair<std::string, int>> KeysOf(const std::vector<JobPhase>& phases) {
  std::map<std::string, int> seen;
  std::vector<std::pair<std::string, int>> out;
  for (const JobPhase& p : phases) out.emplace_back(p.phase, seen[p.phase]++);
  return out;
}

}  // namespace

JobView CombineProgress(const progress::Snapshot& root,
                        const std::map<int, progress::Snapshot>& others, JobState state) {
  JobView v;
  v.phases = PhasesOf(root);
  if (v.phases.empty()) return v;
  const auto keys = KeysOf(v.phases);
  v.shown = v.phases.size() - 1;
  // A process not heard from in any phase yet (on a loaded machine it may start its share after
  // the root has finished its own) holds the job at its first phase: showing a later one would
  // end the earlier phases' lines on the root's share alone.
  if (state == JobState::kSomeUnheard) v.shown = 0;
  for (const auto& [rank, snap] : others) {
    const std::vector<JobPhase> theirs = PhasesOf(snap);
    if (theirs.empty()) continue;
    const auto their_keys = KeysOf(theirs);
    // A process still in a phase the root has left holds the job in it (not once the job has
    // ended: then every process is done, whatever its last report said).
    const auto it = std::find(keys.begin(), keys.end(), their_keys.back());
    if (it != keys.end() && state != JobState::kEnded) {
      v.shown = std::min(v.shown, static_cast<size_t>(it - keys.begin()));
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      const auto j = std::find(their_keys.begin(), their_keys.end(), keys[i]);
      if (j == their_keys.end()) continue;
      const JobPhase& p = theirs[static_cast<size_t>(j - their_keys.begin())];
      v.phases[i].done += p.done;
      v.phases[i].total += p.total;
    }
  }
  v.serial = root.serial - static_cast<int64_t>(v.phases.size() - 1 - v.shown);
  return v;
}

ProgressReporter::ProgressReporter(api::ProcessGroup& group, double every_s)
    : group_(group), every_s_(every_s) {
  thread_ = std::thread([this] { Loop(); });
}

ProgressReporter::~ProgressReporter() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void ProgressReporter::Loop() {
  using Clock = std::chrono::steady_clock;
  std::string sent;
  Clock::time_point last = Clock::now() - std::chrono::hours(1);
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (std::chrono::duration<double>(Clock::now() - last).count() < every_s_) continue;
    const std::string report = EncodeProgress(progress::Read(), false);
    // A report still on its way is not replaced: the next tick sends newer counts.
    if (report != sent && group_.PostProgressReport(report)) {
      sent = report;
      last = Clock::now();
    }
  }
  // The last report, with every phase's final counts; bounded waits, so a root that is gone
  // (a failed job) keeps no process here.
  const std::string report = EncodeProgress(progress::Read(), true);
  // (Seconds, not milliseconds: on a loaded machine the root may take a while to drain the
  // report before it.)
  const Clock::time_point until = Clock::now() + std::chrono::seconds(3);
  while (!group_.PostProgressReport(report) && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  group_.FlushProgressReports(3.0);
}

ProgressDisplay::ProgressDisplay(std::ostream& err, std::string label, bool terminal,
                                 double every_s, api::ProcessGroup* job)
    : err_(err),
      label_(std::move(label)),
      terminal_(terminal),
      every_s_(every_s),
      job_(job != nullptr && job->CarriesProgressReports() && job->is_root() ? job : nullptr) {
  thread_ = std::thread([this] { Loop(); });
}

ProgressDisplay::~ProgressDisplay() {
  if (job_ != nullptr) {
    // Every process's last report, so that the last lines hold the whole job's final counts;
    // a process that died sends none, which costs at most this wait (generous: a loaded machine
    // can delay a live process's last report by seconds, and the wait ends when all are in).
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(6);
    while (ended_count_.load() < job_->size() - 1 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (terminal_ && drew_) err_ << "\r\033[K" << std::flush;
}

JobView ProgressDisplay::View(bool ended) {
  const progress::Snapshot mine = progress::Read();
  if (job_ == nullptr) return CombineProgress(mine, others_);
  {
    for (auto& [rank, text] : job_->TakeProgressReports()) {
      progress::Snapshot s;
      bool last = false;
      if (rank <= 0 || !DecodeProgress(text, s, last)) continue;
      others_[rank] = std::move(s);
      if (last && !ended_[rank]) {
        ended_[rank] = true;
        ++ended_count_;
      }
    }
  }
  unheard_ = 0;
  for (int rank = 1; rank < job_->size() && !ended; ++rank) {
    const auto it = others_.find(rank);
    if (!ended_[rank] && (it == others_.end() || PhasesOf(it->second).empty())) ++unheard_;
  }
  const JobState state = ended          ? JobState::kEnded
                         : unheard_ > 0 ? JobState::kSomeUnheard
                                        : JobState::kRunning;
  return CombineProgress(mine, others_, state);
}

std::string ProgressDisplay::Line(const JobPhase& p, double secs) const {
  std::string line = label_ + ": " + p.phase;
  if (unheard_ > 0) {
    // The job's total is not known while a process has not reported: no percentage or ETA
    // that would have to go backwards when it does.
    const int n = job_->size();
    line += " " + HumanBytes(p.done);
    if (p.total > 0) line += " of " + HumanBytes(p.total);
    line += " from " + std::to_string(n - unheard_) + " of " + std::to_string(n) + " processes";
    return line;
  }
  if (p.total > 0 || p.done > 0) {
    line += " " + HumanBytes(p.done);
    if (p.total > 0) {
      const int64_t done = std::min(p.done, p.total);
      char pct[16];
      std::snprintf(pct, sizeof pct, " (%d%%)", static_cast<int>(100.0 * done / p.total));
      line += " of " + HumanBytes(p.total) + pct;
    }
    if (secs > 0.5 && p.done > 0) {
      const double rate = p.done / secs;
      line += ", " + HumanBytes(static_cast<int64_t>(rate)) + "/s";
      if (p.total > p.done) line += ", ETA " + Duration((p.total - p.done) / rate);
    }
  }
  return line;
}

void ProgressDisplay::Loop() {
  using Clock = std::chrono::steady_clock;
  int64_t serial = -1, printed_serial = -1;
  size_t shown = 0;
  std::string shown_phase;
  JobPhase printed;  // the counts of the last plain line
  bool printed_any = false;
  const Clock::time_point started = Clock::now();
  Clock::time_point phase_start = started, last_line = started;
  const auto tick = std::chrono::milliseconds(terminal_ ? 200 : 100);
  // No plain line for a run shorter than this.
  const double quiet_s = std::min(2.0, every_s_);
  auto emit = [&](const std::string& line) {
    if (terminal_) {
      err_ << "\r\033[K" << line << std::flush;
    } else {
      err_ << line << "\n" << std::flush;
    }
    drew_ = true;
  };
  while (true) {
    const bool stopping = stop_.load();
    if (!stopping) std::this_thread::sleep_for(tick);
    const JobView v = View(stopping);
    if (v.phases.empty()) {
      if (stopping) break;
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (v.serial != serial) {
      // The phase shown until now has ended everywhere, and so has any phase between it and the
      // one shown now (a short one that began and ended between two looks): a log gets each
      // one's final counts (100%).
      if (!terminal_ && printed_any && serial >= 0 && shown < v.phases.size() &&
          v.phases[shown].phase == shown_phase) {
        for (size_t i = shown; i < v.shown; ++i) {
          const JobPhase& old = v.phases[i];
          if (i > shown || printed_serial != serial || old.done != printed.done ||
              old.total != printed.total) {
            emit(Line(old, i == shown ? std::chrono::duration<double>(now - phase_start).count()
                                      : 0.0));
          }
        }
      }
      serial = v.serial;
      shown = v.shown;
      shown_phase = v.phases[shown].phase;
      phase_start = now;
    }
    const JobPhase& p = v.phases[v.shown];
    const double secs = std::chrono::duration<double>(now - phase_start).count();
    if (stopping) {
      // The last counts of the last phase, when the log has lines and they changed.
      if (!terminal_ && printed_any &&
          (printed_serial != serial || p.done != printed.done || p.total != printed.total)) {
        emit(Line(p, secs));
      }
      break;
    }
    // Plain lines (logs): none for a short run, then one per phase and every every_s_ seconds.
    if (!terminal_ && (std::chrono::duration<double>(now - started).count() < quiet_s ||
                       (serial == printed_serial &&
                        (std::chrono::duration<double>(now - last_line).count() < every_s_ ||
                         (p.done == printed.done && p.total == printed.total))))) {
      continue;  // (a log does not repeat a line whose counts have not moved)
    }
    // A log's first line comes after the quiet start: the phases that ended during it get their
    // final line first, so a log that has lines has one for every phase.
    if (!terminal_ && !printed_any) {
      for (size_t i = 0; i < v.shown; ++i) emit(Line(v.phases[i], 0.0));
    }
    last_line = now;
    printed_serial = serial;
    printed = p;
    printed_any = true;
    emit(Line(p, secs));
  }
}

}  // namespace ucp::cli
