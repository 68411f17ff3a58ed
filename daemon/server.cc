#include "daemon/server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "tools/cc/status_macros.h"

namespace wb::daemon {

absl::StatusOr<DaemonRole> ParseRole(const std::string& role) {
  if (role == "node") return DaemonRole::kNode;
  if (role == "coordinator") return DaemonRole::kCoordinator;
  if (role == "standalone") return DaemonRole::kStandalone;
  return absl::InvalidArgumentError(absl::StrCat("--role must be node, coordinator or standalone, got '", role, "'"));
}

std::string Server::address() const {
  std::string host = options_.listen.substr(0, options_.listen.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]") host = "127.0.0.1";
  return absl::StrCat(host, ":", port_);
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  std::unique_ptr<Server> s(new Server());
  s->options_ = std::move(options);
  ServerOptions& o = s->options_;
  const bool has_coord = o.role != DaemonRole::kNode;
  const bool has_node = o.role != DaemonRole::kCoordinator;
  if (has_node && o.worker_socket.empty()) return absl::InvalidArgumentError("--worker_socket is required for role node/standalone");
  if (o.role == DaemonRole::kNode && o.coordinator.empty()) return absl::InvalidArgumentError("--coordinator is required for role node");
  if (has_node && !o.make_data_channel) return absl::InvalidArgumentError("no data channel factory");
  if (has_coord && !o.make_plan) return absl::InvalidArgumentError("no planner");
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder tcp;
  tcp.AddListeningPort(o.listen, grpc::InsecureServerCredentials(), &s->port_);
  tcp.SetMaxReceiveMessageSize(256 << 20);
  tcp.SetMaxSendMessageSize(256 << 20);
  if (has_coord) {
    Coordinator::Options co;
    co.clock = o.clock;
    co.lease = o.lease;
    co.transfer_timeout = o.transfer_timeout;
    co.make_plan = o.make_plan;
    co.inventory_from_hf = o.inventory_from_hf;
    co.preset_layout = o.preset_layout;
    s->coordinator_ = std::make_unique<Coordinator>(std::move(co));
    tcp.RegisterService(s->coordinator_.get());
  }
  if (has_node) {
    NodeDaemon::Options no;
    no.node_id = o.node_id;
    no.data_listen = o.data_listen;
    no.clock = o.clock;
    no.heartbeat = o.heartbeat;
    no.staging_budget_bytes = o.staging_budget_bytes;
    no.data_channel = o.make_data_channel();
    s->node_ = std::make_unique<NodeDaemon>(std::move(no));
    tcp.RegisterService(s->node_->node_service());
  }
  s->tcp_server_ = tcp.BuildAndStart();
  if (!s->tcp_server_ || s->port_ == 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", o.listen));
  if (has_coord) s->coordinator_->Start();
  if (has_node) {
    ::unlink(o.worker_socket.c_str());  // a stale socket from a killed daemon
    grpc::ServerBuilder ub;
    ub.AddListeningPort(absl::StrCat("unix:", o.worker_socket), grpc::InsecureServerCredentials());
    ub.SetMaxReceiveMessageSize(256 << 20);
    ub.RegisterService(s->node_->worker_service());
    s->unix_server_ = ub.BuildAndStart();
    if (!s->unix_server_) return absl::UnavailableError(absl::StrCat("cannot listen on unix socket ", o.worker_socket));
    ::chmod(o.worker_socket.c_str(), 0660);
    // Standalone talks to its own coordinator over the same TCP port as remote nodes would.
    s->node_->set_coordinator(o.role == DaemonRole::kStandalone ? s->address() : o.coordinator);
    RETURN_IF_ERROR(s->node_->Start(s->address()));
  }
  return s;
}

Server::~Server() { Shutdown(); }

void Server::Shutdown() {
  if (shut_) return;
  shut_ = true;
  if (node_) node_->Shutdown();
  if (coordinator_) coordinator_->Shutdown();
  auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
  if (unix_server_) unix_server_->Shutdown(deadline);
  if (tcp_server_) tcp_server_->Shutdown(deadline);
  if (!options_.worker_socket.empty() && node_) ::unlink(options_.worker_socket.c_str());
}

}  // namespace wb::daemon
