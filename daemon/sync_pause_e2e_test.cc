// A sync rollout that never pauses (docs/daemon.md "Rollouts that never pause"), end to end with
// real daemons (coordinator + 2 nodes, shm workers, host_shm / host_tcp): an extra rollout joins the
// model with memory of its own and never calls BeginUpdate. Past the coordinator's sync pause
// timeout it is left out; the trainers' versions commit for the well-behaved rollouts byte for byte
// within the timeout and a few seconds, never writing its memory; once it calls BeginUpdate it is
// caught up to the committed version byte for byte before its WaitVersion answers, and takes part
// in the next version. The same with the trainers gone by then (their processes exited after the
// last publish): the left-out rollout is caught up from its peers all the same, and trainers coming
// back while that catch-up runs wait for it.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/metrics.h"
#include "daemon/metrics_scrape.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kPauseTimeout = absl::Seconds(2);

double LeftOutEvents(int port) {
  auto m = ScrapeMetrics(port, absl::Seconds(10));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? MetricSum(*m, "wb_versions_total", "event=\"rollout_left_out\"") : -1;
}

bool AllZero(const TestWorker& w) {
  const uint8_t* bytes = static_cast<const uint8_t*>(w.seg.data());
  return std::all_of(bytes, bytes + w.seg.size(), [](uint8_t b) { return b == 0; });
}

TEST(SyncPauseE2eTest, ARolloutThatNeverPausesIsLeftOutThenCaughtUpAtItsBeginUpdate) {
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  const double left_out_before = LeftOutEvents(port);
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [](ServerOptions& o) { o.sync_pause_timeout = kPauseTimeout; });
  c.StartNode(0);
  c.StartNode(1);
  ASSERT_FALSE(HasFatalFailure());
  const pb::ModelSpec spec = SmallSpec(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = AddTwoNodeWorkers(c, inv);
  for (TestWorker* x : {&w.t0, &w.t1, &w.r0, &w.r1}) ASSERT_TRUE(c.Register(*x, spec).ok()) << x->id;
  // The extra rollout: joins with its own memory (the spec repeated), never pauses.
  TestWorker& r2 = c.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv,
                               LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  ASSERT_TRUE(c.Register(r2, spec).ok());
  for (uint64_t v : {1u, 2u}) {
    const absl::Time start = absl::Now();
    for (grpc::Status& s : c.Publish("m", pb::MODE_SYNC, v, {&w.t0, &w.t1}, {&w.r0, &w.r1})) {
      ASSERT_TRUE(s.ok()) << "publish v" << v << ": " << s.error_message();
    }
    const absl::Duration took = absl::Now() - start;
    EXPECT_LT(took, kPauseTimeout + absl::Seconds(8)) << "version " << v << " waited for the rollout that never pauses";
    for (TestWorker* r : {&w.r0, &w.r1}) {
      pb::WaitVersionResponse resp;
      grpc::Status s = WaitVersionAs(*r, "m", v, 10000, &resp);
      ASSERT_TRUE(s.ok()) << r->id << " v" << v << ": " << s.error_message();
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
    EXPECT_TRUE(AllZero(r2)) << "version " << v << " wrote the memory of the left-out rollout";
  }
  // Left out once (version 1), and shown so with the reason; version 2 did not wait for it.
  auto st = c.WaitForCoordinator([](const pb::StatusResponse& s) {
    for (const pb::WorkerStatus& ws : s.workers()) {
      if (ws.worker_id() == "r2") return ws.left_out();
    }
    return false;
  }, absl::Seconds(10));
  ASSERT_TRUE(st.ok()) << "r2 is not shown left out: " << st.status();
  for (const pb::WorkerStatus& ws : st->workers()) {
    if (ws.worker_id() != "r2") continue;
    EXPECT_NE(ws.left_out_reason().find("version 1"), std::string::npos) << ws.left_out_reason();
  }
  EXPECT_EQ(LeftOutEvents(port) - left_out_before, 1);
  // Its WaitVersion for the version it missed does not report a version it does not hold.
  {
    pb::WaitVersionResponse resp;
    grpc::Status s = WaitVersionAs(r2, "m", 2, 500, &resp);
    EXPECT_FALSE(s.ok()) << "r2 was told version 2 while left out";
    EXPECT_TRUE(AllZero(r2));
  }
  // It pauses: back in the plan, caught up to version 2 byte for byte before its wait answers.
  ASSERT_TRUE(BeginUpdateAs(r2, 10000).ok());
  {
    pb::WaitVersionResponse resp;
    grpc::Status s = WaitVersionAs(r2, "m", 2, 20000, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(CountBad(r2, 2), 0) << "r2 was answered before it held version 2";
  }
  // Version 3 reaches all three rollouts.
  for (grpc::Status& s : c.Publish("m", pb::MODE_SYNC, 3, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2})) {
    ASSERT_TRUE(s.ok()) << "publish v3: " << s.error_message();
  }
  for (TestWorker* r : {&w.r0, &w.r1, &r2}) {
    pb::WaitVersionResponse resp;
    ASSERT_TRUE(WaitVersionAs(*r, "m", 3, 10000, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  }
  EXPECT_EQ(LeftOutEvents(port) - left_out_before, 1) << "r2 was left out again after it paused";
  c.Stop();
}


// Trainers t0, t1 and rollouts r0 (n0), r1 (n1); the extra rollout r2 (n1) never pauses, so version
// 1 commits without it (left out). Then the trainers exit (Deregister, as their node sends when
// their processes end). Returns r2.
TestWorker& LeftOutThenTrainersGone(Cluster& c, const planner::Inventory& inv, const pb::ModelSpec& spec, TwoNodeWorkers& w) {
  for (TestWorker* x : {&w.t0, &w.t1, &w.r0, &w.r1}) EXPECT_TRUE(c.Register(*x, spec).ok()) << x->id;
  TestWorker& r2 = c.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv,
                               LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  EXPECT_TRUE(c.Register(r2, spec).ok());
  for (grpc::Status& s : c.Publish("m", pb::MODE_SYNC, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) {
    EXPECT_TRUE(s.ok()) << "publish v1: " << s.error_message();
  }
  for (TestWorker* r : {&w.r0, &w.r1}) {
    pb::WaitVersionResponse resp;
    EXPECT_TRUE(WaitVersionAs(*r, "m", 1, 10000, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  EXPECT_TRUE(AllZero(r2)) << "version 1 wrote the memory of the left-out rollout";
  for (TestWorker* t : {&w.t0, &w.t1}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    pb::DeregisterRequest req;
    req.set_model_id("m");
    req.set_worker_id(t->id);
    pb::DeregisterResponse resp;
    grpc::Status s = t->stub->Deregister(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << t->id << ": " << s.error_message();
  }
  // The coordinator knows both gone (and r2 left out) before r2 pauses: with a trainer still
  // there, its BeginUpdate would be planned and caught up the ordinary way.
  auto gone = c.WaitForCoordinator([](const pb::StatusResponse& s) {
    bool left_out = false;
    for (const pb::WorkerStatus& ws : s.workers()) left_out |= ws.worker_id() == "r2" && ws.left_out();
    for (const pb::ModelStatus& ms : s.models()) {
      if (ms.model_id() == "m") return left_out && ms.registered_trainers() == 0 && ms.committed_version() == 1;
    }
    return false;
  }, absl::Seconds(10));
  EXPECT_TRUE(gone.ok()) << "trainers not gone or r2 not left out: " << gone.status();
  return r2;
}

// Before (next steps 25): no plan could be made without trainers, so no catch-up started: r2 stayed
// without version 1 (which r0 and r1 hold) and its WaitVersion(1) ran to its deadline.
TEST(SyncPauseE2eTest, ALeftOutRolloutIsCaughtUpAfterTheTrainersExited) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [](ServerOptions& o) { o.sync_pause_timeout = kPauseTimeout; });
  c.StartNode(0);
  c.StartNode(1);
  ASSERT_FALSE(HasFatalFailure());
  const pb::ModelSpec spec = SmallSpec(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = AddTwoNodeWorkers(c, inv);
  TestWorker& r2 = LeftOutThenTrainersGone(c, inv, spec, w);
  ASSERT_FALSE(HasFailure());
  // Still left out (it has not paused): no catch-up writes its live memory, trainers or not.
  {
    pb::WaitVersionResponse resp;
    grpc::Status s = WaitVersionAs(r2, "m", 1, 1000, &resp);
    EXPECT_FALSE(s.ok()) << "r2 was told version 1 while left out";
    EXPECT_TRUE(AllZero(r2)) << "a catch-up wrote the memory of the left-out rollout";
  }
  ASSERT_TRUE(BeginUpdateAs(r2, 10000).ok());
  {
    pb::WaitVersionResponse resp;
    grpc::Status s = WaitVersionAs(r2, "m", 1, 15000, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_GE(resp.committed_version(), 1u);
    EXPECT_EQ(CountBad(r2, 1), 0) << "r2 was answered before it held version 1";
  }
  // The trainers come back (new processes, same ids): version 2 reaches all three rollouts.
  for (TestWorker* t : {&w.t0, &w.t1}) ASSERT_TRUE(c.Register(*t, spec).ok()) << t->id;
  for (grpc::Status& s : c.Publish("m", pb::MODE_SYNC, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2})) {
    ASSERT_TRUE(s.ok()) << "publish v2: " << s.error_message();
  }
  for (TestWorker* r : {&w.r0, &w.r1, &r2}) {
    pb::WaitVersionResponse resp;
    ASSERT_TRUE(WaitVersionAs(*r, "m", 2, 10000, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
  c.Stop();
}

// The trainers come back and publish version 2 while r2's trainer-less catch-up of version 1 is held
// mid-transfer on n1: version 2, published by both trainers, does not start before the catch-up
// ends (the normal path waits for it, never the other way round); r2's WaitVersion(1), pending
// meanwhile, ends OK with version 1 in its memory; r2 then pauses for version 2 as an engine does
// and ends with version 2 whole (version 1 never lands over it).
TEST(SyncPauseE2eTest, TrainersComingBackDuringATrainerlessCatchUpWaitForIt) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  std::atomic<bool> armed{false};
  absl::Notification entered, release;
  // The hook uses this test's locals: the cluster stops before they go, also on an early return.
  const absl::Cleanup stop_cluster = [&c, &release] {
    if (!release.HasBeenNotified()) release.Notify();
    c.Stop();
  };
  c.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [](ServerOptions& o) { o.sync_pause_timeout = kPauseTimeout; });
  c.StartNode(0);
  c.StartNode(1, [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 1 || !armed.exchange(false)) return;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(15));
  });
  ASSERT_FALSE(HasFatalFailure());
  const pb::ModelSpec spec = SmallSpec(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = AddTwoNodeWorkers(c, inv);
  TestWorker& r2 = LeftOutThenTrainersGone(c, inv, spec, w);
  ASSERT_FALSE(HasFailure());
  armed = true;  // from now on version 1 runs only as r2's catch-up
  ASSERT_TRUE(BeginUpdateAs(r2, 10000).ok());
  // r2's engine: waits for version 1 (answered once its catch-up landed), then pauses for the next
  // update and waits for version 2, one call after the other.
  grpc::Status waited1, waited2;
  int64_t bad1 = -1;
  std::thread engine([&] {
    pb::WaitVersionResponse resp;
    waited1 = WaitVersionAs(r2, "m", 1, 25000, &resp);
    if (!waited1.ok()) return;
    bad1 = CountBad(r2, 1);  // resumed: no commit writes its live weights before its next pause
    if (grpc::Status b = BeginUpdateAs(r2, 10000); !b.ok()) {
      waited2 = b;
      return;
    }
    waited2 = WaitVersionAs(r2, "m", 2, 25000, &resp);
  });
  absl::Cleanup join_engine = [&] { engine.join(); };
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(15))) << "no catch-up of version 1 ran on n1";
  for (TestWorker* t : {&w.t0, &w.t1}) ASSERT_TRUE(c.Register(*t, spec).ok()) << t->id;
  std::vector<grpc::Status> published;
  std::thread publisher([&] { published = c.Publish("m", pb::MODE_SYNC, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1}); });
  // Version 2 published by both trainers, its rollouts r0 and r1 paused: it would start now but for
  // the catch-up, and must not.
  auto queued = c.WaitForCoordinator([](const pb::StatusResponse& s) {
    for (const pb::VersionStatus& vs : s.versions()) {
      if (vs.model_id() == "m" && vs.version() == 2 && vs.state() == "queued") return true;
    }
    return false;
  }, absl::Seconds(10));
  EXPECT_TRUE(queued.ok()) << "version 2 not queued: " << queued.status();
  auto overtaken = c.WaitForCoordinator([](const pb::StatusResponse& s) {
    for (const pb::VersionStatus& vs : s.versions()) {
      if (vs.model_id() == "m" && vs.version() == 2 && vs.state() != "publishing" && vs.state() != "queued") return true;
    }
    return false;
  }, absl::Seconds(2));
  EXPECT_FALSE(overtaken.ok()) << "version 2 started while the catch-up of version 1 ran";
  release.Notify();
  publisher.join();
  for (grpc::Status& s : published) ASSERT_TRUE(s.ok()) << "publish v2: " << s.error_message();
  std::move(join_engine).Invoke();
  EXPECT_TRUE(waited1.ok()) << "r2's WaitVersion(1), pending during its catch-up: " << waited1.error_message();
  EXPECT_EQ(bad1, 0) << "r2 was answered before it held version 1";
  EXPECT_TRUE(waited2.ok()) << "r2's WaitVersion(2): " << waited2.error_message();
  for (TestWorker* r : {&w.r0, &w.r1, &r2}) EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
}

}  // namespace
}  // namespace wb::daemon
