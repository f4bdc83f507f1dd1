// MPI_COMM_WORLD behind ProcessGroup: broadcasts and gathers of byte strings.
#include "ucp/mpi/mpi_group.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <utility>
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

// Progress reports travel on their own communicator (a duplicate of the world made when the
// group is), so they can never match a receive of the operation's collectives, with one tag.
constexpr int kProgressTag = 7;

class WorldGroupImpl final : public api::ProcessGroup {
 public:
  WorldGroupImpl(int rank, int size, MPI_Comm progress, bool threads)
      : rank_(rank), size_(size), progress_(progress), threads_(threads) {}
  ~WorldGroupImpl() override {
    {
      // A report nobody took is dropped, not waited for: the root may have ended first.
      std::lock_guard<std::mutex> lock(progress_mu_);
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) {
        AbandonPending();
        if (progress_ != MPI_COMM_NULL) MPI_Comm_free(&progress_);
      }
    }
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

  bool CarriesProgressReports() const override {
    return threads_ && size_ > 1 && progress_ != MPI_COMM_NULL;
  }

  // One report in flight at a time, sent with MPI_Isend from the caller's buffer: a tiny
  // message that MPI sends eagerly, so the operation's thread never waits for the root.
  bool PostProgressReport(const std::string& report) override {
    if (!CarriesProgressReports() || rank_ == 0) return false;
    std::lock_guard<std::mutex> lock(progress_mu_);
    if (pending_ != MPI_REQUEST_NULL) {
      int done = 0;
      if (MPI_Test(&pending_, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) return false;
    }
    sending_ = report;
    if (MPI_Isend(sending_.data(), static_cast<int>(sending_.size()), MPI_CHAR, 0, kProgressTag,
                  progress_, &pending_) != MPI_SUCCESS) {
      pending_ = MPI_REQUEST_NULL;
      return false;
    }
    return true;
  }

  // Matched probes (MPI_Improbe + MPI_Mrecv) take exactly the message found, whatever other
  // threads do; only messages that have arrived are taken.
  std::vector<std::pair<int, std::string>> TakeProgressReports() override {
    std::vector<std::pair<int, std::string>> out;
    if (!CarriesProgressReports() || rank_ != 0) return out;
    std::lock_guard<std::mutex> lock(progress_mu_);
    for (int i = 0; i < 4 * size_; ++i) {  // bounded: a flood cannot keep the caller here
      int found = 0;
      MPI_Message msg;
      MPI_Status st;
      if (MPI_Improbe(MPI_ANY_SOURCE, kProgressTag, progress_, &found, &msg, &st) != MPI_SUCCESS ||
          !found) {
        break;
      }
      int n = 0;
      MPI_Get_count(&st, MPI_CHAR, &n);
      std::string text(static_cast<size_t>(std::max(n, 0)), '\0');
      if (MPI_Mrecv(text.data(), n, MPI_CHAR, &msg, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
      out.emplace_back(st.MPI_SOURCE, std::move(text));
    }
    return out;
  }

  void FlushProgressReports(double timeout_s) override {
    if (!CarriesProgressReports() || rank_ == 0) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (true) {
      {
        std::lock_guard<std::mutex> lock(progress_mu_);
        if (pending_ == MPI_REQUEST_NULL) return;
        int done = 0;
        if (MPI_Test(&pending_, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done) {
          pending_ = MPI_REQUEST_NULL;
          return;
        }
        if (std::chrono::steady_clock::now() >= until) {
          AbandonPending();
          return;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

 private:
  // Lets MPI complete or drop the report in flight without anyone waiting on it; its buffer is
  // left allocated (a few bytes), as MPI may still read it. Called with progress_mu_ held.
  void AbandonPending() {
    if (pending_ == MPI_REQUEST_NULL) return;
    MPI_Request_free(&pending_);
    static_cast<void>(new std::string(std::move(sending_)));  // deliberately never freed
    sending_.clear();
  }

  int rank_;
  int size_;
  std::mutex progress_mu_;
  MPI_Comm progress_;
  bool threads_;  // MPI_THREAD_MULTIPLE: a reporter thread may call MPI beside the operation
  MPI_Request pending_ = MPI_REQUEST_NULL;
  std::string sending_;  // the buffer of the report in flight
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
    // The operation's thread runs the collectives; a progress thread posts or takes reports
    // on a communicator of its own beside it (MPI_THREAD_MULTIPLE). An MPI that cannot
    // gives no progress reports, nothing else changes.
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Init_thread");
    we_initialised = true;
  }
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  // Errors come back as return codes, not as an abort of the whole job.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // Collective: every process makes its group at the same point (ucp's main, a trainer's
  // start). Every process duplicates, whatever its thread level, so the calls match.
  MPI_Comm progress = MPI_COMM_NULL;
  const int dup = MPI_Comm_dup(MPI_COMM_WORLD, &progress);
  if (dup != MPI_SUCCESS) return MpiError(dup, "MPI_Comm_dup");
  ++live_groups;
  return std::unique_ptr<api::ProcessGroup>(
      new WorldGroupImpl(rank, size, progress, level == MPI_THREAD_MULTIPLE));
}

}  // namespace ucp::mpi
