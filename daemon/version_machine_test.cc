#include "daemon/version_machine.h"

#include "gtest/gtest.h"
#include "base/clock.h"

namespace wb::daemon {
namespace {

VersionMachine Make(ModeKind mode, uint32_t k = 0) {
  VersionMachine m(mode, k);
  m.SetTrainers({"t0", "t1"});
  m.SetRollouts({"r0", "r1"});
  return m;
}

TEST(VersionMachineTest, SyncWaitsForEveryTrainerAndPausedRollout) {
  FakeClock clock;
  VersionMachine m = Make(ModeKind::kSync);
  ASSERT_TRUE(m.RecordPublish("t0", 1).ok());
  EXPECT_FALSE(m.NextToStart());
  ASSERT_TRUE(m.RecordPublish("t1", 1).ok());
  EXPECT_FALSE(m.NextToStart());  // rollouts not paused
  m.RecordReady("r0");
  EXPECT_FALSE(m.NextToStart());
  m.RecordReady("r1");
  ASSERT_EQ(m.NextToStart(), 1u);
  m.Start(1, {"a", "b"}, clock.Now(), absl::Seconds(5), 100);
  EXPECT_FALSE(m.Outcome(1));
  EXPECT_FALSE(m.NodeDone("a", 1));
  EXPECT_TRUE(m.NodeDone("b", 1));
  m.Commit(1, clock.Now());
  ASSERT_TRUE(m.Outcome(1));
  EXPECT_TRUE(m.Outcome(1)->ok());
  EXPECT_EQ(m.Applied("r0"), 1u);
  EXPECT_FALSE(m.IsPaused("r0"));
  EXPECT_FALSE(m.RecordPublish("t0", 1).ok() && m.Find(1)->state != VState::kCommitted);
}

// A paused rollout that resumed with no commit taking its pause (ReportReadyRequest.resumed) is
// waited for again before the next version starts; a version already started records no apply
// for it at its commit (its live weights were not written).
TEST(VersionMachineTest, SyncResumedRolloutIsWaitedForAgain) {
  FakeClock clock;
  VersionMachine m = Make(ModeKind::kSync);
  m.RecordReady("r0");
  m.RecordReady("r1");
  m.RecordResumed("r0");
  EXPECT_FALSE(m.IsPaused("r0"));
  ASSERT_TRUE(m.RecordPublish("t0", 1).ok());
  ASSERT_TRUE(m.RecordPublish("t1", 1).ok());
  EXPECT_FALSE(m.NextToStart()) << "started while r0 runs";
  m.RecordReady("r0");
  ASSERT_EQ(m.NextToStart(), 1u);
  m.Start(1, {"a"}, clock.Now(), absl::Seconds(5), 100);
  m.RecordResumed("r1");  // resumed after the version started: it goes on
  EXPECT_TRUE(m.NodeDone("a", 1));
  m.Commit(1, clock.Now());
  EXPECT_EQ(m.Applied("r0"), 1u);
  EXPECT_EQ(m.Applied("r1"), 0u);
}

TEST(VersionMachineTest, TimeoutAbortKeepsPreviousCommitted) {
  FakeClock clock;
  VersionMachine m = Make(ModeKind::kOneStepOff);
  for (uint64_t v : {1u, 2u}) {
    ASSERT_TRUE(m.RecordPublish("t0", v).ok());
    ASSERT_TRUE(m.RecordPublish("t1", v).ok());
    ASSERT_EQ(m.NextToStart(), v);
    m.Start(v, {"a"}, clock.Now(), absl::Seconds(5), 10);
    if (v == 1) {
      ASSERT_TRUE(m.NodeDone("a", 1));
      m.Commit(1, clock.Now());
    }
  }
  clock.Advance(absl::Seconds(4));
  EXPECT_FALSE(m.TimedOut(clock.Now()));
  clock.Advance(absl::Seconds(2));
  ASSERT_EQ(m.TimedOut(clock.Now()), 2u);
  m.Abort(2, "transfer timed out", clock.Now());
  EXPECT_EQ(m.committed(), 1u);
  ASSERT_TRUE(m.Outcome(2));
  EXPECT_EQ(m.Outcome(2)->code(), absl::StatusCode::kAborted);
  EXPECT_NE(m.Outcome(2)->message().find("timed out"), std::string::npos);
  EXPECT_TRUE(m.Outcome(1)->ok());
  EXPECT_TRUE(m.Idle());
  // A late done from the aborted transfer changes nothing; the next version proceeds.
  EXPECT_FALSE(m.NodeDone("a", 2));
  ASSERT_TRUE(m.RecordPublish("t0", 3).ok());
  ASSERT_TRUE(m.RecordPublish("t1", 3).ok());
  EXPECT_EQ(m.NextToStart(), 3u);
}

TEST(VersionMachineTest, NewerPublishSupersedesUnstartedOlder) {
  FakeClock clock;
  VersionMachine m = Make(ModeKind::kAsync);
  for (const char* t : {"t0", "t1"}) ASSERT_TRUE(m.RecordPublish(t, 1).ok());
  m.Start(1, {"a"}, clock.Now(), absl::Seconds(5), 1);
  for (const char* t : {"t0", "t1"}) ASSERT_TRUE(m.RecordPublish(t, 2).ok());
  for (const char* t : {"t0", "t1"}) ASSERT_TRUE(m.RecordPublish(t, 3).ok());
  EXPECT_EQ(m.Find(2)->state, VState::kSuperseded);
  EXPECT_FALSE(m.NextToStart());  // one transfer at a time
  ASSERT_TRUE(m.NodeDone("a", 1));
  m.Commit(1, clock.Now());
  EXPECT_EQ(m.NextToStart(), 3u);
  m.Start(3, {"a"}, clock.Now(), absl::Seconds(5), 1);
  EXPECT_FALSE(m.Outcome(2));  // satisfied only by a newer commit
  ASSERT_TRUE(m.NodeDone("a", 3));
  m.Commit(3, clock.Now());
  EXPECT_TRUE(m.Outcome(2)->ok());
}

TEST(VersionMachineTest, StalenessBoundHoldsPublish) {
  VersionMachine m = Make(ModeKind::kAsync, /*k=*/2);
  EXPECT_TRUE(m.PublishAdmissible(1));
  EXPECT_TRUE(m.PublishAdmissible(2));
  EXPECT_FALSE(m.PublishAdmissible(3));  // r0, r1 applied nothing: 3 - 0 > 2
  m.RecordApplied("r0", 1);
  EXPECT_FALSE(m.PublishAdmissible(3));  // r1 still behind
  m.RecordApplied("r1", 2);
  EXPECT_TRUE(m.PublishAdmissible(3));
  EXPECT_FALSE(m.PublishAdmissible(4));
  // Unbounded (k = 0) and non-async modes never hold.
  VersionMachine u = Make(ModeKind::kAsync, 0);
  EXPECT_TRUE(u.PublishAdmissible(100));
  VersionMachine o = Make(ModeKind::kOneStepOff, 1);
  EXPECT_TRUE(o.PublishAdmissible(100));
}

TEST(VersionMachineTest, DrainRefusesNewVersionsButFinishesStarted) {
  FakeClock clock;
  VersionMachine m = Make(ModeKind::kOneStepOff);
  ASSERT_TRUE(m.RecordPublish("t0", 1).ok());
  m.set_draining(true);
  EXPECT_TRUE(m.RecordPublish("t1", 1).ok());  // already being published: allowed to finish
  EXPECT_EQ(m.RecordPublish("t0", 2).code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(m.Idle());
  m.Start(1, {"a"}, clock.Now(), absl::Seconds(1), 1);
  ASSERT_TRUE(m.NodeDone("a", 1));
  m.Commit(1, clock.Now());
  EXPECT_TRUE(m.Idle());
}

TEST(VersionMachineTest, RejectsOldVersionsAndStrangers) {
  VersionMachine m = Make(ModeKind::kSync);
  EXPECT_EQ(m.RecordPublish("r0", 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.RecordPublish("t0", 0).code(), absl::StatusCode::kInvalidArgument);
  FakeClock clock;
  for (const char* t : {"t0", "t1"}) ASSERT_TRUE(m.RecordPublish(t, 5).ok());
  m.RecordReady("r0");
  m.RecordReady("r1");
  m.Start(5, {"a"}, clock.Now(), absl::Seconds(1), 1);
  EXPECT_EQ(m.RecordPublish("t0", 4).code(), absl::StatusCode::kFailedPrecondition);
  // Lost node: the coordinator aborts; paused rollouts are released (must pause again).
  EXPECT_TRUE(m.InFlightInvolves("a"));
  m.Abort(5, "node a lost its lease", clock.Now());
  EXPECT_FALSE(m.IsPaused("r0"));
  EXPECT_EQ(m.committed(), 0u);
}

// Issue 15.15: one huge version (2^64 - 1) must not block every later version.
TEST(VersionMachineTest, RefusesVersionsThatWouldBlockEveryLaterOne) {
  VersionMachine m = Make(ModeKind::kAsync);
  absl::Status s = m.RecordPublish("t0", ~uint64_t{0});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("18446744073709551615"), std::string::npos) << s;
  EXPECT_NE(s.message().find("9007199254740991"), std::string::npos) << s;
  s = m.RecordPublish("t0", (uint64_t{1} << 32) + 2);  // a jump of more than 2^32 from 0
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("4294967296"), std::string::npos) << s;
  EXPECT_EQ(m.Find(~uint64_t{0}), nullptr) << "a refused version left a record";
  // Later, ordinary versions still go through.
  ASSERT_TRUE(m.RecordPublish("t0", 7).ok());
  ASSERT_TRUE(m.RecordPublish("t1", 7).ok());
  EXPECT_EQ(m.NextToStart(), 7u);
  EXPECT_TRUE(m.RecordPublish("t0", 7 + (uint64_t{1} << 32)).ok()) << "a jump of exactly 2^32 is allowed";
}

// Sync commit that some nodes did not acknowledge: the version is not committed (waiters see
// which nodes and rollouts do not hold it), rollouts that do hold it count as having applied it,
// and the version number is used up (the next version must be newer).
TEST(VersionMachineTest, CommitFailedIsNotCommitted) {
  FakeClock clock;
  VersionMachine m = Make(ModeKind::kSync);
  ASSERT_TRUE(m.RecordPublish("t0", 1).ok());
  ASSERT_TRUE(m.RecordPublish("t1", 1).ok());
  m.RecordReady("r0");
  m.RecordReady("r1");
  ASSERT_EQ(m.NextToStart(), 1u);
  m.Start(1, {"a", "b"}, clock.Now(), absl::Seconds(5), 100);
  ASSERT_FALSE(m.NodeDone("a", 1));
  ASSERT_TRUE(m.NodeDone("b", 1));
  m.CommitFailed(1, "commit failed on node b (rollouts r1): copy failed", {"r0"}, clock.Now());
  EXPECT_EQ(m.committed(), 0u);
  ASSERT_TRUE(m.Outcome(1));
  EXPECT_EQ(m.Outcome(1)->code(), absl::StatusCode::kAborted);
  EXPECT_NE(m.Outcome(1)->message().find("node b (rollouts r1)"), std::string::npos) << *m.Outcome(1);
  EXPECT_EQ(m.Applied("r0"), 1u);
  EXPECT_EQ(m.Applied("r1"), 0u);
  EXPECT_FALSE(m.IsPaused("r0"));
  EXPECT_FALSE(m.InFlight());
  EXPECT_FALSE(m.RecordPublish("t0", 1).ok());
  EXPECT_TRUE(m.RecordPublish("t0", 2).ok());
}

// Trainers publish in order: once t0 published 2 without 1, a 1 published by t1 afterwards (a
// Publish re-sent after a coordinator restart) can never be published by every trainer.
TEST(VersionMachineTest, PublishedPastWithoutNamesTheRankAlreadyPastTheVersion) {
  VersionMachine m = Make(ModeKind::kSync);
  ASSERT_TRUE(m.RecordPublish("t0", 2).ok());
  ASSERT_TRUE(m.RecordPublish("t1", 1).ok());
  EXPECT_EQ(m.PublishedPastWithout("t1", 1), "t0");
  EXPECT_EQ(m.PublishedPastWithout("t0", 2), "") << "nobody is past 2";
  ASSERT_TRUE(m.RecordPublish("t0", 3).ok());
  ASSERT_TRUE(m.RecordPublish("t1", 3).ok());
  EXPECT_EQ(m.PublishedPastWithout("t1", 3), "");
  // t0 published 4 after t1's 4 was recorded: t0 is in 4's published_by, not past it.
  ASSERT_TRUE(m.RecordPublish("t1", 4).ok());
  ASSERT_TRUE(m.RecordPublish("t0", 4).ok());
  ASSERT_TRUE(m.RecordPublish("t0", 5).ok());
  EXPECT_EQ(m.PublishedPastWithout("t1", 4), "");
}

}  // namespace
}  // namespace wb::daemon
