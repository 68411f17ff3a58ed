#pragma once
// NodeService (TCP, called by the coordinator and peer nodes): InstallPlan, ExecuteVersion,
// CommitVersion, AbortVersion, ExchangeRegions, DropWorker, SetupDataChannel, Drain, Status. A
// thin adapter: each call goes to the NodeDaemon method of the same name
// (daemon/node_daemon_versions.cc), whose absl::Status becomes the gRPC status through
// ToGrpcStatus (proto/grpc_status.h).

#include <memory>

#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {

class NodeDaemon;

// `node` must outlive the service.
std::unique_ptr<::weightbridge::v1::NodeService::Service> NewNodeService(NodeDaemon* node);

}  // namespace wb::daemon
