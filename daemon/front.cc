#include "daemon/front.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"

namespace wb::daemon {

DaemonFront::DaemonFront(SecurityOptions options, std::string node_id)
    : options_(std::move(options)),
      node_id_(std::move(node_id)),
      auth_(options_.peer_auth ? options_.peer_auth : std::make_shared<const PeerAuthConfig>()) {}

DaemonFront::~DaemonFront() { Stop(); }

absl::Status DaemonFront::StartMetrics() {
  if (options_.metrics_listen.empty() || metrics_) return absl::OkStatus();
  auto m = MetricsEndpoint::Start(options_.metrics_listen, Metrics().registry());
  if (!m.ok()) return m.status();
  metrics_ = std::move(*m);
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> DaemonFront::server_credentials() const { return MakeServerCredentials(*auth_); }

std::function<std::shared_ptr<grpc::Channel>(const std::string&)> DaemonFront::channel_factory() const {
  return [auth = auth_](const std::string& target) { return MakePeerChannel(target, *auth); };
}

grpc::Service* DaemonFront::WrapCoordinator(pb::CoordinatorService::Service* inner) {
  coordinator_ = std::make_unique<TokenCoordinatorService>(inner, auth_, options_.limits);
  return coordinator_.get();
}

grpc::Service* DaemonFront::WrapNode(pb::NodeService::Service* inner) {
  node_ = std::make_unique<TokenNodeService>(
      inner, auth_, node_id_,
      [this](const std::string& model, uint64_t version) {
        if (GuardedWorkerService* w = workers_ready_.load()) w->NoteCommitted(model, version);
      },
      [this](const std::string& model, uint64_t version) {
        if (GuardedWorkerService* w = workers_ready_.load()) w->NoteAborted(model, version);
      });
  return node_.get();
}

absl::StatusOr<std::unique_ptr<grpc::Server>> DaemonFront::ServeWorkers(const std::string& path, pb::WorkerService::Service* inner) {
  auto l = PeerCredListener::Bind(path, options_.worker_socket_mode);
  if (!l.ok()) return l.status();
  listener_ = std::move(*l);
  workers_ = std::make_unique<GuardedWorkerService>(inner, listener_.get(), options_.limits, node_id_);
  grpc::ServerBuilder b;
  b.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(options_.limits.max_message_bytes, INT32_MAX)));
  b.RegisterService(workers_.get());
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (!server) return absl::UnavailableError(absl::StrCat("cannot start the worker service on ", path));
  workers_ready_.store(workers_.get());
  listener_->Serve(server.get());
  return server;
}

void DaemonFront::Stop() {
  if (listener_) listener_->Stop();
}

}  // namespace wb::daemon
