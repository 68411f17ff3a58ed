#pragma once
// NodeClient over a NodeService gRPC channel (TLS + token when the channel carries them).

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "daemon/coordinator/node_client.h"
#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {

class GrpcNodeClient final : public NodeClient {
 public:
  explicit GrpcNodeClient(std::shared_ptr<grpc::Channel> channel) : stub_(pb::NodeService::NewStub(channel)) {}

  absl::Status InstallPlan(const pb::PlanSlice& slice, absl::Duration timeout) override;
  absl::Status ExecuteVersion(const pb::ExecuteVersionRequest& req, absl::Duration timeout) override;
  absl::Status CommitVersion(const std::string& model_id, uint64_t version, absl::Duration timeout) override;
  absl::Status AbortVersion(const std::string& model_id, uint64_t version, uint64_t plan_epoch, const std::string& reason,
                            absl::Duration timeout) override;

 private:
  std::unique_ptr<pb::NodeService::Stub> stub_;
};

}  // namespace wb::daemon
