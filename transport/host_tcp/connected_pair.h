#pragma once

// Test helper: two host_tcp transports in one process, connected to each other over loopback
// (both Connect calls run at once, as the two daemons' would). Shared by host_tcp_test and
// unit_hashes_test so that the connection dance lives in one place.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/config.h"
#include "transport/transport.h"

namespace wb::transport {

struct ConnectedPair {
  std::unique_ptr<Transport> a, b;
  PeerId a_to_b, b_to_a;  // a's id for b, b's id for a
};

// Makes both transports and connects them with a 20 s deadline; the first error is returned.
absl::StatusOr<ConnectedPair> ConnectHostTcpPair(const TransportConfig& ca, const TransportConfig& cb);

}  // namespace wb::transport
