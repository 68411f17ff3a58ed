#pragma once
// Who may talk to a daemon, and as whom. Two fronts, both decorators around the real services so
// the services themselves stay free of security code (daemon/server.cc wires them):
//
// 1. Workers (Unix socket). gRPC's AuthContext does not carry SO_PEERCRED for Unix sockets, so
//    PeerCredListener accepts connections itself, reads SO_PEERCRED (pid/uid/gid, filled in by
//    the kernel at connect(): unforgeable) of each accepted socket and hands the descriptor to the
//    gRPC server (grpc::AddInsecureChannelFromFd). gRPC reports such a call's peer as "fd:<n>",
//    which maps back to the credentials recorded at accept. The socket file is mode 0660.
//    GuardedWorkerService then enforces, per call:
//      - RegisterWorker binds worker_id -> (pid, process start time, uid, model). A worker id bound
//        to another LIVE process is PERMISSION_DENIED (a dead one's binding is taken over: restarts).
//      - every other call naming a worker must come from the bound process and name its model;
//        WaitVersion needs some worker of the caller bound to that model;
//      - RegisterLayout: every shm segment must be owned by the caller's uid (fstat of the opened
//        descriptor) and be at least size_bytes large; request limits (daemon/limits.h) first.
// 2. Daemons (TCP: NodeService, CoordinatorService). PeerAuthConfig: mutual TLS when cert, key and
//    CA are given (the server requests and verifies client certificates against the CA), plus an
//    optional shared token sent as "authorization: Bearer <token>" on every call (a client
//    interceptor adds it). The Token* decorators refuse a call with UNAUTHENTICATED when the token
//    is missing/wrong or, with TLS configured, when the peer presented no verified certificate.
//    Coordinator calls that carry layouts/specs are also checked against the limits.
// Every refusal is counted in wb_rejected_total (daemon/metrics.h).

#include <sys/types.h>

#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <thread>
#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/limits.h"
#include "proto/weightbridge.grpc.pb.h"

namespace grpc {
namespace experimental {
class ServerInterceptorFactoryInterface;
}  // namespace experimental
class Channel;
class Server;
class ServerContext;
class ServerCredentials;
}  // namespace grpc

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22: tells a reused pid apart
};

// Start time of `pid` (clock ticks since boot) or 0 when the process does not exist.
uint64_t ProcessStartTime(pid_t pid);

class PeerCredListener {
 public:
  // Binds `path` (removing a stale socket) and listens; the file has `mode` from the start
  // (created under umask 0777, then chmod). Connections queue in the kernel until Serve().
  static absl::StatusOr<std::unique_ptr<PeerCredListener>> Bind(const std::string& path, mode_t mode);
  // Feeds accepted connections to `server` (built with no listening ports). Call once.
  void Serve(grpc::Server* server);
  ~PeerCredListener();
  void Stop();
  // Credentials of the process behind the call; UNAUTHENTICATED if the call did not come through
  // this listener.
  absl::StatusOr<PeerCred> Lookup(const grpc::ServerContext& ctx) const;

 private:
  PeerCredListener() = default;
  void AcceptLoop();
  std::string path_;
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // eventfd: wakes the accept loop
  grpc::Server* server_ = nullptr;
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::map<int, PeerCred> by_fd_ ABSL_GUARDED_BY(mu_);
};

// At most `limit` calls at once hold a slot; Acquire() fails RESOURCE_EXHAUSTED naming `what` and
// the limit when all are taken. For calls that block (WaitVersion), each holding a server thread.
class BlockedCalls {
 public:
  BlockedCalls(std::string what, int limit) : what_(std::move(what)), limit_(limit) {}
  class Slot {
   public:
    explicit Slot(BlockedCalls* owner) : owner_(owner) {}
    Slot(Slot&& o) noexcept : owner_(o.owner_) { o.owner_ = nullptr; }
    ~Slot() {
      if (owner_ != nullptr) owner_->in_use_.fetch_sub(1);
    }

   private:
    BlockedCalls* owner_;
  };
  absl::StatusOr<Slot> Acquire();

 private:
  std::string what_;
  int limit_;
  std::atomic<int> in_use_{0};
};

class GuardedWorkerService final : public pb::WorkerService::Service {
 public:
  // `inner` and `peers` must outlive this. `node_id` labels metrics.
  GuardedWorkerService(pb::WorkerService::Service* inner, const PeerCredListener* peers, Limits limits, std::string node_id);

  grpc::Status RegisterWorker(grpc::ServerContext*, const pb::RegisterWorkerRequest*, pb::RegisterWorkerResponse*) override;
  grpc::Status RegisterLayout(grpc::ServerContext*, const pb::RegisterLayoutRequest*, pb::RegisterLayoutResponse*) override;
  grpc::Status Publish(grpc::ServerContext*, const pb::PublishRequest*, pb::PublishResponse*) override;
  grpc::Status BeginUpdate(grpc::ServerContext*, const pb::BeginUpdateRequest*, pb::BeginUpdateResponse*) override;
  grpc::Status Apply(grpc::ServerContext*, const pb::ApplyRequest*, pb::ApplyResponse*) override;
  grpc::Status WaitVersion(grpc::ServerContext*, const pb::WaitVersionRequest*, pb::WaitVersionResponse*) override;
  grpc::Status Deregister(grpc::ServerContext*, const pb::DeregisterRequest*, pb::DeregisterResponse*) override;
  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse*) override;
  // Read-only (layout discovery): anyone on the socket; the spec and layout are checked against the limits.
  grpc::Status DescribeLayout(grpc::ServerContext*, const pb::DescribeLayoutRequest*, pb::DescribeLayoutResponse*) override;

  // Newest version committed on this node per model (fed by TokenNodeService): staleness gauge,
  // and published versions up to it stop counting against max_concurrent_versions.
  void NoteCommitted(const std::string& model, uint64_t version);
  void NoteAborted(const std::string& model, uint64_t version);
  // The fd channel (daemon/fd_channel.h): OK when `sender` is the live process bound to `worker`
  // (pid + start time) and the worker belongs to `model`; NOT_FOUND / PERMISSION_DENIED otherwise.
  absl::Status CheckBound(const PeerCred& sender, const std::string& model, const std::string& worker);
  // The process `worker` is bound to; NOT_FOUND if none.
  absl::StatusOr<PeerCred> BoundCred(const std::string& worker);
  // Told the id of every worker that deregistered (the fd channel releases its fds). Set before
  // serving.
  void set_on_deregister(std::function<void(const std::string& worker)> f) { on_deregister_ = std::move(f); }

 private:
  struct Binding {
    PeerCred cred;
    std::string model;
    std::set<uint64_t> pending;  // published by this worker, not yet committed or aborted
  };
  // The caller, or an error status (also counted as rejected).
  absl::StatusOr<PeerCred> Caller(grpc::ServerContext* ctx);
  // The caller is the process bound to worker_id and names its model.
  absl::Status CheckActsAs(grpc::ServerContext* ctx, const std::string& model, const std::string& worker);
  grpc::Status Reject(const absl::Status& s, const std::string& what);

  pb::WorkerService::Service* inner_;
  const PeerCredListener* peers_;
  Limits limits_;
  std::string node_id_;
  absl::Mutex mu_;
  std::map<std::string, Binding> bindings_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> committed_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> on_deregister_;
  BlockedCalls blocked_;
};

// ------------------------------------------------------------------------- daemon <-> daemon
struct PeerAuthConfig {
  std::string tls_cert_pem, tls_key_pem, tls_ca_pem;  // all three or none
  std::string tls_server_name;                        // optional: expected name in server certs
  std::string token;                                  // empty: no token check
  // With TLS: node-scoped coordinator calls (RegisterNode, Heartbeat, JoinWorker, SubmitLayout,
  // LeaveWorker, Publish, Report*) must name the node the client certificate names (its CN or a
  // DNS SAN), else PERMISSION_DENIED naming both. Issue one certificate per node.
  bool bind_node_id = true;
  bool tls() const { return !tls_cert_pem.empty(); }
};

// Reads the files (empty path = not given). TLS needs all of cert/key/ca; a token file must hold
// a non-empty token (surrounding whitespace trimmed). INVALID_ARGUMENT names the flag.
absl::StatusOr<PeerAuthConfig> LoadPeerAuth(const std::string& cert_path, const std::string& key_path,
                                            const std::string& ca_path, const std::string& token_path);

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const PeerAuthConfig& config);
// A channel to another daemon with TLS (when configured) and the token on every call.
// `max_message_bytes` (> 0): receive and send limit of the channel (PeerMessageBytes; gRPC's
// default receive limit is 4 MiB, too small for an inventory); 0 keeps gRPC's defaults.
std::shared_ptr<grpc::Channel> MakePeerChannel(const std::string& target, const PeerAuthConfig& config,
                                               int64_t max_message_bytes = 0);

// Server interceptor for every daemon server: a call failing INTERNAL with no message (gRPC's own
// answer to a request body that does not parse as the method's request type) gets one naming the
// method.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeStatusMessageInterceptor();

// UNAUTHENTICATED unless the call carries the token and (TLS) a verified client certificate.
absl::Status CheckPeer(const grpc::ServerContext& ctx, const PeerAuthConfig& config);
// With TLS and bind_node_id: PERMISSION_DENIED unless `node_id` is the verified client
// certificate's CN or one of its SANs. OK without TLS (the token is shared: no per-node identity).
absl::Status CheckNodeIdentity(const grpc::ServerContext& ctx, const PeerAuthConfig& config, const std::string& node_id);

// Told the gRPC peer string of every call that passed CheckPeer (DaemonFront: ConnGuard).
using PeerAuthenticated = std::function<void(const std::string& grpc_peer)>;

class TokenNodeService final : public pb::NodeService::Service {
 public:
  // `on_commit` (optional) is told about commits (model, version): the staleness gauge.
  // `on_abort` likewise for aborts.
  using CommitHook = std::function<void(const std::string&, uint64_t)>;
  TokenNodeService(pb::NodeService::Service* inner, std::shared_ptr<const PeerAuthConfig> config, std::string node_id,
                   CommitHook on_commit, CommitHook on_abort = nullptr, PeerAuthenticated on_authenticated = nullptr);
  grpc::Status InstallPlan(grpc::ServerContext*, const pb::InstallPlanRequest*, pb::InstallPlanResponse*) override;
  grpc::Status ExecuteVersion(grpc::ServerContext*, const pb::ExecuteVersionRequest*, pb::ExecuteVersionResponse*) override;
  grpc::Status CommitVersion(grpc::ServerContext*, const pb::CommitVersionRequest*, pb::CommitVersionResponse*) override;
  grpc::Status AbortVersion(grpc::ServerContext*, const pb::AbortVersionRequest*, pb::AbortVersionResponse*) override;
  grpc::Status DropWorker(grpc::ServerContext*, const pb::DropWorkerRequest*, pb::DropWorkerResponse*) override;
  grpc::Status SetupDataChannel(grpc::ServerContext*, const pb::SetupDataChannelRequest*, pb::SetupDataChannelResponse*) override;
  grpc::Status ExchangeRegions(grpc::ServerContext*, const pb::ExchangeRegionsRequest*, pb::ExchangeRegionsResponse*) override;
  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest*, pb::DrainResponse*) override;
  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse*) override;

 private:
  grpc::Status Check(grpc::ServerContext* ctx);
  pb::NodeService::Service* inner_;
  std::shared_ptr<const PeerAuthConfig> config_;
  std::string node_id_;
  CommitHook on_commit_, on_abort_;
  PeerAuthenticated on_authenticated_;
};

class TokenCoordinatorService final : public pb::CoordinatorService::Service {
 public:
  TokenCoordinatorService(pb::CoordinatorService::Service* inner, std::shared_ptr<const PeerAuthConfig> config, Limits limits,
                          PeerAuthenticated on_authenticated = nullptr);
  grpc::Status RegisterNode(grpc::ServerContext*, const pb::RegisterNodeRequest*, pb::RegisterNodeResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const pb::HeartbeatRequest*, pb::HeartbeatResponse*) override;
  grpc::Status CreateModel(grpc::ServerContext*, const pb::CreateModelRequest*, pb::CreateModelResponse*) override;
  grpc::Status JoinWorker(grpc::ServerContext*, const pb::JoinWorkerRequest*, pb::JoinWorkerResponse*) override;
  grpc::Status SubmitLayout(grpc::ServerContext*, const pb::SubmitLayoutRequest*, pb::SubmitLayoutResponse*) override;
  grpc::Status LeaveWorker(grpc::ServerContext*, const pb::LeaveWorkerRequest*, pb::LeaveWorkerResponse*) override;
  grpc::Status Publish(grpc::ServerContext*, const pb::CoordPublishRequest*, pb::PublishResponse*) override;
  grpc::Status ReportReady(grpc::ServerContext*, const pb::ReportReadyRequest*, pb::ReportReadyResponse*) override;
  grpc::Status ReportDone(grpc::ServerContext*, const pb::ReportDoneRequest*, pb::ReportDoneResponse*) override;
  grpc::Status ReportApplied(grpc::ServerContext*, const pb::ReportAppliedRequest*, pb::ReportAppliedResponse*) override;
  grpc::Status WaitVersion(grpc::ServerContext*, const pb::WaitVersionRequest*, pb::WaitVersionResponse*) override;
  grpc::Status ClusterStatus(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse*) override;
  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest*, pb::DrainResponse*) override;
  grpc::Status Plan(grpc::ServerContext*, const pb::PlanRequest*, pb::PlanResponse*) override;
  grpc::Status WatchStatus(grpc::ServerContext*, const pb::WatchStatusRequest*, grpc::ServerWriter<pb::StatusResponse>*) override;

 private:
  grpc::Status Check(grpc::ServerContext* ctx);
  // Check, then CheckNodeIdentity for calls a node makes about itself.
  grpc::Status CheckNode(grpc::ServerContext* ctx, const std::string& node_id);
  pb::CoordinatorService::Service* inner_;
  std::shared_ptr<const PeerAuthConfig> config_;
  Limits limits_;
  PeerAuthenticated on_authenticated_;
  BlockedCalls blocked_;
};

}  // namespace wb::daemon
