#pragma once
// NodeService (TCP, called by the coordinator and peer nodes): InstallPlan, ExecuteVersion,
// CommitVersion, AbortVersion, ExchangeRegions, DropWorker, SetupDataChannel, Drain, Status. A
// thin adapter: each call goes to the node::Versions method of the same name
// (daemon/node/versions.h; Status to node::WorkerCalls::ClusterStatus), whose absl::Status
// becomes the gRPC status through ToGrpcStatus (proto/grpc_status.h).

#include <functional>
#include <memory>
#include <string>

#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {

namespace node {
class Versions;
class WorkerCalls;
}

// `versions` and `calls` must outlive the service; `data_address` answers SetupDataChannel.
std::unique_ptr<::weightbridge::v1::NodeService::Service> NewNodeService(node::Versions* versions, node::WorkerCalls* calls,
                                                                          std::function<std::string()> data_address);

}  // namespace wb::daemon
