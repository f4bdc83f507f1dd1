// The GPUs' communicator: NCCL collectives on device memory (issue 12: "NCCL carries the
// communicator's collectives on GPUs, MPI only to start it"). The engine's Communicator
// (offload/comm/communicator.h) stays the host's, for host buffers and for starting this one: rank
// 0 makes NCCL's unique id and the host communicator's Broadcast carries it to the others, which
// is MPI's only part; the bytes of the collectives then move GPU to GPU (NVLink, or the network
// NCCL finds), never through host memory.
//
// The calls mirror Communicator's, on device pointers and a CUDA stream: each checks what it can
// by itself (the same kInvalidArgument messages as the host communicators: comm_checks.h), then
// queues the collective on `stream` and returns; Synchronize waits for it. Every rank calls each
// one in the same order with the same sizes, else NCCL hangs or fails (a caller bug, as with MPI).
//
// Deterministic sums. NCCL chooses its reduction algorithm (ring, tree, NVLS) from the size, the
// GPUs and the version, so its AllReduce(kSum) bits may change with any of them. The
// *Deterministic calls let NCCL only move bytes (AllToAll, AllGather) and add on the device in a
// fixed order (cuda_ordered_sum.h): the bits Communicator's *Deterministic calls give on the host
// for the same inputs, so a trainer's gradient sums are the same whether the host or the GPUs add
// them, and the same in every run.
//
// Failure. A call's synchronous error (bad arguments, a launch) is a Status. NCCL reports errors
// met while the collectives run (a peer gone, a network failure) asynchronously: Synchronize polls
// for them while it waits, aborts the communicator (every later call fails), and returns a
// kDeviceError naming it. A process that dies is otherwise its launcher's to handle, as with the
// host communicator (mpirun ends the job).
//
// Threads: one thread uses a communicator, as NCCL requires of a communicator's calls.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "offload/comm/communicator.h"
#include "offload/comm/ordered_sum.h"
#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload::cuda {

class NcclCommunicator {
 public:
  /// Collective over `host` (every rank calls it): rank r of `host` becomes rank r here, on CUDA
  /// device `device`, which it makes this thread's current device. With one rank no id crosses.
  /// Errors: kInvalidArgument (no such device), kDeviceError (CUDA, NCCL), those of the host
  /// communicator; a rank whose own checks passed while another's failed returns
  /// kFailedPrecondition naming that rank (none waits in NCCL's start for it).
  static Result<std::unique_ptr<NcclCommunicator>> Create(Communicator& host, int device);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }

  /// data[0, n) <- op over all ranks, in place (NCCL's order of the adds: use
  /// AllReduceDeterministic for fixed bits).
  Status AllReduce(float* data, int64_t n, ReduceOp op, cudaStream_t stream);
  /// out[0, out_n) <- the sum over ranks of block rank() of in[0, size() * out_n) (NCCL's order).
  Status ReduceScatter(const float* in, float* out, int64_t out_n, cudaStream_t stream);
  /// Block j of out[0, size() * in_n) <- rank j's in[0, in_n).
  Status AllGather(const float* in, float* out, int64_t in_n, cudaStream_t stream);
  /// Block j of out <- block rank() of rank j's in; both hold n floats, size() equal blocks.
  Status AllToAll(const float* in, float* out, int64_t n, cudaStream_t stream);
  /// AllToAll with per-peer counts (host arrays of size() each): in holds send_counts[j] floats
  /// for rank j, in rank order; out gets recv_counts[j] floats from rank j, in rank order.
  /// NCCL cannot check the counts against the peers' (the host communicator's AllToAllV
  /// exchanges them first): a caller gives counts every rank derived alike.
  Status AllToAllV(const float* in, const int64_t* send_counts, float* out,
                   const int64_t* recv_counts, cudaStream_t stream);
  /// Every rank's data[0, bytes) <- rank root's.
  Status Broadcast(void* data, int64_t bytes, int root, cudaStream_t stream);

  /// ReduceScatter with the adds on this device in `order`: Communicator::
  /// ReduceScatterDeterministic's bits. scratch: size() * out_n floats of device memory, apart
  /// from in and out.
  Status ReduceScatterDeterministic(const float* in, float* out, int64_t out_n, float* scratch,
                                    SumOrder order, cudaStream_t stream);
  /// AllReduce(kSum) with the adds on the devices in `order`: Communicator::
  /// AllReduceDeterministic's bits. scratch: AllReduceDeterministicScratch(n) floats of device
  /// memory, apart from data.
  Status AllReduceDeterministic(float* data, int64_t n, float* scratch, SumOrder order,
                                cudaStream_t stream);
  int64_t AllReduceDeterministicScratch(int64_t n) const;

  /// Waits until the calls queued on `stream` have run, polling NCCL's asynchronous error.
  /// Errors: kDeviceError (the stream's, or NCCL's: the communicator is then aborted, and every
  /// later call fails with kFailedPrecondition).
  Status Synchronize(cudaStream_t stream);

 private:
  NcclCommunicator(void* comm, int rank, int size, int device)
      : comm_(comm), rank_(rank), size_(size), device_(device) {}
  Status Usable(const char* op) const;
  /// Usable, count >= 0, and `in` (in_blocks x count floats) apart from `out` (out_blocks x).
  Status Ready(const char* op, int64_t count, const void* in, int in_blocks, const void* out,
               int out_blocks) const;
  Status Nccl(int result, const char* op);
  void* comm_;  // ncclComm_t (nccl.h stays out of this header)
  int rank_, size_, device_;
  std::string failed_;  // set once an error aborted the communicator
};

}  // namespace ucp::offload::cuda
