// Communicator over MPI (Debian's OpenMPI); the only file of offload/ that includes mpi.h.
//
// Counts. MPI counts and displacements are int. Spans above max_elements_per_call (INT_MAX by
// default) go in several calls: reductions in chunks of the span (a derived datatype cannot carry
// MPI_SUM), gathers and all-to-alls in chunks of each block described by a block-strided datatype
// (no copies), and AllToAllV in pairwise MPI_Sendrecv rounds when a count or displacement does not
// fit an int.
//
// Lifetime. MPI is initialised by the first WorldCommunicator() (unless the caller did) and
// finalised at exit, not when the last communicator goes: MPI cannot be initialised twice, and
// tests create and drop communicators freely. A communicator destroyed after MPI_Finalize does
// not free its MPI_Comm (that would be an error), which is harmless at exit. ucp/mpi's
// WorldGroup finalises MPI when its last group goes, if it initialised MPI: a process that uses
// both creates the communicator first, or keeps a WorldGroup alive as long as its communicators.
//
// Failure. A process that returns from main while its peers are still in a collective hangs the
// job: MPI_Finalize waits for them (measured with OpenMPI 4.1.4: the job stayed up until killed).
// Hence Communicator::Abort, which is MPI_Abort on MPI_COMM_WORLD.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "offload/comm/comm_checks.h"
#include "offload/comm/communicator.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload {
namespace {

using internal_comm::CheckDisjoint;
using internal_comm::Prefix;

std::string MpiErrorText(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<size_t>(len));
}

// A committed datatype, freed on scope exit.
class MpiType {
 public:
  MpiType() = default;
  MpiType(const MpiType&) = delete;
  MpiType& operator=(const MpiType&) = delete;
  ~MpiType() {
    if (type_ != MPI_DATATYPE_NULL) MPI_Type_free(&type_);
  }
  MPI_Datatype get() const { return type_; }
  MPI_Datatype* out() { return &type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size, int64_t max_elements)
      : comm_(comm), rank_(rank), size_(size), max_(max_elements) {}
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Result<std::unique_ptr<Communicator>> Split(int color, int key) override {
    if (color < 0) {
      return InvalidArgumentError(Prefix("split", *this) + "color " + std::to_string(color) +
                                  " is negative");
    }
    MPI_Comm sub = MPI_COMM_NULL;
    UCP_RETURN_IF_ERROR(Check(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split", "split",
                              "color " + std::to_string(color) + ", key " + std::to_string(key)));
    return Wrap(sub, max_);
  }

  Status AllReduce(std::span<float> data, ReduceOp op) override {
    return AllReduceImpl(data, op, MPI_FLOAT, "floats");
  }
  Status AllReduce(std::span<double> data, ReduceOp op) override {
    return AllReduceImpl(data, op, MPI_DOUBLE, "doubles");
  }
  Status AllReduce(std::span<int64_t> data, ReduceOp op) override {
    return AllReduceImpl(data, op, MPI_INT64_T, "int64s");
  }

  Status ReduceScatter(std::span<const float> in, std::span<float> out) override {
    constexpr std::string_view kOp = "reduce_scatter";
    UCP_RETURN_IF_ERROR(internal_comm::CheckReduceScatterSizes(kOp, *this, in.size(), out.size()));
    UCP_RETURN_IF_ERROR(
        CheckDisjoint(kOp, *this, in.data(), in.size_bytes(), out.data(), out.size_bytes()));
    const size_t n = out.size();
    const std::string what = std::to_string(n) + " floats per rank";
    if (n == 0) return Status::Ok();
    if (n <= Max()) {
      return Check(MPI_Reduce_scatter_block(in.data(), out.data(), static_cast<int>(n), MPI_FLOAT,
                                            MPI_SUM, comm_),
                   "MPI_Reduce_scatter_block", kOp, what);
    }
    // MPI_SUM needs a predefined type, so the strided chunk of each block is packed first.
    const size_t chunk = std::min<size_t>(Max(), size_t{1} << 24);
    std::vector<float> packed(static_cast<size_t>(size_) * chunk);
    for (size_t at = 0; at < n; at += chunk) {
      const size_t len = std::min(chunk, n - at);
      for (size_t j = 0; j < static_cast<size_t>(size_); ++j) {
        std::copy_n(in.data() + j * n + at, len, packed.data() + j * len);
      }
      UCP_RETURN_IF_ERROR(
          Check(MPI_Reduce_scatter_block(packed.data(), out.data() + at, static_cast<int>(len),
                                         MPI_FLOAT, MPI_SUM, comm_),
                "MPI_Reduce_scatter_block", kOp, what));
    }
    return Status::Ok();
  }

  Status AllGather(std::span<const float> in, std::span<float> out) override {
    constexpr std::string_view kOp = "all_gather";
    UCP_RETURN_IF_ERROR(internal_comm::CheckAllGatherSizes(kOp, *this, in.size(), out.size()));
    UCP_RETURN_IF_ERROR(
        CheckDisjoint(kOp, *this, in.data(), in.size_bytes(), out.data(), out.size_bytes()));
    const size_t n = in.size();
    const std::string what = std::to_string(n) + " floats per rank";
    if (n == 0) return Status::Ok();
    if (n <= Max()) {
      return Check(MPI_Allgather(in.data(), static_cast<int>(n), MPI_FLOAT, out.data(),
                                 static_cast<int>(n), MPI_FLOAT, comm_),
                   "MPI_Allgather", kOp, what);
    }
    for (size_t at = 0; at < n; at += Max()) {
      const size_t len = std::min(Max(), n - at);
      MpiType block;
      UCP_RETURN_IF_ERROR(BlockType(len, n, block, kOp));
      UCP_RETURN_IF_ERROR(Check(MPI_Allgather(in.data() + at, static_cast<int>(len), MPI_FLOAT,
                                              out.data() + at, 1, block.get(), comm_),
                                "MPI_Allgather", kOp, what));
    }
    return Status::Ok();
  }

  Status AllToAll(std::span<const float> in, std::span<float> out) override {
    constexpr std::string_view kOp = "all_to_all";
    UCP_RETURN_IF_ERROR(internal_comm::CheckAllToAllSizes(kOp, *this, in.size(), out.size()));
    UCP_RETURN_IF_ERROR(
        CheckDisjoint(kOp, *this, in.data(), in.size_bytes(), out.data(), out.size_bytes()));
    const size_t b = in.size() / static_cast<size_t>(size_);
    const std::string what = std::to_string(b) + " floats per block";
    if (b == 0) return Status::Ok();
    if (b <= Max()) {
      return Check(MPI_Alltoall(in.data(), static_cast<int>(b), MPI_FLOAT, out.data(),
                                static_cast<int>(b), MPI_FLOAT, comm_),
                   "MPI_Alltoall", kOp, what);
    }
    for (size_t at = 0; at < b; at += Max()) {
      const size_t len = std::min(Max(), b - at);
      MpiType block;
      UCP_RETURN_IF_ERROR(BlockType(len, b, block, kOp));
      UCP_RETURN_IF_ERROR(Check(
          MPI_Alltoall(in.data() + at, 1, block.get(), out.data() + at, 1, block.get(), comm_),
          "MPI_Alltoall", kOp, what));
    }
    return Status::Ok();
  }

  Status AllToAllV(std::span<const float> in, std::span<const int64_t> send_counts,
                   std::span<float> out, std::span<const int64_t> recv_counts) override {
    constexpr std::string_view kOp = "all_to_all_v";
    UCP_RETURN_IF_ERROR(internal_comm::CheckAllToAllVSizes(kOp, *this, in.size(), send_counts,
                                                           out.size(), recv_counts));
    UCP_RETURN_IF_ERROR(
        CheckDisjoint(kOp, *this, in.data(), in.size_bytes(), out.data(), out.size_bytes()));
    std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
    const bool fits = ToInts(send_counts, sc, sd) && ToInts(recv_counts, rc, rd);
    UCP_ASSIGN_OR_RETURN(const bool all_fit, AgreeOnCounts(send_counts, recv_counts, fits));
    const std::string what =
        std::to_string(in.size()) + " floats out, " + std::to_string(out.size()) + " in";
    if (all_fit) {
      return Check(MPI_Alltoallv(in.data(), sc.data(), sd.data(), MPI_FLOAT, out.data(), rc.data(),
                                 rd.data(), MPI_FLOAT, comm_),
                   "MPI_Alltoallv", kOp, what);
    }
    // Too large for int counts: round s sends to rank + s and receives from rank - s, in chunks
    // of at most Max() floats. Both ends agree on the chunks because the counts agree.
    std::vector<size_t> send_at(size_ + 1, 0), recv_at(size_ + 1, 0);
    for (int j = 0; j < size_; ++j) {
      send_at[j + 1] = send_at[j] + static_cast<size_t>(send_counts[j]);
      recv_at[j + 1] = recv_at[j] + static_cast<size_t>(recv_counts[j]);
    }
    for (int s = 0; s < size_; ++s) {
      const int dst = (rank_ + s) % size_;
      const int src = (rank_ - s + size_) % size_;
      const auto to_send = static_cast<size_t>(send_counts[dst]);
      const auto to_recv = static_cast<size_t>(recv_counts[src]);
      for (size_t at = 0; at < std::max(to_send, to_recv); at += Max()) {
        const int ns = static_cast<int>(at < to_send ? std::min(Max(), to_send - at) : 0);
        const int nr = static_cast<int>(at < to_recv ? std::min(Max(), to_recv - at) : 0);
        int code = MPI_SUCCESS;
        if (ns > 0 && nr > 0) {
          code = MPI_Sendrecv(in.data() + send_at[dst] + at, ns, MPI_FLOAT, dst, 0,
                              out.data() + recv_at[src] + at, nr, MPI_FLOAT, src, 0, comm_,
                              MPI_STATUS_IGNORE);
        } else if (ns > 0) {
          code = MPI_Send(in.data() + send_at[dst] + at, ns, MPI_FLOAT, dst, 0, comm_);
        } else {
          code = MPI_Recv(out.data() + recv_at[src] + at, nr, MPI_FLOAT, src, 0, comm_,
                          MPI_STATUS_IGNORE);
        }
        UCP_RETURN_IF_ERROR(Check(
            code, "MPI_Sendrecv", kOp,
            what + ", to rank " + std::to_string(dst) + ", from rank " + std::to_string(src)));
      }
    }
    return Status::Ok();
  }

  Status Broadcast(std::span<std::byte> data, int root) override {
    constexpr std::string_view kOp = "broadcast";
    UCP_RETURN_IF_ERROR(internal_comm::CheckRoot(kOp, *this, root));
    const std::string what =
        std::to_string(data.size()) + " bytes from rank " + std::to_string(root);
    for (size_t at = 0; at < data.size(); at += Max()) {
      const size_t len = std::min(Max(), data.size() - at);
      UCP_RETURN_IF_ERROR(
          Check(MPI_Bcast(data.data() + at, static_cast<int>(len), MPI_BYTE, root, comm_),
                "MPI_Bcast", kOp, what));
    }
    return Status::Ok();
  }

  Status Barrier() override { return Check(MPI_Barrier(comm_), "MPI_Barrier", "barrier", ""); }

  [[noreturn]] void Abort(int exit_code) override {
    // The whole job, not just this communicator: a dp or sp group alone cannot be ended.
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::_Exit(exit_code);  // MPI_Abort does not return; this keeps [[noreturn]] honest
  }

  /// `comm` with errors returned instead of aborting, as a Communicator that owns it.
  static Result<std::unique_ptr<Communicator>> Wrap(MPI_Comm comm, int64_t max_elements) {
    int code = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    if (code == MPI_SUCCESS) code = MPI_Comm_rank(comm, &rank);
    if (code == MPI_SUCCESS) code = MPI_Comm_size(comm, &size);
    if (code != MPI_SUCCESS) {
      MPI_Comm_free(&comm);
      return IoError("communicator setup failed: " + MpiErrorText(code));
    }
    return std::unique_ptr<Communicator>(new MpiCommunicator(comm, rank, size, max_elements));
  }

 private:
  size_t Max() const { return static_cast<size_t>(max_); }

  // kIoError "all_gather (rank 1 of 4): MPI_Allgather failed on 7 floats per rank: <MPI text>".
  Status Check(int code, std::string_view mpi_call, std::string_view op,
               const std::string& what) const {
    if (code == MPI_SUCCESS) return Status::Ok();
    return IoError(Prefix(op, *this) + std::string(mpi_call) + " failed" +
                   (what.empty() ? "" : " on " + what) + ": " + MpiErrorText(code));
  }

  template <typename T>
  Status AllReduceImpl(std::span<T> data, ReduceOp op, MPI_Datatype type, const char* unit) {
    const std::string what = std::to_string(data.size()) + " " + unit;
    const MPI_Op mpi_op = op == ReduceOp::kSum ? MPI_SUM : MPI_MAX;
    for (size_t at = 0; at < data.size(); at += Max()) {
      const size_t len = std::min(Max(), data.size() - at);
      UCP_RETURN_IF_ERROR(Check(
          MPI_Allreduce(MPI_IN_PLACE, data.data() + at, static_cast<int>(len), type, mpi_op, comm_),
          "MPI_Allreduce", "all_reduce", what));
    }
    return Status::Ok();
  }

  // `len` floats, then a gap up to `stride` floats: one chunk of one rank's block.
  Status BlockType(size_t len, size_t stride, MpiType& type, std::string_view op) const {
    MpiType contiguous;
    int code = MPI_Type_contiguous(static_cast<int>(len), MPI_FLOAT, contiguous.out());
    if (code == MPI_SUCCESS) {
      code = MPI_Type_create_resized(contiguous.get(), 0,
                                     static_cast<MPI_Aint>(stride * sizeof(float)), type.out());
    }
    if (code == MPI_SUCCESS) code = MPI_Type_commit(type.out());
    return Check(code, "MPI_Type_create_resized", op,
                 std::to_string(len) + " of every " + std::to_string(stride) + " floats");
  }

  // Every rank learns what its peers send it and compares with its recv_counts; the first rank
  // with a mismatch is agreed on by an all-reduce, so all return the same kInvalidArgument
  // instead of some entering the exchange and waiting for ever. The same all-reduce tells whether
  // every rank's counts fit one MPI_Alltoallv (true) or all must take the pairwise rounds: the
  // two paths do not match each other, so the choice must be the same everywhere.
  Result<bool> AgreeOnCounts(std::span<const int64_t> send_counts,
                             std::span<const int64_t> recv_counts, bool fits) {
    constexpr std::string_view kOp = "all_to_all_v";
    std::vector<int64_t> peer_sends(size_);
    UCP_RETURN_IF_ERROR(Check(
        MPI_Alltoall(send_counts.data(), 1, MPI_INT64_T, peer_sends.data(), 1, MPI_INT64_T, comm_),
        "MPI_Alltoall", kOp, "the counts"));
    int bad_peer = -1;
    for (int j = 0; j < size_ && bad_peer < 0; ++j) {
      if (peer_sends[j] != recv_counts[j]) bad_peer = j;
    }
    // {first rank with a mismatch (size_ if none), 1 if this rank's counts fit ints}, minimised.
    int verdict[2] = {bad_peer >= 0 ? rank_ : size_, fits ? 1 : 0};
    UCP_RETURN_IF_ERROR(Check(MPI_Allreduce(MPI_IN_PLACE, verdict, 2, MPI_INT, MPI_MIN, comm_),
                              "MPI_Allreduce", kOp, "the count check"));
    const int first_bad_rank = verdict[0];
    if (first_bad_rank == size_) return verdict[1] == 1;
    if (bad_peer >= 0) {
      return InvalidArgumentError(Prefix(kOp, *this) + "rank " + std::to_string(rank_) +
                                  " expects " + std::to_string(recv_counts[bad_peer]) +
                                  " floats from rank " + std::to_string(bad_peer) +
                                  ", which sends " + std::to_string(peer_sends[bad_peer]));
    }
    return InvalidArgumentError(Prefix(kOp, *this) + "rank " + std::to_string(first_bad_rank) +
                                "'s recv counts disagree with its peers' send counts");
  }

  // Counts and displacements as ints, or false when one does not fit Max().
  bool ToInts(std::span<const int64_t> counts, std::vector<int>& ints,
              std::vector<int>& displs) const {
    int64_t at = 0;
    for (int j = 0; j < size_; ++j) {
      if (counts[j] > max_ || at > max_) return false;
      ints[j] = static_cast<int>(counts[j]);
      displs[j] = static_cast<int>(at);
      at += counts[j];
    }
    return true;
  }

  MPI_Comm comm_;
  int rank_;
  int size_;
  int64_t max_;
};

bool LaunchedByMpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

std::mutex init_mu;

}  // namespace

Result<std::unique_ptr<Communicator>> WorldCommunicator(const CommunicatorOptions& options) {
  if (options.max_elements_per_call < 1 || options.max_elements_per_call > INT_MAX) {
    return InvalidArgumentError("world communicator: max_elements_per_call " +
                                std::to_string(options.max_elements_per_call) +
                                " is outside [1, INT_MAX]");
  }
  if (!LaunchedByMpi()) return SelfCommunicator();
  std::lock_guard<std::mutex> lock(init_mu);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (code != MPI_SUCCESS) return IoError("MPI_Init_thread failed: " + MpiErrorText(code));
    std::atexit(FinalizeAtExit);
  }
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_FUNNELED) {
    return FailedPreconditionError(
        "world communicator: MPI was initialised without MPI_THREAD_FUNNELED (level " +
        std::to_string(provided) + ")");
  }
  // A duplicate, so that our error handler and our traffic do not touch other users of
  // MPI_COMM_WORLD (ucp/mpi's ProcessGroup).
  MPI_Comm world = MPI_COMM_NULL;
  const int code = MPI_Comm_dup(MPI_COMM_WORLD, &world);
  if (code != MPI_SUCCESS) return IoError("MPI_Comm_dup failed: " + MpiErrorText(code));
  return MpiCommunicator::Wrap(world, options.max_elements_per_call);
}

}  // namespace ucp::offload
