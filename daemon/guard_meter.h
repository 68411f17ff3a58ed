#pragma once
// wb_transport_guard_events_total / wb_transport_guard_held (daemon/metrics.h) from the transports'
// bound counters (transport::TransportStats::guards: host_tcp's hellos refused, parked connections,
// early control frames, ...). The transports count cumulatively and know nothing of metrics; the
// node daemon calls Record once per control tick (every heartbeat period), and the meter turns each
// cumulative count's growth since its previous look into counter increments and sets the gauges of
// what is held now. So an operator sees a peer hammering the data port without a version running.

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/metrics.h"
#include "transport/transport.h"

namespace wb::daemon {

class GuardMeter {
 public:
  // Records into `metrics`, for node `node`, the guards of the transport labelled `transport`
  // (its kind, e.g. "host_tcp"). A cumulative count adds its growth since the last call for the same
  // (transport, name) - nothing when it did not grow (an older snapshot than one recorded, from a
  // concurrent caller, adds nothing) -; a held count sets the gauge. A node's transports live as
  // long as the node daemon, so one label's counts never restart from zero.
  // Thread-safe; every event is recorded once.
  void Record(DaemonMetrics& metrics, const std::string& node, const std::string& transport,
              const std::vector<transport::GuardCount>& guards);

 private:
  absl::Mutex mu_;
  // (transport label, guard name) -> the cumulative value already recorded. A few entries per
  // transport kind (the guard names are a fixed vocabulary of each transport).
  std::map<std::pair<std::string, std::string>, int64_t> seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon
