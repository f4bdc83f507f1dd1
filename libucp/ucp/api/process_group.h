// The processes that run one operation together. One process by default; under `mpirun`, MPI's
// world (ucp/mpi/mpi_group.h). An operation's processes each write a share of the output files
// into one temporary folder that the first process (rank 0, the root) created, send it what they
// wrote, and the root commits; all of them agree on success or on the first failure, so every
// process exits with the same code and no output is left half-written.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::api {

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  bool is_root() const { return rank() == 0; }

  /// The root's `text`, on every process (the argument is ignored elsewhere).
  /// Errors: kInternal when the transport fails.
  virtual Result<std::string> Broadcast(const std::string& text) = 0;
  /// Every process's `text`, in rank order, at the root; an empty vector elsewhere.
  /// Errors: kInternal when the transport fails.
  virtual Result<std::vector<std::string>> Gather(const std::string& text) = 0;

  /// Agreement on an outcome: every process passes its own status and gets the same result,
  /// ok when all are ok, else the error of the lowest failing rank (its code, and its message
  /// prefixed with "process R: " when the group has several processes).
  Status Agree(const Status& mine);

  // --- progress reports (ucp-cli/progress.h: the root of a job shows the whole job's bytes) ---
  // A side channel that never blocks and never mixes with the operation's own messages: the
  // processes' reporter threads post their counters while the operation runs in the main thread,
  // and the root's display thread takes what has arrived. A process that stops reporting (it
  // finished, or failed) only leaves its last counts in the root's view.

  /// Whether this group carries progress reports (several processes and a transport that a
  /// second thread may use while the operation runs).
  virtual bool CarriesProgressReports() const { return false; }
  /// Not the root: posts `report` to the root without waiting for it to arrive. Returns false,
  /// posting nothing, while the previous report is still on its way (the caller retries later
  /// with newer counts) or when the group carries no reports.
  virtual bool PostProgressReport(const std::string& report) {
    (void)report;
    return false;
  }
  /// The root: the reports that have arrived, as (rank, report) in arrival order; never waits.
  virtual std::vector<std::pair<int, std::string>> TakeProgressReports() { return {}; }
  /// Not the root: waits at most `timeout_s` seconds for the posted report to leave this
  /// process (called when reporting ends, before the process exits); then gives up on it.
  virtual void FlushProgressReports(double timeout_s) { (void)timeout_s; }
};

/// The group of this process alone (no transport).
ProcessGroup& SingleProcess();

}  // namespace ucp::api
