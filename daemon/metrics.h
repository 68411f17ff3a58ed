#pragma once
// Prometheus metrics of one weightbridged process (prometheus-cpp core + its pull Exposer; no
// hand-written HTTP). main.cc makes one DaemonMetrics and gives it to every role through their
// Options (ServerOptions::metrics -> DaemonFront, ConnGuard, CoordinatorOptions, the node daemon);
// MetricsEndpoint exposes its registry on --metrics_listen. Tests running several daemons in one
// process may give each its own instance; those that leave it null share Metrics(), where every
// series' `node` label keeps them apart.
//
// Series (all names prefixed wb_):
//   versions_total{node,model,event}          event = published | committed | aborted | applied
//   bytes_total{node,model,route,peer}        bytes this node moved (route = local | tcp | ...)
//   phase_seconds{node,phase}  (histogram)    phase = snapshot | transfer | commit | apply
//   nccl_lane_bytes_total{node,peer,gpu,peer_gpu}  bytes over one nccl lane pair
//   nccl_bounce_bytes_total{node}             nccl sources copied to their lane's GPU first
//   nic_bytes_total{node,nic,peer,peer_nic,direction}  host_tcp payload per local address (data
//                                             NIC) and the peer node's address; direction = sent | received
//   link_gbps{node,peer}       (gauge)        GB/s of the newest transfer towards `peer`
//   staging_bytes_total{node,result}          host staging taken for versions: result = reused (from
//                                             the staging pool) | allocated (new memory)
//   staging_pool_bytes{node}   (gauge)        idle host staging kept for the next version
//   relay_at_commit_bytes_total{node}         same-node relays a sync commit copied straight into live
//   failures_total{node,reason}               reason = FailureReason(status)
//   staleness_versions{node,model,worker}     committed - applied for a rollout worker
//   committed_version{node,model}, applied_version{node,model,worker}
//   rejected_total{node,what}                 requests refused by auth / limits
//   transport_guard_events_total{node,transport,what}  a transport's bounds against its peers
//                                             acting (host_tcp: hellos_refused, parked_refused, ...)
//   transport_guard_held{node,transport,what}  (gauge)  what peers make it hold now (host_tcp:
//                                             parked_connections, early_control_frames)
// Contract: every recording call is thread-safe, cheap (a map lookup under prometheus' family
// lock) and never fails.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace prometheus {
class Exposer;
class Registry;
}  // namespace prometheus

namespace wb::daemon {

class DaemonMetrics {
 public:
  DaemonMetrics();
  ~DaemonMetrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void Version(const std::string& node, const std::string& model, const std::string& event);
  void Bytes(const std::string& node, const std::string& model, const std::string& route, const std::string& peer,
             uint64_t bytes);
  void Phase(const std::string& node, const std::string& phase, double seconds);
  // Staging allocated for CUDA buffers: memory "gpu" (GPU-direct) or "host"; what "snapshot" | "incoming".
  void Staged(const std::string& node, const std::string& memory, const std::string& what, uint64_t bytes);
  // Bytes over the nccl lane pair (our GPU `gpu`, the peer's `peer_gpu`).
  void NcclLane(const std::string& node, const std::string& peer, int gpu, int peer_gpu, uint64_t bytes);
  // A source of nccl ops copied whole to its lane's GPU before sending (an imported live buffer, or
  // a snapshot not already on that GPU).
  void NcclBounce(const std::string& node, uint64_t bytes);
  // Payload bytes over one network path of the cross-node host channel: our address `nic` (a data
  // NIC), the peer node's address `peer_nic`; direction "sent" | "received" (daemon/nic_meter.h).
  void NicBytes(const std::string& node, const std::string& nic, const std::string& peer, const std::string& peer_nic,
                const std::string& direction, uint64_t bytes);
  // Canonical bytes of quantised rollout pieces quantised on this node (and the seconds the version
  // waited for them after its buckets as phase "quantize": pieces quantised beside the buckets cost
  // it nothing there).
  void Quantized(const std::string& node, uint64_t bytes, double seconds);
  void Link(const std::string& node, const std::string& peer, uint64_t bytes, double seconds);
  // Host staging handed to a version: recycled from the staging pool (`reused`) or newly allocated.
  void StagingTaken(const std::string& node, bool reused, uint64_t bytes);
  void StagingPoolBytes(const std::string& node, int64_t idle_bytes);
  void RelayAtCommit(const std::string& node, uint64_t bytes);
  // Lossless deltas (issue 17.2): wb_delta_cache_bytes{node} (host memory of the sender's copies of
  // what destinations committed), wb_delta_bytes_total{node,kind=stream|replaced|full} (streams
  // sent, the raw bytes they replaced, delta ops sent in full) and wb_delta_fallbacks_total{node}
  // (deltas this node refused: base mismatch or corrupt, resent in full).
  // `decoded` delta ops decoded here, `in_place` of them into staging that still held the base.
  void Deltas(const std::string& node, uint64_t cache_bytes, uint64_t stream, uint64_t replaced, uint64_t full, uint64_t refused,
              uint64_t decoded = 0, uint64_t in_place = 0);
  // End-to-end digests (issue 17.4): wb_digest_bytes_total{node,how=transport|codec|memory}, the
  // bytes of the boxes a version digested here, by where they were hashed: by host_tcp as they
  // crossed, by the delta codec as it packed / decoded them, or read again from memory.
  void Digests(const std::string& node, uint64_t transport, uint64_t codec, uint64_t memory);
  // A transport's bounds against its peers (daemon/guard_meter.h turns the transports' cumulative
  // counts into these): `n` more events of `what`, or `held` = how much `what` holds now.
  void GuardEvents(const std::string& node, const std::string& transport, const std::string& what, uint64_t n);
  void GuardHeld(const std::string& node, const std::string& transport, const std::string& what, int64_t held);
  void Failure(const std::string& node, const absl::Status& status);
  void Rejected(const std::string& node, const std::string& what);
  void Committed(const std::string& node, const std::string& model, uint64_t version);
  // Records applied version and staleness (committed - applied, 0 when applied >= committed).
  void Applied(const std::string& node, const std::string& model, const std::string& worker, uint64_t applied,
               uint64_t committed);

 private:
  struct Families;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Families> f_;
};

// The default instance where Options leave `metrics` null (created on first use, never
// destroyed: gRPC threads may record during static destruction). Daemon code records into the
// instance it was given, never into this one directly.
DaemonMetrics& Metrics();

// A small fixed vocabulary for failures, so label cardinality stays bounded:
// timeout | node_lost | restarted | checksum | send | worker_left | superseded | unauthenticated |
// permission | limit | invalid | aborted | other.
std::string FailureReason(const absl::Status& status);

// Pull endpoint: GET /metrics in the Prometheus text format, served by prometheus-cpp's Exposer.
class MetricsEndpoint {
 public:
  // listen = "host:port"; port 0 picks one (see port()). UNAVAILABLE if it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen,
                                                               std::shared_ptr<prometheus::Registry> registry);
  ~MetricsEndpoint();
  int port() const { return port_; }

 private:
  MetricsEndpoint() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace wb::daemon
