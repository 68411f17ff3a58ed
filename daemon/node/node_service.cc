#include "daemon/node/node_service.h"

#include <grpcpp/grpcpp.h>

#include "daemon/node_daemon.h"
#include "proto/grpc_status.h"

namespace wb::daemon {
namespace {

class NodeServiceImpl final : public pb::NodeService::Service {
 public:
  explicit NodeServiceImpl(NodeDaemon* node) : node_(node) {}

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
    return ToGrpcStatus(node_->ClusterStatus(*req, resp));
  }
  grpc::Status SetupDataChannel(grpc::ServerContext*, const pb::SetupDataChannelRequest*, pb::SetupDataChannelResponse* resp) override {
    resp->set_endpoint(node_->data_address());  // data planes are set up per version by ExchangeRegions
    return grpc::Status::OK;
  }

 private:
  NodeDaemon* node_;
};

}  // namespace

std::unique_ptr<pb::NodeService::Service> NewNodeService(NodeDaemon* node) { return std::make_unique<NodeServiceImpl>(node); }

}  // namespace wb::daemon
