// Which CPUs a thread may run on: the CPU Adam's pinned pool (ucp-train --pin-threads) and its
// checks. Linux only (sched_getaffinity, pthread_setaffinity_np); elsewhere every call returns
// kUnimplemented, and nothing is pinned.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload {

/// The CPUs the calling thread may run on, ascending (a process's threads inherit the mask
/// mpirun's or taskset's binding set). Errors: kInternal (the system call), kUnimplemented.
Result<std::vector<int>> ThisThreadCpus();

/// Restricts the calling thread to `cpus`. Errors: kInvalidArgument (empty, an id outside
/// [0, CPU_SETSIZE), or none of them allowed to this process), kUnimplemented.
Status SetThisThreadCpus(std::span<const int> cpus);

/// "0-3,8,10-11" for ascending, distinct ids (the kernel's cpulist notation).
std::string CpuListString(std::span<const int> cpus);

}  // namespace ucp::offload
