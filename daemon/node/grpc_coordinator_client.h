#pragma once
// The real CoordinatorClient: CoordinatorService stubs over one gRPC channel.

#include <memory>

#include "daemon/node/coordinator_client.h"
#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  explicit GrpcCoordinatorClient(std::shared_ptr<grpc::Channel> channel);

  absl::Status RegisterNode(const pb::RegisterNodeRequest& req, pb::RegisterNodeResponse* resp, absl::Duration timeout) override;
  absl::Status Heartbeat(const pb::HeartbeatRequest& req, pb::HeartbeatResponse* resp, absl::Duration timeout) override;
  absl::Status JoinWorker(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse* resp, absl::Duration timeout) override;
  absl::Status SubmitLayout(const pb::SubmitLayoutRequest& req, pb::SubmitLayoutResponse* resp, absl::Duration timeout) override;
  absl::Status LeaveWorker(const pb::LeaveWorkerRequest& req, pb::LeaveWorkerResponse* resp, absl::Duration timeout) override;
  absl::Status Publish(const pb::CoordPublishRequest& req, pb::PublishResponse* resp, absl::Duration timeout) override;
  absl::Status ReportReady(const pb::ReportReadyRequest& req, pb::ReportReadyResponse* resp, absl::Duration timeout) override;
  absl::Status ReportDone(const pb::ReportDoneRequest& req, pb::ReportDoneResponse* resp, absl::Duration timeout) override;
  absl::Status ExchangeMagnitudes(const pb::ExchangeMagnitudesRequest& req, pb::ExchangeMagnitudesResponse* resp,
                                  absl::Duration timeout) override;
  absl::Status ReportApplied(const pb::ReportAppliedRequest& req, pb::ReportAppliedResponse* resp, absl::Duration timeout) override;
  absl::Status WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Duration timeout) override;
  absl::Status ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp, absl::Duration timeout) override;
  absl::Status Drain(const pb::DrainRequest& req, pb::DrainResponse* resp, absl::Duration timeout) override;

 private:
  std::unique_ptr<pb::CoordinatorService::Stub> stub_;
};

}  // namespace wb::daemon
