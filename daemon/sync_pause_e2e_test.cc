// A sync rollout that never pauses (docs/daemon.md "Rollouts that never pause"), end to end with
// real daemons (coordinator + 2 nodes, shm workers, host_shm / host_tcp): an extra rollout joins the
// model with memory of its own and never calls BeginUpdate. Past the coordinator's sync pause
// timeout it is left out; the trainers' versions commit for the well-behaved rollouts byte for byte
// within the timeout and a few seconds, never writing its memory; once it calls BeginUpdate it is
// caught up to the committed version byte for byte before its WaitVersion answers, and takes part
// in the next version.
#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
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

}  // namespace
}  // namespace wb::daemon
