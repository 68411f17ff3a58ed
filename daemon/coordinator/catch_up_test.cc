// ChooseCatchUp (pure): which rollouts are late and which may serve as catch-up sources.
#include "daemon/coordinator/catch_up.h"

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

CatchUpCandidate Rollout(const std::string& id, uint64_t holds) {
  CatchUpCandidate c;
  c.id = id;
  c.node = "n0";
  c.rollout = true;
  c.has_layout = true;
  c.in_plan = true;
  c.holds = holds;
  return c;
}

TEST(ChooseCatchUpTest, LateRolloutsAndSources) {
  CatchUpCandidate trainer = Rollout("t0", 3);
  trainer.rollout = false;
  CatchUpCandidate no_layout = Rollout("r9", 0);
  no_layout.has_layout = false;
  CatchUpCandidate not_planned = Rollout("r8", 0);
  not_planned.in_plan = false;
  CatchUpCandidate ahead = Rollout("r7", 4);  // holds an uncommitted newer version: not a source
  CatchUpChoice c = ChooseCatchUp(3, {trainer, Rollout("r0", 3), Rollout("r1", 0), Rollout("r2", 2), no_layout, not_planned, ahead,
                                      Rollout("r3", 3)});
  EXPECT_EQ(c.sources, (std::vector<std::string>{"r0", "r3"}));
  EXPECT_EQ(c.dests, (std::vector<std::string>{"r1", "r2"}));
  EXPECT_TRUE(c.no_source.empty());
}

TEST(ChooseCatchUpTest, NothingBeforeTheFirstCommitOrWhenEveryoneHoldsIt) {
  EXPECT_TRUE(ChooseCatchUp(0, {Rollout("r0", 0), Rollout("r1", 0)}).dests.empty());
  CatchUpChoice c = ChooseCatchUp(2, {Rollout("r0", 2), Rollout("r1", 2)});
  EXPECT_TRUE(c.dests.empty());
  EXPECT_TRUE(c.no_source.empty());
}

TEST(ChooseCatchUpTest, FailedForThisVersionIsNotTriedAgain) {
  CatchUpCandidate failed = Rollout("r1", 0);
  failed.catch_up_failed = 2;
  EXPECT_TRUE(ChooseCatchUp(2, {Rollout("r0", 2), failed}).dests.empty());
  // The next committed version makes it late again.
  EXPECT_EQ(ChooseCatchUp(3, {Rollout("r0", 3), failed}).dests, (std::vector<std::string>{"r1"}));
}

TEST(ChooseCatchUpTest, NoSourceNamesWhoHoldsItAndWhyNotUsable) {
  CatchUpCandidate gpu = Rollout("r0", 2);
  gpu.host_memory = false;
  CatchUpCandidate fp8 = Rollout("r1", 2);
  fp8.quantized = true;
  CatchUpChoice c = ChooseCatchUp(2, {gpu, fp8, Rollout("r2", 0)});
  EXPECT_TRUE(c.sources.empty());
  EXPECT_EQ(c.dests, (std::vector<std::string>{"r2"}));
  EXPECT_NE(c.no_source.find("version 2"), std::string::npos) << c.no_source;
  EXPECT_NE(c.no_source.find("r0 (CUDA buffers)"), std::string::npos) << c.no_source;
  EXPECT_NE(c.no_source.find("r1 (quantised)"), std::string::npos) << c.no_source;
  c = ChooseCatchUp(2, {Rollout("r2", 0)});
  EXPECT_NE(c.no_source.find("no rollout holds it at all"), std::string::npos) << c.no_source;
}

}  // namespace
}  // namespace wb::daemon
