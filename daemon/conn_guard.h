#pragma once
// ConnGuard: the daemon's own accept loop in front of its TCP gRPC port (CoordinatorService,
// NodeService), so that connections without credentials cannot take the port down.
//
// Why not gRPC's listener: gRPC 1.51 (Debian) stops accepting on that port for good when accept4
// fails with EMFILE/ENFILE ("Failed accept4"), and keeps an idle TCP connection that never sends
// a byte open for its 120 s handshake timeout; nothing bounds connections per source. gRPC can
// adopt an already-accepted fd only without TLS (grpc_server_add_channel_from_fd), so the guard
// instead accepts on the public address and splices each connection, byte for byte, to the gRPC
// server listening on a private Unix socket (a 0700 directory): TLS, the token and every RPC are
// still end to end between the client and gRPC.
//
// What it enforces (defaults in ConnLimits):
//   - A connection is UNAUTHENTICATED until its first call passes the daemon's auth check
//     (NoteAuthenticated, from CheckPeer's callers). Until then it counts against its source IP
//     (max_unauthenticated_per_source) and against all sources (max_unauthenticated), and it must
//     authenticate within unauthenticated_timeout or it is closed.
//   - Over the per-source bound the new connection is closed at once. Over the total bound the
//     oldest unauthenticated connection of the source holding the most is closed instead (when
//     that source holds more than the newcomer's), so a flood from a few addresses cannot lock
//     out a node connecting from another one.
//   - All connections together stay under a quarter of RLIMIT_NOFILE's free part at start (each
//     costs 3 fds: the client's, the splice's and gRPC's), so the network alone cannot exhaust
//     the daemon's fds.
//   - accept4 failing with EMFILE/ENFILE never stops the loop: a reserved fd is released, the
//     pending connection accepted and closed at once (the client sees a reset, not a hang), and the
//     reserve taken again.
// Every closing is counted (stats(), and wb_rejected_total{what="conn_*"}) and logged at most once
// per second per reason.
//
// Residual: gRPC's accept on the private socket is still gRPC's; it can only hit EMFILE when
// something other than the network (e.g. thousands of worker buffers) has used up the fds.

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/metrics.h"

namespace wb::daemon {

struct ConnLimits {
  int max_unauthenticated_per_source = 64;
  int max_unauthenticated = 1024;
  absl::Duration unauthenticated_timeout = absl::Seconds(10);
  int max_connections = 16384;  // also capped from RLIMIT_NOFILE at start (see above)
};

struct ConnGuardStats {
  int64_t accepted = 0;
  int64_t refused_per_source = 0;  // closed at accept: its source was at max_unauthenticated_per_source
  int64_t refused_total = 0;       // closed at accept: max_unauthenticated / max_connections reached
  int64_t evicted = 0;             // unauthenticated, closed to make room for another source
  int64_t timed_out = 0;           // unauthenticated after unauthenticated_timeout
  int64_t fd_exhausted = 0;        // accept4/socket failed with EMFILE/ENFILE
  int open = 0;
  int unauthenticated = 0;
  int max_connections = 0;  // the effective cap
};

class ConnGuard {
 public:
  // Binds `listen` (host:port; port 0 picks one) and creates the private Unix socket path that
  // the gRPC server must listen on (inner_address(), as "unix:<path>") before Serve(). `label`
  // names the daemon in logs and metrics; refusals are counted in `metrics` (must outlive the
  // guard; null = the process default, Metrics()).
  static absl::StatusOr<std::unique_ptr<ConnGuard>> Bind(const std::string& listen, ConnLimits limits, std::string label,
                                                         DaemonMetrics* metrics = nullptr);
  ~ConnGuard();  // Stop()

  int port() const { return port_; }
  std::string inner_address() const { return "unix:" + inner_path_; }
  // Starts accepting (the gRPC server is listening on inner_address()).
  void Serve();
  // Closes the listener and every connection, removes the private socket. Idempotent.
  void Stop();

  // `grpc_peer`: ServerContext::peer() of a call that passed authentication. Marks its connection
  // authenticated (no longer bounded or timed out). Returns the client's "ip:port", or "" when
  // the call did not come through this guard.
  std::string NoteAuthenticated(const std::string& grpc_peer);
  // The client's "ip:port" behind a gRPC peer string, or `grpc_peer` itself when unknown.
  std::string ExternalPeer(const std::string& grpc_peer) const;
  ConnGuardStats stats() const;

 private:
  struct Conn;
  ConnGuard() = default;
  void Loop();
  void AcceptAll();
  void Admit(int ext, const std::string& source, const std::string& peer);
  void Pump(uint64_t id, bool from_ext);
  void Flush(uint64_t id, bool to_ext);
  void Arm(Conn& c);
  void CloseLocked(uint64_t id, const char* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EvictForLocked(const std::string& source) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Note(const char* reason, const std::string& detail) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t IdFromPeer(const std::string& grpc_peer) const;

  ConnLimits limits_;
  std::string label_;
  DaemonMetrics* metrics_ = nullptr;
  std::string dir_, inner_path_;
  std::string tag_;  // "wbg-<pid>-<n>-": prefix of every splice socket's abstract name
  int port_ = 0;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;     // eventfd: Stop()
  int reserve_fd_ = -1;  // released to accept-and-close when fds run out
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> unauth_by_source_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  ConnGuardStats stats_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Time> last_log_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool serving_ = false;
  std::vector<char> buf_;  // the loop thread's read buffer (not thread_local: that would grow
                           // every thread's static TLS, e.g. civetweb's small stacks)
};

}  // namespace wb::daemon
