// MPI_COMM_WORLD behind ProcessGroup: broadcasts and gathers of byte strings.
#include "ucp/mpi/mpi_group.h"

#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace ucp::mpi {
namespace {

Status MpiError(int rc, const char* what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return InternalError(std::string(what) + " failed: " + std::string(text, len));
}

// Who initialised MPI, and how many groups are alive (MPI is finalised with the last one).
std::mutex init_mu;
int live_groups = 0;
bool we_initialised = false;

class WorldGroupImpl final : public api::ProcessGroup {
 public:
  WorldGroupImpl(int rank, int size) : rank_(rank), size_(size) {}
  ~WorldGroupImpl() override {
    std::lock_guard<std::mutex> lock(init_mu);
    if (--live_groups == 0 && we_initialised) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Result<std::string> Broadcast(const std::string& text) override {
    uint64_t n = text.size();
    int rc = MPI_Bcast(&n, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Bcast");
    std::string out = rank_ == 0 ? text : std::string(n, '\0');
    if (n > 0) {
      rc = MPI_Bcast(out.data(), static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Bcast");
    }
    return out;
  }

  Result<std::vector<std::string>> Gather(const std::string& text) override {
    const int n = static_cast<int>(text.size());
    std::vector<int> sizes(rank_ == 0 ? size_ : 0);
    int rc = MPI_Gather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Gather");
    std::vector<int> displs(sizes.size());
    int64_t total = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      displs[i] = static_cast<int>(total);
      total += sizes[i];
    }
    if (total > INT32_MAX) return InternalError("gathered parts exceed 2 GiB");
    std::string all(static_cast<size_t>(total), '\0');
    rc = MPI_Gatherv(text.data(), n, MPI_CHAR, all.data(), sizes.data(), displs.data(), MPI_CHAR, 0,
                     MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Gatherv");
    std::vector<std::string> out;
    for (size_t i = 0; i < sizes.size(); ++i) out.push_back(all.substr(displs[i], sizes[i]));
    return out;
  }

 private:
  int rank_;
  int size_;
};

}  // namespace

bool LaunchedByMpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

Result<std::unique_ptr<api::ProcessGroup>> WorldGroup() {
  std::lock_guard<std::mutex> lock(init_mu);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // Only the thread that calls ucp's operations talks to MPI.
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Init_thread");
    we_initialised = true;
  }
  // Errors come back as return codes, not as an abort of the whole job.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  ++live_groups;
  return std::unique_ptr<api::ProcessGroup>(new WorldGroupImpl(rank, size));
}

}  // namespace ucp::mpi
