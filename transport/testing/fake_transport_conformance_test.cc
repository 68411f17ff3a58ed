// The conformance suite against the in-process fake transport: peers are threads of this process
// (InProcessPeer), "kill -9" is FakeFabric::Vanish. A simulated 2 GB/s link keeps large transfers
// in flight long enough for the kill and deadline cases to hit them mid-transfer.
#include "transport/testing/conformance.h"
#include "transport/testing/fake_transport.h"

namespace wb::transport {
namespace {

ConformanceParam FakeParam() {
  ConformanceParam p{"fake", MemoryKind::kHost};
  p.make_transport = [](const TransportConfig& config) -> absl::StatusOr<std::unique_ptr<Transport>> {
    testing::FakeOptions o;
    o.corrupt = config.test_corrupt_checksummed_payload;
    o.link_bytes_per_second = int64_t{2} << 30;
    return testing::MakeFakeTransport(o);
  };
  p.vanish = [](Transport& t) { testing::FakeFabric::Default()->Vanish(t.instance_id()); };
  return p;
}

INSTANTIATE_TEST_SUITE_P(Fake, TransportConformanceTest, ::testing::Values(FakeParam()), ConformanceName);

}  // namespace
}  // namespace wb::transport
