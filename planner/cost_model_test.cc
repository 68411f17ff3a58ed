#include "planner/cost_model.h"

#include "gtest/gtest.h"
#include "planner/box.h"

namespace wb::planner {
namespace {

Worker MakeWorker(Role role, int node, int gpu, int tensor, Box box) {
  Worker w;
  w.id = absl::StrCat(role == Role::kTrainer ? "t" : "r", node, ".", gpu);
  w.role = role;
  w.node = node;
  w.gpu = gpu;
  Piece pc;
  pc.tensor = tensor;
  pc.box = std::move(box);
  w.layout.pieces.push_back(pc);
  return w;
}

Problem Base() {
  Problem p;
  p.inventory.tensors.push_back(TensorSpec{"w", {1000, 500}, DType::kF32});  // 2 MB
  p.topology.nic_GBps_per_gpu = 1;  // 1 GB/s: seconds = bytes / 1e9
  p.topology.intra_node_GBps = 10;
  return p;
}

TEST(CostModelTest, NodeIngressBoundSpreadsOverTheNodeNics) {
  Problem p = Base();
  const Box full = FullBox({1000, 500});
  for (int g = 0; g < 4; ++g) p.workers.push_back(MakeWorker(Role::kTrainer, 0, g, 0, full));
  // Node 1 has 2 GPUs that both need everything: 2 MB over 2 NICs.
  p.workers.push_back(MakeWorker(Role::kRollout, 1, 0, 0, full));
  p.workers.push_back(MakeWorker(Role::kRollout, 1, 1, 0, full));
  EXPECT_DOUBLE_EQ(LowerBound(p), 2e6 / 2 / 1e9);
}

TEST(CostModelTest, ExclusiveReceiverAndSourceEgress) {
  Problem p = Base();
  // One trainer holds the tensor; three single-GPU nodes need it: its NIC sends it at least once,
  // and each receiver is the only needer on its node.
  p.workers.push_back(MakeWorker(Role::kTrainer, 0, 0, 0, FullBox({1000, 500})));
  for (int n = 1; n <= 3; ++n) p.workers.push_back(MakeWorker(Role::kRollout, n, 0, 0, FullBox({1000, 500})));
  EXPECT_DOUBLE_EQ(LowerBound(p), 2e6 / 1e9);
}

TEST(CostModelTest, ColocatedIntraIngress) {
  Problem p = Base();
  p.topology.colocated = true;
  p.workers.push_back(MakeWorker(Role::kTrainer, 0, 0, 0, Box{{0, 0}, {500, 500}}));
  p.workers.push_back(MakeWorker(Role::kTrainer, 0, 1, 0, Box{{500, 0}, {1000, 500}}));
  p.workers.push_back(MakeWorker(Role::kRollout, 0, 0, 0, FullBox({1000, 500})));
  // GPU 0 holds half itself; the other half (1 MB) must come over its intra-node link at 10 GB/s.
  EXPECT_DOUBLE_EQ(LowerBound(p), 1e6 / 10e9);
}

TEST(CostModelTest, PredictMakespanIsTheBusiestLink) {
  Problem p = Base();
  p.workers.push_back(MakeWorker(Role::kTrainer, 0, 0, 0, FullBox({1000, 500})));
  p.workers.push_back(MakeWorker(Role::kRollout, 1, 0, 0, FullBox({1000, 500})));
  p.workers.push_back(MakeWorker(Role::kRollout, 1, 1, 0, FullBox({1000, 500})));
  Plan plan;
  plan.buckets.resize(2);
  TransferOp a;
  a.src_worker = 0;
  a.dst_worker = 1;
  a.bytes = 2'000'000;
  a.route = Route::kInterNode;
  plan.buckets[0].ops.push_back(a);
  TransferOp b = a;
  b.src_worker = 1;
  b.dst_worker = 2;
  b.route = Route::kIntraNode;
  plan.buckets[1].ops.push_back(b);
  EXPECT_DOUBLE_EQ(PredictMakespan(p, plan), 2e6 / 1e9);
  // A second network copy into node 1 from the same trainer doubles its egress.
  b.src_worker = 0;
  b.route = Route::kInterNode;
  plan.buckets[1].ops[0] = b;
  EXPECT_DOUBLE_EQ(PredictMakespan(p, plan), 4e6 / 1e9);
  const ClusterIndex ci = IndexCluster(p);
  std::string where;
  MakespanOf(AccumulateLoads(ci, plan), ci, p.topology, &where);
  EXPECT_EQ(where, "nic_egress of node 0 gpu 0");
}

TEST(CostModelTest, InvalidProblemGivesNegativeBound) {
  Problem p = Base();
  p.workers.push_back(MakeWorker(Role::kRollout, 1, 0, 0, FullBox({1000, 500})));
  EXPECT_LT(LowerBound(p), 0);  // nobody holds the tensor
}

}  // namespace
}  // namespace wb::planner
