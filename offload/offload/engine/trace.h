// A Chrome trace-event recorder (the JSON object format that chrome://tracing and Perfetto open):
// complete events ("ph": "X") with a name, a category and a track, timed on one steady clock.
// Thread-safe; the pipeline's stages record into one recorder from their own threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "ucp/base/status.h"

namespace ucp::offload {

/// The tracks (Chrome "tid"s) of the pipeline's trace, one per stage.
enum class TraceTrack : int {
  kBackward = 1,   ///< the trainer thread: forward, backward per grad group
  kTransfer = 2,   ///< the copy stream: gradients device -> host, weights host -> device
  kCpuAdam = 3,    ///< the CPU Adam worker pool, one event per bucket
  kDeviceAdam = 4, ///< Adam of the tail buckets kept on the device
  kValidate = 5,   ///< validation: commit, correction, undo
  kReduce = 6,     ///< the communicator's thread: per-bucket gradient reductions (dp > 1)
};

/// One complete event, times in microseconds since the recorder was made.
struct TraceEvent {
  std::string name;
  std::string category;
  TraceTrack track = TraceTrack::kBackward;
  double begin_us = 0;
  double duration_us = 0;
  int64_t step = 0;
};

class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;
  TraceRecorder();

  /// Records [begin, end) on `track` when enabled (a no-op otherwise).
  void Add(std::string name, std::string category, TraceTrack track, Clock::time_point begin,
           Clock::time_point end);
  /// Stops or resumes recording (ucp-train records its first few steps only).
  void set_enabled(bool enabled);
  bool enabled() const;
  /// The step number stamped on later events (an "args": {"step": N}).
  void set_step(int64_t step);

  std::vector<TraceEvent> events() const;
  /// {"traceEvents": [...], "displayTimeUnit": "ms"}, with thread-name metadata per track.
  std::string ToJson() const;
  /// Writes ToJson() atomically. Errors: kIoError.
  Status Write(const std::filesystem::path& path) const;

 private:
  Clock::time_point origin_;
  mutable std::mutex mu_;
  bool enabled_ = true;
  int64_t step_ = 0;
  std::vector<TraceEvent> events_;
};

}  // namespace ucp::offload
