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

/// CPU ids run from 0 to kMaxCpus - 1 (glibc's CPU_SETSIZE).
inline constexpr int kMaxCpus = 1024;

/// The CPUs the calling thread may run on, ascending (a process's threads inherit the mask
/// mpirun's or taskset's binding set). Errors: kInternal (the system call), kUnimplemented.
Result<std::vector<int>> ThisThreadCpus();

/// How many threads a run starts when none are asked for: the CPUs the calling thread may run
/// on (under `mpirun --bind-to core` or taskset, the process's share, not the machine), else
/// std::thread::hardware_concurrency(); at least 1.
int DefaultThreads();

/// Restricts the calling thread to `cpus`. Errors: kInvalidArgument (empty, an id outside
/// [0, kMaxCpus), or none of them allowed to this process), kUnimplemented.
Status SetThisThreadCpus(std::span<const int> cpus);

/// The CPUs to pin `adam_threads` CPU Adam threads to out of `allowed` (the process's,
/// ascending): the last ones, leaving the first to the process's other threads; all of them,
/// taken in turn, where there are fewer than threads.
std::vector<int> AdamCpus(std::span<const int> allowed, int adam_threads);

/// "0-3,8,10-11" for ascending, distinct ids (the kernel's cpulist notation).
std::string CpuListString(std::span<const int> cpus);

}  // namespace ucp::offload
