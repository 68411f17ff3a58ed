#include <gtest/gtest.h>

#include "bench/rl_sim.h"

namespace wb::bench {
namespace {

SimParams Params(double x, bool blocking) {
  SimParams p;
  p.train_s = 10;
  p.rollout_s = 20;
  p.transfer_s = x;
  p.blocking = blocking;
  p.snapshot_s = blocking ? 0 : 0.1;
  p.apply_s = blocking ? 0 : 0.2;
  p.steps = 40;
  return p;
}

TEST(RlSim, SyncStallsBothSidesForTheTransfer) {
  SimResult r = SimulateLoop(SimMode::kSync, Params(3, true));
  EXPECT_DOUBLE_EQ(r.trainer_stall_s, 3);
  EXPECT_DOUBLE_EQ(r.rollout_stall_s, 3);
  EXPECT_DOUBLE_EQ(r.step_s, 33);
}

TEST(RlSim, BlockingOneStepOffStallsBothSides) {
  SimResult r = SimulateLoop(SimMode::kOneStepOff, Params(3, true));
  EXPECT_DOUBLE_EQ(r.trainer_stall_s, 3);
  EXPECT_DOUBLE_EQ(r.rollout_stall_s, 3);
}

TEST(RlSim, NonBlockingOneStepOffHidesAShortTransfer) {
  // The transfer (3 s) finishes long before the rollout's next boundary: only copies stall.
  SimResult r = SimulateLoop(SimMode::kOneStepOff, Params(3, false));
  EXPECT_NEAR(r.trainer_stall_s, 0.1, 1e-9);
  EXPECT_NEAR(r.rollout_stall_s, 0.2, 1e-9);
}

TEST(RlSim, NonBlockingOneStepOffWaitsForALongTransfer) {
  // A 50 s transfer cannot hide behind 20 s of generation: the rollout waits for it.
  SimResult r = SimulateLoop(SimMode::kOneStepOff, Params(50, false));
  EXPECT_GT(r.rollout_stall_s, 20);
}

TEST(RlSim, AsyncNonBlockingAppliesAtMostOncePerBatch) {
  SimResult r = SimulateLoop(SimMode::kAsync, Params(3, false));
  EXPECT_LE(r.versions_applied, 40);
  EXPECT_GT(r.versions_applied, 0);
  EXPECT_NEAR(r.trainer_stall_s, 0.1, 1e-9);
  EXPECT_LE(r.rollout_stall_s, 0.2 + 1e-9);
}

TEST(RlSim, AsyncBlockingInterruptsGeneration) {
  SimResult b = SimulateLoop(SimMode::kAsync, Params(3, true));
  SimResult n = SimulateLoop(SimMode::kAsync, Params(3, false));
  EXPECT_DOUBLE_EQ(b.rollout_stall_s, 3);
  EXPECT_GT(b.step_s, n.step_s);
}

}  // namespace
}  // namespace wb::bench
