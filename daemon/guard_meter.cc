#include "daemon/guard_meter.h"

namespace wb::daemon {

void GuardMeter::Record(DaemonMetrics& metrics, const std::string& node, const std::string& transport,
                        const std::vector<transport::GuardCount>& guards) {
  absl::MutexLock l(&mu_);
  for (const transport::GuardCount& g : guards) {
    if (!g.cumulative) {
      metrics.GuardHeld(node, transport, g.name, g.value);
      continue;
    }
    int64_t& seen = seen_[{transport, g.name}];
    if (g.value > seen) {
      metrics.GuardEvents(node, transport, g.name, static_cast<uint64_t>(g.value - seen));
      seen = g.value;
    }
  }
}

}  // namespace wb::daemon
