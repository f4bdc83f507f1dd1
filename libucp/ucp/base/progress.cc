// Process-wide progress counters (progress.h).
#include "ucp/base/progress.h"

#include <atomic>
#include <mutex>
#include <system_error>

namespace ucp::progress {
namespace {

struct State {
  std::mutex mu;
  std::string phase;                // guarded by mu
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> total{0};
  std::atomic<int64_t> serial{0};
  std::vector<PhaseCount> finished;  // guarded by mu
};

State& S() {
  static State* s = new State();  // never destroyed: a display thread may read it at exit
  return *s;
}

}  // namespace

void BeginPhase(std::string_view phase, int64_t total_bytes) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.phase.empty()) {
    if (s.finished.size() == kMaxFinishedPhases) s.finished.erase(s.finished.begin());
    s.finished.push_back({s.phase, s.done.load(std::memory_order_relaxed),
                          s.total.load(std::memory_order_relaxed)});
  }
  s.phase = std::string(phase);
  s.done.store(0, std::memory_order_relaxed);
  s.total.store(total_bytes, std::memory_order_relaxed);
  s.serial.fetch_add(1, std::memory_order_relaxed);
}

void AddBytes(int64_t bytes) { S().done.fetch_add(bytes, std::memory_order_relaxed); }

Snapshot Read() {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  Snapshot out;
  out.phase = s.phase;
  out.done = s.done.load(std::memory_order_relaxed);
  out.total = s.total.load(std::memory_order_relaxed);
  out.serial = s.serial.load(std::memory_order_relaxed);
  out.finished = s.finished;
  return out;
}

int64_t TreeBytes(const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  std::error_code ec;
  int64_t total = 0;
  for (auto it = fs::recursive_directory_iterator(root, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code e2;
    if (it->is_regular_file(e2)) total += static_cast<int64_t>(it->file_size(e2));
  }
  return total;
}

}  // namespace ucp::progress
