#pragma once
// The coordinator's node table (docs/architecture.md "Coordinator"): every node daemon that
// registered, with its incarnation, lease, addresses, transports, drain flag and NodeClient.
//
// NOT thread-safe: plain data that CoordinatorCore guards with its mu_ (every call is made with
// mu_ held; the member is ABSL_GUARDED_BY(mu_)). It never blocks, sleeps or calls a node, and it
// reads no clock of its own: callers pass the injected clock's time (options.clock->Now()), so
// leases run in simulated time in tests.
//
// Contract:
//   - Register: a node id seen before gets incarnation + 1 (the old process is gone: the caller
//     drops its workers and versions), is alive again and no longer draining. Its lease is
//     max(lease, 3 heartbeats of the node): a shorter one would expire on one late beat.
//   - Heartbeat: renews the lease of the node's current incarnation only; NOT_FOUND for an unknown,
//     lost or older incarnation (the node registers again).
//   - Sweep: marks lost every node whose lease ran out; the local node (same process) never is.
//   - A lost node stays (alive = false) until it registers again, or until the caller Removes it
//     (CoordinatorCore: at max_nodes, a lost node nothing refers to makes room for a new one).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/coordinator/node_client.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

class NodeTable {
 public:
  struct Node {
    std::string address, data_address;
    uint64_t incarnation = 0;
    absl::Time lease_expiry;
    bool alive = true;
    bool draining = false;
    std::map<std::string, std::string> transport_instances;
    std::vector<std::string> data_nics;  // RegisterNodeRequest.data_nics (status only)
    uint64_t delta_cache_bytes = 0;      // RegisterNodeRequest.delta_cache_bytes: > 0 = it sends deltas
    bool delta_in_place = false;         // RegisterNodeRequest.delta_in_place: keeps shadow bases
    // RegisterNodeRequest.understands_bases_without_shadows: reads ExecuteVersionRequest.
    // bases_without_shadows (false: a node built before it; rolling upgrades).
    bool understands_bases_without_shadows = false;
    absl::Duration lease = absl::ZeroDuration();  // max(Options::lease, 3 heartbeats of the node)
    // shared: driver work that captured it may still run while Register replaces it.
    std::shared_ptr<NodeClient> client;
  };
  using Map = std::map<std::string, Node>;

  struct Options {
    absl::Duration lease = absl::Seconds(3);  // the shortest lease granted
    // The node daemon in this same process (standalone role): its lease never expires (a late
    // heartbeat there means this process is starved, not that the node is gone). Empty = none.
    std::string local_node;
    int max_heartbeat_progress = 1024;  // VersionProgress entries in one heartbeat
  };

  struct Registered {
    uint64_t incarnation = 0;
    absl::Duration lease;
    bool restarted = false;  // the id was registered before: its old process is gone
  };

  explicit NodeTable(Options options) : options_(std::move(options)) {}

  // Records (or replaces) the node of req.node_id() with `client`, lease from `now`. The request
  // is checked by the caller (checks.h CheckRegisterNode).
  Registered Register(const ::weightbridge::v1::RegisterNodeRequest& req, std::shared_ptr<NodeClient> client, absl::Time now);

  // RESOURCE_EXHAUSTED when the heartbeat carries more progress entries than allowed (a node
  // reports one per model with a version in flight; more is a bug or an attack). Checked before
  // anything is stored or locked; the lease is not renewed.
  absl::Status CheckHeartbeat(const ::weightbridge::v1::HeartbeatRequest& req) const;
  // Renews the lease of `node_id` at `incarnation` from `received` (the receipt time, taken before
  // the caller's lock: a busy coordinator must not count its own delay as a missed beat); returns
  // the node's lease. NOT_FOUND: unknown, lost, or another incarnation.
  absl::StatusOr<absl::Duration> Heartbeat(const std::string& node_id, uint64_t incarnation, absl::Time received);

  // The lease check at `now`. If the caller (the driver) did not sweep for over a quarter lease
  // since `last_sweep` (InfinitePast = first sweep), that gap is the coordinator's fault, not the
  // nodes': every lease is extended by it first. Each node found expired is marked lost and
  // `on_lost(id)` runs right then, before the next node is looked at (what it queues for other
  // nodes sees them still alive, as it did when this lived in the driver).
  void Sweep(absl::Time now, absl::Time last_sweep, const std::function<void(const std::string&)>& on_lost);

  // Forgets the node (nothing when unknown). The caller makes sure nothing refers to it any more.
  void Remove(const std::string& node_id);

  // Drain flags. SetDraining: false when the node is unknown. ClearDraining: every node.
  bool SetDraining(const std::string& node_id, bool draining);
  void ClearDraining();
  bool any_draining() const { return draining_ > 0; }
  bool IsDraining(const std::string& node_id) const;

  // Queries. Find: null when unknown. Client: null when unknown (or, for AliveClient, lost).
  const Node* Find(const std::string& node_id) const;
  bool IsAlive(const std::string& node_id) const;
  // The node is alive at exactly this incarnation (an owed commit is for the process that ran it).
  bool HoldsIncarnation(const std::string& node_id, uint64_t incarnation) const;
  std::shared_ptr<NodeClient> Client(const std::string& node_id) const;
  std::shared_ptr<NodeClient> AliveClient(const std::string& node_id) const;
  // The node's current incarnation, alive or lost; 0 when unknown (incarnations start at 1), so
  // a commit recorded against it is dropped by HoldsIncarnation.
  uint64_t Incarnation(const std::string& node_id) const;
  size_t size() const { return nodes_.size(); }

  // Read-only iteration over every node (id -> Node, sorted by id), for ClusterStatus. Lookups of
  // one node go through the named queries above; every change through the methods above.
  Map::const_iterator begin() const { return nodes_.begin(); }
  Map::const_iterator end() const { return nodes_.end(); }

 private:
  const Options options_;
  Map nodes_;
  int draining_ = 0;  // nodes with Node::draining set
};

}  // namespace wb::daemon
