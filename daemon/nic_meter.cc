#include "daemon/nic_meter.h"

namespace wb::daemon {

void NicMeter::Record(DaemonMetrics& metrics, const std::string& node, const std::vector<transport::PathStats>& paths,
                      const std::map<std::string, std::string>& peer_node) {
  absl::MutexLock l(&mu_);
  for (const transport::PathStats& p : paths) {
    auto peer = peer_node.find(p.peer_instance);
    if (peer == peer_node.end()) continue;
    Seen& seen = seen_[{p.peer_instance, p.local_address, p.remote_address}];
    if (p.bytes_sent > seen.sent) {
      metrics.NicBytes(node, p.local_address, peer->second, p.remote_address, "sent", static_cast<uint64_t>(p.bytes_sent - seen.sent));
      seen.sent = p.bytes_sent;
    }
    if (p.bytes_received > seen.received) {
      metrics.NicBytes(node, p.local_address, peer->second, p.remote_address, "received",
                       static_cast<uint64_t>(p.bytes_received - seen.received));
      seen.received = p.bytes_received;
    }
  }
}

}  // namespace wb::daemon
