#include "daemon/nccl_route.h"

#include <set>

namespace wb::daemon {

std::vector<bool> RouteOverNccl(const std::vector<RouteOpFacts>& ops) {
  auto candidate = [](const RouteOpFacts& op) {
    return op.cross_node && op.src_node_nccl && op.dst_node_nccl && op.src_is_trainer && op.dst_is_rollout && op.src_cuda &&
           op.dst_cuda;
  };
  // Workers whose cross-node ops must all stay on the host channel: a destination with any
  // cross-node op that cannot take nccl, and every rollout that relays to another node.
  std::set<int> host_only;
  for (const RouteOpFacts& op : ops) {
    if (!op.cross_node) continue;
    if (!candidate(op)) host_only.insert(op.dst_worker);
    if (!op.src_is_trainer) host_only.insert(op.src_worker);
  }
  std::vector<bool> out;
  out.reserve(ops.size());
  for (const RouteOpFacts& op : ops) out.push_back(candidate(op) && host_only.count(op.dst_worker) == 0);
  return out;
}

}  // namespace wb::daemon
