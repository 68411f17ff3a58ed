#include "daemon/coordinator/node_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/checks.h"
#include "daemon/log.h"

namespace wb::daemon {

NodeTable::Registered NodeTable::Register(const pb::RegisterNodeRequest& req, std::shared_ptr<NodeClient> client, absl::Time now) {
  Node& n = nodes_[req.node_id()];
  Registered out;
  out.restarted = n.incarnation > 0;
  n.address = req.address();
  n.data_address = req.data_address();
  n.incarnation += 1;
  n.alive = true;
  if (n.draining) --draining_;
  n.draining = false;
  n.lease = std::max(options_.lease, 3 * absl::Milliseconds(req.heartbeat_ms()));
  n.lease_expiry = now + n.lease;
  n.client = std::move(client);
  n.transport_instances.clear();
  for (auto& [k, v] : req.transport_instances()) n.transport_instances[k] = v;
  n.data_nics.assign(req.data_nics().begin(), req.data_nics().end());
  n.delta_cache_bytes = req.delta_cache_bytes();
  n.delta_in_place = req.delta_in_place();
  n.understands_bases_without_shadows = req.understands_bases_without_shadows();
  out.incarnation = n.incarnation;
  out.lease = n.lease;
  return out;
}

absl::Status NodeTable::CheckHeartbeat(const pb::HeartbeatRequest& req) const {
  if (req.progress_size() <= options_.max_heartbeat_progress) return absl::OkStatus();
  // (400k entries held +539 MiB before this bound.)
  return absl::ResourceExhaustedError(absl::StrCat("heartbeat from node ", EchoValue(req.node_id()), " carries ", req.progress_size(),
                                                   " progress entries, more than the limit of ", options_.max_heartbeat_progress,
                                                   " (max_heartbeat_progress)"));
}

absl::StatusOr<absl::Duration> NodeTable::Heartbeat(const std::string& node_id, uint64_t incarnation, absl::Time received) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end() || !it->second.alive || it->second.incarnation != incarnation) {
    return absl::NotFoundError(absl::StrCat("node ", EchoValue(node_id), " is not registered (lease lost?): register again"));
  }
  it->second.lease_expiry = std::max(it->second.lease_expiry, received + it->second.lease);
  return it->second.lease;
}

void NodeTable::Sweep(absl::Time now, absl::Time last_sweep, const std::function<void(const std::string&)>& on_lost) {
  if (last_sweep != absl::InfinitePast() && now - last_sweep > options_.lease / 4) {
    const absl::Duration gap = now - last_sweep;
    for (auto& [id, n] : nodes_) n.lease_expiry += gap;
  }
  for (auto& [id, n] : nodes_) {
    if (!n.alive || now < n.lease_expiry) continue;
    if (!options_.local_node.empty() && id == options_.local_node) {
      Log(LogLevel::kWarning, "local node heartbeat late (same process: lease kept)",
          {{"node", id}, {"late_s", absl::ToDoubleSeconds(now - n.lease_expiry)}});
      n.lease_expiry = now + n.lease;
      continue;
    }
    n.alive = false;
    on_lost(id);
  }
}

void NodeTable::Remove(const std::string& node_id) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  if (it->second.draining) --draining_;
  nodes_.erase(it);
}

bool NodeTable::SetDraining(const std::string& node_id, bool draining) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return false;
  if (it->second.draining != draining) draining_ += draining ? 1 : -1;
  it->second.draining = draining;
  return true;
}

void NodeTable::ClearDraining() {
  for (auto& [id, n] : nodes_) n.draining = false;
  draining_ = 0;
}

bool NodeTable::IsDraining(const std::string& node_id) const {
  const Node* n = Find(node_id);
  return n != nullptr && n->draining;
}

const NodeTable::Node* NodeTable::Find(const std::string& node_id) const {
  auto it = nodes_.find(node_id);
  return it == nodes_.end() ? nullptr : &it->second;
}

bool NodeTable::IsAlive(const std::string& node_id) const {
  const Node* n = Find(node_id);
  return n != nullptr && n->alive;
}

bool NodeTable::HoldsIncarnation(const std::string& node_id, uint64_t incarnation) const {
  const Node* n = Find(node_id);
  return n != nullptr && n->alive && n->incarnation == incarnation;
}

std::shared_ptr<NodeClient> NodeTable::Client(const std::string& node_id) const {
  const Node* n = Find(node_id);
  return n != nullptr ? n->client : nullptr;
}

std::shared_ptr<NodeClient> NodeTable::AliveClient(const std::string& node_id) const {
  const Node* n = Find(node_id);
  return n != nullptr && n->alive ? n->client : nullptr;
}

uint64_t NodeTable::Incarnation(const std::string& node_id) const {
  const Node* n = Find(node_id);
  return n != nullptr ? n->incarnation : 0;
}

}  // namespace wb::daemon
