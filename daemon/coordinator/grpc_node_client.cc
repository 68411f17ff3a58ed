#include "daemon/coordinator/grpc_node_client.h"

#include "absl/time/clock.h"
#include "proto/grpc_status.h"

namespace wb::daemon {
namespace {
void SetTimeout(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}
}  // namespace

absl::Status GrpcNodeClient::InstallPlan(const pb::PlanSlice& slice, absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetTimeout(&ctx, timeout);
  pb::InstallPlanRequest req;
  *req.mutable_slice() = slice;
  pb::InstallPlanResponse resp;
  return FromGrpcStatus(stub_->InstallPlan(&ctx, req, &resp));
}

absl::Status GrpcNodeClient::ExecuteVersion(const pb::ExecuteVersionRequest& req, absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetTimeout(&ctx, timeout);
  pb::ExecuteVersionResponse resp;
  return FromGrpcStatus(stub_->ExecuteVersion(&ctx, req, &resp));
}

absl::Status GrpcNodeClient::CommitVersion(const std::string& model_id, uint64_t version, absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetTimeout(&ctx, timeout);
  pb::CommitVersionRequest req;
  req.set_model_id(model_id);
  req.set_version(version);
  pb::CommitVersionResponse resp;
  return FromGrpcStatus(stub_->CommitVersion(&ctx, req, &resp));
}

absl::Status GrpcNodeClient::AbortVersion(const std::string& model_id, uint64_t version, uint64_t plan_epoch, const std::string& reason,
                                          absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetTimeout(&ctx, timeout);
  pb::AbortVersionRequest req;
  req.set_model_id(model_id);
  req.set_version(version);
  req.set_plan_epoch(plan_epoch);
  req.set_reason(reason);
  pb::AbortVersionResponse resp;
  return FromGrpcStatus(stub_->AbortVersion(&ctx, req, &resp));
}

}  // namespace wb::daemon
