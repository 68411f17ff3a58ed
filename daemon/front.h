#pragma once
// DaemonFront: everything between the network and the services of one weightbridged process -
// server/channel credentials, the auth/limit decorators (daemon/auth.h), the SO_PEERCRED worker
// socket and the metrics endpoint (daemon/metrics.h). daemon/server.cc asks it for credentials
// and wrapped services, so the services themselves carry no security code.

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/auth.h"
#include "daemon/fd_channel.h"
#include "daemon/limits.h"
#include "daemon/metrics.h"

namespace wb::daemon {

struct SecurityOptions {
  std::shared_ptr<const PeerAuthConfig> peer_auth;  // null: plaintext, no token
  Limits limits;
  mode_t worker_socket_mode = 0660;
  std::string metrics_listen;  // host:port (port 0 picks one); empty = no endpoint
};

class DaemonFront {
 public:
  DaemonFront(SecurityOptions options, std::string node_id);
  ~DaemonFront();

  // Starts the metrics endpoint when configured (UNAVAILABLE if it cannot bind).
  absl::Status StartMetrics();
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

  std::shared_ptr<grpc::ServerCredentials> server_credentials() const;
  // Factory for channels to other daemons (TLS + token as configured).
  std::function<std::shared_ptr<grpc::Channel>(const std::string&)> channel_factory() const;
  // Decorated services; owned by the front, valid until it is destroyed.
  grpc::Service* WrapCoordinator(pb::CoordinatorService::Service* inner);
  grpc::Service* WrapNode(pb::NodeService::Service* inner);
  // Binds the worker socket (mode from options), builds a port-less gRPC server with the guarded
  // WorkerService and starts accepting. Call Stop() before shutting that server down.
  absl::StatusOr<std::unique_ptr<grpc::Server>> ServeWorkers(const std::string& path, pb::WorkerService::Service* inner);
  void Stop();
  const Limits& limits() const { return options_.limits; }
  // The fd of a CUDA VMM allocation that `worker` sent on the fd channel (<worker socket>.fd,
  // started by ServeWorkers) under `key`, if the process that sent it is the one bound to the
  // worker now (daemon/fd_channel.h). FAILED_PRECONDITION before ServeWorkers.
  absl::StatusOr<CudaVmmFd> FindVmmFd(const std::string& worker, const std::string& key);

 private:
  SecurityOptions options_;
  std::string node_id_;
  std::shared_ptr<const PeerAuthConfig> auth_;
  std::unique_ptr<MetricsEndpoint> metrics_;
  std::unique_ptr<TokenCoordinatorService> coordinator_;
  std::unique_ptr<TokenNodeService> node_;
  std::unique_ptr<PeerCredListener> listener_;
  std::unique_ptr<GuardedWorkerService> workers_;
  std::unique_ptr<FdChannel> fd_channel_;
  absl::Status fd_channel_error_;  // why fd_channel_ is null after ServeWorkers
  std::atomic<GuardedWorkerService*> workers_ready_{nullptr};
};

}  // namespace wb::daemon
