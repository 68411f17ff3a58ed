#include "daemon/server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

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
  if (has_node && !o.make_transports) return absl::InvalidArgumentError("no transport factory");
  grpc::EnableDefaultHealthCheckService(true);
  DaemonMetrics* metrics = o.metrics != nullptr ? o.metrics : &Metrics();
  s->front_ = std::make_unique<DaemonFront>(o.security, has_node ? o.node_id : "coordinator", metrics);
  RETURN_IF_ERROR(s->front_->StartMetrics());
  grpc::ServerBuilder tcp;
  // Our own accept loop in front of gRPC's (daemon/conn_guard.h): survives fd exhaustion and
  // bounds unauthenticated connections; gRPC listens on a private Unix socket behind it.
  ASSIGN_OR_RETURN(s->port_, s->front_->BindTcp(o.listen));
  tcp.AddListeningPort(s->front_->tcp_inner_address(), s->front_->server_credentials());
  s->front_->ConfigureServer(tcp);
  if (has_coord) {
    Coordinator::Options co;
    co.clock = o.clock;
    co.lease = o.lease;
    co.make_channel = s->front_->channel_factory();
    co.transfer_timeout = o.transfer_timeout;
    co.plan_deadline = o.plan_deadline;
    co.sync_pause_timeout = o.sync_pause_timeout;
    co.make_plan = o.make_plan;
    co.topology = o.topology;
    co.bucket_bytes = o.bucket_bytes;
    co.max_status_watchers = o.security.limits.max_status_watchers;
    // Replies travel on channels sized by PeerMessageBytes (DaemonFront::channel_factory).
    co.max_reply_bytes = PeerMessageBytes(o.security.limits);
    co.max_wait = absl::Milliseconds(o.security.limits.max_wait_ms);
    co.status_resend = o.status_resend;
    co.metrics = metrics;
    // Standalone: the node lives in this very process, so it cannot be lost while we run (its
    // heartbeats are only late when the whole process is starved, e.g. by its own copies).
    if (o.role == DaemonRole::kStandalone) co.local_node = o.node_id;
    s->coordinator_ = std::make_unique<Coordinator>(std::move(co));
    tcp.RegisterService(s->front_->WrapCoordinator(s->coordinator_.get()));
  }
  if (has_node) {
    NodeDaemon::Options no;
    no.node_id = o.node_id;
    // Named by the node's worker calls that give up on an unreachable coordinator (WorkerCalls
    // copies it at construction: set_coordinator below came too late, and they said "(unknown
    // address)"). A standalone's own address is known only once its server listens.
    if (o.role != DaemonRole::kStandalone) no.coordinator = o.coordinator;
    no.data_listen = o.data_listen;
    no.clock = o.clock;
    no.heartbeat = o.heartbeat;
    no.make_channel = s->front_->channel_factory();
    no.cuda_vmm_fd = [front = s->front_.get()](const std::string& model, const std::string& worker, const std::string& key) {
      return front->FindVmmFd(model, worker, key);
    };
    no.worker_uid = [front = s->front_.get()](const std::string& model, const std::string& worker) { return front->WorkerUid(model, worker); };
    no.staging_budget_bytes = o.staging_budget_bytes;
    no.metrics = metrics;
    no.live_state_dir = o.live_state_dir;
    ASSIGN_OR_RETURN(no.transports, o.make_transports());
    no.checksums = o.checksums;
    no.digests = o.digests;
    no.digest_overlap = o.digest_overlap;
    no.digest_in_transport = o.digest_in_transport;
    no.delta_cache_bytes = o.delta_cache_bytes;
    no.delta_threads = o.delta_threads;
    no.delta_in_place = o.delta_in_place;
    no.quantize_early_threads = o.quantize_early_threads;
    no.delta_apply_delay = o.delta_apply_delay;
    no.device_staging = o.device_staging;
    no.test_before_bucket = o.test_before_bucket;
    no.test_skip_heartbeat = o.test_skip_heartbeat;
    if (o.configure_node) o.configure_node(no);  // TEST ONLY (NODE helper: live-copy fault hooks)
    s->node_ = std::make_unique<NodeDaemon>(std::move(no));
    tcp.RegisterService(s->front_->WrapNode(s->node_->node_service()));
  }
  s->tcp_server_ = tcp.BuildAndStart();
  if (!s->tcp_server_) return absl::UnavailableError(absl::StrCat("cannot start the gRPC server behind ", o.listen));
  s->front_->ServeTcp();
  if (has_coord) s->coordinator_->Start();
  if (has_node) {
    // Standalone talks to its own coordinator over the same TCP port as remote nodes would.
    s->node_->set_coordinator(o.role == DaemonRole::kStandalone ? s->address() : o.coordinator);
    // Register with the coordinator before any worker can reach us: a restarted node's
    // RegisterNode drops every worker of its previous incarnation at the coordinator, so a
    // worker joining before it would be dropped there while this node keeps it (left out of
    // every plan). NodeDaemon also gates worker registration on its own registration.
    RETURN_IF_ERROR(s->node_->Start(s->address()));
    // Worker socket: SO_PEERCRED identity, ownership checks and limits in front (daemon/auth.h).
    ASSIGN_OR_RETURN(s->unix_server_, s->front_->ServeWorkers(o.worker_socket, s->node_->worker_service()));
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
  if (front_) front_->Stop();  // no new worker connections
  if (unix_server_) unix_server_->Shutdown(deadline);
  if (tcp_server_) tcp_server_->Shutdown(deadline);
  // (The worker socket file went with front_->Stop(): its listener removes it only while the path
  // still names the socket it bound, never one a daemon started since bound there.)
}

}  // namespace wb::daemon
