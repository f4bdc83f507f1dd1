// The engine's communicator: the collectives that ZeRO data parallelism and Ulysses sequence
// parallelism need, behind one interface, on host buffers. On CPU machines one MPI process
// stands in for one GPU and MPI implements it (mpi_communicator.cc, Debian's OpenMPI); the CUDA
// engine's collectives on device memory are NCCL's (offload/cuda/nccl_communicator.h: the same
// calls on device pointers and a stream, started over this one, adding in the same order).
//
// The collectives (P = size(), r = rank(); every process of the communicator calls each one, in
// the same order, with the same sizes, else it is a caller bug that MPI may report or may hang on):
//   AllReduce(x, op)        x <- op over all ranks of x, elementwise, in place.
//   ReduceScatter(in, out)  in = P blocks of out.size(); out <- sum over ranks of block r.
//   AllGather(in, out)      out = P blocks of in.size(); block j <- rank j's in.
//   AllToAll(in, out)       in and out = P equal blocks; out block j <- rank j's in block r
//                           (Ulysses: sequence shards <-> head shards).
//   AllToAllV(in, sc, out, rc)  the same with per-peer counts: in holds sc[0] floats for rank 0,
//                           then sc[1] for rank 1, ...; out receives rc[j] floats from rank j, in
//                           rank order. The counts are checked against the peers' (see below).
//   Broadcast(bytes, root)  every rank's bytes <- root's bytes.
//   Barrier()               returns once every rank has entered it.
//   Split(color, key)       the processes with the same color, ranked by key (MPI_Comm_split):
//                           the engine makes its dp and sp groups with it.
//   AllReduceDeterministic / ReduceScatterDeterministic: sums whose bits depend neither on the
//                           library's algorithm nor on the run (below).
//
// Deterministic sums. MPI (and NCCL) choose the reduction algorithm from the message size, the
// process count and the library version, so AllReduce(kSum) on floats may differ in the last bits
// between layouts, process counts and library versions. The *Deterministic collectives never let
// the library add: each rank receives every rank's copy of the elements it owns (AllToAll), adds
// them itself in a fixed order (SumOrder), and the owned sums are then gathered (AllGather). The
// result is the same bits on every rank and in every run of the same layout. Cost: the bytes of a
// ring all-reduce (2 (P-1)/P n floats sent per rank), scratch of about 2 n floats (AllReduce) or
// P * out.size() floats (ReduceScatter), and no overlap of the adds with the transfers; not yet
// timed against the native calls, expect them slower. With SumOrder::kHalvingTree and a
// power-of-two P the sum is also independent of P when each rank pre-reduces its contiguous share
// of the leaves with the same tree (ordered_sum.h): a --deterministic trainer mode can build
// bitwise dp-invariance on that.
//
// Buffers. The caller owns every buffer; nothing is kept after a call returns (all calls are
// blocking). Inputs and outputs must not overlap (kInvalidArgument: MPI forbids aliasing), except
// where a call works in place on one span.
//
// Sizes. Every size a call can check by itself is checked before any communication: a mismatch
// is kInvalidArgument, never undefined behaviour. Element counts above INT_MAX (MPI counts are
// int) are split into several calls. Only AllToAllV exchanges its counts first, because uneven
// counts are where a caller is most likely to be wrong; the equal-count collectives trust every
// rank to pass the same size (checking it would cost a collective per call).
//
// Threads. One thread calls a communicator (MPI is initialised MPI_THREAD_FUNNELED: the thread
// that created the world communicator makes every MPI call). Different communicators of one
// process are used from that same thread, one call at a time.
//
// Failure. A communication error comes back as a Status (MPI_ERRORS_RETURN is set on every MPI
// communicator). A process that dies (SIGKILL, a crash) makes mpirun kill the others within a few
// seconds (tests/comm/comm_mpi_test.sh measures it), so no heartbeat is needed here. A process that
// fails with an error while its peers may still be waiting in a collective must not just return
// from main (MPI_Finalize would wait for them forever): it calls Abort(), which ends the job.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "offload/comm/ordered_sum.h"
#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload {

/// The elementwise operation of AllReduce.
enum class ReduceOp : uint8_t { kSum, kMax };

/// Options of the MPI communicator.
struct CommunicatorOptions {
  /// The most elements one MPI call moves; larger spans are split into several calls. MPI counts
  /// are int, hence INT_MAX; tests set it small to exercise the split paths.
  int64_t max_elements_per_call = 2147483647;
};

/// A group of processes that run collectives together. See the file comment for the meaning of
/// each call, buffer ownership, thread rules and failure handling.
class Communicator {
 public:
  virtual ~Communicator() = default;

  /// This process's rank in [0, size()).
  virtual int rank() const = 0;
  /// The number of processes.
  virtual int size() const = 0;

  /// The sub-communicator of the processes that pass the same `color`, ranked by `key` (ties by
  /// rank in this communicator), as MPI_Comm_split. Collective over this communicator.
  /// Errors: kInvalidArgument (color < 0); kIoError when MPI fails.
  virtual Result<std::unique_ptr<Communicator>> Split(int color, int key) = 0;

  /// `data` <- op over all ranks, elementwise, in place. kSum on floats leaves the order of the
  /// adds to the library (use AllReduceDeterministic for fixed bits); int64 sums are exact.
  /// Errors: kIoError when MPI fails (the message names the call, the size and the rank).
  virtual Status AllReduce(std::span<float> data, ReduceOp op) = 0;
  virtual Status AllReduce(std::span<double> data, ReduceOp op) = 0;
  virtual Status AllReduce(std::span<int64_t> data, ReduceOp op) = 0;

  /// `out` <- the sum over ranks of block rank() of `in` (in.size() == size() * out.size()).
  /// Errors: kInvalidArgument (sizes, overlapping spans); kIoError when MPI fails.
  virtual Status ReduceScatter(std::span<const float> in, std::span<float> out) = 0;

  /// Block j of `out` <- rank j's `in` (out.size() == size() * in.size()).
  /// Errors: kInvalidArgument (sizes, overlapping spans); kIoError when MPI fails.
  virtual Status AllGather(std::span<const float> in, std::span<float> out) = 0;

  /// Block j of `out` <- block rank() of rank j's `in`; in and out hold size() equal blocks.
  /// Errors: kInvalidArgument (sizes not size() equal blocks or different, overlapping spans);
  /// kIoError when MPI fails.
  virtual Status AllToAll(std::span<const float> in, std::span<float> out) = 0;

  /// AllToAll with per-peer counts: `in` is send_counts[0] floats for rank 0, then
  /// send_counts[1] for rank 1, ...; `out` gets recv_counts[j] floats from rank j, in rank order.
  /// The counts are exchanged first (one small all-to-all and an all-reduce of a flag), so that a
  /// recv_count that disagrees with the peer's send_count fails on every rank alike.
  /// Errors: kInvalidArgument (count arrays not of size(), negative counts, a span not of the
  /// counts' sum, overlapping spans, a count that disagrees with the peer's, naming both ranks);
  /// kIoError when MPI fails.
  virtual Status AllToAllV(std::span<const float> in, std::span<const int64_t> send_counts,
                           std::span<float> out, std::span<const int64_t> recv_counts) = 0;

  /// Every rank's `data` <- rank `root`'s (the same size on every rank).
  /// Errors: kInvalidArgument (root outside [0, size())); kIoError when MPI fails.
  virtual Status Broadcast(std::span<std::byte> data, int root) = 0;

  /// Returns once every rank has entered it. Errors: kIoError when MPI fails.
  virtual Status Barrier() = 0;

  /// Ends every process of the job with `exit_code` (MPI_Abort; std::_Exit for one process). For
  /// a process that failed while its peers may be waiting in a collective. Does not return.
  [[noreturn]] virtual void Abort(int exit_code) = 0;

  /// AllReduce(kSum) with the adds done here, in `order`, over fp32 (see the file comment): the
  /// same bits on every rank and in every run of the same layout. Built on AllToAll and
  /// AllGather, so every implementation gets the same bits. Scratch: about 2 * data.size() floats.
  /// Errors: those of AllToAll and AllGather, with "while all_reduce_deterministic" appended.
  Status AllReduceDeterministic(std::span<float> data, SumOrder order = SumOrder::kRankOrder);

  /// ReduceScatter with the adds done here, in `order` (in.size() == size() * out.size()).
  /// Scratch: size() * out.size() floats.
  /// Errors: kInvalidArgument (sizes, overlapping spans); those of AllToAll.
  Status ReduceScatterDeterministic(std::span<const float> in, std::span<float> out,
                                    SumOrder order = SumOrder::kRankOrder);
};

/// MPI_COMM_WORLD when an MPI launcher started this process (OMPI_COMM_WORLD_SIZE, PMI_SIZE or
/// PMIX_RANK set): MPI is initialised if nobody did (MPI_THREAD_FUNNELED) and finalised at exit.
/// Otherwise a one-process communicator without MPI, so single-process training needs no mpirun.
/// Errors: kIoError when MPI fails to initialise; kFailedPrecondition when MPI was initialised
/// by someone else with less than MPI_THREAD_FUNNELED.
Result<std::unique_ptr<Communicator>> WorldCommunicator(const CommunicatorOptions& options = {});

/// A communicator of this process alone (no MPI): every collective is a copy or a no-op, with
/// the same size checks as the MPI one. For tests and single-process runs.
std::unique_ptr<Communicator> SelfCommunicator();

/// This process's rank among its node's, as its launcher says: OMPI_COMM_WORLD_LOCAL_RANK
/// (OpenMPI), MPI_LOCALRANKID (MPICH's Hydra), SLURM_LOCALID (srun) or LOCAL_RANK (torchrun),
/// the first set to a number >= 0; else `rank` (one node, ranks numbered along it). What picks a
/// process's GPU: the world rank would give two processes of a node one GPU under
/// `mpirun --map-by node`.
int LauncherLocalRank(int rank);

}  // namespace ucp::offload
