#include "daemon/front.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/support/server_interceptor.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/log.h"

namespace wb::daemon {

DaemonFront::DaemonFront(SecurityOptions options, std::string node_id, DaemonMetrics* metrics)
    : options_(std::move(options)),
      node_id_(std::move(node_id)),
      daemon_metrics_(metrics != nullptr ? metrics : &Metrics()),
      auth_(options_.peer_auth ? options_.peer_auth : std::make_shared<const PeerAuthConfig>()) {
  // Refusals of coordinator calls are the coordinator's, the others this node's.
  tcp_gate_ = std::make_unique<AuthGate>([this](const std::string& method, const std::string& what) {
    daemon_metrics_->Rejected(absl::StartsWith(method, "/weightbridge.v1.CoordinatorService/") ? "coordinator" : node_id_, what);
  });
}

DaemonFront::~DaemonFront() { Stop(); }

absl::Status DaemonFront::StartMetrics() {
  if (options_.metrics_listen.empty() || metrics_) return absl::OkStatus();
  auto m = MetricsEndpoint::Start(options_.metrics_listen, daemon_metrics_->registry());
  if (!m.ok()) return m.status();
  metrics_ = std::move(*m);
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> DaemonFront::server_credentials() const { return MakeServerCredentials(*auth_); }

std::function<std::shared_ptr<grpc::Channel>(const std::string&)> DaemonFront::channel_factory() const {
  return [auth = auth_, bytes = PeerMessageBytes(options_.limits)](const std::string& target) {
    return MakePeerChannel(target, *auth, bytes);
  };
}

void DaemonFront::ConfigureServer(grpc::ServerBuilder& b) { Configure(b, tcp_gate_.get()); }

void DaemonFront::Configure(grpc::ServerBuilder& b, AuthGate* gate) const {
  const int bytes = static_cast<int>(PeerMessageBytes(options_.limits));
  b.SetMaxReceiveMessageSize(bytes);
  b.SetMaxSendMessageSize(bytes);
  // Every in-flight call of a sync server holds a thread: blocked calls are bounded
  // (Limits::max_blocked_calls) and the quota leaves room for short ones; over the quota gRPC
  // answers RESOURCE_EXHAUSTED "Server Threadpool Exhausted" instead of creating more threads
  // (the daemons' clients send such a call again: proto/grpc_retry.h).
  grpc::ResourceQuota quota(absl::StrCat("wb-", node_id_));
  quota.SetMaxThreads(ServerThreadBudget(options_.limits));
  b.SetResourceQuota(quota);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(gate->Interceptor());
  interceptors.push_back(MakeStatusMessageInterceptor());
  b.experimental().SetInterceptorCreators(std::move(interceptors));
}

absl::StatusOr<int> DaemonFront::BindTcp(const std::string& listen) {
  auto g = ConnGuard::Bind(listen, options_.connections, node_id_, daemon_metrics_);
  if (!g.ok()) return g.status();
  guard_ = std::move(*g);
  return guard_->port();
}

void DaemonFront::ServeTcp() {
  if (guard_) guard_->Serve();
}

// A call that passed the peer check: its connection is no longer unauthenticated (ConnGuard).
PeerAuthenticated DaemonFront::OnAuthenticated() {
  return [this](const std::string& peer) {
    if (guard_) guard_->NoteAuthenticated(peer);
  };
}

PeerRuleOptions DaemonFront::PeerRules() {
  return PeerRuleOptions{.config = auth_, .limits = options_.limits, .on_authenticated = OnAuthenticated(), .node_id = node_id_};
}

grpc::Service* DaemonFront::WrapCoordinator(pb::CoordinatorService::Service* inner) {
  AddCoordinatorRules(*tcp_gate_, PeerRules());
  return tcp_gate_->Guard<pb::CoordinatorService>(inner);
}

grpc::Service* DaemonFront::WrapNode(pb::NodeService::Service* inner) {
  // Commits and aborts move the versions a trainer may still publish (WorkerGuard).
  AddNodeRules(
      *tcp_gate_, PeerRules(),
      [this](const std::string& model, uint64_t version) {
        if (WorkerGuard* w = workers_ready_.load()) w->NoteCommitted(model, version);
      },
      [this](const std::string& model, uint64_t version) {
        if (WorkerGuard* w = workers_ready_.load()) w->NoteAborted(model, version);
      });
  return tcp_gate_->Guard<pb::NodeService>(inner);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> DaemonFront::ServeWorkers(const std::string& path, pb::WorkerService::Service* inner) {
  auto l = PeerCredListener::Bind(path, options_.worker_socket_mode);
  if (!l.ok()) return l.status();
  listener_ = std::move(*l);
  workers_ = std::make_unique<WorkerGuard>(listener_.get(), options_.limits, node_id_);
  worker_gate_ = std::make_unique<AuthGate>(
      [this](const std::string&, const std::string& what) { daemon_metrics_->Rejected(node_id_, what); });
  workers_->AddRules(*worker_gate_);
  // CUDA VMM fds (gRPC cannot carry descriptors): only the process bound to a worker may send them.
  auto fds = FdChannel::Bind(absl::StrCat(path, ".fd"), options_.worker_socket_mode,
                             [w = workers_.get()](const PeerCred& sender, const std::string& model, const std::string& worker) {
                               return w->CheckBound(sender, model, worker);
                             },
                             FdChannelLimits{.per_worker = static_cast<size_t>(options_.limits.max_vmm_fds_per_worker),
                                             .per_uid = static_cast<size_t>(options_.limits.max_vmm_fds_per_uid),
                                             .total = static_cast<size_t>(options_.limits.max_vmm_fds_per_node)});
  if (fds.ok()) {
    fd_channel_ = std::move(*fds);
    // A deregistered worker's fds are closed at once (those of exited processes by the channel).
    workers_->set_on_deregister(
        [c = fd_channel_.get()](const std::string& model, const std::string& worker) { c->ReleaseWorker(model, worker); });
  } else if (fds.status().code() == absl::StatusCode::kFailedPrecondition) {
    // The path is another process's live channel (or a file that is not a socket): this daemon's
    // VMM workers would offer their fds there. Refused like a live worker socket path (the
    // worker socket bound above goes with the listener when the daemon is torn down).
    return fds.status();
  } else {
    // Not fatal (e.g. the path + ".fd" no longer fits a socket address): only VMM buffers need it,
    // and they then fail with this reason.
    fd_channel_error_ = fds.status();
    Log(LogLevel::kWarning, "fd channel not serving: CUDA VMM buffers of this node's workers will be refused",
        {{"node", node_id_}, {"error", fds.status().message()}});
  }
  grpc::ServerBuilder b;
  Configure(b, worker_gate_.get());
  b.RegisterService(worker_gate_->Guard<pb::WorkerService>(inner));
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (!server) return absl::UnavailableError(absl::StrCat("cannot start the worker service on ", path));
  workers_ready_.store(workers_.get());
  listener_->Serve(server.get());
  return server;
}

void DaemonFront::Stop() {
  if (guard_) guard_->Stop();
  if (listener_) listener_->Stop();
  if (fd_channel_) fd_channel_->Stop();
}

absl::StatusOr<CudaVmmFd> DaemonFront::FindVmmFd(const std::string& model, const std::string& worker, const std::string& key) {
  if (!fd_channel_ || !workers_) {
    return absl::FailedPreconditionError(absl::StrCat("the fd channel for CUDA VMM fds is not serving: ",
                                                      fd_channel_error_.ok() ? "no worker socket" : fd_channel_error_.message()));
  }
  absl::StatusOr<PeerCred> bound = workers_->BoundCred(model, worker);
  if (!bound.ok()) return bound.status();
  return fd_channel_->Get(model, worker, key, *bound);
}

absl::StatusOr<uid_t> DaemonFront::WorkerUid(const std::string& model, const std::string& worker) {
  WorkerGuard* w = workers_ready_.load();
  if (w == nullptr) return absl::FailedPreconditionError("the worker socket is not serving: no worker is bound");
  absl::StatusOr<PeerCred> bound = w->BoundCred(model, worker);
  if (!bound.ok()) return bound.status();
  return bound->uid;
}

}  // namespace wb::daemon
