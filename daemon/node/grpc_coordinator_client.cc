#include "daemon/node/grpc_coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "base/clock.h"
#include "proto/grpc_retry.h"
#include "proto/grpc_status.h"

namespace wb::daemon {
namespace {

// One unary call with its deadline `timeout` from now (real time), gRPC status -> absl; sent again
// while the coordinator's server had no thread for it (proto/grpc_retry.h).
template <typename Req, typename Resp, typename Method>
absl::Status Call(pb::CoordinatorService::Stub* stub, Method method, const Req& req, Resp* resp, absl::Duration timeout,
                  bool wait_for_ready = false) {
  const absl::Time deadline = absl::Now() + timeout;
  return CallWhileServerBusy(Clock::Real(), deadline, [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    if (wait_for_ready) ctx.set_wait_for_ready(true);
    return FromGrpcStatus((stub->*method)(&ctx, req, resp));
  });
}

}  // namespace

GrpcCoordinatorClient::GrpcCoordinatorClient(std::shared_ptr<grpc::Channel> channel) : stub_(pb::CoordinatorService::NewStub(channel)) {}

absl::Status GrpcCoordinatorClient::RegisterNode(const pb::RegisterNodeRequest& req, pb::RegisterNodeResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::RegisterNode, req, resp, timeout, /*wait_for_ready=*/true);
}
absl::Status GrpcCoordinatorClient::Heartbeat(const pb::HeartbeatRequest& req, pb::HeartbeatResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::Heartbeat, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::JoinWorker(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::JoinWorker, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::SubmitLayout(const pb::SubmitLayoutRequest& req, pb::SubmitLayoutResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::SubmitLayout, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::LeaveWorker(const pb::LeaveWorkerRequest& req, pb::LeaveWorkerResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::LeaveWorker, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::Publish(const pb::CoordPublishRequest& req, pb::PublishResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::Publish, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::ReportReady(const pb::ReportReadyRequest& req, pb::ReportReadyResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::ReportReady, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::ExchangeMagnitudes(const pb::ExchangeMagnitudesRequest& req, pb::ExchangeMagnitudesResponse* resp,
                                                       absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::ExchangeMagnitudes, req, resp, timeout);
}

absl::Status GrpcCoordinatorClient::ReportDone(const pb::ReportDoneRequest& req, pb::ReportDoneResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::ReportDone, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::ReportApplied(const pb::ReportAppliedRequest& req, pb::ReportAppliedResponse* resp,
                                                  absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::ReportApplied, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::WaitVersion, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::ClusterStatus, req, resp, timeout);
}
absl::Status GrpcCoordinatorClient::Drain(const pb::DrainRequest& req, pb::DrainResponse* resp, absl::Duration timeout) {
  return Call(stub_.get(), &pb::CoordinatorService::Stub::Drain, req, resp, timeout);
}

}  // namespace wb::daemon
