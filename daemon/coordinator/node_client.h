#pragma once
// The coordinator's view of one node daemon: the four calls the version driver makes
// (coordinator -> node). Seam for tests and the control-plane bench: GrpcNodeClient
// (grpc_node_client.h) talks to a NodeService, FakeNodeClient (fake_node_client.h) answers in
// process.
//
// Contract: every call returns within `timeout` (real time; the RPC deadline) with the node's
// answer as absl::Status: UNAVAILABLE / DEADLINE_EXCEEDED when the node could not be reached or
// did not answer in time (it may or may not have acted), any other error as the node answered.
// Calls may come from several threads at once.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

class NodeClient {
 public:
  virtual ~NodeClient() = default;
  virtual absl::Status InstallPlan(const pb::PlanSlice& slice, absl::Duration timeout) = 0;
  virtual absl::Status ExecuteVersion(const pb::ExecuteVersionRequest& req, absl::Duration timeout) = 0;
  // Sync mode: the node copies staging into its paused rollouts' live weights before answering;
  // OK means every rollout of the node holds `version` whole in live memory.
  virtual absl::Status CommitVersion(const std::string& model_id, uint64_t version, absl::Duration timeout) = 0;
  // Ends `version` on the node. `plan_epoch` > 0: only the execution of that epoch (a catch-up
  // attempt's; a node running the version on another epoch keeps it); 0: whatever runs for it.
  virtual absl::Status AbortVersion(const std::string& model_id, uint64_t version, uint64_t plan_epoch, const std::string& reason,
                                    absl::Duration timeout) = 0;
  // Ends the calls of this client in flight now: each returns promptly, CANCELLED (the node may or
  // may not have acted, as for UNAVAILABLE). Later calls are not affected; a call that starts while
  // this runs may escape it and run to its own deadline. The coordinator cancels a node's calls
  // when its lease runs out: a frozen node's call would otherwise hold its lane until its deadline
  // (docs/daemon.md "The driver never waits for a node").
  virtual void CancelCalls() = 0;
};

// Makes the client for a node from its NodeService address (RegisterNodeRequest.address).
using NodeClientFactory = std::function<std::shared_ptr<NodeClient>(const std::string& node_id, const std::string& address)>;

}  // namespace wb::daemon
