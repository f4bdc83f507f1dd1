// NcclCommunicator (nccl_communicator.h): NCCL on device memory, started over the host
// communicator.
#include "offload/cuda/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <string>
#include <thread>

#include "offload/comm/comm_checks.h"
#include "offload/cuda/cuda_ordered_sum.h"
#include "offload/cuda/cuda_status.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload::cuda {
namespace {

using internal_comm::CommRanks;

ncclComm_t Comm(void* c) { return static_cast<ncclComm_t>(c); }

// What rank 0 sends the others: whether it could make the id, and the id.
struct IdMessage {
  int32_t ok = 0;
  ncclUniqueId id{};
};

// kInvalidArgument for a negative element or byte count.
Status CheckCount(const char* op, CommRanks where, int64_t n) {
  if (n >= 0) return Status::Ok();
  return InvalidArgumentError(internal_comm::Prefix(op, where) + "negative count " +
                              std::to_string(n));
}

}  // namespace

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(Communicator& host, int device) {
  const CommRanks where(host);
  const std::string who = internal_comm::Prefix("nccl init", where);
  // Each rank's own checks first, then one all-reduce of the outcome, so that no rank goes on
  // into ncclCommInitRank (which waits for every rank) while another has given up.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();  // the sticky "no driver" error
    devices = 0;
  }
  Status local = Status::Ok();
  if (device < 0 || device >= devices) {
    local = InvalidArgumentError(who + "no CUDA device " + std::to_string(device) + " (" +
                                 std::to_string(devices) + " visible)");
  } else {
    local =
        CudaStatus(cudaSetDevice(device), who + "cudaSetDevice(" + std::to_string(device) + ")");
  }
  IdMessage msg;
  if (host.rank() == 0 && local.ok()) {
    const ncclResult_t r = ncclGetUniqueId(&msg.id);
    if (r == ncclSuccess) {
      msg.ok = 1;
    } else {
      local = DeviceError(who + "ncclGetUniqueId: " + ncclGetErrorString(r));
    }
  }
  if (host.size() > 1) {
    int64_t failed[2] = {local.ok() ? 0 : 1, local.ok() ? -1 : host.rank()};
    UCP_RETURN_IF_ERROR(host.AllReduce(std::span<int64_t>(failed), ReduceOp::kMax), who);
    if (!local.ok()) return local;
    if (failed[0] != 0) {
      return FailedPreconditionError(who + "rank " + std::to_string(failed[1]) +
                                     " could not start NCCL (its error says why)");
    }
    UCP_RETURN_IF_ERROR(host.Broadcast(std::as_writable_bytes(std::span<IdMessage>(&msg, 1)), 0),
                        who);
    if (msg.ok != 1) return DeviceError(who + "rank 0 sent no NCCL id");
  } else if (!local.ok()) {
    return local;
  }
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, host.size(), msg.id, host.rank());
  if (r != ncclSuccess) {
    return DeviceError(who + "ncclCommInitRank: " + ncclGetErrorString(r) + " (" +
                       ncclGetLastError(nullptr) + ")");
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, host.rank(), host.size(), device));
}

NcclCommunicator::~NcclCommunicator() {
  // Aborted, not destroyed: ncclCommDestroy finalizes, which waits for the peers' communicators
  // to be quiescent, and a communicator may go away on this rank alone (a failure elsewhere in
  // its process, before the launcher ends the job). Abort is local; every call has been
  // synchronised (Synchronize) before a clean end, so it cuts nothing short there.
  if (comm_ != nullptr) ncclCommAbort(Comm(comm_));
}

Status NcclCommunicator::Usable(const char* op) const {
  if (failed_.empty()) return Status::Ok();
  return FailedPreconditionError(internal_comm::Prefix(op, CommRanks(rank_, size_)) +
                                 "the communicator was aborted after " + failed_);
}

Status NcclCommunicator::Ready(const char* op, int64_t count, const void* in, int in_blocks,
                               const void* out, int out_blocks) const {
  UCP_RETURN_IF_ERROR(Usable(op));
  const CommRanks where(rank_, size_);
  UCP_RETURN_IF_ERROR(CheckCount(op, where, count));
  const auto bytes = static_cast<size_t>(count) * 4;
  return internal_comm::CheckDisjoint(op, where, in, bytes * static_cast<size_t>(in_blocks), out,
                                      bytes * static_cast<size_t>(out_blocks));
}

Status NcclCommunicator::Nccl(int result, const char* op) {
  const auto r = static_cast<ncclResult_t>(result);
  if (r == ncclSuccess) return Status::Ok();
  std::string msg = internal_comm::Prefix(op, CommRanks(rank_, size_)) + ncclGetErrorString(r);
  const char* last = ncclGetLastError(Comm(comm_));
  if (last != nullptr && *last != '\0') msg += " (" + std::string(last) + ")";
  // Argument errors leave the communicator usable; anything else may have left peers waiting.
  if (r != ncclInvalidArgument && r != ncclInvalidUsage) {
    failed_ = msg;
    ncclCommAbort(Comm(comm_));
    comm_ = nullptr;
  }
  return DeviceError(msg);
}

Status NcclCommunicator::AllReduce(float* data, int64_t n, ReduceOp op, cudaStream_t stream) {
  UCP_RETURN_IF_ERROR(Ready("all_reduce", n, nullptr, 0, nullptr, 0));
  if (n == 0) return Status::Ok();
  return Nccl(ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat32,
                            op == ReduceOp::kSum ? ncclSum : ncclMax, Comm(comm_), stream),
              "all_reduce");
}

Status NcclCommunicator::ReduceScatter(const float* in, float* out, int64_t out_n,
                                       cudaStream_t stream) {
  constexpr const char* kOp = "reduce_scatter";
  UCP_RETURN_IF_ERROR(Ready(kOp, out_n, in, size_, out, 1));
  const auto n = static_cast<size_t>(out_n);
  if (n == 0) return Status::Ok();
  return Nccl(ncclReduceScatter(in, out, n, ncclFloat32, ncclSum, Comm(comm_), stream), kOp);
}

Status NcclCommunicator::AllGather(const float* in, float* out, int64_t in_n, cudaStream_t stream) {
  constexpr const char* kOp = "all_gather";
  UCP_RETURN_IF_ERROR(Ready(kOp, in_n, in, 1, out, size_));
  const auto n = static_cast<size_t>(in_n);
  if (n == 0) return Status::Ok();
  return Nccl(ncclAllGather(in, out, n, ncclFloat32, Comm(comm_), stream), kOp);
}

Status NcclCommunicator::AllToAll(const float* in, float* out, int64_t n, cudaStream_t stream) {
  constexpr const char* kOp = "all_to_all";
  UCP_RETURN_IF_ERROR(Ready(kOp, n, in, 1, out, 1));
  const auto total = static_cast<size_t>(n);
  UCP_RETURN_IF_ERROR(
      internal_comm::CheckAllToAllSizes(kOp, CommRanks(rank_, size_), total, total));
  if (total == 0) return Status::Ok();
  return Nccl(
      ncclAlltoAll(in, out, total / static_cast<size_t>(size_), ncclFloat32, Comm(comm_), stream),
      kOp);
}

Status NcclCommunicator::AllToAllV(const float* in, const int64_t* send_counts, float* out,
                                   const int64_t* recv_counts, cudaStream_t stream) {
  constexpr const char* kOp = "all_to_all_v";
  UCP_RETURN_IF_ERROR(Usable(kOp));
  const auto p = static_cast<size_t>(size_);
  const std::span<const int64_t> sc(send_counts, p), rc(recv_counts, p);
  int64_t sent = 0, received = 0;
  for (size_t j = 0; j < p; ++j) {
    sent += std::max<int64_t>(0, sc[j]);
    received += std::max<int64_t>(0, rc[j]);
  }
  const CommRanks where(rank_, size_);
  UCP_RETURN_IF_ERROR(internal_comm::CheckAllToAllVSizes(kOp, where, static_cast<size_t>(sent), sc,
                                                         static_cast<size_t>(received), rc));
  UCP_RETURN_IF_ERROR(internal_comm::CheckDisjoint(kOp, where, in, static_cast<size_t>(sent) * 4,
                                                   out, static_cast<size_t>(received) * 4));
  // One group of sends and receives: NCCL runs them together, without deadlock in any order.
  UCP_RETURN_IF_ERROR(Nccl(ncclGroupStart(), kOp));
  int64_t at_in = 0, at_out = 0;
  ncclResult_t first = ncclSuccess;
  for (size_t j = 0; j < p; ++j) {
    if (sc[j] > 0 && first == ncclSuccess) {
      first = ncclSend(in + at_in, static_cast<size_t>(sc[j]), ncclFloat32, static_cast<int>(j),
                       Comm(comm_), stream);
    }
    if (rc[j] > 0 && first == ncclSuccess) {
      first = ncclRecv(out + at_out, static_cast<size_t>(rc[j]), ncclFloat32, static_cast<int>(j),
                       Comm(comm_), stream);
    }
    at_in += sc[j];
    at_out += rc[j];
  }
  const ncclResult_t end = ncclGroupEnd();
  // The group's failure first where it is not an argument's: it aborts the communicator (peers
  // may be waiting), which an earlier call's argument error alone would not.
  if (end != ncclSuccess && end != ncclInvalidArgument && end != ncclInvalidUsage) {
    return Nccl(end, kOp);
  }
  UCP_RETURN_IF_ERROR(Nccl(first, kOp));
  return Nccl(end, kOp);
}

Status NcclCommunicator::Broadcast(void* data, int64_t bytes, int root, cudaStream_t stream) {
  constexpr const char* kOp = "broadcast";
  UCP_RETURN_IF_ERROR(Usable(kOp));
  UCP_RETURN_IF_ERROR(internal_comm::CheckRoot(kOp, CommRanks(rank_, size_), root));
  UCP_RETURN_IF_ERROR(CheckCount(kOp, CommRanks(rank_, size_), bytes));
  if (bytes == 0) return Status::Ok();
  return Nccl(
      ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclUint8, root, Comm(comm_), stream),
      kOp);
}

Status NcclCommunicator::ReduceScatterDeterministic(const float* in, float* out, int64_t out_n,
                                                    float* scratch, SumOrder order,
                                                    cudaStream_t stream) {
  constexpr const char* kOp = "reduce_scatter_deterministic";
  UCP_RETURN_IF_ERROR(Usable(kOp));
  const CommRanks where(rank_, size_);
  UCP_RETURN_IF_ERROR(CheckCount(kOp, where, out_n));
  const size_t n = static_cast<size_t>(out_n), all = n * static_cast<size_t>(size_);
  UCP_RETURN_IF_ERROR(internal_comm::CheckDisjoint(kOp, where, in, all * 4, out, n * 4));
  UCP_RETURN_IF_ERROR(internal_comm::CheckDisjoint(kOp, where, in, all * 4, scratch, all * 4));
  UCP_RETURN_IF_ERROR(internal_comm::CheckDisjoint(kOp, where, scratch, all * 4, out, n * 4));
  if (n == 0) return Status::Ok();
  // Block j of the scratch is rank j's copy of the block this rank owns (NCCL only moves bytes),
  // then added here in one order, as Communicator::ReduceScatterDeterministic does on the host.
  UCP_RETURN_IF_ERROR(AllToAll(in, scratch, static_cast<int64_t>(all), stream),
                      std::string("while ") + kOp);
  return OrderedSumOnDevice(out, scratch, size_, out_n, order == SumOrder::kHalvingTree, stream);
}

int64_t NcclCommunicator::AllReduceDeterministicScratch(int64_t n) const {
  if (size_ == 1 || n <= 0) return 0;
  const int64_t b = (n + size_ - 1) / size_;
  return 2 * size_ * b + b;
}

Status NcclCommunicator::AllReduceDeterministic(float* data, int64_t n, float* scratch,
                                                SumOrder order, cudaStream_t stream) {
  constexpr const char* kOp = "all_reduce_deterministic";
  UCP_RETURN_IF_ERROR(Usable(kOp));
  UCP_RETURN_IF_ERROR(CheckCount(kOp, CommRanks(rank_, size_), n));
  if (size_ == 1 || n == 0) return Status::Ok();  // one contribution is its own sum
  UCP_RETURN_IF_ERROR(internal_comm::CheckDisjoint(
      kOp, CommRanks(rank_, size_), data, static_cast<size_t>(n) * 4, scratch,
      static_cast<size_t>(AllReduceDeterministicScratch(n)) * 4));
  // As Communicator::AllReduceDeterministic: rank r owns elements [r b, (r + 1) b) of the data
  // padded with zeros to size() b; reduce-scatter, then all-gather.
  const int64_t b = (n + size_ - 1) / size_, padded_n = size_ * b;
  float* padded = scratch;
  float* gathered = scratch + padded_n;
  float* mine = gathered + padded_n;
  const std::string during = std::string("while ") + kOp;
  UCP_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(padded, data, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, stream),
      during));
  UCP_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(padded + n, 0, static_cast<size_t>(padded_n - n) * 4, stream), during));
  UCP_RETURN_IF_ERROR(ReduceScatterDeterministic(padded, mine, b, gathered, order, stream), during);
  UCP_RETURN_IF_ERROR(AllGather(mine, padded, b, stream), during);
  return CudaStatus(
      cudaMemcpyAsync(data, padded, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, stream),
      during);
}

Status NcclCommunicator::Synchronize(cudaStream_t stream) {
  UCP_RETURN_IF_ERROR(Usable("synchronize"));
  // cudaStreamSynchronize would wait forever on a collective whose peer is gone; polling lets
  // NCCL's asynchronous error end the wait.
  auto pause = std::chrono::microseconds(20);
  while (true) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done == cudaSuccess) return Status::Ok();
    if (done != cudaErrorNotReady) {
      return CudaStatus(done, internal_comm::Prefix("synchronize", CommRanks(rank_, size_)));
    }
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(Comm(comm_), &async);
    if (r != ncclSuccess) return Nccl(r, "synchronize");
    if (async != ncclSuccess && async != ncclInProgress) return Nccl(async, "synchronize");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace ucp::offload::cuda
