#pragma once
// WorkerService (the node's Unix socket, called by local workers): RegisterWorker, RegisterLayout,
// Publish, BeginUpdate, EndUpdate, Apply, WaitVersion, Deregister, Status, DescribeLayout. A thin adapter:
// each call goes to the node::WorkerCalls method of the same name (daemon/node/worker_calls.h),
// whose absl::Status becomes the gRPC status through ToGrpcStatus (proto/grpc_status.h).

#include <memory>

#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {

namespace node {
class WorkerCalls;
}

// `calls` must outlive the service.
std::unique_ptr<::weightbridge::v1::WorkerService::Service> NewWorkerService(node::WorkerCalls* calls);

}  // namespace wb::daemon
