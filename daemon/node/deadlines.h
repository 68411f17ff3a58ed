#pragma once
// Deadlines of the node daemon's calls: a worker's request deadline and the timeout of a call the
// node makes on its behalf. Both on the node's injected clock (NodeDaemon::Options::clock).

#include <algorithm>
#include <cstdint>

#include "absl/time/time.h"
#include "base/clock.h"

namespace wb::daemon {

// The deadline of a worker's call: its timeout_ms from now, or 60 s when it gave none.
inline absl::Time Deadline(Clock* clock, int64_t timeout_ms) {
  return clock->Now() + (timeout_ms > 0 ? absl::Milliseconds(timeout_ms) : absl::Seconds(60));
}

// The deadline of a worker call without timeout_ms (RegisterWorker, RegisterLayout, Deregister):
// `time_left` of its gRPC deadline less a margin (at most 1 s), so that the node's own answer,
// which names what it waited for, reaches the worker before its deadline cuts the call; 30 s (the
// clients' default call timeout) when it gave none; at most 60 s, like Deadline.
inline absl::Time CallerDeadline(Clock* clock, absl::Duration time_left) {
  if (time_left == absl::InfiniteDuration()) return clock->Now() + absl::Seconds(30);
  const absl::Duration margin = std::min(absl::Seconds(1), time_left / 4);
  return clock->Now() + std::clamp(time_left - margin, absl::ZeroDuration(), absl::Seconds(60));
}

// When a worker call with a gRPC deadline `time_left` away must have its answer on the way: that
// deadline less CallerDeadline's margin (at most 1 s), so a forwarded call cut there still leaves
// the node time to answer with its own words (naming the coordinator) before the worker's deadline
// cuts the call with a bare DEADLINE_EXCEEDED. The infinite future when the worker gave none.
inline absl::Time ReplyBy(Clock* clock, absl::Duration time_left) {
  if (time_left == absl::InfiniteDuration()) return absl::InfiniteFuture();
  const absl::Duration margin = std::min(absl::Seconds(1), time_left / 4);
  return clock->Now() + std::max(absl::ZeroDuration(), time_left - margin);
}

// A forwarded call (daemon/node/coordinator_client.h, which takes a timeout) gets 2 s beyond the
// deadline it serves, so the far side answers (with its own deadline error) before the transport
// cuts the call.
inline absl::Duration CallTimeout(Clock* clock, absl::Time deadline) { return deadline + absl::Seconds(2) - clock->Now(); }

}  // namespace wb::daemon
