// The conformance suite against host_tcp: this process and a peer process over loopback.
#include "transport/testing/conformance.h"

namespace wb::transport {

INSTANTIATE_TEST_SUITE_P(HostTcp, TransportConformanceTest,
                         ::testing::Values(ConformanceParam{"host_tcp", MemoryKind::kHost}), ConformanceName);

}  // namespace wb::transport
