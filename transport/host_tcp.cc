#include "transport/host_tcp.h"
namespace wb::transport {
absl::StatusOr<std::unique_ptr<Transport>> NewHostTcpTransport(const TransportConfig&) {
  return absl::UnimplementedError("host_tcp: not yet");
}
}  // namespace wb::transport
