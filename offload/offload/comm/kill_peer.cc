// A job whose rank 1 dies while the others are in collectives, for tests/comm/comm_mpi_test.sh:
//   offload_comm_kill_peer sigkill   rank 1 raises SIGKILL after 50 all-reduces
//   offload_comm_kill_peer abort     rank 1 calls Communicator::Abort(3) instead
// The survivors keep all-reducing; mpirun must end them. If nothing ends them within 60 s they
// print "survived" and exit 0, which the script reports as a failure.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include "offload/comm/communicator.h"

int main(int argc, char** argv) {
  using ucp::offload::ReduceOp;
  if (argc != 2 || (std::strcmp(argv[1], "sigkill") != 0 && std::strcmp(argv[1], "abort") != 0)) {
    std::fprintf(stderr, "usage: offload_comm_kill_peer sigkill|abort\n");
    return 2;
  }
  const bool sigkill = std::strcmp(argv[1], "sigkill") == 0;
  auto world = ucp::offload::WorldCommunicator();
  if (!world.ok()) {
    std::fprintf(stderr, "%s\n", world.status().ToString().c_str());
    return 2;
  }
  auto& comm = **world;
  std::vector<float> data(1000, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    if (comm.rank() == 1 && i == 50) {
      // The moment of death, for the script to measure how long the others take to go.
      timespec now{};
      clock_gettime(CLOCK_REALTIME, &now);
      std::printf("rank 1 dies at %lld.%09ld\n", static_cast<long long>(now.tv_sec), now.tv_nsec);
      std::fflush(stdout);
      if (sigkill) std::raise(SIGKILL);
      if (std::getenv("KILL_PEER_RETURN") != nullptr) return 5;  // measurement only
      comm.Abort(3);
    }
    const ucp::Status s = comm.AllReduce(std::span<float>(data), ReduceOp::kMax);
    if (!s.ok()) {
      // What a trainer does on a failed collective: end the job, not just this process.
      std::fprintf(stderr, "rank %d: %s\n", comm.rank(), s.ToString().c_str());
      comm.Abort(4);
    }
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {
      std::printf("rank %d survived\n", comm.rank());
      return 0;
    }
  }
}
