#include "daemon/node/worker_service.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "daemon/node/worker_calls.h"
#include "proto/grpc_status.h"

namespace wb::daemon {
namespace {

// What is left of a call's gRPC deadline (infinite: the worker gave none), for the calls whose
// request carries no timeout_ms (WorkerCalls::RegisterWorker, RegisterLayout, Deregister) and for
// WaitVersion, whose answer must reach the worker before that deadline (WorkerCalls' ReplyBy).
absl::Duration TimeLeft(const grpc::ServerContext* ctx) {
  const std::chrono::system_clock::time_point d = ctx->deadline();
  if (d == std::chrono::system_clock::time_point::max()) return absl::InfiniteDuration();
  const std::chrono::system_clock::time_point now = std::chrono::system_clock::now();
  if (d <= now) return absl::ZeroDuration();
  return absl::FromChrono(d - now);
}

class WorkerServiceImpl final : public pb::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(node::WorkerCalls* node) : node_(node) {}

  grpc::Status RegisterWorker(grpc::ServerContext* ctx, const pb::RegisterWorkerRequest* req, pb::RegisterWorkerResponse* resp) override {
    return ToGrpcStatus(node_->RegisterWorker(*req, resp, TimeLeft(ctx)));
  }
  grpc::Status RegisterLayout(grpc::ServerContext* ctx, const pb::RegisterLayoutRequest* req, pb::RegisterLayoutResponse* resp) override {
    return ToGrpcStatus(node_->RegisterLayout(*req, resp, TimeLeft(ctx)));
  }
  grpc::Status Publish(grpc::ServerContext*, const pb::PublishRequest* req, pb::PublishResponse* resp) override {
    return ToGrpcStatus(node_->Publish(*req, resp));
  }
  grpc::Status BeginUpdate(grpc::ServerContext*, const pb::BeginUpdateRequest* req, pb::BeginUpdateResponse* resp) override {
    return ToGrpcStatus(node_->BeginUpdate(*req, resp));
  }
  grpc::Status EndUpdate(grpc::ServerContext*, const pb::EndUpdateRequest* req, pb::EndUpdateResponse* resp) override {
    return ToGrpcStatus(node_->EndUpdate(*req, resp));
  }
  grpc::Status Apply(grpc::ServerContext*, const pb::ApplyRequest* req, pb::ApplyResponse* resp) override {
    return ToGrpcStatus(node_->Apply(*req, resp));
  }
  grpc::Status WaitVersion(grpc::ServerContext* ctx, const pb::WaitVersionRequest* req, pb::WaitVersionResponse* resp) override {
    return ToGrpcStatus(node_->WaitVersion(*req, resp, TimeLeft(ctx)));
  }
  grpc::Status Deregister(grpc::ServerContext* ctx, const pb::DeregisterRequest* req, pb::DeregisterResponse*) override {
    return ToGrpcStatus(node_->Deregister(*req, TimeLeft(ctx)));
  }
  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest* req, pb::StatusResponse* resp) override {
    return ToGrpcStatus(node_->ClusterStatus(*req, resp));
  }
  grpc::Status DescribeLayout(grpc::ServerContext*, const pb::DescribeLayoutRequest* req, pb::DescribeLayoutResponse* resp) override {
    return ToGrpcStatus(node_->DescribeLayout(*req, resp));
  }
 private:
  node::WorkerCalls* node_;
};

}  // namespace

std::unique_ptr<pb::WorkerService::Service> NewWorkerService(node::WorkerCalls* node) { return std::make_unique<WorkerServiceImpl>(node); }

}  // namespace wb::daemon
