#pragma once
// NodeClient over a NodeService gRPC channel (TLS + token when the channel carries them).

#include <memory>
#include <set>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/coordinator/node_client.h"
#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {

class GrpcNodeClient final : public NodeClient {
 public:
  // `coordinator_instance`: the coordinator process's instance, stamped on every InstallPlan,
  // CommitVersion and AbortVersion (ExecuteVersion's request carries its own), so a node that
  // re-joined a restarted coordinator refuses this one's late calls; empty: not stamped.
  explicit GrpcNodeClient(std::shared_ptr<grpc::Channel> channel, std::string coordinator_instance = {})
      : stub_(pb::NodeService::NewStub(channel)), coordinator_instance_(std::move(coordinator_instance)) {}

  absl::Status InstallPlan(const pb::PlanSlice& slice, absl::Duration timeout) override;
  absl::Status ExecuteVersion(const pb::ExecuteVersionRequest& req, absl::Duration timeout) override;
  absl::Status CommitVersion(const std::string& model_id, uint64_t version, absl::Duration timeout) override;
  absl::Status AbortVersion(const std::string& model_id, uint64_t version, uint64_t plan_epoch, const std::string& reason,
                            absl::Duration timeout) override;
  void CancelCalls() override;

 private:
  // One unary call (grpc_node_client.cc); its context is in in_flight_ while it runs.
  template <typename Req, typename Resp, typename Method>
  absl::Status Call(Method method, const Req& req, absl::Duration timeout);

  std::unique_ptr<pb::NodeService::Stub> stub_;
  const std::string coordinator_instance_;
  absl::Mutex mu_;
  std::set<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(mu_);  // TryCancel'ed by CancelCalls
};

}  // namespace wb::daemon
