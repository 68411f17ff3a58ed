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
#include "daemon/conn_guard.h"
#include "daemon/fd_channel.h"
#include "daemon/limits.h"
#include "daemon/metrics.h"

namespace grpc {
class ServerBuilder;
}  // namespace grpc

namespace wb::daemon {

struct SecurityOptions {
  std::shared_ptr<const PeerAuthConfig> peer_auth;  // null: plaintext, no token
  Limits limits;
  mode_t worker_socket_mode = 0660;
  std::string metrics_listen;  // host:port (port 0 picks one); empty = no endpoint
  ConnLimits connections;      // unauthenticated TCP connections (daemon/conn_guard.h)
};

class DaemonFront {
 public:
  DaemonFront(SecurityOptions options, std::string node_id);
  ~DaemonFront();

  // Starts the metrics endpoint when configured (UNAVAILABLE if it cannot bind).
  absl::Status StartMetrics();
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

  std::shared_ptr<grpc::ServerCredentials> server_credentials() const;
  // The daemon's TCP port goes through a ConnGuard (daemon/conn_guard.h): BindTcp binds `listen`
  // and returns the port; the gRPC server must listen on tcp_inner_address() (with
  // server_credentials()) and be started before ServeTcp(). Stop() stops the guard.
  absl::StatusOr<int> BindTcp(const std::string& listen);
  // Message sizes (PeerMessageBytes), thread quota (ServerThreadBudget) and the status-message
  // interceptor for a daemon server; ServeWorkers applies it to the worker server itself.
  void ConfigureServer(grpc::ServerBuilder& builder) const;
  std::string tcp_inner_address() const { return guard_ ? guard_->inner_address() : ""; }
  void ServeTcp();
  const ConnGuard* conn_guard() const { return guard_.get(); }
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
  PeerAuthenticated OnAuthenticated();
  SecurityOptions options_;
  std::string node_id_;
  std::shared_ptr<const PeerAuthConfig> auth_;
  std::unique_ptr<MetricsEndpoint> metrics_;
  std::unique_ptr<ConnGuard> guard_;
  std::unique_ptr<TokenCoordinatorService> coordinator_;
  std::unique_ptr<TokenNodeService> node_;
  std::unique_ptr<PeerCredListener> listener_;
  std::unique_ptr<GuardedWorkerService> workers_;
  std::unique_ptr<FdChannel> fd_channel_;
  absl::Status fd_channel_error_;  // why fd_channel_ is null after ServeWorkers
  std::atomic<GuardedWorkerService*> workers_ready_{nullptr};
};

}  // namespace wb::daemon
