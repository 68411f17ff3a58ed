#pragma once
// TEST ONLY. The one conformance suite every transport must pass (design.md "Data plane"). A test
// binary instantiates it for one transport kind:
//
//   INSTANTIATE_TEST_SUITE_P(HostTcp, TransportConformanceTest,
//       ::testing::Values(ConformanceParam{"host_tcp", MemoryKind::kHost}));
//
// Each test runs the transport between this process and a real child process
// (transport_peer_main.cc, added as a `data` dependency), which it may kill -9, or, for an in-process
// fake, a peer thread (ConformanceParam::make_transport). GPU kinds skip
// (GTEST_SKIP) when fewer than `min_gpus` CUDA devices are visible.

#include <functional>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "absl/status/statusor.h"
#include "transport/config.h"
#include "transport/transport.h"

namespace wb::transport {

struct ConformanceParam {
  std::string kind;
  MemoryKind memory = MemoryKind::kHost;
  int min_gpus = 0;
  int64_t large_op_bytes = int64_t{32} << 20;
  int peer_device = 0;  // CUDA device of the peer process
  std::string peer_binary = "transport/testing/transport_peer";
  // In-process transports (transport/testing/fake_transport.h): when set, both sides are made with
  // it (TransportConfig::test_corrupt_checksummed_payload set for a corrupting side) and every peer
  // runs in a thread of the test (InProcessPeer) instead of a transport_peer process; `vanish` is
  // how such a peer is "killed -9" (its transport disappears abruptly).
  std::function<absl::StatusOr<std::unique_ptr<Transport>>(const TransportConfig&)> make_transport;
  std::function<void(Transport&)> vanish;
};

inline std::string ConformanceName(const ::testing::TestParamInfo<ConformanceParam>& info) {
  return info.param.kind;
}

class TransportConformanceTest : public ::testing::TestWithParam<ConformanceParam> {};

}  // namespace wb::transport
