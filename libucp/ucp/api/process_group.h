// The processes that run one operation together. One process by default; under `mpirun`, MPI's
// world (ucp/mpi/mpi_group.h). An operation's processes each write a share of the output files
// into one temporary folder that the first process (rank 0, the root) created, send it what they
// wrote, and the root commits; all of them agree on success or on the first failure, so every
// process exits with the same code and no output is left half-written.
#pragma once

#include <string>
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
};

/// The group of this process alone (no transport).
ProcessGroup& SingleProcess();

}  // namespace ucp::api
