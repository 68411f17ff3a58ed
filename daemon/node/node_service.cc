#include "daemon/node/node_service.h"

#include <grpcpp/grpcpp.h>

#include "daemon/node/versions.h"
#include "daemon/node/worker_calls.h"
#include "proto/grpc_status.h"

namespace wb::daemon {
namespace {

class NodeServiceImpl final : public pb::NodeService::Service {
 public:
  NodeServiceImpl(node::Versions* versions, node::WorkerCalls* calls, std::function<std::string()> data_address)
      : node_(versions), calls_(calls), data_address_(std::move(data_address)) {}

  grpc::Status InstallPlan(grpc::ServerContext*, const pb::InstallPlanRequest* req, pb::InstallPlanResponse*) override {
    return ToGrpcStatus(node_->InstallPlan(*req));
  }
  grpc::Status ExecuteVersion(grpc::ServerContext*, const pb::ExecuteVersionRequest* req, pb::ExecuteVersionResponse*) override {
    return ToGrpcStatus(node_->ExecuteVersion(*req));
  }
  grpc::Status CommitVersion(grpc::ServerContext*, const pb::CommitVersionRequest* req, pb::CommitVersionResponse*) override {
    return ToGrpcStatus(node_->CommitVersion(*req));
  }
  grpc::Status AbortVersion(grpc::ServerContext*, const pb::AbortVersionRequest* req, pb::AbortVersionResponse*) override {
    return ToGrpcStatus(node_->AbortVersion(*req));
  }
  grpc::Status ExchangeRegions(grpc::ServerContext*, const pb::ExchangeRegionsRequest* req, pb::ExchangeRegionsResponse* resp) override {
    return ToGrpcStatus(node_->ExchangeRegions(*req, resp));
  }
  grpc::Status DropWorker(grpc::ServerContext*, const pb::DropWorkerRequest* req, pb::DropWorkerResponse*) override {
    return ToGrpcStatus(node_->DropWorker(*req));
  }
  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest* req, pb::DrainResponse* resp) override {
    return ToGrpcStatus(node_->Drain(*req, resp));
  }
  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest* req, pb::StatusResponse* resp) override {
    return ToGrpcStatus(calls_->ClusterStatus(*req, resp));
  }
  grpc::Status SetupDataChannel(grpc::ServerContext*, const pb::SetupDataChannelRequest*, pb::SetupDataChannelResponse* resp) override {
    resp->set_endpoint(data_address_());  // data planes are set up per version by ExchangeRegions
    return grpc::Status::OK;
  }

 private:
  node::Versions* node_;
  node::WorkerCalls* calls_;
  std::function<std::string()> data_address_;
};

}  // namespace

std::unique_ptr<pb::NodeService::Service> NewNodeService(node::Versions* versions, node::WorkerCalls* calls,
                                                        std::function<std::string()> data_address) {
  return std::make_unique<NodeServiceImpl>(versions, calls, std::move(data_address));
}

}  // namespace wb::daemon
