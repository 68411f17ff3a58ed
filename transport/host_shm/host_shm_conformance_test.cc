// The conformance suite against host_shm, across real processes (transport_peer).
#include "transport/testing/conformance.h"

namespace wb::transport {

INSTANTIATE_TEST_SUITE_P(HostShm, TransportConformanceTest,
                         ::testing::Values(ConformanceParam{"host_shm", MemoryKind::kHost}), ConformanceName);

}  // namespace wb::transport
