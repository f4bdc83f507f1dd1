// TraceRecorder (trace.h): events kept in memory, written as one JSON document.
#include "offload/engine/trace.h"

#include "ucp/io/atomic_file.h"
#include "ucp/json/strict_json.h"

namespace ucp::offload {

TraceRecorder::TraceRecorder() : origin_(Clock::now()) {}

void TraceRecorder::Add(std::string name, std::string category, TraceTrack track,
                        Clock::time_point begin, Clock::time_point end) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled_) return;
  TraceEvent e;
  e.name = std::move(name);
  e.category = std::move(category);
  e.track = track;
  e.begin_us = std::chrono::duration<double, std::micro>(begin - origin_).count();
  e.duration_us = std::chrono::duration<double, std::micro>(end - begin).count();
  e.step = step_;
  events_.push_back(std::move(e));
}

void TraceRecorder::set_enabled(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  enabled_ = enabled;
}

bool TraceRecorder::enabled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return enabled_;
}

void TraceRecorder::set_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  step_ = step;
}

std::vector<TraceEvent> TraceRecorder::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

std::string TraceRecorder::ToJson() const {
  using json = ucp::json::Json;
  json events = json::array();
  const std::pair<TraceTrack, const char*> names[] = {
      {TraceTrack::kBackward, "trainer: forward/backward"},
      {TraceTrack::kTransfer, "copy stream"},
      {TraceTrack::kCpuAdam, "cpu adam"},
      {TraceTrack::kDeviceAdam, "device adam (tail buckets)"},
      {TraceTrack::kValidate, "validation"},
      {TraceTrack::kReduce, "communicator: gradient reduction"}};
  for (const auto& [track, name] : names) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", static_cast<int>(track)},
                      {"args", {{"name", name}}}});
  }
  for (const TraceEvent& e : this->events()) {
    events.push_back({{"name", e.name},
                      {"cat", e.category},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", static_cast<int>(e.track)},
                      {"ts", e.begin_us},
                      {"dur", e.duration_us},
                      {"args", {{"step", e.step}}}});
  }
  return json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

Status TraceRecorder::Write(const std::filesystem::path& path) const {
  return io::WriteFileAtomic(path, ToJson());
}

}  // namespace ucp::offload
