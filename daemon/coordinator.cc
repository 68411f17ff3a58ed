#include "daemon/coordinator.h"

#include <grpcpp/grpcpp.h>

#include "proto/grpc_status.h"

namespace wb::daemon {

// The one place the coordinator's absl::Status becomes a gRPC status.
#define WB_COORDINATOR_RPC(Method, Req, Resp)                                                       \
  grpc::Status Coordinator::Method(grpc::ServerContext*, const pb::Req* req, pb::Resp* resp) { \
    return ToGrpcStatus(core_.Method(*req, resp));                                              \
  }

WB_COORDINATOR_RPC(RegisterNode, RegisterNodeRequest, RegisterNodeResponse)
WB_COORDINATOR_RPC(Heartbeat, HeartbeatRequest, HeartbeatResponse)
WB_COORDINATOR_RPC(CreateModel, CreateModelRequest, CreateModelResponse)
WB_COORDINATOR_RPC(JoinWorker, JoinWorkerRequest, JoinWorkerResponse)
WB_COORDINATOR_RPC(SubmitLayout, SubmitLayoutRequest, SubmitLayoutResponse)
WB_COORDINATOR_RPC(LeaveWorker, LeaveWorkerRequest, LeaveWorkerResponse)
WB_COORDINATOR_RPC(Publish, CoordPublishRequest, PublishResponse)
WB_COORDINATOR_RPC(ReportReady, ReportReadyRequest, ReportReadyResponse)
WB_COORDINATOR_RPC(ReportDone, ReportDoneRequest, ReportDoneResponse)
WB_COORDINATOR_RPC(ReportApplied, ReportAppliedRequest, ReportAppliedResponse)
WB_COORDINATOR_RPC(WaitVersion, WaitVersionRequest, WaitVersionResponse)
WB_COORDINATOR_RPC(ClusterStatus, StatusRequest, StatusResponse)
WB_COORDINATOR_RPC(Drain, DrainRequest, DrainResponse)
WB_COORDINATOR_RPC(Plan, PlanRequest, PlanResponse)
#undef WB_COORDINATOR_RPC

grpc::Status Coordinator::WatchStatus(grpc::ServerContext* ctx, const pb::WatchStatusRequest* req,
                                      grpc::ServerWriter<pb::StatusResponse>* writer) {
  return ToGrpcStatus(core_.WatchStatus(
      *req, [writer](const pb::StatusResponse& s) { return writer->Write(s); },
      [ctx] { return ctx != nullptr && ctx->IsCancelled(); }));
}

}  // namespace wb::daemon
