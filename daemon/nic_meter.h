#pragma once
// wb_nic_bytes_total (daemon/metrics.h) from a transport's per-path counters
// (transport::TransportStats::paths). The transport counts payload per (peer instance, local
// address, remote address) as it moves, cumulatively and without knowing node ids; the node
// daemon calls Record after each bucket, and the meter turns the growth since its previous look
// into counter increments labelled with the peer's node id. Kept out of the transport so the
// transport interface stays free of metrics and of the daemon's notion of nodes.

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/metrics.h"
#include "transport/transport.h"

namespace wb::daemon {

class NicMeter {
 public:
  // Records into `metrics`, for node `node`, the growth of every path of `paths` since the last
  // call, labelled with the node id `peer_node` gives for the path's peer instance. A path whose
  // instance `peer_node` lacks stays pending: a later call that knows it records all of its growth.
  // Thread-safe; every byte is recorded once, also when concurrent callers pass snapshots taken
  // in a different order (a snapshot older than what was recorded adds nothing).
  void Record(DaemonMetrics& metrics, const std::string& node, const std::vector<transport::PathStats>& paths,
              const std::map<std::string, std::string>& peer_node);

 private:
  struct Seen {
    int64_t sent = 0, received = 0;
  };
  absl::Mutex mu_;
  // (peer instance, local address, remote address) -> counts already recorded. One entry per path
  // ever used: grows with peer restarts (a new instance each), a few entries each.
  std::map<std::tuple<std::string, std::string, std::string>, Seen> seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon
