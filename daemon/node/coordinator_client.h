#pragma once
// Seam: the node daemon's calls to the coordinator (CoordinatorService), node -> coordinator.
// The real one is GrpcCoordinatorClient (grpc_coordinator_client.h); tests use
// FakeCoordinatorClient (fake_coordinator_client.h), an in-process coordinator with restarts,
// outages and call records.
//
// Contract: every call returns when it has an answer or `timeout` (measured on REAL time: it
// bounds a network call, not simulated time) has passed, with the coordinator's status as an
// absl::Status (codes one to one, daemon/proto/grpc_status.h); on error `resp` may be partly
// filled and is not to be trusted. Thread-safe: any number of calls may run at once.

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

class CoordinatorClient {
 public:
  virtual ~CoordinatorClient() = default;
  // Session (daemon/node/coordinator_session.h). RegisterNode waits for the coordinator to be
  // reachable (up to `timeout`) instead of failing at once: a node may start before it.
  virtual absl::Status RegisterNode(const pb::RegisterNodeRequest& req, pb::RegisterNodeResponse* resp, absl::Duration timeout) = 0;
  virtual absl::Status Heartbeat(const pb::HeartbeatRequest& req, pb::HeartbeatResponse* resp, absl::Duration timeout) = 0;
  // Workers of this node.
  virtual absl::Status JoinWorker(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse* resp, absl::Duration timeout) = 0;
  virtual absl::Status SubmitLayout(const pb::SubmitLayoutRequest& req, pb::SubmitLayoutResponse* resp, absl::Duration timeout) = 0;
  virtual absl::Status LeaveWorker(const pb::LeaveWorkerRequest& req, pb::LeaveWorkerResponse* resp, absl::Duration timeout) = 0;
  // Versions.
  virtual absl::Status Publish(const pb::CoordPublishRequest& req, pb::PublishResponse* resp, absl::Duration timeout) = 0;
  virtual absl::Status ReportReady(const pb::ReportReadyRequest& req, pb::ReportReadyResponse* resp, absl::Duration timeout) = 0;
  virtual absl::Status ReportDone(const pb::ReportDoneRequest& req, pb::ReportDoneResponse* resp, absl::Duration timeout) = 0;
  virtual absl::Status ReportApplied(const pb::ReportAppliedRequest& req, pb::ReportAppliedResponse* resp, absl::Duration timeout) = 0;
  virtual absl::Status WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Duration timeout) = 0;
  // NVFP4 global scales across nodes (CoordinatorCore::ExchangeMagnitudes).
  virtual absl::Status ExchangeMagnitudes(const pb::ExchangeMagnitudesRequest& req, pb::ExchangeMagnitudesResponse* resp,
                                          absl::Duration timeout) = 0;
  // Forwarded for wbctl / workers.
  virtual absl::Status ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp, absl::Duration timeout) = 0;
  virtual absl::Status Drain(const pb::DrainRequest& req, pb::DrainResponse* resp, absl::Duration timeout) = 0;
};

}  // namespace wb::daemon
