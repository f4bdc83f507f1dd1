// Test-only: a Communicator that names rank r of p and communicates nothing (every collective is
// kInternal "not a real communicator"), for code that only reads rank() and size(): the shared
// argument checks (communicator_test.cc), Ulysses' geometry (kernels_emulated_test.cc). A test
// communicator that runs a few collectives derives from it and overrides those
// (cuda_model_test.cc's ThreadRanks).
#pragma once

#include <cstdlib>
#include <memory>

#include "offload/comm/communicator.h"

namespace ucp::offload {

class RankOnlyCommunicator : public Communicator {
 public:
  RankOnlyCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<std::unique_ptr<Communicator>> Split(int, int) override { return Unused(); }
  Status AllReduce(std::span<float>, ReduceOp) override { return Unused(); }
  Status AllReduce(std::span<double>, ReduceOp) override { return Unused(); }
  Status AllReduce(std::span<int64_t>, ReduceOp) override { return Unused(); }
  Status ReduceScatter(std::span<const float>, std::span<float>) override { return Unused(); }
  Status AllGather(std::span<const float>, std::span<float>) override { return Unused(); }
  Status AllToAll(std::span<const float>, std::span<float>) override { return Unused(); }
  Status AllToAllV(std::span<const float>, std::span<const int64_t>, std::span<float>,
                   std::span<const int64_t>) override {
    return Unused();
  }
  Status Broadcast(std::span<std::byte>, int) override { return Unused(); }
  Status Barrier() override { return Unused(); }
  [[noreturn]] void Abort(int code) override { std::_Exit(code); }

 private:
  static Status Unused() { return InternalError("not a real communicator"); }
  int rank_, size_;
};

}  // namespace ucp::offload
