// Size and aliasing checks shared by every Communicator implementation (MPI here, NCCL in the
// CUDA engine), so that each rejects the same calls with the same kInvalidArgument messages
// before it communicates. Internal to offload/comm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "offload/comm/communicator.h"
#include "ucp/base/status.h"

namespace ucp::offload::internal_comm {

/// "rank 1 of 4": where an error happened, for messages.
std::string Where(const Communicator& comm);

/// The prefix of every message: "all_gather (rank 1 of 4): ".
std::string Prefix(std::string_view op, const Communicator& comm);

/// kInvalidArgument when two non-empty byte ranges overlap (MPI forbids aliased buffers).
Status CheckDisjoint(std::string_view op, const Communicator& comm, const void* in, size_t in_bytes,
                     const void* out, size_t out_bytes);

/// in == size() * out floats (reduce-scatter).
Status CheckReduceScatterSizes(std::string_view op, const Communicator& comm, size_t in,
                               size_t out);
/// out == size() * in floats (all-gather).
Status CheckAllGatherSizes(std::string_view op, const Communicator& comm, size_t in, size_t out);
/// in == out, a multiple of size() (all-to-all).
Status CheckAllToAllSizes(std::string_view op, const Communicator& comm, size_t in, size_t out);
/// size() counts each, none negative, summing to the span sizes without overflow.
Status CheckAllToAllVSizes(std::string_view op, const Communicator& comm, size_t in,
                           std::span<const int64_t> send_counts, size_t out,
                           std::span<const int64_t> recv_counts);
/// root in [0, size()).
Status CheckRoot(std::string_view op, const Communicator& comm, int root);

}  // namespace ucp::offload::internal_comm
