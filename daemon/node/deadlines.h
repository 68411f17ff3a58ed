#pragma once
// Deadlines of the node daemon's calls: a worker's request deadline and the timeout of a call the
// node makes on its behalf. Both on the node's injected clock (NodeDaemon::Options::clock).

#include <cstdint>

#include "absl/time/time.h"
#include "base/clock.h"

namespace wb::daemon {

// The deadline of a worker's call: its timeout_ms from now, or 60 s when it gave none.
inline absl::Time Deadline(Clock* clock, int64_t timeout_ms) {
  return clock->Now() + (timeout_ms > 0 ? absl::Milliseconds(timeout_ms) : absl::Seconds(60));
}

// A forwarded call (daemon/node/coordinator_client.h, which takes a timeout) gets 2 s beyond the
// deadline it serves, so the far side answers (with its own deadline error) before the transport
// cuts the call.
inline absl::Duration CallTimeout(Clock* clock, absl::Time deadline) { return deadline + absl::Seconds(2) - clock->Now(); }

}  // namespace wb::daemon
