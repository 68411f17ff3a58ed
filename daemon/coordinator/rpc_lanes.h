#pragma once
// RpcLanes: where the coordinator's driver runs its node RPCs (docs/daemon.md "The driver never
// waits for a node"). Each call is posted to a named lane: calls of one lane run one after another,
// in the order posted; different lanes run at once, on up to `threads` worker threads.
//
// Why: the driver thread used to run every pass's RPCs itself, one work item after another. A node
// that stopped answering without closing its connections (frozen, SIGSTOP, a hung host) held an
// ExecuteVersion or CommitVersion for its whole timeout (the transfer timeout, 60 s): meanwhile no
// lease was swept, no version of any other model started or committed, and the frozen node's own
// version was aborted only when the call gave up. With lanes the driver only posts and goes on;
// the coordinator keys a model's version calls (start, commit, catch-up, aborts) by the model, so
// they keep their order, and owed retries by node, so one node's retries never hold another's.
//
// Contract:
//   - Post never waits for a call: it takes only the lanes' own mutex, which is never held while a
//     call (or on_idle) runs, so it may be called under a lock the calls take themselves (the
//     coordinator posts under its mu_; lock order: caller's locks -> lanes mutex).
//   - `on_idle` (Options) runs after each call, on the worker thread, with no lanes lock held: the
//     coordinator wakes its driver there (a lane's next step may have been waiting for it).
//   - Busy(lane): a call of the lane is queued or running.
//   - Shutdown: calls not started are dropped (each is a node RPC the next coordinator, or the
//     node's own timeouts, make up for); running ones are waited for; Post afterwards drops the call.
//     The destructor shuts down.

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace wb::daemon {

class RpcLanes {
 public:
  struct Options {
    size_t threads = 16;
    std::function<void()> on_idle;  // after every call (see the contract)
  };
  explicit RpcLanes(Options options);
  ~RpcLanes();
  RpcLanes(const RpcLanes&) = delete;
  RpcLanes& operator=(const RpcLanes&) = delete;

  void Post(const std::string& lane, std::function<void()> call);
  bool Busy(const std::string& lane) const;
  // Waits (real time) until no call is queued or running in any lane; false at `deadline`.
  bool AwaitIdle(absl::Time deadline) const;
  void Shutdown();

 private:
  struct Lane {
    std::deque<std::function<void()>> calls;
    bool running = false;  // a worker runs its front call
  };
  void Work();

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Lane> lanes_ ABSL_GUARDED_BY(mu_);  // only lanes with calls (erased when empty)
  std::deque<std::string> ready_ ABSL_GUARDED_BY(mu_);       // lanes with calls and no worker
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace wb::daemon
