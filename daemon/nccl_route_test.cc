#include "daemon/nccl_route.h"

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// Trainer `src` (CUDA, nccl node) -> rollout `dst` (CUDA, nccl node) across nodes.
RouteOpFacts Gpu(int src, int dst) {
  RouteOpFacts f;
  f.src_worker = src;
  f.dst_worker = dst;
  f.cross_node = true;
  f.src_is_trainer = true;
  f.dst_is_rollout = true;
  f.src_cuda = f.dst_cuda = true;
  f.src_node_nccl = f.dst_node_nccl = true;
  return f;
}

TEST(NcclRouteTest, CudaTrainerToCudaRolloutAcrossNccLNodes) {
  EXPECT_EQ(RouteOverNccl({Gpu(0, 2), Gpu(1, 2), Gpu(1, 3)}), (std::vector<bool>{true, true, true}));
}

TEST(NcclRouteTest, EachConditionAlone) {
  RouteOpFacts same_node = Gpu(0, 2);
  same_node.cross_node = false;
  RouteOpFacts host_src = Gpu(0, 2);
  host_src.src_cuda = false;
  RouteOpFacts host_dst = Gpu(0, 2);
  host_dst.dst_cuda = false;
  RouteOpFacts no_nccl_src = Gpu(0, 2);
  no_nccl_src.src_node_nccl = false;
  RouteOpFacts no_nccl_dst = Gpu(0, 2);
  no_nccl_dst.dst_node_nccl = false;
  RouteOpFacts quantized_dst = Gpu(0, 2);
  quantized_dst.dst_quantized = true;
  for (const RouteOpFacts& f : {same_node, host_src, host_dst, no_nccl_src, no_nccl_dst, quantized_dst}) {
    EXPECT_EQ(RouteOverNccl({f}), std::vector<bool>{false});
  }
}

TEST(NcclRouteTest, ARolloutWithOneHostSourceElsewhereTakesNothingOverNccl) {
  RouteOpFacts host_src = Gpu(1, 2);
  host_src.src_cuda = false;  // another node's trainer in shared memory
  // Rollout 2 gets one op it cannot take over nccl: all of its cross-node ops stay on the host
  // channel (its staging must then be host memory); rollout 3 is unaffected.
  EXPECT_EQ(RouteOverNccl({Gpu(0, 2), host_src, Gpu(0, 3)}), (std::vector<bool>{false, false, true}));
}

TEST(NcclRouteTest, ARolloutThatRelaysToAnotherNodeTakesNothingOverNccl) {
  RouteOpFacts relay = Gpu(2, 4);  // rollout 2's staging forwarded to rollout 4 on a third node
  relay.src_is_trainer = false;
  // Rollout 2 relays: host channel for it. The relay itself is a host-channel op into rollout 4,
  // so rollout 4 takes nothing over nccl either; rollout 5 (not involved) still does.
  EXPECT_EQ(RouteOverNccl({Gpu(0, 2), relay, Gpu(0, 4), Gpu(0, 5)}), (std::vector<bool>{false, false, false, true}));
}

TEST(NcclRouteTest, SameNodeOpsDoNotDisqualify) {
  RouteOpFacts local_host = Gpu(5, 2);
  local_host.cross_node = false;
  local_host.src_cuda = false;  // a same-node host trainer feeding the same rollout: cuda_ipc H2D
  EXPECT_EQ(RouteOverNccl({Gpu(0, 2), local_host}), (std::vector<bool>{true, false}));
}

TEST(NcclLaneTest, NamesRoundTrip) {
  EXPECT_EQ(NcclLaneName(0), "nccl/0");
  EXPECT_EQ(NcclLaneName(13), "nccl/13");
  for (int d : {0, 1, 7, 13, 1023}) EXPECT_EQ(ParseNcclLaneName(NcclLaneName(d)), d);
  for (const char* bad : {"nccl", "nccl/", "nccl/x", "nccl/1x", "nccl/-1", "nccl/01", "host_tcp", "cuda_ipc", "xnccl/1", ""}) {
    EXPECT_EQ(ParseNcclLaneName(bad), -1) << bad;
  }
}

TEST(NcclLaneTest, DevicesFromTransportNames) {
  EXPECT_EQ(NcclLaneDevices({"host_shm", "host_tcp", "nccl/3", "cuda_ipc", "nccl/0", "nccl/1"}), (std::vector<int>{0, 1, 3}));
  EXPECT_TRUE(NcclLaneDevices({"host_shm", "host_tcp", "nccl"}).empty());
}

TEST(NcclLaneTest, OwnLaneFirstElseSpreadOverLanes) {
  const std::vector<int> all = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int g = 0; g < 8; ++g) EXPECT_EQ(NcclLaneFor(all, g), g) << "a GPU with a lane uses it";
  const std::vector<int> two = {0, 4};  // e.g. one lane per NIC pair
  EXPECT_EQ(NcclLaneFor(two, 4), 4);
  EXPECT_EQ(NcclLaneFor(two, 1), 4);
  EXPECT_EQ(NcclLaneFor(two, 2), 0);
  EXPECT_EQ(NcclLaneFor(two, 3), 4);
  EXPECT_EQ(NcclLaneFor(two, -1), 0) << "unknown GPU: the first lane";
  EXPECT_EQ(NcclLaneFor({}, 0), -1);
  EXPECT_EQ(NcclLaneFor({5}, 0), 5);
}

}  // namespace
}  // namespace wb::daemon
