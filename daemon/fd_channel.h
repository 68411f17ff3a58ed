#pragma once
// The node daemon's fd channel: where a local worker hands over the POSIX fd of a CUDA VMM
// allocation (cuMemExportToShareableHandle; PyTorch expandable segments), which gRPC cannot carry.
//
// A Unix SOCK_SEQPACKET socket at <worker_socket>.fd (same mode as the worker socket). Each
// datagram is one VmmFdOffer (base/fd_passing.h: model, worker, key, allocation size) with
// exactly one fd attached; the daemon answers each with a status. Who may send: the connecting
// process's SO_PEERCRED (pid, uid; kernel-filled at connect, unforgeable) plus its start time must
// be the process the worker id is bound to (RegisterWorker through the guarded worker socket,
// daemon/auth.h) for that model - `authorize` decides; anything else is refused and the fd closed
// at once. Accepted fds are kept keyed by (model, worker, key), with the sender's identity: worker
// ids are scoped per model (docs/daemon.md "Model and worker rules"), so two models' `rollout/0`
// in one process never share or replace each other's fds. A new offer for the same key replaces
// (closes) the old fd; it stands for the same allocation (same cache key) only when it carries the
// allocation id the old one did (a client's replay), else for a new one (a new cache key: the
// node maps it anew instead of reusing the old mapping). An offer from a new process of the same
// (model, worker) (a restart) drops the fds the previous process sent for it.
//
// Bounds (FdChannelLimits, RESOURCE_EXHAUSTED naming the limit beyond): fds per worker (a
// (model, worker) pair), per sending uid (one principal may hold several workers) and per node in
// total (further capped at half of RLIMIT_NOFILE at Bind). Fds are released when the worker
// deregisters from its model (ReleaseWorker, from the guarded worker service) and when the process
// that sent them has exited (checked on every offer and every second), so dead or departed
// workers pin nothing.
//
// Get() hands out a dup of the fd (the caller closes it) only to a lookup that names the process
// currently bound to the (model, worker): fds of a dead predecessor never reach a new registration.
// Connections are served concurrently by one poll loop: a message is one datagram, read without
// blocking, so a slow, silent or refused client delays no other. A connection idle for
// message_timeout (2 s) is closed; at most max_connections at once, max_connections_per_uid per
// uid (more are closed at accept).

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/fd_passing.h"
#include "base/socket_path.h"
#include "daemon/auth.h"

namespace wb::daemon {

struct FdChannelLimits {
  size_t per_worker = 1024;
  size_t per_uid = 65536;
  size_t total = 131072;  // and at most half of RLIMIT_NOFILE's soft limit at Bind
  size_t max_connections = 64;
  size_t max_connections_per_uid = 16;
  absl::Duration message_timeout = absl::Seconds(2);  // idle connection closed after this
};

struct CudaVmmFd {
  int fd = -1;                   // a dup owned by the caller
  int64_t allocation_bytes = 0;  // as the worker declared it
  // The transport's mapping key: unique per (sending process, model, worker, key, allocation). An
  // offer under a key this process used before with another allocation id (VmmFdOffer) is another
  // allocation and gets another cache key; the same id (a replay) keeps it.
  std::string cache_key;
};

class FdChannel {
 public:
  using Authorize = std::function<absl::Status(const PeerCred& sender, const std::string& model, const std::string& worker)>;

  // Binds `path` (an existing socket file there is replaced) and starts serving.
  static absl::StatusOr<std::unique_ptr<FdChannel>> Bind(const std::string& path, mode_t mode, Authorize authorize,
                                                        FdChannelLimits limits = {});
  ~FdChannel();  // Stop(), then closes every kept fd
  // Stops accepting and unlinks the socket file. Idempotent.
  void Stop();

  // NOT_FOUND when `worker` of `model` sent nothing under `key`, PERMISSION_DENIED when it was
  // sent by another process than `bound` (pid + start time).
  absl::StatusOr<CudaVmmFd> Get(const std::string& model, const std::string& worker, const std::string& key,
                                const PeerCred& bound) const;
  size_t size() const;
  // Closes every fd `worker` of `model` sent (it deregistered from that model; its fds for other
  // models stay). Returns how many.
  size_t ReleaseWorker(const std::string& model, const std::string& worker);
  // Closes every fd whose sending process has exited. Returns how many.
  size_t ReleaseDead();
  const FdChannelLimits& limits() const { return limits_; }
  const std::string& path() const { return path_; }

 private:
  struct Entry {
    int fd = -1;
    int64_t allocation_bytes = 0;
    PeerCred sender;
    uint64_t allocation_id = 0;  // the worker's id of the allocation (VmmFdOffer; 0: not given)
    uint64_t serial = 0;         // which allocation this is in the cache key: new for another allocation
  };
  struct Conn {
    int fd = -1;
    PeerCred sender;
    absl::Time last;  // accepted or last message
  };
  FdChannel() = default;
  void Serve();
  void AcceptConnections(std::vector<Conn>& conns);
  // Reads and answers one message; false when the connection is to be closed.
  bool ServeOne(Conn& conn);
  absl::Status Accept(const PeerCred& sender, const transport::VmmFdOffer& offer, int fd);
  size_t ReleaseDeadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::string path_;
  BoundSocketPath bound_;  // the socket file this channel created (removed at Stop only while still ours)
  Authorize authorize_;
  FdChannelLimits limits_;
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // eventfd: wakes the serving thread
  std::thread thread_;
  mutable absl::Mutex mu_;
  using Key = std::tuple<std::string, std::string, std::string>;  // (model, worker, key)
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace wb::daemon
