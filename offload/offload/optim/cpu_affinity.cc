#include "offload/optim/cpu_affinity.h"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace ucp::offload {

#if defined(__linux__)

static_assert(CPU_SETSIZE == kMaxCpus);

Result<std::vector<int>> ThisThreadCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (pthread_getaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
    return InternalError(std::string("pthread_getaffinity_np: ") + std::strerror(errno));
  }
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

Status SetThisThreadCpus(std::span<const int> cpus) {
  if (cpus.empty()) return InvalidArgumentError("pin a thread: no CPUs given");
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) {
      return InvalidArgumentError("pin a thread: CPU " + std::to_string(c) + " is outside [0, " +
                                  std::to_string(CPU_SETSIZE) + ")");
    }
    CPU_SET(c, &set);
  }
  // pthread_setaffinity_np returns the error number (it does not set errno).
  if (const int e = pthread_setaffinity_np(pthread_self(), sizeof(set), &set); e != 0) {
    return InvalidArgumentError("pin a thread to CPUs " + CpuListString(cpus) + ": " +
                                std::strerror(e));
  }
  return Status::Ok();
}

#else

Result<std::vector<int>> ThisThreadCpus() {
  return UnimplementedError("thread CPU affinity is implemented on Linux only");
}
Status SetThisThreadCpus(std::span<const int>) {
  return UnimplementedError("thread CPU affinity is implemented on Linux only");
}

#endif

int DefaultThreads() {
  // The mask, not hardware_concurrency(): processes bound to a share of the machine would
  // otherwise each start pools as wide as it, oversubscribing their cores.
  if (Result<std::vector<int>> cpus = ThisThreadCpus(); cpus.ok() && !cpus->empty()) {
    return static_cast<int>(cpus->size());
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

std::vector<int> AdamCpus(std::span<const int> allowed, int adam_threads) {
  if (adam_threads >= static_cast<int>(allowed.size())) {
    return std::vector<int>(allowed.begin(), allowed.end());
  }
  return std::vector<int>(allowed.end() - adam_threads, allowed.end());
}

std::string CpuListString(std::span<const int> cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(cpus[i]);
    if (j > i) s += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return s;
}

}  // namespace ucp::offload
