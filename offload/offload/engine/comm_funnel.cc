// The communicator funnel (comm_funnel.h).
#include "offload/engine/comm_funnel.h"

#include <cstdlib>

#include "ucp/base/check.h"

namespace ucp::offload {

void CommFunnel::Open() {
  std::lock_guard<std::mutex> lock(mu_);
  UCP_CHECK(!open_) << "comm funnel: a session is already open";
  open_ = true;
  closing_ = false;
  owner_ = std::this_thread::get_id();
}

void CommFunnel::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_all();
}

void CommFunnel::Serve() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lock(mu_);
      UCP_CHECK(open_ && owner_ == std::this_thread::get_id())
          << "comm funnel: Serve outside the session's thread";
      cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      if (queue_.empty()) {
        open_ = false;
        closing_ = false;
        return;
      }
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

void CommFunnel::Post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    UCP_CHECK(open_ && !closing_) << "comm funnel: Post outside a session";
    queue_.push_back(std::move(fn));
  }
  cv_.notify_all();
}

Status CommFunnel::Call(const std::function<Status()>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!open_ || owner_ == std::this_thread::get_id()) {
    lock.unlock();
    return fn();
  }
  UCP_CHECK(!closing_) << "comm funnel: Call after Close";
  Status result;
  bool done = false;
  queue_.push_back([&] {
    Status st = fn();
    {
      std::lock_guard<std::mutex> l(mu_);
      result = std::move(st);
      done = true;
    }
    cv_.notify_all();
  });
  cv_.notify_all();
  cv_.wait(lock, [&] { return done; });
  return result;
}

namespace {

class Funneled final : public Communicator {
 public:
  Funneled(Communicator* inner, CommFunnel* funnel) : inner_(inner), funnel_(funnel) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Result<std::unique_ptr<Communicator>> Split(int color, int key) override {
    Result<std::unique_ptr<Communicator>> out = InternalError("comm funnel: split not run");
    Status st = funnel_->Call([&] {
      out = inner_->Split(color, key);
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return out;
  }
  Status AllReduce(std::span<float> d, ReduceOp op) override {
    return funnel_->Call([&] { return inner_->AllReduce(d, op); });
  }
  Status AllReduce(std::span<double> d, ReduceOp op) override {
    return funnel_->Call([&] { return inner_->AllReduce(d, op); });
  }
  Status AllReduce(std::span<int64_t> d, ReduceOp op) override {
    return funnel_->Call([&] { return inner_->AllReduce(d, op); });
  }
  Status ReduceScatter(std::span<const float> in, std::span<float> out) override {
    return funnel_->Call([&] { return inner_->ReduceScatter(in, out); });
  }
  Status AllGather(std::span<const float> in, std::span<float> out) override {
    return funnel_->Call([&] { return inner_->AllGather(in, out); });
  }
  Status AllToAll(std::span<const float> in, std::span<float> out) override {
    return funnel_->Call([&] { return inner_->AllToAll(in, out); });
  }
  Status AllToAllV(std::span<const float> in, std::span<const int64_t> sc, std::span<float> out,
                   std::span<const int64_t> rc) override {
    return funnel_->Call([&] { return inner_->AllToAllV(in, sc, out, rc); });
  }
  Status Broadcast(std::span<std::byte> data, int root) override {
    return funnel_->Call([&] { return inner_->Broadcast(data, root); });
  }
  Status Barrier() override {
    return funnel_->Call([&] { return inner_->Barrier(); });
  }
  [[noreturn]] void Abort(int exit_code) override {
    inner_->Abort(exit_code);
    std::abort();  // not reached: Abort does not return
  }

 private:
  Communicator* inner_;
  CommFunnel* funnel_;
};

}  // namespace

std::unique_ptr<Communicator> FunnelCommunicator(Communicator* inner, CommFunnel* funnel) {
  return std::make_unique<Funneled>(inner, funnel);
}

}  // namespace ucp::offload
