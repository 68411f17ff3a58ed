#pragma once
// TEST ONLY: what tests of the executor (daemon/node/executor.h) share: slice ops, and
// ExecRendezvous, where two in-process executors meet (the ChannelSetup seam).
// Each "node" of a test registers its cross-node transport, publishes its region descriptors and
// an endpoint for each peer, then connects to the peer's endpoint once both are there - the fake
// transport is two-sided, like host_tcp. The node daemon's real ChannelSetup exchanges the same
// things over the peers' NodeService (versions_run.cc: SetupPeer); tests of the executor
// (executor_test, delta_exchange_test) use this one instead.

#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/node/executor.h"

namespace wb::daemon::testing {

// An op of a test slice from piece 0 of slice worker `src` to piece 0 of `dst`.
node::SliceOp TestSliceOp(uint32_t index, uint32_t bucket, uint32_t src, uint32_t dst, int32_t tensor, planner::Box box, uint64_t bytes);

class ExecRendezvous {
 public:
  // `t` is node `node`'s cross-node transport (its instance id is what peers export endpoints for).
  void Add(const std::string& node, transport::Transport* t);
  // Forgets descriptors and endpoints (the transports stay): the next version meets afresh.
  void Reset();

  // One node's executor in a test: the exec plan of `slice` for node `me` over `memory` (each
  // region's kind as given), run with `local` / `cross` and `options`, meeting its peers here.
  // Each node of the test calls it on its own thread at once.
  absl::Status RunNode(const node::Slice& slice, const std::string& me, const std::map<std::string, node::RegionMemory>& memory,
                       transport::Transport* local, transport::Transport* cross, const node::ExecOptions& options,
                       node::ExecResult& result);

  // One node's side: the ChannelSetup its executor runs with.
  class Side : public node::ChannelSetup {
   public:
    Side(ExecRendezvous* r, std::string me) : r_(r), me_(std::move(me)) {}
    void Publish(std::map<std::string, std::map<std::string, std::string>> descriptors) override;
    // Waits (real time, until `deadline`) for the peer's endpoint and descriptors, then connects.
    absl::StatusOr<node::ChannelLink> Setup(const node::ChannelPlan& c, transport::Transport* t, absl::Time deadline) override;

   private:
    ExecRendezvous* r_;
    std::string me_;
  };

 private:
  absl::Mutex mu_;
  std::map<std::string, transport::Transport*> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::map<std::string, std::map<std::string, std::string>>> desc_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, std::string> endpoints_ ABSL_GUARDED_BY(mu_);  // (from, to) -> endpoint
};

}  // namespace wb::daemon::testing
