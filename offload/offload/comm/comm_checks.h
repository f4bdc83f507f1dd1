// Size and aliasing checks shared by every communicator (MPI and the one-process one here, NCCL's
// on device memory in the CUDA engine: offload/cuda/nccl_communicator.h), so that each rejects
// the same calls with the same kInvalidArgument messages before it communicates. Internal to the
// engine's communicators.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "offload/comm/communicator.h"
#include "ucp/base/status.h"

namespace ucp::offload::internal_comm {

/// The rank and size an error names: a Communicator's (every implementation passes *this), or
/// those of a group that is not one (the CUDA engine's NCCL communicator on device memory).
class CommRanks {
 public:
  CommRanks(int rank, int size) : rank_(rank), size_(size) {}
  CommRanks(const Communicator& comm)  // NOLINT(google-explicit-constructor): *this at every call
      : rank_(comm.rank()), size_(comm.size()) {}
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  int rank_, size_;
};

/// "rank 1 of 4": where an error happened, for messages.
std::string Where(CommRanks comm);

/// The prefix of every message: "all_gather (rank 1 of 4): ".
std::string Prefix(std::string_view op, CommRanks comm);

/// kInvalidArgument when two non-empty byte ranges overlap (MPI forbids aliased buffers).
Status CheckDisjoint(std::string_view op, CommRanks comm, const void* in, size_t in_bytes,
                     const void* out, size_t out_bytes);

/// in == size() * out floats (reduce-scatter).
Status CheckReduceScatterSizes(std::string_view op, CommRanks comm, size_t in, size_t out);
/// out == size() * in floats (all-gather).
Status CheckAllGatherSizes(std::string_view op, CommRanks comm, size_t in, size_t out);
/// in == out, a multiple of size() (all-to-all).
Status CheckAllToAllSizes(std::string_view op, CommRanks comm, size_t in, size_t out);
/// size() counts each, none negative, summing to the span sizes without overflow.
Status CheckAllToAllVSizes(std::string_view op, CommRanks comm, size_t in,
                           std::span<const int64_t> send_counts, size_t out,
                           std::span<const int64_t> recv_counts);
/// root in [0, size()).
Status CheckRoot(std::string_view op, CommRanks comm, int root);

}  // namespace ucp::offload::internal_comm
