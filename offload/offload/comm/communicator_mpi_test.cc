// The MPI communicator against serial references, run by tests/comm/comm_mpi_test.sh under
// mpirun -np 1, 2, 3 and 4. Every rank computes what every rank sends from a hash of (rank,
// index), so each can check its result alone. Each test runs twice: with MPI's own count limit
// and with max_elements_per_call = 4099, which sends every large span in several calls (the
// paths taken above INT_MAX elements, at a size a test can afford).
//
// All ranks run the same tests in the same order; checks that could differ between ranks use
// EXPECT, so no rank leaves a test early and strands the others in a collective.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "offload/comm/communicator.h"
#include "tests/testutil/status_matchers.h"

namespace ucp::offload {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

constexpr int64_t kSmallChunk = 4099;
const size_t kSizes[] = {0, 1, 7, 1000003};

// The world communicators of the two chunk limits, made once (MPI starts once per process).
Communicator& World(int64_t max_elements) {
  static std::unique_ptr<Communicator> whole = [] {
    auto c = WorldCommunicator();
    UCP_CHECK(c.ok()) << c.status();
    return std::move(c).value();
  }();
  static std::unique_ptr<Communicator> chunked = [] {
    auto c = WorldCommunicator({.max_elements_per_call = kSmallChunk});
    UCP_CHECK(c.ok()) << c.status();
    return std::move(c).value();
  }();
  return max_elements == kSmallChunk ? *chunked : *whole;
}

uint64_t Mix(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t Hash(uint64_t a, uint64_t b, uint64_t c) { return Mix(Mix(Mix(a) ^ b) ^ c); }

// An integer in [-8, 8] as a float: sums of a few are exact in any order.
float Small(uint64_t a, uint64_t b, uint64_t c) {
  return static_cast<float>(static_cast<int>(Hash(a, b, c) % 17) - 8);
}
// A float of mixed magnitude: sums of a few depend on the order of the adds.
float Wide(uint64_t a, uint64_t b, uint64_t c) {
  const uint64_t h = Hash(a, b, c);
  const float mantissa = static_cast<float>(h >> 40) / static_cast<float>(1 << 24) - 0.5f;
  return std::ldexp(mantissa, static_cast<int>((h >> 8) % 25) - 12);
}

bool SameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

class MpiCommTest : public ::testing::TestWithParam<int64_t> {
 protected:
  Communicator& comm() { return World(GetParam()); }
  int p() { return comm().size(); }
  int r() { return comm().rank(); }
};

TEST_P(MpiCommTest, AllReduceSumAndMax) {
  for (size_t n : kSizes) {
    std::vector<float> f(n), f_max(n);
    std::vector<double> d(n);
    std::vector<int64_t> i(n);
    for (size_t k = 0; k < n; ++k) {
      f[k] = f_max[k] = Small(r(), k, 1);
      d[k] = Small(r(), k, 2) * 0.5;
      i[k] = static_cast<int64_t>(Hash(r(), k, 3) % 1000) << 33;
    }
    UCP_ASSERT_OK(comm().AllReduce(std::span<float>(f), ReduceOp::kSum));
    UCP_ASSERT_OK(comm().AllReduce(std::span<float>(f_max), ReduceOp::kMax));
    UCP_ASSERT_OK(comm().AllReduce(std::span<double>(d), ReduceOp::kSum));
    UCP_ASSERT_OK(comm().AllReduce(std::span<int64_t>(i), ReduceOp::kSum));
    size_t wrong = 0;
    for (size_t k = 0; k < n; ++k) {
      float sum = 0, max = -100;
      double dsum = 0;
      int64_t isum = 0;
      for (int j = 0; j < p(); ++j) {
        sum += Small(j, k, 1);
        max = std::max(max, Small(j, k, 1));
        dsum += Small(j, k, 2) * 0.5;
        isum += static_cast<int64_t>(Hash(j, k, 3) % 1000) << 33;
      }
      wrong += f[k] != sum || f_max[k] != max || d[k] != dsum || i[k] != isum;
    }
    EXPECT_EQ(wrong, 0u) << n << " elements";
  }
}

TEST_P(MpiCommTest, ReduceScatter) {
  for (size_t n : kSizes) {
    std::vector<float> in(n * p()), out(n, -1.0f);
    for (size_t k = 0; k < in.size(); ++k) in[k] = Small(r(), k, 4);
    UCP_ASSERT_OK(comm().ReduceScatter(in, out));
    size_t wrong = 0;
    for (size_t k = 0; k < n; ++k) {
      float sum = 0;
      for (int j = 0; j < p(); ++j) sum += Small(j, r() * n + k, 4);
      wrong += out[k] != sum;
    }
    EXPECT_EQ(wrong, 0u) << n << " elements";
  }
}

TEST_P(MpiCommTest, AllGather) {
  for (size_t n : kSizes) {
    std::vector<float> in(n), out(n * p(), -1.0f);
    for (size_t k = 0; k < n; ++k) in[k] = Wide(r(), k, 5);
    UCP_ASSERT_OK(comm().AllGather(in, out));
    size_t wrong = 0;
    for (int j = 0; j < p(); ++j) {
      for (size_t k = 0; k < n; ++k) wrong += out[j * n + k] != Wide(j, k, 5);
    }
    EXPECT_EQ(wrong, 0u) << n << " elements";
  }
}

TEST_P(MpiCommTest, AllToAll) {
  for (size_t n : kSizes) {
    std::vector<float> in(n * p()), out(n * p(), -1.0f);
    for (size_t k = 0; k < in.size(); ++k) in[k] = Wide(r(), k, 6);
    UCP_ASSERT_OK(comm().AllToAll(in, out));
    size_t wrong = 0;
    for (int j = 0; j < p(); ++j) {
      for (size_t k = 0; k < n; ++k) wrong += out[j * n + k] != Wide(j, r() * n + k, 6);
    }
    EXPECT_EQ(wrong, 0u) << n << " floats per block";
  }
}

// Rank a sends Count(a, b) floats to rank b: uneven, with zeros, up to n.
int64_t Count(int a, int b, size_t n) {
  if (n == 0) return 0;
  return static_cast<int64_t>(Hash(a, b, n) % (n + 1)) * ((a + b) % 3 == 1 ? 0 : 1);
}

TEST_P(MpiCommTest, AllToAllVUnevenCounts) {
  for (size_t n : kSizes) {
    std::vector<int64_t> sc(p()), rc(p());
    int64_t send_total = 0, recv_total = 0;
    for (int j = 0; j < p(); ++j) {
      sc[j] = Count(r(), j, n);
      rc[j] = Count(j, r(), n);
      send_total += sc[j];
      recv_total += rc[j];
    }
    std::vector<float> in(send_total), out(recv_total, -1.0f);
    for (int j = 0, at = 0; j < p(); at += static_cast<int>(sc[j]), ++j) {
      for (int64_t k = 0; k < sc[j]; ++k) in[at + k] = Wide(r(), j, k);
    }
    UCP_ASSERT_OK(comm().AllToAllV(in, sc, out, rc));
    size_t wrong = 0;
    for (int j = 0, at = 0; j < p(); at += static_cast<int>(rc[j]), ++j) {
      for (int64_t k = 0; k < rc[j]; ++k) wrong += out[at + k] != Wide(j, r(), k);
    }
    EXPECT_EQ(wrong, 0u) << "counts up to " << n;
  }
}

// Only ranks 0 and 1 exchange more than the chunk limit: every rank must still take the same
// path (one MPI_Alltoallv or pairwise rounds), or the job would hang.
TEST_P(MpiCommTest, AllToAllVWhereOnlyTwoRanksExceedTheLimit) {
  const int64_t big = kSmallChunk + 5;
  auto count = [&](int a, int b) -> int64_t { return a == 0 && b == 1 % p() ? big : 1; };
  std::vector<int64_t> sc(p()), rc(p());
  for (int j = 0; j < p(); ++j) {
    sc[j] = count(r(), j);
    rc[j] = count(j, r());
  }
  std::vector<float> in(std::accumulate(sc.begin(), sc.end(), int64_t{0}));
  std::vector<float> out(std::accumulate(rc.begin(), rc.end(), int64_t{0}), -1.0f);
  for (int j = 0, at = 0; j < p(); at += static_cast<int>(sc[j]), ++j) {
    for (int64_t k = 0; k < sc[j]; ++k) in[at + k] = Wide(r(), j, k);
  }
  UCP_ASSERT_OK(comm().AllToAllV(in, sc, out, rc));
  size_t wrong = 0;
  for (int j = 0, at = 0; j < p(); at += static_cast<int>(rc[j]), ++j) {
    for (int64_t k = 0; k < rc[j]; ++k) wrong += out[at + k] != Wide(j, r(), k);
  }
  EXPECT_EQ(wrong, 0u);
}

TEST_P(MpiCommTest, AllToAllVCountsThatDisagreeFailOnEveryRank) {
  if (p() < 2) GTEST_SKIP() << "needs two ranks";
  // Rank 0 expects one float more from rank 1 than rank 1 sends.
  std::vector<int64_t> sc(p(), 2), rc(p(), 2);
  if (r() == 0) rc[1] = 3;
  std::vector<float> in(2 * p()), out(2 * p() + (r() == 0));
  const Status s = comm().AllToAllV(in, sc, out, rc);
  if (r() == 0) {
    EXPECT_THAT(s, StatusIs(StatusCode::kInvalidArgument,
                            HasSubstr("rank 0 expects 3 floats from rank 1, which sends 2")));
  } else {
    EXPECT_THAT(s, StatusIs(StatusCode::kInvalidArgument,
                            HasSubstr("rank 0's recv counts disagree with its peers' send")));
  }
  UCP_EXPECT_OK(comm().Barrier());  // still usable
}

TEST_P(MpiCommTest, BroadcastFromEveryRoot) {
  for (size_t n : kSizes) {
    for (int root = 0; root < p(); ++root) {
      std::vector<std::byte> data(n);
      for (size_t k = 0; k < n; ++k) data[k] = static_cast<std::byte>(Hash(r(), root, k));
      UCP_ASSERT_OK(comm().Broadcast(data, root));
      size_t wrong = 0;
      for (size_t k = 0; k < n; ++k)
        wrong += data[k] != static_cast<std::byte>(Hash(root, root, k));
      EXPECT_EQ(wrong, 0u) << n << " bytes from " << root;
    }
  }
  std::vector<std::byte> one(1);
  EXPECT_THAT(comm().Broadcast(one, p()),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not a rank")));
}

TEST_P(MpiCommTest, SizeMismatchIsInvalidArgumentBeforeAnyCall) {
  std::vector<float> a(p() * 3 + 1), b(3);
  EXPECT_THAT(comm().ReduceScatter(a, b),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("reduce_scatter (rank")));
  EXPECT_THAT(comm().AllGather(b, a),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("all_gather (rank")));
  std::span<float> blocks(a.data(), p() * 3);
  EXPECT_THAT(comm().AllToAll(blocks, blocks),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlap")));
  UCP_EXPECT_OK(comm().Barrier());
}

// The rank-order sum of every rank's contribution, the same bits on every rank, for both orders.
TEST_P(MpiCommTest, DeterministicSumsAreTheSerialOrderedSum) {
  for (size_t n : kSizes) {
    // AllReduce: rank j contributes Wide(j, k, 7). ReduceScatter: rank j's input is
    // Wide(j, k, 8) for k in [0, P n), and this rank owns block r() of it.
    std::vector<float> all(n * p()), owned(n * p()), mine(n * p());
    for (int j = 0; j < p(); ++j) {
      for (size_t k = 0; k < n; ++k) {
        all[j * n + k] = Wide(j, k, 7);
        owned[j * n + k] = Wide(j, r() * n + k, 8);
      }
    }
    for (size_t k = 0; k < mine.size(); ++k) mine[k] = Wide(r(), k, 8);
    for (SumOrder order : {SumOrder::kRankOrder, SumOrder::kHalvingTree}) {
      std::vector<float> want(n);
      UCP_ASSERT_OK(OrderedSum(all, p(), want, order));
      std::vector<float> data(all.begin() + r() * n, all.begin() + (r() + 1) * n);
      UCP_ASSERT_OK(comm().AllReduceDeterministic(data, order));
      EXPECT_TRUE(SameBits(data, want)) << n << " elements";

      // The same on every rank: rank 0's bytes, broadcast, compared.
      std::vector<float> zero = data;
      UCP_ASSERT_OK(comm().Broadcast(std::as_writable_bytes(std::span<float>(zero)), 0));
      EXPECT_TRUE(SameBits(data, zero)) << n << " elements";

      std::vector<float> rs_want(n), rs_out(n);
      UCP_ASSERT_OK(OrderedSum(owned, p(), rs_want, order));
      UCP_ASSERT_OK(comm().ReduceScatterDeterministic(mine, rs_out, order));
      EXPECT_TRUE(SameBits(rs_out, rs_want)) << n << " elements";
    }
  }
}

// The stretch goal: 8 leaves (micro-batches), split over P = 1, 2 or 4 ranks, each rank
// pre-reducing its own with the halving tree: the total has the bits of the serial tree over all
// 8, whatever P is (the reference does not depend on P).
TEST_P(MpiCommTest, HalvingTreeTotalIsTheSameAtEveryPowerOfTwoSize) {
  if (8 % p() != 0) GTEST_SKIP() << "P=" << p() << " does not divide 8 leaves";
  const size_t n = 100003;
  const int per = 8 / p();
  std::vector<float> leaves(8 * n);
  for (size_t k = 0; k < leaves.size(); ++k) leaves[k] = Wide(99, k, 9);
  std::vector<float> want(n);
  UCP_ASSERT_OK(OrderedSum(leaves, 8, want, SumOrder::kHalvingTree));
  std::vector<float> data(n);
  UCP_ASSERT_OK(OrderedSum(std::span<const float>(leaves).subspan(r() * per * n, per * n), per,
                           data, SumOrder::kHalvingTree));
  UCP_ASSERT_OK(comm().AllReduceDeterministic(data, SumOrder::kHalvingTree));
  EXPECT_TRUE(SameBits(data, want));
}

// dp x sp groups (sp = 2 when P is even, else 1): the sp group is consecutive ranks, the dp group
// every sp-th rank, and each collective stays inside its group.
TEST_P(MpiCommTest, SplitIntoDpAndSpGroups) {
  const int sp = p() % 2 == 0 ? 2 : 1, dp = p() / sp;
  UCP_ASSERT_OK_AND_ASSIGN(auto sp_group, comm().Split(r() / sp, r()));
  UCP_ASSERT_OK_AND_ASSIGN(auto dp_group, comm().Split(r() % sp, r()));
  ASSERT_EQ(sp_group->size(), sp);
  ASSERT_EQ(dp_group->size(), dp);
  EXPECT_EQ(sp_group->rank(), r() % sp);
  EXPECT_EQ(dp_group->rank(), r() / sp);
  std::vector<float> me = {static_cast<float>(r())}, sp_members(sp), dp_members(dp);
  UCP_ASSERT_OK(sp_group->AllGather(me, sp_members));
  UCP_ASSERT_OK(dp_group->AllGather(me, dp_members));
  for (int j = 0; j < sp; ++j) EXPECT_EQ(sp_members[j], (r() / sp) * sp + j);
  for (int j = 0; j < dp; ++j) EXPECT_EQ(dp_members[j], j * sp + r() % sp);
  std::vector<int64_t> one = {1};
  UCP_ASSERT_OK(dp_group->AllReduce(std::span<int64_t>(one), ReduceOp::kSum));
  EXPECT_EQ(one[0], dp);

  // key orders the members: reversed keys give reversed ranks.
  UCP_ASSERT_OK_AND_ASSIGN(auto reversed, comm().Split(0, -r()));
  EXPECT_EQ(reversed->rank(), p() - 1 - r());
  EXPECT_THAT(comm().Split(-2, 0), StatusIs(StatusCode::kInvalidArgument, HasSubstr("color -2")));
}

INSTANTIATE_TEST_SUITE_P(ChunkLimits, MpiCommTest,
                         ::testing::Values(int64_t{2147483647}, kSmallChunk),
                         [](const ::testing::TestParamInfo<int64_t>& limit) {
                           return limit.param == kSmallChunk ? std::string("Chunked")
                                                             : std::string("Whole");
                         });

}  // namespace
}  // namespace ucp::offload

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  // Every rank's verdict, so mpirun's exit code fails when any rank failed.
  std::vector<int64_t> failed = {rc != 0};
  auto& world = ucp::offload::World(2147483647);
  if (!world.AllReduce(std::span<int64_t>(failed), ucp::offload::ReduceOp::kMax).ok()) return 1;
  if (world.rank() == 0) {
    std::printf("np %d: %s\n", world.size(), failed[0] ? "FAILED" : "all ranks passed");
  }
  return failed[0] ? 1 : 0;
}
