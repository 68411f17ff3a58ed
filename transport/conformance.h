#pragma once
// TEST ONLY. The one conformance suite every transport must pass (design.md "Data plane"). A test
// binary instantiates it for one transport kind:
//
//   INSTANTIATE_TEST_SUITE_P(HostTcp, TransportConformanceTest,
//       ::testing::Values(ConformanceParam{"host_tcp", MemoryKind::kHost}));
//
// Each test runs the transport between this process and a real child process
// (transport_peer_main.cc, added as a `data` dependency), which it may kill -9. GPU kinds skip
// (GTEST_SKIP) when fewer than `min_gpus` CUDA devices are visible.

#include <string>

#include "gtest/gtest.h"
#include "transport/transport.h"

namespace wb::transport {

struct ConformanceParam {
  std::string kind;
  MemoryKind memory = MemoryKind::kHost;
  int min_gpus = 0;
  int64_t large_op_bytes = int64_t{32} << 20;
  int peer_device = 0;  // CUDA device of the peer process
  std::string peer_binary = "transport/transport_peer";
};

inline std::string ConformanceName(const ::testing::TestParamInfo<ConformanceParam>& info) {
  return info.param.kind;
}

class TransportConformanceTest : public ::testing::TestWithParam<ConformanceParam> {};

}  // namespace wb::transport
