#pragma once
// Seam: the node's coordinator session as the node's parts see it (node::Versions reports done
// versions and their progress through it; node::WorkerCalls forwards worker calls and waits for
// (re-)registration). NodeDaemon implements it over CoordinatorSession and the CoordinatorClient
// it creates in Start; unit tests implement it with fakes (FakeCoordinatorClient).
//
// Contract: thread-safe; every call may be made before Start (client() is then a client that
// answers UNAVAILABLE to every call, the waits return false / nullopt at once, session() is 0,
// TrackProgress does nothing).

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "daemon/node/coordinator_client.h"

namespace wb::daemon::node {

class CoordinatorAccess {
 public:
  virtual ~CoordinatorAccess() = default;
  // Node -> coordinator calls (daemon/node/coordinator_client.h); never null.
  virtual CoordinatorClient& client() = 0;
  // CoordinatorSession::AwaitRegistered / session / AwaitCoordinatorChange / TrackProgress.
  virtual bool AwaitRegistered(absl::Time deadline) = 0;
  virtual uint64_t session() = 0;
  virtual std::optional<std::string> AwaitCoordinatorChange(uint64_t session0, absl::Time deadline) = 0;
  // CoordinatorSession::UnreachableSince: since when heartbeats find the coordinator unreachable
  // (named by a held worker call that gave up); nullopt while it answers, or unknown.
  virtual std::optional<absl::Time> UnreachableSince() { return std::nullopt; }
  // CoordinatorSession::coordinator_instance: the instance of the coordinator the node registered
  // with last (set before the re-join runs); empty while unknown (then nothing is checked against
  // it). node::Versions refuses ExecuteVersion calls stamped with another instance: a coordinator
  // that restarted since cannot run versions here any more (docs/daemon.md "Coordinator restart").
  virtual std::string coordinator_instance() { return {}; }
  // Heartbeats report `bytes_done` of the version while it exists.
  virtual void TrackProgress(const std::string& model_id, uint64_t version, std::weak_ptr<const std::atomic<uint64_t>> bytes_done) = 0;
};

// What client() is before the node started: every call UNAVAILABLE, naming the node.
class UnstartedCoordinatorClient final : public CoordinatorClient {
 public:
  explicit UnstartedCoordinatorClient(std::string node_id) : node_id_(std::move(node_id)) {}
#define WB_UNSTARTED_(Name, Req, Resp)                                        \
  absl::Status Name(const pb::Req&, pb::Resp*, absl::Duration) override { \
    return Unstarted(#Name);                                                  \
  }
  WB_UNSTARTED_(RegisterNode, RegisterNodeRequest, RegisterNodeResponse)
  WB_UNSTARTED_(Heartbeat, HeartbeatRequest, HeartbeatResponse)
  WB_UNSTARTED_(JoinWorker, JoinWorkerRequest, JoinWorkerResponse)
  WB_UNSTARTED_(SubmitLayout, SubmitLayoutRequest, SubmitLayoutResponse)
  WB_UNSTARTED_(LeaveWorker, LeaveWorkerRequest, LeaveWorkerResponse)
  WB_UNSTARTED_(Publish, CoordPublishRequest, PublishResponse)
  WB_UNSTARTED_(ReportReady, ReportReadyRequest, ReportReadyResponse)
  WB_UNSTARTED_(ReportDone, ReportDoneRequest, ReportDoneResponse)
  WB_UNSTARTED_(ReportApplied, ReportAppliedRequest, ReportAppliedResponse)
  WB_UNSTARTED_(WaitVersion, WaitVersionRequest, WaitVersionResponse)
  WB_UNSTARTED_(ExchangeMagnitudes, ExchangeMagnitudesRequest, ExchangeMagnitudesResponse)
  WB_UNSTARTED_(ClusterStatus, StatusRequest, StatusResponse)
  WB_UNSTARTED_(Drain, DrainRequest, DrainResponse)
#undef WB_UNSTARTED_

 private:
  absl::Status Unstarted(const char* call) const {
    return absl::UnavailableError(std::string(call) + ": node " + node_id_ + " has not started (no coordinator session yet)");
  }
  std::string node_id_;
};

}  // namespace wb::daemon::node
