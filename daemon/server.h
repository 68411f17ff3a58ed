#pragma once
// One weightbridged process: coordinator, node daemon, or both (standalone), with their gRPC
// servers (TCP for CoordinatorService/NodeService + grpc.health.v1, a Unix socket for
// WorkerService). main.cc only parses flags into Options and calls Start(); tests start several
// of these in one process on 127.0.0.1:0.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/coordinator.h"
#include "daemon/front.h"
#include "daemon/node_daemon.h"
#include "transport/factory.h"
#include "base/clock.h"

namespace wb::daemon {

enum class DaemonRole { kNode, kCoordinator, kStandalone };
absl::StatusOr<DaemonRole> ParseRole(const std::string& role);

struct ServerOptions {
  DaemonRole role = DaemonRole::kStandalone;
  std::string listen = "127.0.0.1:0";  // TCP gRPC
  std::string worker_socket;           // node/standalone: Unix socket path for WorkerService
  std::string coordinator;             // node: coordinator address
  std::string node_id = "node0";
  std::string data_listen = "127.0.0.1:0";
  int64_t staging_budget_bytes = int64_t{64} << 30;
  std::string live_state_dir;  // node/standalone: NodeDaemon::Options::live_state_dir (empty: none)
  absl::Duration heartbeat = absl::Milliseconds(500);
  absl::Duration lease = absl::Seconds(3);
  absl::Duration transfer_timeout = absl::Seconds(60);
  absl::Duration plan_deadline = absl::Seconds(120);  // coordinator: CoordinatorOptions::plan_deadline (<= 0: none)
  absl::Duration sync_pause_timeout = absl::Seconds(30);  // coordinator: CoordinatorOptions::sync_pause_timeout (<= 0: none)
  Clock* clock = Clock::Real();
  // TLS/token between daemons, request limits, worker socket mode, metrics endpoint (daemon/front.h).
  SecurityOptions security;
  // Where every role of this process counts (daemon/metrics.h): main.cc makes one per process;
  // tests running several daemons in one process may give each its own. Null = Metrics().
  DaemonMetrics* metrics = nullptr;
  planner::Topology topology;                 // bandwidths the coordinator's planner assumes
  int64_t bucket_bytes = int64_t{2} << 30;    // planner staging budget per GPU per bucket
  // xxh3 per cross-node batch on the wire. Off by default: end-to-end digests (on by default) check
  // every op's landed bytes against what its source read, which covers the wire.
  bool checksums = false;
  bool digests = true;                        // NodeDaemon::Options::digests
  bool digest_overlap = true;                 // NodeDaemon::Options::digest_overlap
  bool digest_in_transport = true;            // NodeDaemon::Options::digest_in_transport
  uint64_t delta_cache_bytes = 0;             // NodeDaemon::Options::delta_cache_bytes
  int delta_threads = 0;                      // NodeDaemon::Options::delta_threads
  bool delta_in_place = true;                 // NodeDaemon::Options::delta_in_place
  int quantize_early_threads = 0;             // NodeDaemon::Options::quantize_early_threads
  absl::Duration delta_apply_delay = absl::Milliseconds(200);  // NodeDaemon::Options::delta_apply_delay
  absl::Duration status_resend = absl::Seconds(1);  // WatchStatus safety net (Coordinator::Options)
  // Injected dependencies (main.cc picks the concrete ones).
  PlanFn make_plan;  // empty = planner::MakePlan
  // Node/standalone: the data-plane transports (transport/factory.h). Required for a node.
  std::function<absl::StatusOr<transport::TransportSet>()> make_transports;
  // Node/standalone: GPU-direct staging (NodeDaemon::Options::device_staging); null = host only.
  std::shared_ptr<DeviceStaging> device_staging;
  // TEST ONLY: see NodeDaemon::Options::test_before_bucket.
  std::function<void(const std::string& model_id, uint64_t version, uint32_t bucket)> test_before_bucket;
  std::function<bool()> test_skip_heartbeat;
  // TEST ONLY: last say on the node daemon's options (e.g. NodeDaemon::Options::test_live_copy_fault).
  std::function<void(NodeDaemon::Options&)> configure_node;
};

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options);
  ~Server();
  // Stops accepting, fails waiters, joins threads. Idempotent.
  void Shutdown();
  int port() const { return port_; }
  int metrics_port() const { return front_ ? front_->metrics_port() : 0; }  // 0 = no endpoint
  std::string address() const;  // host:port of the TCP server
  Coordinator* coordinator() const { return coordinator_.get(); }  // null for role node
  const std::string& worker_socket() const { return options_.worker_socket; }
  // The TCP port's connection guard (daemon/conn_guard.h): refusals, timeouts, open connections.
  ConnGuardStats connection_stats() const {
    return front_ && front_->conn_guard() ? front_->conn_guard()->stats() : ConnGuardStats{};
  }

 private:
  Server() = default;
  ServerOptions options_;
  int port_ = 0;
  std::unique_ptr<DaemonFront> front_;  // outlives the servers below (declared first)
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<NodeDaemon> node_;
  std::unique_ptr<grpc::Server> tcp_server_, unix_server_;
  bool shut_ = false;
};

}  // namespace wb::daemon
