// The one-process communicator, WorldCommunicator without a launcher, and the size checks every
// implementation shares (against a stand-in of 3 ranks).
#include "offload/comm/communicator.h"
#include "offload/comm/rank_only_communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "offload/comm/comm_checks.h"
#include "tests/testutil/status_matchers.h"

namespace ucp::offload {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

TEST(SelfCommunicatorTest, CollectivesAreCopies) {
  auto comm = SelfCommunicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  std::vector<float> a = {1.5f, -2.0f, 3.25f}, b(3);
  UCP_EXPECT_OK(comm->AllReduce(std::span<float>(a), ReduceOp::kSum));
  EXPECT_EQ(a, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::vector<double> d = {1.0, 2.0};
  UCP_EXPECT_OK(comm->AllReduce(std::span<double>(d), ReduceOp::kMax));
  std::vector<int64_t> i = {7};
  UCP_EXPECT_OK(comm->AllReduce(std::span<int64_t>(i), ReduceOp::kSum));
  EXPECT_EQ(i[0], 7);
  using Copy = Status (Communicator::*)(std::span<const float>, std::span<float>);
  for (Copy op : {Copy{&Communicator::ReduceScatter}, Copy{&Communicator::AllGather},
                  Copy{&Communicator::AllToAll}}) {
    std::fill(b.begin(), b.end(), 0.0f);
    UCP_EXPECT_OK(((*comm).*op)(a, b));
    EXPECT_EQ(a, b);
  }
  const int64_t counts[] = {3};
  std::fill(b.begin(), b.end(), 0.0f);
  UCP_EXPECT_OK(comm->AllToAllV(a, counts, b, counts));
  EXPECT_EQ(a, b);
  std::fill(b.begin(), b.end(), 0.0f);
  UCP_EXPECT_OK(comm->ReduceScatterDeterministic(a, b));
  EXPECT_EQ(a, b);
  UCP_EXPECT_OK(comm->AllReduceDeterministic(a, SumOrder::kHalvingTree));
  EXPECT_EQ(a, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::vector<std::byte> bytes(4, std::byte{9});
  UCP_EXPECT_OK(comm->Broadcast(bytes, 0));
  UCP_EXPECT_OK(comm->Barrier());
  UCP_ASSERT_OK_AND_ASSIGN(auto sub, comm->Split(5, 0));
  EXPECT_EQ(sub->size(), 1);
}

TEST(SelfCommunicatorTest, RejectsBadSizes) {
  auto comm = SelfCommunicator();
  std::vector<float> a(3), b(4);
  EXPECT_THAT(comm->ReduceScatter(a, b),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("reduce_scatter (rank 0 of 1): the input has 3 floats, "
                                 "expected 1 ranks x 4 output floats")));
  EXPECT_THAT(comm->AllGather(a, b),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("the output has 4 floats")));
  EXPECT_THAT(comm->AllToAll(a, b), StatusIs(StatusCode::kInvalidArgument,
                                             HasSubstr("the input has 3 floats and the output 4")));
  const int64_t three[] = {3}, four[] = {4};
  EXPECT_THAT(comm->AllToAllV(a, three, b, four),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("rank 0 expects 4 floats from rank 0, which sends 3")));
  std::vector<std::byte> bytes(4);
  EXPECT_THAT(comm->Broadcast(bytes, 1),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("root 1 is not a rank in [0, 1)")));
  EXPECT_THAT(comm->Split(-1, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("color -1 is negative")));
  // Aliased input and output: MPI forbids it, so every implementation rejects it.
  EXPECT_THAT(
      comm->AllGather(std::span<const float>(b.data(), 2), std::span<float>(b.data() + 1, 2)),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("overlap")));
}

TEST(SelfCommunicatorTest, AbortEndsTheProcessWithTheCode) {
  EXPECT_EXIT(SelfCommunicator()->Abort(3), ::testing::ExitedWithCode(3), "");
}

// The node-local rank from the launcher's variables, in their order of precedence; the world
// rank where none is set or none is a count.
TEST(LauncherLocalRankTest, ReadsTheLaunchersVariable) {
  const std::vector<std::string> names = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                          "SLURM_LOCALID", "LOCAL_RANK"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const std::string& n : names) {
    if (const char* v = std::getenv(n.c_str())) saved.emplace_back(n, v);
    unsetenv(n.c_str());
  }
  EXPECT_EQ(LauncherLocalRank(13), 13);
  // Each variable set in turn, from the last in precedence: it wins over those set before.
  const std::vector<std::tuple<std::string, std::string, int>> steps = {
      {"LOCAL_RANK", "x1", 13},  {"LOCAL_RANK", "-2", 13}, {"LOCAL_RANK", "5", 5},
      {"SLURM_LOCALID", "4", 4}, {"MPI_LOCALRANKID", "3", 3},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "2", 2}};
  for (const auto& [name, value, want] : steps) {
    setenv(name.c_str(), value.c_str(), 1);
    EXPECT_EQ(LauncherLocalRank(13), want) << name << "=" << value;
  }
  for (const std::string& n : names) unsetenv(n.c_str());
  for (const auto& [n, v] : saved) setenv(n.c_str(), v.c_str(), 1);
}

TEST(WorldCommunicatorTest, WithoutALauncherIsOneProcess) {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) unsetenv(v);
  UCP_ASSERT_OK_AND_ASSIGN(auto comm, WorldCommunicator());
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_THAT(WorldCommunicator({.max_elements_per_call = 0}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("max_elements_per_call 0")));
}

// The shared checks, for rank 1 of a communicator of 3 ranks (nothing is communicated).
TEST(CommChecksTest, SizesForThreeRanks) {
  using namespace internal_comm;  // NOLINT(build/namespaces)
  RankOnlyCommunicator c(1, 3);
  UCP_EXPECT_OK(CheckReduceScatterSizes("rs", c, 21, 7));
  UCP_EXPECT_OK(CheckReduceScatterSizes("rs", c, 0, 0));
  EXPECT_THAT(CheckReduceScatterSizes("rs", c, 22, 7),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("rs (rank 1 of 3): the input has 22 floats, expected 3 ranks x 7 "
                                 "output floats")));
  UCP_EXPECT_OK(CheckAllGatherSizes("ag", c, 7, 21));
  EXPECT_THAT(CheckAllGatherSizes("ag", c, 7, 20),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("the output has 20 floats")));
  UCP_EXPECT_OK(CheckAllToAllSizes("a2a", c, 21, 21));
  EXPECT_THAT(
      CheckAllToAllSizes("a2a", c, 20, 20),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("20 floats are not 3 equal blocks")));
  const int64_t sc[] = {1, 0, 5}, rc[] = {2, 2, 2}, two[] = {1, 1}, neg[] = {1, -1, 2};
  UCP_EXPECT_OK(CheckAllToAllVSizes("v", c, 6, sc, 6, rc));
  EXPECT_THAT(CheckAllToAllVSizes("v", c, 6, two, 6, rc),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("2 send counts, expected one per rank (3)")));
  EXPECT_THAT(
      CheckAllToAllVSizes("v", c, 2, neg, 6, rc),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("send count for rank 1 is negative")));
  EXPECT_THAT(CheckAllToAllVSizes("v", c, 6, sc, 7, rc),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("recv counts sum to 6 floats, but the span has 7")));
  const int64_t huge[] = {INT64_MAX, INT64_MAX, 1};
  EXPECT_THAT(CheckAllToAllVSizes("v", c, 6, huge, 6, rc),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("past INT64_MAX")));
  UCP_EXPECT_OK(CheckRoot("b", c, 2));
  EXPECT_THAT(CheckRoot("b", c, 3), StatusIs(StatusCode::kInvalidArgument, HasSubstr("root 3")));
  EXPECT_THAT(CheckRoot("b", c, -1), StatusIs(StatusCode::kInvalidArgument, HasSubstr("root -1")));
}

// The deterministic collectives check sizes before they communicate.
TEST(CommChecksTest, DeterministicChecksBeforeCommunicating) {
  RankOnlyCommunicator c(1, 3);
  std::vector<float> in(10), out(3);
  EXPECT_THAT(c.ReduceScatterDeterministic(in, out),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("reduce_scatter_deterministic (rank 1 of 3): the input has 10")));
}

}  // namespace
}  // namespace ucp::offload
