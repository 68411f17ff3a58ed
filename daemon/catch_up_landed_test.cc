// Apply copies a rollout's committed staging with the layout it landed with (status.md item 25,
// docs/daemon.md "Catch-up"), end to end with real daemons (coordinator + 2 nodes) and shm workers.
//
// When one node's catch-up slice is replaced by the next late rollout's and a rollout still needs
// it: a node keeps one catch-up slice per model (the coordinator runs one catch-up of a model at a
// time), and a rollout caught up while the trainers are gone is in no model plan there - its
// catch-up slice was the only installed plan listing it. A later catch-up of the same version
// lists it again as a source while the coordinator counts it as holding the version; but when the
// coordinator does not (the catch-up's CommitVersion answer from its node was lost: the node
// committed it, the coordinator counts the rollout's catch-up failed), the next late rollout's
// catch-up on that node lists neither it as a source nor as a destination, its slice replaces the
// one the rollout landed with, and the rollout's Apply of the version it holds was refused
// FAILED_PRECONDITION ("no plan installed there lists the worker") - for good: nothing re-plans or
// catches it up for that. Apply now takes the layout from the plan the staging landed with.
#include <grpcpp/grpcpp.h>

#include <atomic>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

planner::WorkerLayout Whole(const planner::Inventory& inv, bool transposed) {
  return LayoutOf(inv, {{0, {0, 0}, {8, 16}, transposed}, {1, {0, 0}, {4, 6}, transposed}});
}

grpc::Status Deregister(TestWorker& w) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  pb::DeregisterRequest req;
  req.set_model_id("m");
  req.set_worker_id(w.id);
  pb::DeregisterResponse resp;
  return w.stub->Deregister(&ctx, req, &resp);
}

// The coordinator's record of worker `id` (empty when it has none).
pb::WorkerStatus WorkerOf(const pb::StatusResponse& st, const std::string& id) {
  for (const pb::WorkerStatus& ws : st.workers()) {
    if (ws.worker_id() == id) return ws;
  }
  return pb::WorkerStatus();
}

class CatchUpLandedTest : public ::testing::TestWithParam<pb::Mode> {
 protected:
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = SmallInventory();
};

// Trainers gone after version 1; r2 registers on n1 and is caught up from r0 / r1, but n1's answer
// to that catch-up's CommitVersion is lost (n1 committed it: r2's staging holds version 1). Then
// r3 registers on n1 and is caught up: n1's catch-up slice is now r3's (r2 in it neither as source
// nor as destination). r2's Apply(1) lands version 1 byte for byte. Before: FAILED_PRECONDITION,
// "no plan installed there lists the worker", and version 1 stayed staged.
TEST_P(CatchUpLandedTest, ARolloutWhoseCatchUpSliceTheNextLateRolloutsReplacedStillApplies) {
  const pb::Mode mode = GetParam();
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  std::atomic<bool> armed{false};
  std::atomic<int> lost{0};
  // n1's hook reads this test's locals: the cluster stops before they go.
  const StopAtExit stop(c_);
  c_.StartCoordinator();
  c_.StartNode(0);
  c_.StartNode(1, nullptr, nullptr, [&](ServerOptions& o) {
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_commit_answer = [&](const std::string&, uint64_t version, bool catch_up) {
        if (!catch_up || version != 1 || !armed.exchange(false)) return absl::OkStatus();
        ++lost;
        return absl::UnavailableError("test: the answer to this catch-up commit was lost");
      };
    };
  });
  TwoNodeWorkers w = AddTwoNodeWorkers(c_, inv_);
  for (TestWorker* x : {&w.t0, &w.t1, &w.r0, &w.r1}) ASSERT_TRUE(c_.Register(*x, spec).ok()) << x->id;
  for (grpc::Status& s : c_.Publish("m", mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) {
    pb::ApplyResponse ar;
    grpc::Status s = c_.Apply(*r, "m", 1, &ar);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    ASSERT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  for (TestWorker* t : {&w.t0, &w.t1}) ASSERT_TRUE(Deregister(*t).ok()) << t->id;
  // The coordinator knows them gone before r2 registers (else a plan with them could still be
  // made, listing r2 in the model's plan on n1).
  auto gone = c_.WaitForCoordinator(
      [](const pb::StatusResponse& s) {
        for (const pb::ModelStatus& ms : s.models()) {
          if (ms.model_id() == "m") return ms.registered_trainers() == 0;
        }
        return false;
      },
      absl::Seconds(10));
  ASSERT_TRUE(gone.ok()) << gone.status();

  armed = true;
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, false));
  ASSERT_TRUE(c_.Register(r2, spec).ok());
  // The coordinator counts r2's catch-up failed: n1 did not acknowledge its commit.
  auto failed = c_.WaitForCoordinator([](const pb::StatusResponse& s) { return !WorkerOf(s, "r2").catch_up_error().empty(); },
                                      absl::Seconds(20));
  ASSERT_TRUE(failed.ok()) << failed.status();
  ASSERT_EQ(lost.load(), 1) << "n1's catch-up commit answer was not the one lost";
  EXPECT_NE(WorkerOf(*failed, "r2").catch_up_error().find("not committed on node n1"), std::string::npos)
      << WorkerOf(*failed, "r2").catch_up_error();

  // r3 on n1: its catch-up's slice replaces r2's there (sources r0, r1; r2 is neither).
  TestWorker& r3 = c_.AddWorker("r3", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r3, spec).ok());
  pb::ApplyResponse ar;
  grpc::Status s3 = c_.Apply(r3, "m", 1, &ar);
  ASSERT_TRUE(s3.ok()) << s3.error_message();
  EXPECT_EQ(CountBad(r3, 1), 0);

  // r2's staging holds version 1 on n1: Apply(1) copies it with the layout it landed with.
  EXPECT_GT(CountBad(r2, 1), 0) << "r2's live memory held version 1 before its Apply";
  grpc::Status s2 = c_.Apply(r2, "m", 1, &ar);
  ASSERT_TRUE(s2.ok()) << s2.error_message();
  EXPECT_EQ(ar.applied_version(), 1u);
  EXPECT_EQ(CountBad(r2, 1), 0) << "Apply(1) answered OK over memory that does not hold version 1";

  // The trainers come back: version 2 reaches all four rollouts.
  for (TestWorker* t : {&w.t0, &w.t1}) ASSERT_TRUE(c_.Register(*t, spec).ok()) << t->id;
  for (grpc::Status& s : c_.Publish("m", mode, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2, &r3})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1, &r2, &r3}) {
    grpc::Status s = c_.Apply(*r, "m", 2, &ar);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
}

// Sync rollouts are written by the commit itself (no Apply), so only the other modes.
INSTANTIATE_TEST_SUITE_P(Modes, CatchUpLandedTest, ::testing::Values(pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                         [](const ::testing::TestParamInfo<pb::Mode>& i) { return pb::Mode_Name(i.param); });

}  // namespace
}  // namespace wb::daemon
