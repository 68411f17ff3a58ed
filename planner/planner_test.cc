#include "planner/planner.h"

#include <algorithm>
#include <map>
#include <optional>
#include <random>

#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/cost_model.h"
#include "planner/fingerprint.h"
#include "planner/plan_checker.h"

namespace wb::planner {
namespace {

Box B(std::vector<int64_t> b, std::vector<int64_t> e) { return Box{std::move(b), std::move(e)}; }

// Adds a worker whose pieces are packed contiguously into one buffer.
int AddWorker(Problem& p, Role role, int node, int gpu, const std::vector<std::pair<int, Box>>& pieces) {
  Worker w;
  w.id = absl::StrCat(role == Role::kTrainer ? "trainer/" : "rollout/", p.workers.size());
  w.role = role;
  w.node = node;
  w.gpu = gpu;
  int64_t off = 0;
  for (const auto& [t, box] : pieces) {
    Piece pc;
    pc.tensor = t;
    pc.box = box;
    pc.offset_bytes = off;
    std::vector<int64_t> shape;
    for (size_t d = 0; d < box.begin.size(); ++d) shape.push_back(box.end[d] - box.begin[d]);
    pc.strides = ContiguousStrides(shape);
    off += BoxVolume(box) * DTypeSize(p.inventory.tensors[t].dtype);
    w.layout.pieces.push_back(pc);
  }
  w.layout.buffers.push_back(BufferInfo{off});
  p.workers.push_back(std::move(w));
  return static_cast<int>(p.workers.size()) - 1;
}

Problem OneTensor(int64_t rows, int64_t cols) {
  Problem p;
  p.inventory.architecture = "Test";
  p.inventory.tensors.push_back(TensorSpec{"w", {rows, cols}, DType::kBF16});
  return p;
}

std::vector<const TransferOp*> AllOps(const Plan& plan) {
  std::vector<const TransferOp*> ops;
  for (const Bucket& b : plan.buckets) {
    for (const TransferOp& op : b.ops) ops.push_back(&op);
  }
  return ops;
}

int BucketOf(const Plan& plan, const TransferOp* op) {
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (const TransferOp& o : plan.buckets[b].ops) {
      if (&o == op) return static_cast<int>(b);
    }
  }
  return -1;
}

TEST(PlannerTest, DedupsPerNodeAndRelaysInsideTheNode) {
  Problem p = OneTensor(64, 32);
  const Box full = FullBox({64, 32});
  AddWorker(p, Role::kTrainer, 0, 0, {{0, full}});
  for (int g = 0; g < 4; ++g) AddWorker(p, Role::kRollout, 1, g, {{0, full}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  EXPECT_TRUE(plan->stats.complete);
  EXPECT_EQ(plan->stats.redundant_bytes, 0);
  const int64_t bytes = 64 * 32 * 2;
  EXPECT_EQ(plan->stats.bytes_inter_node, bytes);
  EXPECT_EQ(plan->stats.bytes_intra_node, 3 * bytes);
  int relays = 0;
  for (const TransferOp* op : AllOps(*plan)) {
    if (op->route == Route::kIntraNode) {
      ++relays;
      EXPECT_EQ(p.workers[op->src_worker].role, Role::kRollout);
      EXPECT_GT(BucketOf(*plan, op), 0);
    }
  }
  EXPECT_EQ(relays, 3);
  // Baseline without dedup sends it four times.
  auto p2p = MakePlan(p, Strategy::kP2PNoDedup);
  ASSERT_TRUE(p2p.ok());
  EXPECT_EQ(p2p->stats.bytes_inter_node, 4 * bytes);
  EXPECT_EQ(p2p->stats.redundant_bytes, 3 * bytes);
  EXPECT_GT(p2p->stats.makespan_s, plan->stats.makespan_s);
}

TEST(PlannerTest, ColocatedUsesSameGpuAndIntraNodeCopies) {
  Problem p = OneTensor(8, 8);
  p.topology.colocated = true;
  // FSDP-like: two trainers on node 0 gpus 0/1 each hold half the rows.
  AddWorker(p, Role::kTrainer, 0, 0, {{0, B({0, 0}, {4, 8})}});
  AddWorker(p, Role::kTrainer, 0, 1, {{0, B({4, 0}, {8, 8})}});
  // Rollout GPU i is trainer GPU i; TP=2 over columns.
  AddWorker(p, Role::kRollout, 0, 0, {{0, B({0, 0}, {8, 4})}});
  AddWorker(p, Role::kRollout, 0, 1, {{0, B({0, 4}, {8, 8})}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok());
  EXPECT_EQ(plan->stats.bytes_inter_node, 0);
  int same = 0, intra = 0;
  for (const TransferOp* op : AllOps(*plan)) {
    same += op->route == Route::kSameGpu;
    intra += op->route == Route::kIntraNode;
    if (op->route == Route::kSameGpu) {
      EXPECT_EQ(p.workers[op->src_worker].gpu, p.workers[op->dst_worker].gpu);
    }
  }
  EXPECT_EQ(same, 2);
  EXPECT_EQ(intra, 2);
}

TEST(PlannerTest, BalancesOverReplicatedSources) {
  // Four trainer replicas hold the whole (large) tensor; one rollout node of 4 GPUs needs it split
  // by rows. Every trainer NIC must send about a quarter.
  Problem p = OneTensor(4096, 2048);  // 16 MiB
  const Box full = FullBox({4096, 2048});
  for (int t = 0; t < 4; ++t) AddWorker(p, Role::kTrainer, 0, t, {{0, full}});
  for (int g = 0; g < 4; ++g) AddWorker(p, Role::kRollout, 1, g, {{0, B({1024 * g, 0}, {1024 * (g + 1), 2048})}});
  PlanOptions opt;
  opt.max_fragment_bytes = 1 << 20;
  auto plan = MakePlanWithOptions(p, Strategy::kWeightBridge, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok());
  std::map<int, int64_t> sent;
  for (const TransferOp* op : AllOps(*plan)) sent[op->src_worker] += op->bytes;
  ASSERT_EQ(sent.size(), 4u);
  for (const auto& [w, bytes] : sent) EXPECT_EQ(bytes, int64_t{4} << 20) << "trainer " << w;
  EXPECT_NEAR(plan->stats.makespan_s, plan->stats.lower_bound_s, 1e-12);
  // rank0 funnels everything through trainer 0.
  auto r0 = MakePlan(p, Strategy::kRank0Broadcast);
  ASSERT_TRUE(r0.ok());
  EXPECT_NEAR(r0->stats.makespan_s, 4 * plan->stats.makespan_s, 1e-9);
}

TEST(PlannerTest, CrossNodeRelaysWhenTrainerEgressIsTheBottleneck) {
  Problem p = OneTensor(1024, 1024);  // 2 MiB
  const Box full = FullBox({1024, 1024});
  AddWorker(p, Role::kTrainer, 0, 0, {{0, full}});
  for (int n = 1; n <= 6; ++n) AddWorker(p, Role::kRollout, n, 0, {{0, full}});
  PlanOptions opt;
  opt.max_fragment_bytes = 64 << 10;
  auto plan = MakePlanWithOptions(p, Strategy::kWeightBridge, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  int64_t trainer_sent = 0, relayed = 0;
  for (const TransferOp* op : AllOps(*plan)) {
    if (op->src_worker == 0) {
      trainer_sent += op->bytes;
    } else {
      EXPECT_EQ(op->route, Route::kInterNode);
      relayed += op->bytes;
    }
  }
  const int64_t bytes = 1024 * 1024 * 2;
  EXPECT_LE(trainer_sent, bytes + bytes / 8);  // about once
  EXPECT_EQ(trainer_sent + relayed, 6 * bytes);
  EXPECT_LE(plan->stats.makespan_s, 1.15 * plan->stats.lower_bound_s);
  auto owner = MakePlan(p, Strategy::kOwnerBroadcast);
  ASSERT_TRUE(owner.ok());
  EXPECT_NEAR(owner->stats.makespan_s, 6 * plan->stats.lower_bound_s, 1e-9);
}

TEST(PlannerTest, StagingBudgetBoundsBuckets) {
  Problem p = OneTensor(256, 256);  // 128 KiB
  p.staging_budget_bytes = 16 << 10;
  AddWorker(p, Role::kTrainer, 0, 0, {{0, FullBox({256, 256})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, FullBox({256, 256})}});
  AddWorker(p, Role::kRollout, 1, 1, {{0, FullBox({256, 256})}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GE(plan->buckets.size(), 8u);
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
}

TEST(PlannerTest, Rank0GathersIntoStagingThenBroadcasts) {
  Problem p = OneTensor(16, 16);
  AddWorker(p, Role::kTrainer, 0, 0, {{0, B({0, 0}, {8, 16})}});
  AddWorker(p, Role::kTrainer, 0, 1, {{0, B({8, 0}, {16, 16})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, FullBox({16, 16})}});
  AddWorker(p, Role::kRollout, 1, 1, {{0, FullBox({16, 16})}});
  auto plan = MakePlan(p, Strategy::kRank0Broadcast);
  ASSERT_TRUE(plan.ok()) << plan.status();
  CheckOptions co;
  co.allow_staging = true;
  co.require_no_redundancy = false;
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, co).ok()) << CheckPlanElementwise(p, *plan, co);
  int gathers = 0;
  for (const TransferOp* op : AllOps(*plan)) {
    if (op->dst_piece < 0) {
      ++gathers;
      EXPECT_EQ(op->dst_worker, 0);
    } else {
      EXPECT_EQ(op->src_worker, 0);
    }
  }
  EXPECT_EQ(gathers, 1);
  EXPECT_EQ(plan->stats.redundant_bytes, 16 * 16 * 2);
}

TEST(PlannerTest, UncoveredDestinationIsAnErrorNamingTheTensor) {
  Problem p = OneTensor(8, 8);
  AddWorker(p, Role::kTrainer, 0, 0, {{0, B({0, 0}, {4, 8})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, FullBox({8, 8})}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("tensor w box [4:8, 0:8]"), std::string::npos) << plan.status();
}

TEST(PlannerTest, DuplicatedSourceBoxesPlanQuicklyAndEveryHolderStaysASender) {
  // Security review, variant A: a trainer with a diagonal of one-element pieces (a 2049^2-cell
  // grid) and 32768 copies of the full box (~3 min of grid walks before grouping identical boxes).
  Problem p;
  p.inventory.tensors.push_back(TensorSpec{"w", {4096, 4096}, DType::kF32});
  std::vector<std::pair<int, Box>> hostile;
  for (int64_t i = 0; i < 1024; ++i) hostile.push_back({0, B({4 * i, 4 * i}, {4 * i + 1, 4 * i + 1})});
  for (int i = 0; i < 32768; ++i) hostile.push_back({0, FullBox({4096, 4096})});
  AddWorker(p, Role::kTrainer, 0, 0, hostile);
  AddWorker(p, Role::kTrainer, 0, 1, {{0, FullBox({4096, 4096})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, FullBox({4096, 4096})}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->stats.complete);
  EXPECT_EQ(plan->stats.redundant_bytes, 0);
  std::map<int, int64_t> sent;
  int64_t bytes = 0;
  for (const TransferOp* op : AllOps(*plan)) {
    const Box& src = p.workers[op->src_worker].layout.pieces[op->src_piece].box;
    ASSERT_TRUE(BoxContains(src, op->box)) << BoxToString(op->box);
    EXPECT_TRUE(op->src_piece < 1025 || op->src_worker != 0) << op->src_piece;  // first full copy
    sent[op->src_worker] += op->bytes;
    bytes += op->bytes;
  }
  EXPECT_EQ(bytes, int64_t{4096} * 4096 * 4);
  EXPECT_GT(sent[0], bytes / 4);  // both holders send: duplicates did not hide the other worker
  EXPECT_GT(sent[1], bytes / 4);
}

TEST(PlannerTest, OverlappingSourceBoxesPastTheWorkBudgetAreResourceExhausted) {
  // 1024 distinct boxes each covering nearly the whole 2049 x 3073-cell grid: refused before walking.
  Problem p;
  p.inventory.tensors.push_back(TensorSpec{"w", {4096, 4096}, DType::kF32});
  std::vector<std::pair<int, Box>> hostile;
  for (int64_t i = 0; i < 1024; ++i) hostile.push_back({0, B({4 * i, 4 * i}, {4 * i + 1, 4 * i + 1})});
  for (int64_t k = 0; k <= 1024; ++k) hostile.push_back({0, B({0, 0}, {4096, 4096 - 2 * k})});
  AddWorker(p, Role::kTrainer, 0, 0, hostile);
  AddWorker(p, Role::kRollout, 1, 0, {{0, FullBox({4096, 4096})}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted) << plan.status();
  EXPECT_NE(plan.status().message().find("tensor w (largest box: worker trainer/0 piece 1024)"), std::string::npos)
      << plan.status();
}

TEST(PlannerTest, BadBoxIsInvalidArgument) {
  Problem p = OneTensor(8, 8);
  AddWorker(p, Role::kTrainer, 0, 0, {{0, B({0, 0}, {9, 8})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, FullBox({8, 8})}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("trainer/0"), std::string::npos);
}

TEST(PlannerTest, DeterministicFingerprint) {
  Problem p = OneTensor(64, 64);
  AddWorker(p, Role::kTrainer, 0, 0, {{0, FullBox({64, 64})}});
  AddWorker(p, Role::kTrainer, 0, 1, {{0, FullBox({64, 64})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, B({0, 0}, {32, 64})}});
  AddWorker(p, Role::kRollout, 1, 1, {{0, B({32, 0}, {64, 64})}});
  auto a = MakePlan(p, Strategy::kWeightBridge);
  auto b = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->fingerprint, b->fingerprint);
  EXPECT_EQ(a->fingerprint.size(), 32u);
  EXPECT_EQ(a->fingerprint, Fingerprint(p, *a));
  p.workers[2].layout.pieces[0].offset_bytes = 128;  // any layout change changes it
  EXPECT_NE(Fingerprint(p, *a), a->fingerprint);
  auto c = MakePlan(p, Strategy::kP2PNoDedup);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->fingerprint, a->fingerprint);
}

// Many holders and needers per fragment (docs/planner.md "Plan builder cost"): DDP trainers that
// hold every tensor whole, added out of node order, two trainer workers on one GPU, nodes of 1 to
// 4 GPUs, colocated slots, rollout nodes without a holder, and few trainers feeding many rollout
// nodes (cross-node relays). The builder's per-fragment holder index must choose exactly what the
// scan of every holder chose: these fingerprints were recorded with that scan (before 2026-12-06)
// and must never change.
Problem ManyHoldersProblem(int variant) {
  Problem p;
  p.inventory.architecture = "Test";
  p.inventory.tensors = {TensorSpec{"a", {96, 40}, DType::kBF16}, TensorSpec{"b", {33}, DType::kF32},
                         TensorSpec{"c", {24, 8}, DType::kBF16}};
  const std::vector<std::pair<int, Box>> whole = {{0, FullBox({96, 40})}, {1, FullBox({33})}, {2, FullBox({24, 8})}};
  auto half = [](int64_t h) {
    return std::vector<std::pair<int, Box>>{{0, B({48 * h, 0}, {48 * h + 48, 40})}, {1, FullBox({33})},
                                            {2, B({0, 4 * h}, {24, 4 * h + 4})}};
  };
  switch (variant) {
    case 0:  // DDP 12 -> 20 whole, trainers in reverse node order, rollout nodes of 1..4 GPUs
      for (int t = 11; t >= 0; --t) AddWorker(p, Role::kTrainer, t / 2, t % 2, whole);
      for (int r = 0, node = 6, g = 0; r < 20; ++r) {
        AddWorker(p, Role::kRollout, node, g, whole);
        if (++g > (node % 4)) node++, g = 0;
      }
      break;
    case 1:  // colocated DDP on 4 x 4 GPUs, two trainers on (0, 0), rollouts tp2 on the same slots,
             // and a rollout node without a holder
      for (int n = 0; n < 4; ++n) {
        for (int g = 0; g < 4; ++g) AddWorker(p, Role::kTrainer, n, g, whole);
      }
      AddWorker(p, Role::kTrainer, 0, 0, whole);
      for (int n = 0; n < 4; ++n) {
        for (int g = 0; g < 4; ++g) AddWorker(p, Role::kRollout, n, g, half(g % 2));
      }
      for (int g = 0; g < 4; ++g) AddWorker(p, Role::kRollout, 4, g, half(g % 2));
      p.topology.colocated = true;
      break;
    case 2:  // 2 trainers feed 16 one-GPU rollout nodes: trainer egress binds, rollouts relay
      AddWorker(p, Role::kTrainer, 0, 0, whole);
      AddWorker(p, Role::kTrainer, 0, 1, whole);
      for (int r = 0; r < 16; ++r) AddWorker(p, Role::kRollout, 1 + r, 0, r % 3 == 0 ? whole : half(r % 2));
      break;
    default:  // tp2 x dp3 trainers scattered one GPU per node, rollouts on the trainers' nodes and others
      for (int d = 0; d < 3; ++d) {
        for (int h = 0; h < 2; ++h) AddWorker(p, Role::kTrainer, (5 * (2 * d + h)) % 7, 0, half(h));
      }
      for (int r = 0; r < 10; ++r) AddWorker(p, Role::kRollout, r, r < 7 ? 1 : 0, r % 2 ? whole : half(r % 4 / 2));
      break;
  }
  p.staging_budget_bytes = 16384;
  return p;
}

TEST(PlannerTest, ManyHoldersPlansKeepTheirFingerprints) {
  const char* kWant[4][4] = {
      {"4fb49aab44a17c868ee8f1f72aed0e3b", "6601f834c5c56acf33af771d73846a43",
       "694fe6c5fc48065507a84435e3f21452", "47816e2118e0c0956c14e16a97fa1a0c"},
      {"60f42af9174832699e45db76aae6026e", "3b497d6c9e74fa9809f0e656ab1bcd46",
       "03a1800ed599f83a61247dc1fd0ee2b0", "7fec9d15f55b40f378681c2ff5f24aff"},
      {"7d5f464d7bebb9799294dcc9fc42e12d", "2735121978fef622c78ce2d3950eff2f",
       "ceede9054d5ab0ab5148aadb4a398c49", "89bd978365d027da5ad42ac9027f507f"},
      {"2cb05eef5263c3d6ec583c7c28b6256f", "b5b181994c442688752a1fdd27eba373",
       "fc1de07343a2578de03c8b4ac65cd978", "1922396eaa12810c4593314f763caf7c"},
  };
  const Strategy kStrategies[] = {Strategy::kWeightBridge, Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast,
                                  Strategy::kP2PNoDedup};
  for (int v = 0; v < 4; ++v) {
    const Problem p = ManyHoldersProblem(v);
    for (int s = 0; s < 4; ++s) {
      PlanOptions opt;
      opt.max_fragment_bytes = 1000;
      auto plan = MakePlanWithOptions(p, kStrategies[s], opt);
      ASSERT_TRUE(plan.ok()) << plan.status();
      CheckOptions co;
      co.require_no_redundancy = kStrategies[s] == Strategy::kWeightBridge;
      co.allow_staging = kStrategies[s] == Strategy::kRank0Broadcast;
      EXPECT_TRUE(CheckPlanElementwise(p, *plan, co).ok()) << v << " " << StrategyName(kStrategies[s]);
      EXPECT_EQ(plan->fingerprint, kWant[v][s]) << "variant " << v << " " << StrategyName(kStrategies[s]);
    }
  }
}

// Random crowded problems: up to 24 trainers and 24 rollouts on random GPU slots (shared slots,
// nodes of 1 to 4 GPUs, workers in random order), whole / half / quarter boxes, tiny and large
// staging budgets. The FNV-1a digest of all their plans' fingerprints (every strategy) was
// recorded with the scan of every holder (before 2026-12-06) and must never change.
Problem CrowdedProblem(std::mt19937_64& rng) {
  auto u = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  Problem p;
  p.inventory.architecture = "Test";
  const int nt = static_cast<int>(u(1, 3));
  for (int t = 0; t < nt; ++t) {
    p.inventory.tensors.push_back(TensorSpec{absl::StrCat("t", t), {u(2, 32) * 2, u(1, 8) * 2}, DType::kBF16});
  }
  std::vector<std::pair<int, int>> slots;
  const int nodes = static_cast<int>(u(2, 8));
  for (int n = 0; n < nodes; ++n) {
    const int g = static_cast<int>(u(1, 4));
    for (int i = 0; i < g; ++i) slots.push_back({n, i});
  }
  auto boxes = [&](bool whole) {
    std::vector<std::pair<int, Box>> out;
    for (int t = 0; t < nt; ++t) {
      const auto& sh = p.inventory.tensors[t].shape;
      const int64_t kind = whole ? 0 : u(0, 3), h = u(0, 1);
      if (kind <= 1) {
        out.push_back({t, FullBox(sh)});
      } else if (kind == 2) {
        out.push_back({t, B({h * sh[0] / 2, 0}, {(h + 1) * sh[0] / 2, sh[1]})});
      } else {
        out.push_back({t, B({0, h * sh[1] / 2}, {sh[0], (h + 1) * sh[1] / 2})});
      }
    }
    return out;
  };
  struct W {
    Role role;
    std::pair<int, int> at;
    std::vector<std::pair<int, Box>> pieces;
  };
  std::vector<W> ws;
  const int trainers = static_cast<int>(u(1, 24)), rollouts = static_cast<int>(u(1, 24));
  for (int i = 0; i < trainers; ++i) {
    ws.push_back({Role::kTrainer, slots[u(0, slots.size() - 1)], boxes(i == 0 || u(0, 1) == 0)});
  }
  for (int i = 0; i < rollouts; ++i) ws.push_back({Role::kRollout, slots[u(0, slots.size() - 1)], boxes(false)});
  std::shuffle(ws.begin(), ws.end(), rng);
  for (const W& w : ws) AddWorker(p, w.role, w.at.first, w.at.second, w.pieces);
  p.topology.nic_GBps_per_gpu = static_cast<double>(u(10, 100));
  p.topology.intra_node_GBps = static_cast<double>(u(100, 400));
  p.staging_budget_bytes = u(0, 1) ? u(64, 4096) : int64_t{1} << 30;
  return p;
}

TEST(PlannerTest, CrowdedRandomPlansKeepTheirFingerprints) {
  std::mt19937_64 rng(20261206);
  uint64_t digest = 1469598103934665603ULL;
  int64_t ops = 0;
  for (int i = 0; i < 400; ++i) {
    const Problem p = CrowdedProblem(rng);
    PlanOptions opt;
    opt.max_fragment_bytes = i % 3 == 0 ? -1 : (i % 3 == 1 ? 256 : 0);
    for (Strategy s : {Strategy::kWeightBridge, Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast,
                       Strategy::kP2PNoDedup}) {
      auto plan = MakePlanWithOptions(p, s, opt);
      ASSERT_TRUE(plan.ok()) << i << " " << StrategyName(s) << ": " << plan.status();
      ops += plan->stats.num_ops;
      for (char c : plan->fingerprint) digest = (digest ^ static_cast<uint8_t>(c)) * 1099511628211ULL;
    }
  }
  EXPECT_EQ(ops, 135866);
  EXPECT_EQ(digest, 11826321009302863369ULL);
}

TEST(PlannerTest, PlanSizeCapCountsEveryOpBeforeBuildingThem) {
  // PlanOptions::max_ops at exactly the plan's op count plans; one less is RESOURCE_EXHAUSTED naming
  // the model, the tensor with the most ops, the count and the limit (every strategy: rank0's
  // gathers count too).
  for (int v = 0; v < 4; ++v) {
    const Problem p = ManyHoldersProblem(v);
    for (Strategy s : {Strategy::kWeightBridge, Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast,
                       Strategy::kP2PNoDedup}) {
      PlanOptions opt;
      opt.max_fragment_bytes = 1000;
      auto plan = MakePlanWithOptions(p, s, opt);
      ASSERT_TRUE(plan.ok()) << plan.status();
      const int64_t n = plan->stats.num_ops;
      opt.max_ops = n;
      auto at = MakePlanWithOptions(p, s, opt);
      ASSERT_TRUE(at.ok()) << v << " " << StrategyName(s) << ": " << at.status();
      EXPECT_EQ(at->fingerprint, plan->fingerprint);
      opt.max_ops = n - 1;
      auto past = MakePlanWithOptions(p, s, opt);
      ASSERT_FALSE(past.ok()) << v << " " << StrategyName(s);
      EXPECT_EQ(past.status().code(), absl::StatusCode::kResourceExhausted);
      const std::string want = absl::StrCat("model Test: the ", StrategyName(s), " plan would have ", n,
                                            " transfer ops, more than the limit of ", n - 1,
                                            " (PlanOptions::max_ops); tensor a alone needs ");
      EXPECT_NE(past.status().message().find(want), std::string::npos) << past.status();
    }
  }
}

TEST(PlannerTest, DefaultPlanSizeCapRefusesATinyGrainTimesManyNeeders) {
  // A 16-byte staging budget splits a 32768-row tensor into one fragment per row (4 bytes), and
  // 1024 rollout GPUs need every one: 33.5M ops, past MaxPlanOps(1025 pieces) = 2^24 + 256 x 1025.
  // The fragments' work budget does not see it (32768 split chunks); the cap refuses it before a
  // single op is built (about 5 GB of ops otherwise).
  Problem p;
  p.inventory.architecture = "TinyGrain";
  p.inventory.tensors.push_back(TensorSpec{"w", {32768, 2}, DType::kBF16});
  AddWorker(p, Role::kTrainer, 0, 0, {{0, FullBox({32768, 2})}});
  for (int r = 0; r < 1024; ++r) AddWorker(p, Role::kRollout, 1 + r / 8, r % 8, {{0, FullBox({32768, 2})}});
  p.staging_budget_bytes = 16;
  EXPECT_EQ(MaxPlanOps(1025), (int64_t{1} << 24) + 256 * 1025);
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find(
                "model TinyGrain: the weightbridge plan would have 33554432 transfer ops, more than the limit of "
                "17039616 (16777216 + 256 per piece, 1025 pieces); tensor w alone needs 33554432 ops in 32768 "
                "fragments"),
            std::string::npos)
      << plan.status();
}

TEST(PlannerTest, ReplicatedDestinationOverlapCrossesOnceIntoTheNode) {
  // Two rollout GPUs on one node need overlapping (not identical) row ranges.
  Problem p = OneTensor(30, 4);
  AddWorker(p, Role::kTrainer, 0, 0, {{0, FullBox({30, 4})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, B({0, 0}, {20, 4})}});
  AddWorker(p, Role::kRollout, 1, 1, {{0, B({10, 0}, {30, 4})}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  EXPECT_EQ(plan->stats.bytes_inter_node, 30 * 4 * 2);
  EXPECT_EQ(plan->stats.bytes_intra_node, 10 * 4 * 2);
}

TEST(PlannerTest, ScalarAndOneDimTensors) {
  Problem p;
  p.inventory.tensors.push_back(TensorSpec{"scale", {}, DType::kF32});
  p.inventory.tensors.push_back(TensorSpec{"bias", {10}, DType::kF32});
  AddWorker(p, Role::kTrainer, 0, 0, {{0, Box{}}, {1, B({0}, {10})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, Box{}}, {1, B({0}, {5})}});
  AddWorker(p, Role::kRollout, 1, 1, {{1, B({5}, {10})}});
  auto plan = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  EXPECT_EQ(plan->stats.bytes_inter_node, 4 + 40);
}


// ---- Sender-side quantisation (issue 17.1) ----

Quantization Fp8Block(int64_t rows, int64_t cols) {
  Quantization q;
  q.dtype = DType::kF8E4M3;
  q.scale_dtype = DType::kF32;
  q.block = {rows, cols};
  return q;
}

void QuantizeRollouts(Problem& p, const Quantization& q) {
  for (Worker& w : p.workers) {
    if (w.role != Role::kRollout) continue;
    for (Piece& pc : w.layout.pieces) pc.quant = q;
  }
}

PlanOptions SenderQuant() {
  PlanOptions o;
  o.sender_quantization = true;
  return o;
}

TEST(PlannerTest, SenderQuantisesWholeBlocksAndRelaysCarryThem) {
  // Two trainers hold row halves (256 rows = 2 blocks each); four rollout GPUs on another node
  // need the whole tensor as fp8 with 128x128 blocks: one network op per half, three intra-node
  // relays per half, all of fp8 elements + one float32 scale per block.
  Problem p = OneTensor(512, 256);
  AddWorker(p, Role::kTrainer, 0, 0, {{0, B({0, 0}, {256, 256})}});
  AddWorker(p, Role::kTrainer, 0, 1, {{0, B({256, 0}, {512, 256})}});
  for (int g = 0; g < 4; ++g) AddWorker(p, Role::kRollout, 1, g, {{0, FullBox({512, 256})}});
  QuantizeRollouts(p, Fp8Block(128, 128));

  auto bf16 = MakePlan(p, Strategy::kWeightBridge);  // the coordinator's: receiver-side
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  for (const TransferOp* op : AllOps(*bf16)) EXPECT_FALSE(op->sender_quantized);
  EXPECT_EQ(bf16->stats.sender_quantized_bytes, 0);
  EXPECT_EQ(bf16->stats.wire_bytes, bf16->stats.bytes_inter_node + bf16->stats.bytes_intra_node);

  auto plan = MakePlanWithOptions(p, Strategy::kWeightBridge, SenderQuant());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  EXPECT_TRUE(plan->stats.complete);
  EXPECT_EQ(plan->stats.redundant_bytes, 0);
  const int64_t half_bf16 = 256 * 256 * 2, half_fp8 = 256 * 256 + 2 * 2 * 4;
  int relays = 0;
  for (const TransferOp* op : AllOps(*plan)) {
    EXPECT_TRUE(op->sender_quantized);
    EXPECT_EQ(op->bytes * half_fp8, op->wire_bytes * half_bf16);  // any split keeps whole blocks
    relays += p.workers[op->src_worker].role == Role::kRollout;
  }
  EXPECT_GT(relays, 0);
  EXPECT_EQ(plan->stats.wire_bytes_inter_node, 2 * half_fp8);
  EXPECT_EQ(plan->stats.wire_bytes, 8 * half_fp8);
  EXPECT_EQ(plan->stats.sender_quantized_bytes, 8 * half_bf16);
  EXPECT_EQ(plan->stats.bytes_inter_node, bf16->stats.bytes_inter_node);  // canonical bytes unchanged
  // Links carry fp8 now: the bound and the makespan shrink by the wire ratio.
  EXPECT_NEAR(plan->stats.lower_bound_s / bf16->stats.lower_bound_s, static_cast<double>(half_fp8) / half_bf16, 1e-12);
  EXPECT_NEAR(plan->stats.makespan_s / bf16->stats.makespan_s, static_cast<double>(half_fp8) / half_bf16, 1e-12);
  EXPECT_DOUBLE_EQ(plan->stats.lower_bound_s, LowerBound(p, true));
  EXPECT_DOUBLE_EQ(plan->stats.makespan_s, PredictMakespan(p, *plan));
  EXPECT_NE(plan->fingerprint, bf16->fingerprint);
}

TEST(PlannerTest, SplitFragmentsStayOnTheBlockGrid) {
  // A 4 MiB-grain split of a 2048-row fragment must cut on multiples of 128 rows.
  Problem p = OneTensor(2048, 1024);
  AddWorker(p, Role::kTrainer, 0, 0, {{0, FullBox({2048, 1024})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, FullBox({2048, 1024})}});
  QuantizeRollouts(p, Fp8Block(128, 128));
  PlanOptions o = SenderQuant();
  o.max_fragment_bytes = 300 * 1024 * 2;  // 300 rows: not a multiple of 128
  auto plan = MakePlanWithOptions(p, Strategy::kWeightBridge, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  EXPECT_GT(AllOps(*plan).size(), 1u);
  for (const TransferOp* op : AllOps(*plan)) {
    EXPECT_TRUE(op->sender_quantized);
    EXPECT_EQ(op->box.begin[0] % 128, 0);
  }
  EXPECT_EQ(plan->stats.wire_bytes, 2048 * 1024 + 16 * 8 * 4);
}

TEST(PlannerTest, SenderQuantisationFallsBackPerPiece) {
  // Trainer rows split at 100: the ops into rows [0, 128) of the rollout cut a block, so that
  // piece is receiver-quantised - all its ops, also the aligned ones. The other rollout piece
  // (rows [128, 256)) is fed by one trainer only, on the grid: sender-quantised.
  Problem p = OneTensor(256, 128);
  AddWorker(p, Role::kTrainer, 0, 0, {{0, B({0, 0}, {100, 128})}});
  AddWorker(p, Role::kTrainer, 0, 1, {{0, B({100, 0}, {256, 128})}});
  AddWorker(p, Role::kRollout, 1, 0, {{0, B({0, 0}, {128, 128})}, {0, B({128, 0}, {256, 128})}});
  QuantizeRollouts(p, Fp8Block(128, 128));
  auto plan = MakePlanWithOptions(p, Strategy::kWeightBridge, SenderQuant());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  for (const TransferOp* op : AllOps(*plan)) {
    EXPECT_EQ(op->sender_quantized, op->dst_piece == 1) << BoxToString(op->box);
    EXPECT_EQ(op->wire_bytes, op->sender_quantized ? 128 * 128 + 4 : op->bytes);
  }
  EXPECT_EQ(plan->stats.sender_quantized_bytes, 128 * 128 * 2);

  // Needers of one fragment in different formats: neither is sender-quantised (a relay between
  // them could not serve the other's format).
  Problem q = OneTensor(256, 128);
  AddWorker(q, Role::kTrainer, 0, 0, {{0, FullBox({256, 128})}});
  AddWorker(q, Role::kRollout, 1, 0, {{0, FullBox({256, 128})}});
  AddWorker(q, Role::kRollout, 1, 1, {{0, FullBox({256, 128})}});
  QuantizeRollouts(q, Fp8Block(128, 128));
  q.workers[2].layout.pieces[0].quant = Fp8Block(1, 32);
  auto mixed = MakePlanWithOptions(q, Strategy::kWeightBridge, SenderQuant());
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_EQ(mixed->stats.sender_quantized_bytes, 0);
  EXPECT_DOUBLE_EQ(mixed->stats.lower_bound_s, LowerBound(q));
}


// ---- Catch-up from quantised rollouts (PlanOptions::quantized_sources) ----

// w [512, 256] and n [1, 256]; sources (kTrainer: the rollouts holding the version) and late
// rollouts each hold w whole in `wq` (unset: bf16) and n unquantised.
Problem CatchUpProblem(const std::vector<std::optional<Quantization>>& sources, const std::vector<std::optional<Quantization>>& late) {
  Problem p = OneTensor(512, 256);
  p.inventory.tensors.push_back(TensorSpec{"n", {1, 256}, DType::kBF16});
  int gpu = 0;
  for (const auto* side : {&sources, &late}) {
    for (const std::optional<Quantization>& q : *side) {
      const int w = AddWorker(p, side == &sources ? Role::kTrainer : Role::kRollout, gpu % 2, gpu / 2,
                              {{0, FullBox({512, 256})}, {1, FullBox({1, 256})}});
      p.workers[w].layout.pieces[0].quant = q;
      ++gpu;
    }
  }
  return p;
}

PlanOptions CatchUp() {
  PlanOptions o;
  o.quantized_sources = true;
  return o;
}

TEST(PlannerTest, CatchUpCopiesTheQuantisedBytesOfSourcesInTheLateRolloutsFormat) {
  // Two fp8 rollouts hold the version; a late fp8 rollout gets w as copies of their fp8 elements
  // and scales (nobody quantises), n in bf16.
  Problem p = CatchUpProblem({Fp8Block(128, 128), Fp8Block(128, 128)}, {Fp8Block(128, 128)});
  auto plan = MakePlanWithOptions(p, Strategy::kWeightBridge, CatchUp());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  EXPECT_TRUE(plan->stats.complete);
  for (const TransferOp* op : AllOps(*plan)) {
    EXPECT_EQ(op->sender_quantized, op->tensor == 0) << BoxToString(op->box);
    if (op->tensor == 0) {
      EXPECT_EQ(op->box.begin[0] % 128, 0);
    }
  }
  EXPECT_EQ(plan->stats.wire_bytes, 512 * 256 + 4 * 2 * 4 + 256 * 2);
  // Without the option a quantised source piece serves nothing quantised: the checker refuses
  // a plan that would read canonical bytes from it.
  PlanOptions both = CatchUp();
  both.sender_quantization = true;
  EXPECT_EQ(MakePlanWithOptions(p, Strategy::kWeightBridge, both).status().code(), absl::StatusCode::kInvalidArgument);
  auto wrong = MakePlan(p, Strategy::kWeightBridge);
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  EXPECT_FALSE(CheckPlanElementwise(p, *wrong, {}).ok());
}

TEST(PlannerTest, CatchUpServesOtherFormsFromUnquantisedSourcesOnly) {
  // A bf16 late rollout, and an mxfp8 one, with only fp8 sources: no source holds w in their form.
  for (const std::optional<Quantization>& late : {std::optional<Quantization>(), std::optional<Quantization>(Fp8Block(1, 32))}) {
    Problem p = CatchUpProblem({Fp8Block(128, 128)}, {late});
    auto plan = MakePlanWithOptions(p, Strategy::kWeightBridge, CatchUp());
    ASSERT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition) << plan.status();
    EXPECT_NE(plan.status().message().find("of tensor w in the canonical dtype"), std::string::npos) << plan.status();
    EXPECT_NE(plan.status().message().find("hold it only quantised"), std::string::npos) << plan.status();
  }
  // With a bf16 source too: late rollouts in three forms share w's fragments, which are then
  // canonical for all of them (one form per fragment), served by the bf16 source alone.
  Problem p = CatchUpProblem({Fp8Block(128, 128), std::nullopt}, {std::nullopt, Fp8Block(1, 32), Fp8Block(128, 128)});
  auto plan = MakePlanWithOptions(p, Strategy::kWeightBridge, CatchUp());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(CheckPlanElementwise(p, *plan, {}).ok()) << CheckPlanElementwise(p, *plan, {});
  for (const TransferOp* op : AllOps(*plan)) {
    EXPECT_FALSE(op->sender_quantized);
    if (op->tensor == 0 && p.workers[op->src_worker].role == Role::kTrainer) {
      EXPECT_EQ(op->src_worker, 1);
    }
  }
  // A late fp8 rollout alone: w copied from the fp8 source, n from either.
  Problem q = CatchUpProblem({std::nullopt, Fp8Block(128, 128)}, {Fp8Block(128, 128)});
  auto copy = MakePlanWithOptions(q, Strategy::kWeightBridge, CatchUp());
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_TRUE(CheckPlanElementwise(q, *copy, {}).ok()) << CheckPlanElementwise(q, *copy, {});
  int fp8_ops = 0;
  for (const TransferOp* op : AllOps(*copy)) {
    if (op->tensor != 0) continue;
    ++fp8_ops;
    EXPECT_TRUE(op->sender_quantized);
    EXPECT_EQ(op->src_worker, 1);
  }
  EXPECT_GT(fp8_ops, 0);
}

}  // namespace
}  // namespace wb::planner
