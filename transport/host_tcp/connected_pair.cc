#include "transport/host_tcp/connected_pair.h"

#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "transport/host_tcp/host_tcp.h"

namespace wb::transport {

absl::StatusOr<ConnectedPair> ConnectHostTcpPair(const TransportConfig& ca, const TransportConfig& cb) {
  ConnectedPair p;
  auto a = NewHostTcpTransport(ca);
  if (!a.ok()) return a.status();
  auto b = NewHostTcpTransport(cb);
  if (!b.ok()) return b.status();
  p.a = std::move(*a);
  p.b = std::move(*b);
  auto ea = p.a->ExportEndpoint(p.b->instance_id());
  auto eb = p.b->ExportEndpoint(p.a->instance_id());
  if (!ea.ok()) return ea.status();
  if (!eb.ok()) return eb.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<PeerId> from_b = absl::UnknownError("not run");
  std::thread th([&] { from_b = p.b->Connect(*ea, deadline); });
  absl::StatusOr<PeerId> from_a = p.a->Connect(*eb, deadline);
  th.join();
  if (!from_a.ok()) return from_a.status();
  if (!from_b.ok()) return from_b.status();
  p.a_to_b = *from_a;
  p.b_to_a = *from_b;
  return p;
}

}  // namespace wb::transport
