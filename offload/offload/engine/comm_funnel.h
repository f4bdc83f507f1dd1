// The communicator funnel: every collective of an overlapped data-parallel step made by ONE
// thread (docs/offload.md, "Data parallelism in the pipeline").
//
// MPI is initialised MPI_THREAD_FUNNELED (communicator.h): only the thread that initialised it may
// call MPI. To reduce gradient buckets while backward goes on, the overlapped step runs forward
// and backward on a worker thread and keeps the main (MPI) thread as the communicator's thread:
// the main thread Serve()s the funnel, running in arrival order
//   - work Post()ed to it (a bucket's reduction, posted by the backward hook), and
//   - collectives Call()ed by other threads (the model's Ulysses all-to-alls, made through a
//     FunnelCommunicator), each returning its Status to the waiting caller.
// Because every process posts and calls in its program order, every process makes the same
// sequence of MPI calls, so the interleaving cannot deadlock. Outside a Serve session (the sync
// path, validation, saves) and on the serving thread itself, Call runs the collective directly.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "offload/comm/communicator.h"
#include "ucp/base/status.h"

namespace ucp::offload {

class CommFunnel {
 public:
  CommFunnel() = default;
  CommFunnel(const CommFunnel&) = delete;
  CommFunnel& operator=(const CommFunnel&) = delete;

  /// Starts a session served by the calling thread (which must then call Serve). From now on
  /// Call from any other thread is queued for it.
  void Open();
  /// Ends the session once the queue is drained (any thread, typically the worker when done).
  void Close();
  /// The session's thread: runs queued work in order until Close() and the queue is empty.
  void Serve();
  /// Queues `fn` for the serving thread (non-blocking). Only inside a session.
  void Post(std::function<void()> fn);
  /// Runs `fn` on the serving thread and returns its Status; directly when no session is open or
  /// the caller is the serving thread.
  Status Call(const std::function<Status()>& fn);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool open_ = false, closing_ = false;
  std::thread::id owner_;
};

/// A Communicator whose every collective goes through `funnel` to `inner` (neither owned): hand
/// it to code that may run on a worker thread during a session (the model's sp group).
std::unique_ptr<Communicator> FunnelCommunicator(Communicator* inner, CommFunnel* funnel);

}  // namespace ucp::offload
