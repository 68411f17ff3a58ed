#pragma once
// DaemonFront: everything between the network and the services of one weightbridged process -
// server/channel credentials, the auth interceptor and its per-method rules (daemon/auth_gate.h,
// daemon/auth_policy.h), the SO_PEERCRED worker socket and the metrics endpoint
// (daemon/metrics.h). daemon/server.cc asks it for credentials and guarded services, so the
// services themselves carry no security code.

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/auth.h"
#include "daemon/auth_gate.h"
#include "daemon/auth_policy.h"
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
  // `metrics` (must outlive this) receives the refusals and the connection guard's counts;
  // null = the process default (Metrics()).
  DaemonFront(SecurityOptions options, std::string node_id, DaemonMetrics* metrics = nullptr);
  ~DaemonFront();

  // Starts the metrics endpoint when configured (UNAVAILABLE if it cannot bind).
  absl::Status StartMetrics();
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

  std::shared_ptr<grpc::ServerCredentials> server_credentials() const;
  // The daemon's TCP port goes through a ConnGuard (daemon/conn_guard.h): BindTcp binds `listen`
  // and returns the port; the gRPC server must listen on tcp_inner_address() (with
  // server_credentials()) and be started before ServeTcp(). Stop() stops the guard.
  absl::StatusOr<int> BindTcp(const std::string& listen);
  // Message sizes (PeerMessageBytes), thread quota (ServerThreadBudget), the auth interceptor of
  // the TCP services and the status-message interceptor, for the TCP server; ServeWorkers
  // configures the worker server the same way with the worker rules.
  void ConfigureServer(grpc::ServerBuilder& builder);
  std::string tcp_inner_address() const { return guard_ ? guard_->inner_address() : ""; }
  void ServeTcp();
  const ConnGuard* conn_guard() const { return guard_.get(); }
  // Factory for channels to other daemons (TLS + token as configured).
  std::function<std::shared_ptr<grpc::Channel>(const std::string&)> channel_factory() const;
  // Services to register on the TCP server (configured by ConfigureServer) in place of `inner`:
  // their handlers run only for calls the auth rules passed. Owned by the front.
  grpc::Service* WrapCoordinator(pb::CoordinatorService::Service* inner);
  grpc::Service* WrapNode(pb::NodeService::Service* inner);
  // Binds the worker socket (mode from options), builds a port-less gRPC server with the
  // WorkerService guarded by WorkerGuard's rules and starts accepting. Call Stop() before shutting that server down.
  absl::StatusOr<std::unique_ptr<grpc::Server>> ServeWorkers(const std::string& path, pb::WorkerService::Service* inner);
  void Stop();
  const Limits& limits() const { return options_.limits; }
  // The fd of a CUDA VMM allocation that `worker` sent on the fd channel (<worker socket>.fd,
  // started by ServeWorkers) under `key`, if the process that sent it is the one bound to the
  // worker now (daemon/fd_channel.h). FAILED_PRECONDITION before ServeWorkers.
  absl::StatusOr<CudaVmmFd> FindVmmFd(const std::string& model, const std::string& worker, const std::string& key);
  // The uid `worker` of `model` is bound to on the worker socket (WorkerGuard::BoundCred).
  // FAILED_PRECONDITION before ServeWorkers, NOT_FOUND when the worker is not bound.
  absl::StatusOr<uid_t> WorkerUid(const std::string& model, const std::string& worker);

 private:
  PeerAuthenticated OnAuthenticated();
  PeerRuleOptions PeerRules();
  // Sizes, quota and interceptors (`gate`'s first) of one server.
  void Configure(grpc::ServerBuilder& builder, AuthGate* gate) const;
  SecurityOptions options_;
  std::string node_id_;
  DaemonMetrics* daemon_metrics_;
  std::shared_ptr<const PeerAuthConfig> auth_;
  std::unique_ptr<MetricsEndpoint> metrics_;
  std::unique_ptr<ConnGuard> guard_;
  std::unique_ptr<AuthGate> tcp_gate_;  // CoordinatorService, NodeService
  std::unique_ptr<PeerCredListener> listener_;
  std::unique_ptr<WorkerGuard> workers_;
  std::unique_ptr<AuthGate> worker_gate_;  // WorkerService (declared after workers_: its rules use it)
  std::unique_ptr<FdChannel> fd_channel_;
  absl::Status fd_channel_error_;  // why fd_channel_ is null after ServeWorkers
  std::atomic<WorkerGuard*> workers_ready_{nullptr};
};

}  // namespace wb::daemon
