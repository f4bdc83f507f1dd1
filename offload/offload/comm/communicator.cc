// The parts of Communicator that every implementation shares: the size checks, the
// deterministic collectives (built on AllToAll and AllGather; the NCCL communicator repeats them
// on the device, so host and GPUs give the same bits), and the one-process communicator.
#include "offload/comm/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "offload/comm/comm_checks.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload {
namespace internal_comm {

std::string Where(CommRanks comm) {
  return "rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
}

std::string Prefix(std::string_view op, CommRanks comm) {
  return std::string(op) + " (" + Where(comm) + "): ";
}

Status CheckDisjoint(std::string_view op, CommRanks comm, const void* in, size_t in_bytes,
                     const void* out, size_t out_bytes) {
  if (in_bytes == 0 || out_bytes == 0) return Status::Ok();
  const auto a = reinterpret_cast<uintptr_t>(in);
  const auto b = reinterpret_cast<uintptr_t>(out);
  if (a < b + out_bytes && b < a + in_bytes) {
    return InvalidArgumentError(Prefix(op, comm) + "the input (" + std::to_string(in_bytes) +
                                " bytes) and the output (" + std::to_string(out_bytes) +
                                " bytes) overlap");
  }
  return Status::Ok();
}

Status CheckReduceScatterSizes(std::string_view op, CommRanks comm, size_t in,
                               size_t out) {
  const auto p = static_cast<size_t>(comm.size());
  if (in % p != 0 || in / p != out) {
    return InvalidArgumentError(Prefix(op, comm) + "the input has " + std::to_string(in) +
                                " floats, expected " + std::to_string(p) + " ranks x " +
                                std::to_string(out) + " output floats");
  }
  return Status::Ok();
}

Status CheckAllGatherSizes(std::string_view op, CommRanks comm, size_t in, size_t out) {
  const auto p = static_cast<size_t>(comm.size());
  if (out % p != 0 || out / p != in) {
    return InvalidArgumentError(Prefix(op, comm) + "the output has " + std::to_string(out) +
                                " floats, expected " + std::to_string(p) + " ranks x " +
                                std::to_string(in) + " input floats");
  }
  return Status::Ok();
}

Status CheckAllToAllSizes(std::string_view op, CommRanks comm, size_t in, size_t out) {
  const auto p = static_cast<size_t>(comm.size());
  if (in != out) {
    return InvalidArgumentError(Prefix(op, comm) + "the input has " + std::to_string(in) +
                                " floats and the output " + std::to_string(out) +
                                ", expected the same");
  }
  if (in % p != 0) {
    return InvalidArgumentError(Prefix(op, comm) + std::to_string(in) + " floats are not " +
                                std::to_string(p) + " equal blocks");
  }
  return Status::Ok();
}

namespace {

Status CheckCounts(std::string_view op, CommRanks comm, std::string_view which,
                   std::span<const int64_t> counts, size_t span_size) {
  if (counts.size() != static_cast<size_t>(comm.size())) {
    return InvalidArgumentError(Prefix(op, comm) + std::to_string(counts.size()) + " " +
                                std::string(which) + " counts, expected one per rank (" +
                                std::to_string(comm.size()) + ")");
  }
  uint64_t total = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    if (counts[j] < 0) {
      return InvalidArgumentError(Prefix(op, comm) + std::string(which) + " count for rank " +
                                  std::to_string(j) + " is negative (" + std::to_string(counts[j]) +
                                  ")");
    }
    // Checked at every step: two counts below 2^63 cannot wrap a uint64_t.
    total += static_cast<uint64_t>(counts[j]);
    if (total > static_cast<uint64_t>(INT64_MAX)) {
      return InvalidArgumentError(Prefix(op, comm) + std::string(which) +
                                  " counts sum past INT64_MAX");
    }
  }
  if (total != span_size) {
    return InvalidArgumentError(Prefix(op, comm) + std::string(which) + " counts sum to " +
                                std::to_string(total) + " floats, but the span has " +
                                std::to_string(span_size));
  }
  return Status::Ok();
}

}  // namespace

Status CheckAllToAllVSizes(std::string_view op, CommRanks comm, size_t in,
                           std::span<const int64_t> send_counts, size_t out,
                           std::span<const int64_t> recv_counts) {
  UCP_RETURN_IF_ERROR(CheckCounts(op, comm, "send", send_counts, in));
  return CheckCounts(op, comm, "recv", recv_counts, out);
}

Status CheckRoot(std::string_view op, CommRanks comm, int root) {
  if (root < 0 || root >= comm.size()) {
    return InvalidArgumentError(Prefix(op, comm) + "root " + std::to_string(root) +
                                " is not a rank in [0, " + std::to_string(comm.size()) + ")");
  }
  return Status::Ok();
}

}  // namespace internal_comm

using internal_comm::CheckDisjoint;

Status Communicator::ReduceScatterDeterministic(std::span<const float> in, std::span<float> out,
                                                SumOrder order) {
  constexpr std::string_view kOp = "reduce_scatter_deterministic";
  UCP_RETURN_IF_ERROR(internal_comm::CheckReduceScatterSizes(kOp, *this, in.size(), out.size()));
  UCP_RETURN_IF_ERROR(
      CheckDisjoint(kOp, *this, in.data(), in.size_bytes(), out.data(), out.size_bytes()));
  // Block j of `gathered` is rank j's copy of the block this rank owns: the library only moves
  // bytes, and the adds below happen in one place, in one order.
  std::vector<float> gathered(in.size());
  UCP_RETURN_IF_ERROR(AllToAll(in, gathered), "while " + std::string(kOp));
  return OrderedSum(gathered, size(), out, order);
}

Status Communicator::AllReduceDeterministic(std::span<float> data, SumOrder order) {
  constexpr std::string_view kOp = "all_reduce_deterministic";
  if (size() == 1) return Status::Ok();  // one contribution: its sum is itself, in any order
  // Rank r owns elements [r b, (r + 1) b) of the data padded to size() * b; the padding is summed
  // and dropped. Reduce-scatter then all-gather: the bytes of a ring all-reduce.
  const auto p = static_cast<size_t>(size());
  const size_t b = (data.size() + p - 1) / p;
  std::vector<float> padded(p * b, 0.0f);
  std::copy(data.begin(), data.end(), padded.begin());
  std::vector<float> mine(b);
  UCP_RETURN_IF_ERROR(ReduceScatterDeterministic(padded, mine, order), "while " + std::string(kOp));
  UCP_RETURN_IF_ERROR(AllGather(mine, padded), "while " + std::string(kOp));
  std::copy(padded.begin(), padded.begin() + static_cast<std::ptrdiff_t>(data.size()),
            data.begin());
  return Status::Ok();
}

namespace {

// One process: every collective is a copy (or nothing), after the checks the MPI one makes.
class SelfCommunicatorImpl final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

  Result<std::unique_ptr<Communicator>> Split(int color, int /*key*/) override {
    if (color < 0) {
      return InvalidArgumentError(internal_comm::Prefix("split", *this) + "color " +
                                  std::to_string(color) + " is negative");
    }
    return std::unique_ptr<Communicator>(new SelfCommunicatorImpl());
  }
  Status AllReduce(std::span<float>, ReduceOp) override { return Status::Ok(); }
  Status AllReduce(std::span<double>, ReduceOp) override { return Status::Ok(); }
  Status AllReduce(std::span<int64_t>, ReduceOp) override { return Status::Ok(); }

  Status ReduceScatter(std::span<const float> in, std::span<float> out) override {
    UCP_RETURN_IF_ERROR(
        internal_comm::CheckReduceScatterSizes("reduce_scatter", *this, in.size(), out.size()));
    return Copy("reduce_scatter", in, out);
  }
  Status AllGather(std::span<const float> in, std::span<float> out) override {
    UCP_RETURN_IF_ERROR(
        internal_comm::CheckAllGatherSizes("all_gather", *this, in.size(), out.size()));
    return Copy("all_gather", in, out);
  }
  Status AllToAll(std::span<const float> in, std::span<float> out) override {
    UCP_RETURN_IF_ERROR(
        internal_comm::CheckAllToAllSizes("all_to_all", *this, in.size(), out.size()));
    return Copy("all_to_all", in, out);
  }
  Status AllToAllV(std::span<const float> in, std::span<const int64_t> send_counts,
                   std::span<float> out, std::span<const int64_t> recv_counts) override {
    UCP_RETURN_IF_ERROR(internal_comm::CheckAllToAllVSizes("all_to_all_v", *this, in.size(),
                                                           send_counts, out.size(), recv_counts));
    if (send_counts[0] != recv_counts[0]) {
      return InvalidArgumentError(internal_comm::Prefix("all_to_all_v", *this) + "rank 0 expects " +
                                  std::to_string(recv_counts[0]) +
                                  " floats from rank 0, which sends " +
                                  std::to_string(send_counts[0]));
    }
    return Copy("all_to_all_v", in, out);
  }
  Status Broadcast(std::span<std::byte> /*data*/, int root) override {
    return internal_comm::CheckRoot("broadcast", *this, root);
  }
  Status Barrier() override { return Status::Ok(); }
  [[noreturn]] void Abort(int exit_code) override { std::_Exit(exit_code); }

 private:
  Status Copy(std::string_view op, std::span<const float> in, std::span<float> out) {
    UCP_RETURN_IF_ERROR(
        CheckDisjoint(op, *this, in.data(), in.size_bytes(), out.data(), out.size_bytes()));
    std::copy(in.begin(), in.end(), out.begin());
    return Status::Ok();
  }
};

}  // namespace

int LauncherLocalRank(int rank) {
  for (const char* name :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end == '\0' && n >= 0 && n <= 1 << 20) return static_cast<int>(n);
  }
  return rank;
}

std::unique_ptr<Communicator> SelfCommunicator() {
  return std::make_unique<SelfCommunicatorImpl>();
}

}  // namespace ucp::offload
