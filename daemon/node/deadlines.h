#pragma once
// Deadlines of the node daemon's calls: a worker's request deadline and the one set on a gRPC
// call the node makes on its behalf.

#include <grpcpp/grpcpp.h>

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wb::daemon {

// The deadline of a worker's call: its timeout_ms from now, or 60 s when it gave none.
inline absl::Time Deadline(int64_t timeout_ms) {
  return absl::Now() + (timeout_ms > 0 ? absl::Milliseconds(timeout_ms) : absl::Seconds(60));
}

// A forwarded call gets 2 s beyond the deadline it serves, so the far side answers (with its own
// deadline error) before the transport cuts the call.
inline void SetDeadline(grpc::ClientContext* ctx, absl::Time deadline) {
  ctx->set_deadline(absl::ToChronoTime(deadline + absl::Seconds(2)));
}

// The same for a CoordinatorClient call (daemon/node/coordinator_client.h), which takes a timeout.
inline absl::Duration CallTimeout(absl::Time deadline) { return deadline + absl::Seconds(2) - absl::Now(); }

}  // namespace wb::daemon
