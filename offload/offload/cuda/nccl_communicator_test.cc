// The NCCL communicator (nccl_communicator.h) against the host's (communicator.h) on the same
// inputs: the deterministic sums bitwise (both orders, sizes that do not divide by the ranks),
// the byte-moving collectives bitwise (all-to-all with uneven counts too), NCCL's own sums within fp32 rounding; the device's
// ordered sum bitwise OrderedSum; the argument errors before any communication, after which the
// communicator still works.
//
// GPU tests (label gpu): one process per GPU, under mpirun where there are several (each rank on
// device rank % devices: NCCL refuses two ranks on one GPU), or alone, where the host
// communicator is the one-process one. NcclNoDevice.* need no GPU and run in the default suite
// (ctest offload_nccl_nodevice_test): the library links and loads, and refuses a missing device.
#include "offload/cuda/nccl_communicator.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/comm/ordered_sum.h"
#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_ordered_sum.h"
#include "tests/testutil/status_matchers.h"

namespace ucp::offload::cuda {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

// The host communicator of the test process: MPI's world under a launcher, else one process.
Communicator& Host() {
  static std::unique_ptr<Communicator> host = [] {
    Result<std::unique_ptr<Communicator>> w = WorldCommunicator();
    EXPECT_TRUE(w.ok()) << w.status().message();
    return w.ok() ? std::move(*w) : SelfCommunicator();
  }();
  return *host;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  // Many magnitudes, so that another order of the adds changes bits.
  for (size_t i = 0; i < n; ++i) v[i] = d(rng) * std::ldexp(1.0f, static_cast<int>(i % 23) - 11);
  return v;
}

struct DeviceBuffer {
  explicit DeviceBuffer(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * 4), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p); }
  void Put(const std::vector<float>& h) {
    ASSERT_EQ(h.size(), n);
    ASSERT_EQ(cudaMemcpy(p, h.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<float> Get() const {
    std::vector<float> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  float* p = nullptr;
  size_t n;
};

bool Same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST(NcclNoDevice, RefusesAMissingDevice) {
  for (int device : {-1, DeviceCount()}) {
    Result<std::unique_ptr<NcclCommunicator>> c = NcclCommunicator::Create(Host(), device);
    EXPECT_THAT(c.status(), StatusIs(StatusCode::kInvalidArgument,
                                     HasSubstr("no CUDA device " + std::to_string(device))));
  }
}

TEST(NcclNoDevice, OrderedSumChecksItsArguments) {
  float a[8] = {};
  EXPECT_THAT(OrderedSumOnDevice(a, a + 4, 0, 4, false),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("0 contributions")));
  EXPECT_THAT(OrderedSumOnDevice(a + 3, a, 2, 4, false),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlaps")));
}

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    Result<std::unique_ptr<NcclCommunicator>> c =
        NcclCommunicator::Create(Host(), Host().rank() % DeviceCount());
    ASSERT_TRUE(c.ok()) << c.status().message();
    nccl = std::move(*c);
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  }
  void TearDown() override {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  uint32_t Seed(uint32_t base) const { return base * 131 + static_cast<uint32_t>(Host().rank()); }
  std::unique_ptr<NcclCommunicator> nccl;
  cudaStream_t stream = nullptr;
};

TEST_F(Nccl, OrderedSumIsTheHostsBitwise) {
  const int64_t n = 100003;  // several blocks, a partial last one
  for (int64_t count : {1, 2, 3, 4, 6, 8, 16}) {
    const std::vector<float> parts = Random(static_cast<size_t>(count * n), 7);
    DeviceBuffer dparts(parts.size()), dout(static_cast<size_t>(n));
    dparts.Put(parts);
    for (SumOrder order : {SumOrder::kRankOrder, SumOrder::kHalvingTree}) {
      std::vector<float> want(static_cast<size_t>(n));
      UCP_ASSERT_OK(OrderedSum(parts, count, want, order));
      UCP_ASSERT_OK(
          OrderedSumOnDevice(dout.p, dparts.p, count, n, order == SumOrder::kHalvingTree, stream));
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_TRUE(Same(dout.Get(), want)) << "count " << count << " order " << int(order);
    }
  }
}

TEST_F(Nccl, DeterministicSumsAreTheHostCommunicatorsBitwise) {
  const int p = nccl->size();
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{4096} * p}) {
    for (SumOrder order : {SumOrder::kRankOrder, SumOrder::kHalvingTree}) {
      SCOPED_TRACE("n " + std::to_string(n) + " order " + std::to_string(int(order)));
      // all_reduce_deterministic
      std::vector<float> want = Random(static_cast<size_t>(n), Seed(1));
      DeviceBuffer data(want.size()),
          scratch(static_cast<size_t>(nccl->AllReduceDeterministicScratch(n)));
      data.Put(want);
      UCP_ASSERT_OK(Host().AllReduceDeterministic(want, order));
      UCP_ASSERT_OK(nccl->AllReduceDeterministic(data.p, n, scratch.p, order, stream));
      UCP_ASSERT_OK(nccl->Synchronize(stream));
      EXPECT_TRUE(Same(data.Get(), want)) << "all_reduce_deterministic";
      // reduce_scatter_deterministic: n floats per rank out
      const std::vector<float> in = Random(static_cast<size_t>(n * p), Seed(2));
      std::vector<float> out(static_cast<size_t>(n));
      UCP_ASSERT_OK(Host().ReduceScatterDeterministic(in, out, order));
      DeviceBuffer din(in.size()), dout(out.size()), dscratch(in.size());
      din.Put(in);
      UCP_ASSERT_OK(nccl->ReduceScatterDeterministic(din.p, dout.p, n, dscratch.p, order, stream));
      UCP_ASSERT_OK(nccl->Synchronize(stream));
      EXPECT_TRUE(Same(dout.Get(), out)) << "reduce_scatter_deterministic";
    }
  }
}

TEST_F(Nccl, CollectivesMatchTheHostCommunicator) {
  const int p = nccl->size();
  const int64_t n = 3000;
  // Byte-moving collectives: bitwise.
  const std::vector<float> block = Random(static_cast<size_t>(n), Seed(3));
  std::vector<float> gathered(static_cast<size_t>(n * p));
  UCP_ASSERT_OK(Host().AllGather(block, gathered));
  DeviceBuffer dblock(block.size()), dgathered(gathered.size());
  dblock.Put(block);
  UCP_ASSERT_OK(nccl->AllGather(dblock.p, dgathered.p, n, stream));
  UCP_ASSERT_OK(nccl->Synchronize(stream));
  EXPECT_TRUE(Same(dgathered.Get(), gathered)) << "all_gather";

  const std::vector<float> send = Random(static_cast<size_t>(n * p), Seed(4));
  std::vector<float> recv(send.size());
  UCP_ASSERT_OK(Host().AllToAll(send, recv));
  DeviceBuffer dsend(send.size()), drecv(recv.size());
  dsend.Put(send);
  UCP_ASSERT_OK(nccl->AllToAll(dsend.p, drecv.p, n * p, stream));
  UCP_ASSERT_OK(nccl->Synchronize(stream));
  EXPECT_TRUE(Same(drecv.Get(), recv)) << "all_to_all";

  // Uneven counts: rank i sends (i + j) % 3 + 1 blocks of 100 floats to rank j.
  std::vector<int64_t> counts(static_cast<size_t>(p));
  for (int j = 0; j < p; ++j) counts[static_cast<size_t>(j)] = ((Host().rank() + j) % 3 + 1) * 100;
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const std::vector<float> vsend = Random(static_cast<size_t>(total), Seed(8));
  std::vector<float> vrecv(vsend.size());
  UCP_ASSERT_OK(Host().AllToAllV(vsend, counts, vrecv, counts));
  DeviceBuffer dvsend(vsend.size()), dvrecv(vrecv.size());
  dvsend.Put(vsend);
  UCP_ASSERT_OK(nccl->AllToAllV(dvsend.p, counts.data(), dvrecv.p, counts.data(), stream));
  UCP_ASSERT_OK(nccl->Synchronize(stream));
  EXPECT_TRUE(Same(dvrecv.Get(), vrecv)) << "all_to_all_v";

  std::vector<float> bcast = Random(static_cast<size_t>(n), Seed(5));
  DeviceBuffer dbcast(bcast.size());
  dbcast.Put(bcast);
  const int root = p - 1;
  UCP_ASSERT_OK(Host().Broadcast(std::as_writable_bytes(std::span<float>(bcast)), root));
  UCP_ASSERT_OK(nccl->Broadcast(dbcast.p, n * 4, root, stream));
  UCP_ASSERT_OK(nccl->Synchronize(stream));
  EXPECT_TRUE(Same(dbcast.Get(), bcast)) << "broadcast";

  // NCCL's own sums: the max bitwise, the sum within fp32 rounding of p terms.
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
    std::vector<float> want = Random(static_cast<size_t>(n), Seed(6));
    DeviceBuffer d(want.size());
    d.Put(want);
    std::vector<float> mag(want.size());
    for (size_t i = 0; i < want.size(); ++i) mag[i] = std::abs(want[i]);
    UCP_ASSERT_OK(Host().AllReduce(std::span<float>(want), op));
    UCP_ASSERT_OK(Host().AllReduce(std::span<float>(mag), ReduceOp::kSum));
    UCP_ASSERT_OK(nccl->AllReduce(d.p, n, op, stream));
    UCP_ASSERT_OK(nccl->Synchronize(stream));
    const std::vector<float> got = d.Get();
    if (op == ReduceOp::kMax) {
      EXPECT_TRUE(Same(got, want)) << "all_reduce max";
      continue;
    }
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 2.0 * p * 6e-8 * mag[i]) << "all_reduce sum, element " << i;
    }
  }
  std::vector<float> parts = Random(static_cast<size_t>(n * p), Seed(7));
  std::vector<float> mine(static_cast<size_t>(n)), mag(parts.size()), mag_mine(mine.size());
  for (size_t i = 0; i < parts.size(); ++i) mag[i] = std::abs(parts[i]);
  UCP_ASSERT_OK(Host().ReduceScatter(parts, mine));
  UCP_ASSERT_OK(Host().ReduceScatter(mag, mag_mine));
  DeviceBuffer dparts(parts.size()), dmine(mine.size());
  dparts.Put(parts);
  UCP_ASSERT_OK(nccl->ReduceScatter(dparts.p, dmine.p, n, stream));
  UCP_ASSERT_OK(nccl->Synchronize(stream));
  const std::vector<float> got = dmine.Get();
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], mine[i], 2.0 * p * 6e-8 * mag_mine[i]) << "reduce_scatter, element " << i;
  }
}

TEST_F(Nccl, RefusesBadArgumentsAndStaysUsable) {
  const int p = nccl->size();
  DeviceBuffer a(static_cast<size_t>(8 * p)), b(static_cast<size_t>(8 * p));
  EXPECT_THAT(nccl->AllGather(a.p, a.p + 1, 4, stream),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlap")));
  EXPECT_THAT(nccl->AllReduce(a.p, -1, ReduceOp::kSum, stream),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("negative count -1")));
  EXPECT_THAT(nccl->Broadcast(a.p, 4, p, stream),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("root " + std::to_string(p))));
  EXPECT_THAT(nccl->ReduceScatterDeterministic(a.p, b.p, 8, a.p, SumOrder::kRankOrder, stream),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlap")));
  std::vector<int64_t> bad(static_cast<size_t>(p), 1);
  bad[0] = -1;
  EXPECT_THAT(nccl->AllToAllV(a.p, bad.data(), b.p, bad.data(), stream),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("negative")));
  if (p > 1) {
    EXPECT_THAT(nccl->AllToAll(a.p, b.p, p + 1, stream),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("equal blocks")));
  }
  // Still usable: a broadcast from rank 0.
  std::vector<float> v(static_cast<size_t>(8 * p), static_cast<float>(Host().rank() + 1));
  a.Put(v);
  UCP_ASSERT_OK(nccl->Broadcast(a.p, 8 * p * 4, 0, stream));
  UCP_ASSERT_OK(nccl->Synchronize(stream));
  EXPECT_EQ(a.Get(), std::vector<float>(v.size(), 1.0f));
}

}  // namespace
}  // namespace ucp::offload::cuda
