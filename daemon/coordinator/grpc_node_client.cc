#include "daemon/coordinator/grpc_node_client.h"

#include "absl/time/clock.h"
#include "base/clock.h"
#include "proto/grpc_retry.h"
#include "proto/grpc_status.h"

namespace wb::daemon {

// One unary call with its deadline `timeout` from now (real time), gRPC status -> absl; sent again
// while the node's server had no thread for it (proto/grpc_retry.h). Each attempt's context is
// registered for CancelCalls while it runs.
template <typename Req, typename Resp, typename Method>
absl::Status GrpcNodeClient::Call(Method method, const Req& req, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  return CallWhileServerBusy(Clock::Real(), deadline, [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    {
      absl::MutexLock l(&mu_);
      in_flight_.insert(&ctx);
    }
    Resp resp;
    const grpc::Status st = (stub_.get()->*method)(&ctx, req, &resp);
    {
      absl::MutexLock l(&mu_);
      in_flight_.erase(&ctx);
    }
    return FromGrpcStatus(st);
  });
}

void GrpcNodeClient::CancelCalls() {
  // TryCancel never blocks; a context leaves in_flight_ (under mu_) before it is destroyed.
  absl::MutexLock l(&mu_);
  for (grpc::ClientContext* ctx : in_flight_) ctx->TryCancel();
}

absl::Status GrpcNodeClient::InstallPlan(const pb::PlanSlice& slice, absl::Duration timeout) {
  pb::InstallPlanRequest req;
  *req.mutable_slice() = slice;
  req.set_coordinator_instance(coordinator_instance_);
  return Call<pb::InstallPlanRequest, pb::InstallPlanResponse>(&pb::NodeService::Stub::InstallPlan, req, timeout);
}

absl::Status GrpcNodeClient::ExecuteVersion(const pb::ExecuteVersionRequest& req, absl::Duration timeout) {
  return Call<pb::ExecuteVersionRequest, pb::ExecuteVersionResponse>(&pb::NodeService::Stub::ExecuteVersion, req,
                                                                     timeout);
}

absl::Status GrpcNodeClient::CommitVersion(const std::string& model_id, uint64_t version, absl::Duration timeout) {
  pb::CommitVersionRequest req;
  req.set_model_id(model_id);
  req.set_version(version);
  req.set_coordinator_instance(coordinator_instance_);
  return Call<pb::CommitVersionRequest, pb::CommitVersionResponse>(&pb::NodeService::Stub::CommitVersion, req, timeout);
}

absl::Status GrpcNodeClient::AbortVersion(const std::string& model_id, uint64_t version, uint64_t plan_epoch, const std::string& reason,
                                          absl::Duration timeout) {
  pb::AbortVersionRequest req;
  req.set_model_id(model_id);
  req.set_version(version);
  req.set_plan_epoch(plan_epoch);
  req.set_reason(reason);
  req.set_coordinator_instance(coordinator_instance_);
  return Call<pb::AbortVersionRequest, pb::AbortVersionResponse>(&pb::NodeService::Stub::AbortVersion, req, timeout);
}

}  // namespace wb::daemon
