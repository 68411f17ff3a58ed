#pragma once
// WorkerService (the node's Unix socket, called by local workers): RegisterWorker, RegisterLayout,
// Publish, BeginUpdate, Apply, WaitVersion, Deregister, Status, DescribeLayout. A thin adapter:
// each call goes to the NodeDaemon method of the same name (daemon/node_daemon_workers.cc), whose
// absl::Status becomes the gRPC status through ToGrpcStatus (proto/grpc_status.h).

#include <memory>

#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {

class NodeDaemon;

// `node` must outlive the service.
std::unique_ptr<::weightbridge::v1::WorkerService::Service> NewWorkerService(NodeDaemon* node);

}  // namespace wb::daemon
