#pragma once
// Who may talk to a daemon, and as whom: the identities and checks. The per-method rules that use
// them are daemon/auth_policy.h, enforced by one server interceptor (daemon/auth_gate.h), so the
// services themselves carry no security code (DaemonFront wires it: daemon/front.h).
//
// 1. Workers (Unix socket). gRPC's AuthContext does not carry SO_PEERCRED for Unix sockets, so
//    PeerCredListener accepts connections itself, reads SO_PEERCRED (pid/uid/gid, filled in by
//    the kernel at connect(): unforgeable) of each accepted socket and hands the descriptor to the
//    gRPC server (grpc::AddInsecureChannelFromFd). gRPC reports such a call's peer as "fd:<n>",
//    which maps back to the credentials recorded at accept. The socket file is mode 0660.
// 2. Daemons (TCP: NodeService, CoordinatorService). PeerAuthConfig: mutual TLS when cert, key and
//    CA are given (the server requests and verifies client certificates against the CA), plus an
//    optional shared token sent as "authorization: Bearer <token>" on every call (a client
//    interceptor adds it). CheckPeer refuses a call with UNAUTHENTICATED when the token is
//    missing/wrong or, with TLS configured, when the peer presented no verified certificate.

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/socket_path.h"
#include "daemon/limits.h"
#include "proto/weightbridge.grpc.pb.h"

namespace grpc {
namespace experimental {
class ServerInterceptorFactoryInterface;
}  // namespace experimental
class Channel;
class Server;
class ServerContextBase;
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
  absl::StatusOr<PeerCred> Lookup(const grpc::ServerContextBase& ctx) const;

 private:
  PeerCredListener() = default;
  void AcceptLoop();
  std::string path_;
  BoundSocketPath bound_;  // the socket file this listener created (removed at Stop only while still ours)
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // eventfd: wakes the accept loop
  grpc::Server* server_ = nullptr;
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::map<int, PeerCred> by_fd_ ABSL_GUARDED_BY(mu_);
};

// At most `limit` calls at once hold a slot, and (per_key > 0) at most `per_key` of them per key:
// one caller (a worker on the worker socket, a node at the coordinator) cannot take every slot
// and starve the others. Acquire() fails RESOURCE_EXHAUSTED naming `what`, the caller and the
// limit it hit. For calls that block (WaitVersion, Publish, Apply, Drain), each holding a server
// thread. Thread-safe.
class BlockedCalls {
 public:
  // `per_key_what` says in errors what the per-key limit is ("per worker, --flag").
  BlockedCalls(std::string what, int limit, int per_key = 0, std::string per_key_what = "")
      : what_(std::move(what)), limit_(limit), per_key_(per_key), per_key_what_(std::move(per_key_what)) {}
  class Slot {
   public:
    Slot(Slot&& o) noexcept : owner_(o.owner_), key_(std::move(o.key_)) { o.owner_ = nullptr; }
    Slot& operator=(Slot&&) = delete;
    ~Slot() {
      if (owner_ != nullptr) owner_->Release(key_);
    }

   private:
    friend class BlockedCalls;
    Slot(BlockedCalls* owner, std::string key) : owner_(owner), key_(std::move(key)) {}
    BlockedCalls* owner_;
    std::string key_;
  };
  // `key` identifies the caller (calls with the same key share its per-key limit); `who` names it
  // in the error (empty: the key itself).
  absl::StatusOr<Slot> Acquire(const std::string& key = "", const std::string& who = "");
  int in_use() const;
  int in_use(const std::string& key) const;

 private:
  void Release(const std::string& key);
  const std::string what_;
  const int limit_;
  const int per_key_;
  const std::string per_key_what_;
  mutable absl::Mutex mu_;
  int in_use_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int> by_key_ ABSL_GUARDED_BY(mu_);
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
  // With TLS and bind_node_id, on a node: a name its coordinator's certificate carries (main.cc:
  // --tls_server_name, else the host of --coordinator: the name the node verifies when it dials the
  // coordinator, and the coordinator presents the same certificate as a client). The NodeService
  // calls only the coordinator makes (InstallPlan, ExecuteVersion, CommitVersion, AbortVersion,
  // DropWorker) must come from a certificate naming it (CN or SAN; a "*.domain" SAN matches one
  // label), else PERMISSION_DENIED: another node's certificate cannot install a plan or commit a
  // version on this node. Empty: any certificate of the cluster CA may (standalone, tests).
  std::string coordinator_identity;
  // The operator credential (docs/security.md "Operators"). When either is set, a Drain that
  // reaches beyond the caller's own node - the whole cluster (all), another node, or lifting a
  // drain (undo) of another node or of the cluster - needs it: the header kOperatorTokenHeader
  // holding operator_token (wbctl --operator_token_file), or (TLS) a client certificate whose CN /
  // SAN is one of operator_names. Under mTLS with bind_node_id a node's own certificate may still
  // drain and undrain its own node (a node could stop serving anyway). Both empty: Drain is open
  // to every cluster identity, as before (main.cc warns). A node daemon forwarding a Drain it
  // accepted attaches its own operator_token (MakePeerChannel, on CoordinatorService.Drain only).
  std::string operator_token;
  std::vector<std::string> operator_names;
  bool tls() const { return !tls_cert_pem.empty(); }
  bool operator_required() const { return !operator_token.empty() || !operator_names.empty(); }
};

// The metadata key of the operator token (wbctl sends the same: client/ctl_auth.h).
inline constexpr char kOperatorTokenHeader[] = "x-wb-operator-token";

// Reads the files (empty path = not given). TLS needs all of cert/key/ca; a token file must hold
// a non-empty token (surrounding whitespace trimmed). INVALID_ARGUMENT names the flag.
absl::StatusOr<PeerAuthConfig> LoadPeerAuth(const std::string& cert_path, const std::string& key_path,
                                            const std::string& ca_path, const std::string& token_path);

// Fills config's operator credential: `token_path` (a file as for the cluster token; it must
// differ from the cluster token, which every node holds) and `names` (comma-separated certificate
// names; needs TLS). INVALID_ARGUMENT names the flag (--operator_token_file, --operator_names).
absl::Status LoadOperatorCredential(const std::string& token_path, const std::string& names, PeerAuthConfig* config);

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
absl::Status CheckPeer(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config);
// With TLS and bind_node_id: PERMISSION_DENIED unless `node_id` is the verified client
// certificate's CN or one of its SANs. OK without TLS (the token is shared: no per-node identity).
absl::Status CheckNodeIdentity(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config, const std::string& node_id);
// The coordinator-only NodeService calls (PeerAuthConfig::coordinator_identity): OK without TLS,
// without bind_node_id or without an identity; else the caller's certificate must name it.
// PERMISSION_DENIED names `method`, the identity and the certificate's names.
absl::Status CheckCoordinatorIdentity(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config, const std::string& method);
// OK when no operator credential is configured, or the call carries the operator token, or (TLS)
// its verified certificate names one of operator_names; else PERMISSION_DENIED saying `action`
// needs the operator credential and how to send it.
absl::Status CheckOperator(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config, const std::string& action);
// Who holds a daemon server's blocked-call slots, for BlockedCalls' per-key limit: with mutual TLS
// the node its verified certificate names (CN, else its first SAN: the identity the node-scoped
// rules bind node ids to); without, the caller's connection (ServerContext::peer(); the TCP port's
// ConnGuard splices each connection to gRPC on its own socket). A node daemon forwards its
// workers' calls over its one channel to the coordinator, so a worker behind it is bounded by its
// node's share; the node id in a request is no better under a shared token (WaitVersion carries
// none, and a token holder can name any).
std::string PeerKey(const grpc::ServerContextBase& ctx, const PeerAuthConfig& config);
// The host part of a gRPC target ("host:port", "[v6]:port", "dns:///host:port").
std::string TargetHost(const std::string& target);

// Told the gRPC peer string of every call that passed CheckPeer (DaemonFront: ConnGuard).
using PeerAuthenticated = std::function<void(const std::string& grpc_peer)>;

}  // namespace wb::daemon
