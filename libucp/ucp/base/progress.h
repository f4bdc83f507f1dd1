// How far the running operation is, in bytes, for a display to read (the CLI's progress line,
// ucp-cli/progress.h). Process-wide counters: the library announces a phase ("verify": the
// source's checksum pass; "convert": the executor streaming tensors; "commit") with the bytes
// it will handle, and adds bytes as it handles them; a display thread polls Read(). Adding is
// one relaxed atomic operation, so hot loops may call it per range.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace ucp::progress {

/// Starts a phase: `done` restarts at 0 against `total_bytes` (0: unknown).
void BeginPhase(std::string_view phase, int64_t total_bytes);

/// Adds `bytes` to the current phase's done count.
void AddBytes(int64_t bytes);

/// A phase that has ended (a later BeginPhase), with its final counts.
struct PhaseCount {
  std::string phase;
  int64_t done = 0;
  int64_t total = 0;
};

struct Snapshot {
  std::string phase;  ///< "" before the first phase
  int64_t done = 0;
  int64_t total = 0;
  int64_t serial = 0;  ///< increases with every BeginPhase
  /// The phases before this one, oldest first (the last kMaxFinishedPhases), so that a reader
  /// that polls (a display, the reports to an MPI job's root) still sees each phase's final
  /// counts when phases change between two polls.
  std::vector<PhaseCount> finished;
};
inline constexpr size_t kMaxFinishedPhases = 16;
Snapshot Read();

/// The bytes of the regular files under `root` (a phase's total when a pass reads every file).
int64_t TreeBytes(const std::filesystem::path& root);

}  // namespace ucp::progress
