// Sync commits that the coordinator declares failed (docs/daemon.md "Commit across nodes (sync)";
// docs/status.md "Next steps" 11 (a)), on a coordinator + two node daemons in one process
// (daemon/multinode_fixture.h): an AbortVersion that reaches a node while its CommitVersion copies
// the version into live weights, and a node that acknowledged a commit that failed elsewhere.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/coordinator.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

using ::testing::Test;

constexpr absl::Duration kReal = absl::Seconds(20);  // real-time bound on every wait here

grpc::Status AbortOn(Server& node, uint64_t version, const std::string& reason) {
  auto stub = pb::NodeService::NewStub(grpc::CreateChannel(node.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  pb::AbortVersionRequest req;
  req.set_model_id("m");
  req.set_version(version);
  req.set_reason(reason);
  pb::AbortVersionResponse resp;
  return stub->AbortVersion(&ctx, req, &resp);
}

// The coordinator ran the node RPCs it had queued by now (the AbortVersion of a failed commit): a
// driver pass that began after now posted them to their lanes, and the lanes then ran dry.
void AwaitQueuedNodeRpcs(Cluster& c) {
  CoordinatorCore& core = c.coord_->coordinator()->core();
  ASSERT_TRUE(core.AwaitDriverPassAt(absl::Now(), absl::Now() + kReal));
  ASSERT_TRUE(core.AwaitNodeRpcsIdle(absl::Now() + kReal));
}

// Shuts the coordinator down while a node call of it is held (the test's hook waits on `release`):
// once Shutdown began (its waiting calls answered UNAVAILABLE), releases the call and waits for the
// shutdown to end. Returns what a waiting WaitVersion got.
absl::Status ShutDownReleasingHeldCall(Cluster& c, absl::Notification& release) {
  CoordinatorCore& old_core = c.coord_->coordinator()->core();
  std::thread stopper([&] { c.coord_->Shutdown(); });
  pb::WaitVersionRequest never;
  never.set_model_id("m");
  never.set_version(1000);
  never.set_timeout_ms(absl::ToInt64Milliseconds(kReal));
  pb::WaitVersionResponse never_resp;
  const absl::Status stopping = old_core.WaitVersion(never, &never_resp);  // ends when Shutdown began
  release.Notify();
  stopper.join();
  return stopping;
}

// A new coordinator process on the stopped one's port (the nodes find it there and re-join).
void RestartCoordinatorOnItsPort(Cluster& c) {
  const int port = c.coord_->port();
  c.coord_.reset();
  c.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
}

// An AbortVersion of version 2 reaches n0 while its CommitVersion(2) is copying it into r0's live
// weights (the copy is held at its start). The commit sees the abort before it advances n0's
// committed version: it answers ABORTED naming the abort, so the coordinator does not count
// version 2 as committed; r0's live weights hold version 2 whole (nothing torn), and version 3
// commits normally. Before: the execution had left the node's table before the copy, the abort
// found nothing, and the commit answered OK and committed version 2 on n0.
TEST(CommitAbortTest, AnAbortDuringTheSyncCommitsLiveCopyIsSeenByTheCommit) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  absl::Notification entered, release;
  std::atomic<bool> armed{true};
  const StopAtExit stop(c, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go
  auto [t0, t1, r0, r1] = StartTwoNodeCluster(c, inv, {.mode = pb::MODE_SYNC, .n0_live_copy_fault = [&](const std::string& label) {
                                                         if (label == "commit r0 v2" && armed.exchange(false)) {
                                                           entered.Notify();
                                                           release.WaitForNotificationWithTimeout(kReal);
                                                         }
                                                         return absl::OkStatus();
                                                       }});
  ASSERT_FALSE(Test::HasFailure());
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<grpc::Status> published;
  std::thread publisher([&] { published = c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1}); });
  const bool held = entered.WaitForNotificationWithTimeout(kReal);
  grpc::Status aborted = held ? AbortOn(*c.nodes_[0], 2, "test: aborted during the live copy") : grpc::Status::OK;
  release.Notify();
  publisher.join();
  ASSERT_TRUE(held) << "the commit's live copy into r0 never started";
  ASSERT_TRUE(aborted.ok()) << aborted.error_message();
  for (const grpc::Status& s : published) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    EXPECT_NE(s.error_message().find("not committed"), std::string::npos) << s.error_message();
  }
  const pb::VersionStatus v2 = c.FinalVersion(2);
  EXPECT_EQ(v2.state(), "aborted");
  for (const char* want : {"node n0", "aborted during its live copy", "test: aborted during the live copy"}) {
    EXPECT_NE(v2.error().find(want), std::string::npos) << want << " missing in: " << v2.error();
  }
  EXPECT_EQ(CommittedOf(c.Status(r1), "m"), 1u);
  // The copy itself ran to its end: whole, not torn (the next version rewrites it anyway).
  EXPECT_EQ(LocalStatus(c, r0).live_state(), "whole");
  EXPECT_EQ(CountBad(r0, 2), 0);
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  EXPECT_EQ(CommittedOf(c.Status(r1), "m"), 3u);
  c.Stop();
}

// Version 2's sync commit fails on n0 (its live copy into r0 fails) while n1 acknowledged it. The
// coordinator tells both nodes it was aborted; n1 rolls its committed version back to 1. The
// coordinator then restarts: the nodes re-join with what they committed, and the new coordinator's
// committed version is 1, not 2 - version 2, answered ABORTED to the trainers, never comes back as
// committed (nor is it caught up to other rollouts). Version 3 then commits everywhere. Before:
// n1 re-joined with committed version 2 and the coordinator restored it (max over the nodes).
//
// Version 2 published again after the restart (a trainer retrying its step number; the new
// coordinator never saw version 2) is refused ABORTED: r1 re-joined holding version 2 above the
// committed version, so the coordinator counts the number as used (and the nodes remember the
// abort), so it never comes to name other bytes.
TEST(CommitAbortTest, AFailedSyncCommitIsNotRestoredAsCommittedAfterACoordinatorRestart) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  auto faults = std::make_shared<std::atomic<int>>(1);
  auto [t0, t1, r0, r1] = StartTwoNodeCluster(c, inv, {.mode = pb::MODE_SYNC, .n0_live_copy_fault = [faults](const std::string& l) {
                                                         return l == "commit r0 v2" && faults->fetch_sub(1) > 0
                                                                    ? absl::UnavailableError("injected transport failure")
                                                                    : absl::OkStatus();
                                                       }});
  ASSERT_FALSE(Test::HasFailure());
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1})) EXPECT_FALSE(s.ok());
  const pb::VersionStatus v2 = c.FinalVersion(2);
  EXPECT_EQ(v2.state(), "aborted");
  EXPECT_NE(v2.error().find("nodes n1 hold it"), std::string::npos) << v2.error();
  EXPECT_EQ(CountBad(r1, 2), 0) << "r1's node committed version 2 into r1's live weights";
  AwaitQueuedNodeRpcs(c);  // the AbortVersion of version 2 reached both nodes
  ASSERT_FALSE(Test::HasFatalFailure());
  const int port = c.coord_->port();
  c.coord_->Shutdown();
  c.coord_.reset();
  c.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
  ASSERT_FALSE(Test::HasFatalFailure());
  // Every worker is back (re-joined by its node, each JoinWorker before its layout).
  auto back = c.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        int with_layout = 0;
        for (const pb::WorkerStatus& ws : st.workers()) with_layout += ws.has_layout();
        return with_layout == 4;
      },
      kReal);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(CommittedOf(*back, "m"), 1u) << "version 2, whose commit failed, came back as committed after the restart";
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1})) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    EXPECT_NE(s.error_message().find("its number is used: rollout r1 on node n1"), std::string::npos) << s.error_message();
  }
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  c.Stop();
}

// Version 2's sync commit fails on n0 (its live copy into r0 fails midway: TORN) while n1 commits
// it into r1's live weights and acknowledges. The coordinator declares version 2 failed and queues
// its AbortVersion to both nodes, but it is shut down first (its driver exits before sending
// queued node RPCs), so n1 never hears of the failure: it keeps version 2 as committed. A new
// coordinator starts on the same port and the nodes re-join. Version 2 was never committed
// cluster-wide (the trainers' Publish answered ABORTED), and no node was ever told it was: n1 rolls
// it back at its re-join (as the lost AbortVersion would have), so the new coordinator's committed
// version is 1, WaitVersion(2) answers ABORTED, r0 is not caught up to version 2 from r1 (it stays
// TORN until the next version), version 2 published again is refused ABORTED (the number is used:
// r1 holds it) and version 3 reaches both rollouts whole. Before: n1 re-joined with committed
// version 2, the coordinator restored it (max over the nodes), WaitVersion(2) answered OK and r0
// was caught up to version 2 from r1's live weights.
TEST(CommitAbortTest, AFailedSyncCommitWhoseAbortWasLostIsNotRestoredAfterACoordinatorRestart) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  absl::Notification entered, release;
  std::atomic<bool> armed{true};
  const StopAtExit stop(c, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go
  auto [t0, t1, r0, r1] = StartTwoNodeCluster(c, inv, {.mode = pb::MODE_SYNC, .n0_live_copy_fault = [&](const std::string& label) {
                                                         if (label != "commit r0 v2" || !armed.exchange(false)) return absl::OkStatus();
                                                         entered.Notify();
                                                         release.WaitForNotificationWithTimeout(kReal);
                                                         return absl::UnavailableError("injected transport failure");
                                                       }});
  ASSERT_FALSE(Test::HasFailure());
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<grpc::Status> published;
  std::thread publisher([&] { published = c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1}); });
  const JoinAtExit join_publisher(c, publisher, [&] { NotifyOnce(release); });  // also when an ASSERT below returns
  const bool held = entered.WaitForNotificationWithTimeout(kReal);
  // The coordinator stops while n0's commit is held: its commit call, waiting for that answer, then
  // declares version 2 failed and the coordinator exits without sending the AbortVersions it queued.
  const absl::Status stopping = ShutDownReleasingHeldCall(c, release);
  ASSERT_TRUE(held) << "n0's commit of version 2 never started its live copy";
  ASSERT_TRUE(absl::IsUnavailable(stopping)) << stopping;
  EXPECT_EQ(CountBad(r1, 2), 0) << "n1 did not commit version 2 into r1's live weights";
  ASSERT_NO_FATAL_FAILURE(RestartCoordinatorOnItsPort(c));
  publisher.join();
  for (const grpc::Status& s : published) EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  ASSERT_TRUE(c.coord_->coordinator()->core().AwaitPlanInstalled("m", absl::Now() + kReal)) << "no plan after the restart";
  const pb::StatusResponse back = c.Status(r1);
  EXPECT_EQ(CommittedOf(back, "m"), 1u) << "version 2, never committed cluster-wide, came back as committed after the restart";
  for (const pb::WorkerStatus& ws : back.workers()) EXPECT_FALSE(ws.catching_up()) << ws.worker_id() << " is caught up";
  for (TestWorker* r : {&r0, &r1}) {
    pb::WaitVersionResponse wr;
    grpc::Status s = WaitVersionAs(*r, "m", 2, 10000, &wr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << r->id << ": " << s.error_message();
    EXPECT_NE(s.error_message().find("its number is used"), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(LocalStatus(c, r0).live_state(), "torn");
  EXPECT_GT(CountBad(r0, 2), 0) << "r0 was caught up to version 2, which was never committed";
  EXPECT_EQ(CountBad(r1, 2), 0);
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1})) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    EXPECT_NE(s.error_message().find("its number is used: rollout r1 on node n1"), std::string::npos) << s.error_message();
  }
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  EXPECT_EQ(LocalStatus(c, r0).live_state(), "whole");
  EXPECT_EQ(CommittedOf(c.Status(r1), "m"), 3u);
  c.Stop();
}

// The other side of the test above: a sync version committed cluster-wide is kept over a
// coordinator restart although n1, which holds only rollout r1, was never told so (the restart
// comes right after the commit, before r1's next BeginUpdate or WaitVersion): n1 rolls its commit
// of version 1 back at the re-join, but n0 was told (its trainers' Publish answered OK), so the new
// coordinator's committed version is 1, both rollouts count as holding it (WaitVersion(1) OK, no
// catch-up) and version 2 then commits everywhere.
TEST(CommitAbortTest, ASyncCommitConfirmedToOneNodeIsKeptOverACoordinatorRestart) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  ASSERT_FALSE(Test::HasFatalFailure());
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& t1 = c.AddWorker("t1", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {4, 0}, {8, 16}, false}}));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}, {1, {0, 0}, {4, 6}, true}}));
  const pb::ModelSpec spec = SmallSpec(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  const int port = c.coord_->port();
  c.coord_->Shutdown();
  c.coord_.reset();
  c.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
  ASSERT_FALSE(Test::HasFatalFailure());
  ASSERT_TRUE(c.coord_->coordinator()->core().AwaitPlanInstalled("m", absl::Now() + kReal)) << "no plan after the restart";
  const pb::StatusResponse back = c.Status(r1);
  EXPECT_EQ(CommittedOf(back, "m"), 1u) << "version 1, committed on every node and answered OK, was lost over the restart";
  for (const pb::WorkerStatus& ws : back.workers()) EXPECT_FALSE(ws.catching_up()) << ws.worker_id() << " is caught up";
  for (TestWorker* r : {&r0, &r1}) {
    pb::WaitVersionResponse wr;
    grpc::Status s = WaitVersionAs(*r, "m", 1, 10000, &wr);
    EXPECT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  c.Stop();
}

// r1 resumes (EndUpdate) while version 2 is held on n1 before a bucket, so n1's commit makes
// version 2 r1's committed copy instead of writing its live weights; the commit fails on n0 and the
// coordinator aborts version 2 everywhere. n1 drops r1's copy of it with the rollback: r1's next
// BeginUpdate leaves its live weights at version 1 (before: it copied the aborted version 2 in), and
// version 3 then reaches both rollouts whole.
TEST(CommitAbortTest, AResumedRolloutDropsItsCopyOfAFailedSyncCommit) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  auto faults = std::make_shared<std::atomic<int>>(1);
  absl::Notification entered, release;
  std::atomic<bool> armed{false};
  const StopAtExit stop(c, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go
  TwoNodeSetup setup{.mode = pb::MODE_SYNC, .n0_live_copy_fault = [faults](const std::string& l) {
                       return l == "commit r0 v2" && faults->fetch_sub(1) > 0 ? absl::UnavailableError("injected transport failure")
                                                                              : absl::OkStatus();
                     }};
  setup.n1_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 2 || !armed.exchange(false)) return;
    entered.Notify();
    release.WaitForNotificationWithTimeout(kReal);
  };
  auto [t0, t1, r0, r1] = StartTwoNodeCluster(c, inv, setup);
  ASSERT_FALSE(Test::HasFailure());
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(CountBad(r1, 1), 0);
  armed = true;
  std::vector<grpc::Status> published;
  std::thread publisher([&] { published = c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r0, &r1}); });
  const bool held = entered.WaitForNotificationWithTimeout(kReal);
  pb::EndUpdateResponse ended_resp;
  grpc::Status ended = held ? EndUpdateAs(r1, 10000, &ended_resp) : grpc::Status::OK;
  release.Notify();
  publisher.join();
  ASSERT_TRUE(held) << "version 2 never ran on n1";
  ASSERT_TRUE(ended.ok()) << ended.error_message();
  for (const grpc::Status& s : published) EXPECT_FALSE(s.ok());
  EXPECT_EQ(c.FinalVersion(2).state(), "aborted");
  AwaitQueuedNodeRpcs(c);  // the AbortVersion of version 2 reached both nodes
  ASSERT_FALSE(Test::HasFatalFailure());
  EXPECT_EQ(CountBad(r1, 1), 0) << "the commit wrote the live weights of resumed r1";
  grpc::Status begun = BeginUpdateAs(r1, 10000);
  EXPECT_TRUE(begun.ok()) << begun.error_message();
  EXPECT_EQ(CountBad(r1, 1), 0) << "BeginUpdate copied the aborted version 2 into r1's live weights";
  EXPECT_GT(CountBad(r1, 2), 0);
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  c.Stop();
}

// A sync version committed only on a node without rollouts (the trainers' n0) when the coordinator
// dies - n1's commit into r1 is held, and fails after the old coordinator began to shut down - is
// rolled back on n0 at its re-join. The trainers' Publish, answered UNAVAILABLE by the dying
// coordinator, is sent again to the new one (docs/daemon.md "Coordinator restart"), which runs the
// version again: n0 takes its new ExecuteVersion, version 2 commits and reaches r1 whole. Before,
// n0's rollback recorded version 2 aborted and refused it ("... rolled back at the re-join"; chaos
// seed 1002, v34): the trainers' Publish(2) was answered ABORTED.
TEST(CommitAbortTest, AVersionRolledBackOnTheTrainersNodeAtItsReJoinRunsAgain) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  absl::Notification entered, release;
  std::atomic<bool> armed{true};
  const StopAtExit stop(c, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1, nullptr, nullptr, [&](ServerOptions& o) {
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_live_copy_fault = [&](const std::string& label) {
        if (label != "commit r1 v2" || !armed.exchange(false)) return absl::OkStatus();
        entered.Notify();
        release.WaitForNotificationWithTimeout(kReal);
        return absl::UnavailableError("injected transport failure");
      };
    };
  });
  ASSERT_FALSE(Test::HasFatalFailure());
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& t1 = c.AddWorker("t1", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {4, 0}, {8, 16}, false}}));
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}, {1, {0, 0}, {4, 6}, true}}));
  const pb::ModelSpec spec = SpecOf(inv, pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE, 2, 1);
  for (TestWorker* w : {&t0, &t1, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 1, {&t0, &t1}, {&r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<grpc::Status> published;
  std::thread publisher([&] { published = c.Publish("m", pb::MODE_SYNC, 2, {&t0, &t1}, {&r1}); });
  const JoinAtExit join_publisher(c, publisher, [&] { NotifyOnce(release); });  // also when an ASSERT below returns
  const bool held = entered.WaitForNotificationWithTimeout(kReal);
  // The coordinator stops while n1's commit is held: the trainers' Publish calls end UNAVAILABLE
  // when its Shutdown begins, before the commit fails (n0 committed version 2 by then).
  const absl::Status stopping = ShutDownReleasingHeldCall(c, release);
  ASSERT_TRUE(held) << "n1's commit of version 2 never started its live copy";
  ASSERT_TRUE(absl::IsUnavailable(stopping)) << stopping;
  ASSERT_NO_FATAL_FAILURE(RestartCoordinatorOnItsPort(c));
  // The new coordinator does not know r1 paused (sync pauses are not rebuilt): a rollout engine
  // pauses again once its wait for version 2 failed at the restart.
  ASSERT_TRUE(c.coord_->coordinator()->core().AwaitPlanInstalled("m", absl::Now() + kReal)) << "no plan after the restart";
  grpc::Status paused = BeginUpdateAs(r1, 10000);
  publisher.join();
  ASSERT_TRUE(paused.ok()) << paused.error_message();
  for (const grpc::Status& s : published) EXPECT_TRUE(s.ok()) << "publish of version 2 after the restart: " << s.error_message();
  EXPECT_EQ(CountBad(r1, 2), 0) << "version 2 did not reach r1 whole";
  EXPECT_EQ(CommittedOf(c.Status(r1), "m"), 2u);
  for (auto& s : c.Publish("m", pb::MODE_SYNC, 3, {&t0, &t1}, {&r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r1, 3), 0);
  c.Stop();
}

}  // namespace
}  // namespace wb::daemon
