#include "daemon/coordinator.h"

#include <grpcpp/grpcpp.h>

#include "proto/grpc_status.h"

namespace wb::daemon {

Coordinator::Coordinator(Options options)
    : metrics_(options.metrics != nullptr ? options.metrics : &Metrics()), core_(std::move(options)) {}

// Every handler: the core's absl::Status, converted once (proto/grpc_status.h).
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
WB_COORDINATOR_RPC(ReportApplied, ReportAppliedRequest, ReportAppliedResponse)
WB_COORDINATOR_RPC(ExchangeMagnitudes, ExchangeMagnitudesRequest, ExchangeMagnitudesResponse)
WB_COORDINATOR_RPC(WaitVersion, WaitVersionRequest, WaitVersionResponse)
WB_COORDINATOR_RPC(ClusterStatus, StatusRequest, StatusResponse)
WB_COORDINATOR_RPC(Drain, DrainRequest, DrainResponse)
WB_COORDINATOR_RPC(Plan, PlanRequest, PlanResponse)
#undef WB_COORDINATOR_RPC

// A node's transfer report is counted as it arrives (the node's own phase and failure series).
grpc::Status Coordinator::ReportDone(grpc::ServerContext*, const pb::ReportDoneRequest* req, pb::ReportDoneResponse* resp) {
  if (req->ok()) {
    metrics_->Phase(req->node_id(), "transfer", req->seconds());
  } else {
    metrics_->Failure(req->node_id(), absl::AbortedError(req->error()));
  }
  return ToGrpcStatus(core_.ReportDone(*req, resp));
}

grpc::Status Coordinator::WatchStatus(grpc::ServerContext* ctx, const pb::WatchStatusRequest* req,
                                      grpc::ServerWriter<pb::StatusResponse>* writer) {
  return ToGrpcStatus(core_.WatchStatus(
      *req, [writer](const pb::StatusResponse& s) { return writer->Write(s); },
      [ctx] { return ctx != nullptr && ctx->IsCancelled(); },
      // A Write blocked on a client that stopped reading returns false once the call is cancelled
      // (the core's watchdog calls this past the stream's deadline).
      [ctx] {
        if (ctx != nullptr) ctx->TryCancel();
      }));
}

}  // namespace wb::daemon
