// The communicator funnel: work posted and collectives called from other threads all run on the
// serving thread, in arrival order; outside a session calls run directly.
#include "offload/engine/comm_funnel.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace ucp::offload {
namespace {

TEST(CommFunnelTest, CallsOutsideASessionRunDirectly) {
  CommFunnel f;
  std::thread::id ran;
  EXPECT_TRUE(f.Call([&] {
                 ran = std::this_thread::get_id();
                 return Status::Ok();
               }).ok());
  EXPECT_EQ(ran, std::this_thread::get_id());
}

TEST(CommFunnelTest, EverythingRunsOnTheServingThreadInOrder) {
  CommFunnel f;
  auto self = SelfCommunicator();
  auto funneled = FunnelCommunicator(self.get(), &f);
  EXPECT_EQ(funneled->size(), 1);
  EXPECT_EQ(funneled->rank(), 0);
  const std::thread::id main_id = std::this_thread::get_id();
  std::vector<int> order;  // touched only on the serving thread
  bool all_on_main = true;
  f.Open();
  std::thread worker([&] {
    for (int i = 0; i < 50; ++i) {
      f.Post([&, i] {
        all_on_main = all_on_main && std::this_thread::get_id() == main_id;
        order.push_back(2 * i);
      });
      Status st = f.Call([&, i] {
        all_on_main = all_on_main && std::this_thread::get_id() == main_id;
        order.push_back(2 * i + 1);
        return i == 7 ? InternalError("seven") : Status::Ok();
      });
      EXPECT_EQ(st.ok(), i != 7);
      // A collective through the funneled communicator (AllReduce on one rank: a no-op).
      std::vector<float> x{1.0f, 2.0f};
      EXPECT_TRUE(funneled->AllReduce(std::span<float>(x), ReduceOp::kSum).ok());
      EXPECT_EQ(x[1], 2.0f);
    }
    f.Close();
  });
  f.Serve();
  worker.join();
  EXPECT_TRUE(all_on_main);
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  // The session is over: a call runs directly again, and a new session can open.
  EXPECT_TRUE(f.Call([] { return Status::Ok(); }).ok());
  f.Open();
  f.Close();
  f.Serve();
}

}  // namespace
}  // namespace ucp::offload
