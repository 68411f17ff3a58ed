// node::Versions on fakes: a FakeClock, a fake cross-node transport posing as host_tcp, no
// coordinator (UnstartedCoordinatorClient) and no peers. What runs here is the NodeService side
// without an executor: commits of versions that have not landed, and the ExchangeRegions wait for
// our own executor, on simulated time.
#include "daemon/node/versions.h"

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "daemon/metrics.h"
#include "daemon/node/channel_cache.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/node_staging.h"
#include "daemon/node/node_transports.h"
#include "daemon/testing/node_parts.h"
#include "daemon/testing/sim_deadline.h"
#include "transport/config.h"
#include "transport/factory.h"
#include "transport/host_shm/host_shm.h"
#include "transport/testing/fake_transport.h"

namespace wb::daemon::node {
namespace {

// No coordinator: calls answer UNAVAILABLE, nothing is registered.
class NoCoordinator final : public CoordinatorAccess {
 public:
  CoordinatorClient& client() override { return client_; }
  bool AwaitRegistered(absl::Time) override { return false; }
  uint64_t session() override { return 0; }
  std::optional<std::string> AwaitCoordinatorChange(uint64_t, absl::Time) override { return std::nullopt; }
  void TrackProgress(const std::string&, uint64_t, std::weak_ptr<const std::atomic<uint64_t>>) override {}
  // The coordinator instance the node registered with last (set by the test, before the calls).
  std::string coordinator_instance() override { return instance; }
  std::string instance;

 private:
  UnstartedCoordinatorClient client_{"n0"};
};

// The node's parts on a FakeClock, a fake transport posing as host_tcp (daemon/testing/node_parts.h).
class VersionsTest : public ::testing::Test, public daemon::testing::NodeParts {
 protected:
  VersionsTest() : NodeParts({.fake_host_tcp = true, .staging_budget_bytes = int64_t{1} << 20}) { MakeVersions(coordinator_); }
  ~VersionsTest() override {
    versions_.reset();
    local_.reset();
  }

  // Model "m", plan epoch 1: a trainer on n0 and a rollout on n1, no ops.
  void InstallPlan(pb::Mode mode = pb::MODE_UNSPECIFIED) { ASSERT_TRUE(versions_->InstallPlan(PlanRequest(mode)).ok()); }
  // An ExecuteVersion of model m, plan epoch 1, 1 s, stamped with `instance` (empty: none).
  static pb::ExecuteVersionRequest ExecuteRequest(uint64_t version, const std::string& instance = "") {
    pb::ExecuteVersionRequest e;
    e.set_model_id("m");
    e.set_version(version);
    e.set_plan_epoch(1);
    e.set_timeout_ms(1000);
    if (!instance.empty()) e.set_coordinator_instance(instance);
    return e;
  }
  pb::InstallPlanRequest PlanRequest(pb::Mode mode, uint64_t epoch = 1) {
    pb::InstallPlanRequest req;
    pb::PlanSlice* s = req.mutable_slice();
    s->set_model_id("m");
    s->set_plan_epoch(epoch);
    s->set_mode(mode);
    s->set_num_buckets(1);
    pb::PlanWorker* t = s->add_workers();
    t->set_worker_id("trainer/0");
    t->set_node_id("n0");
    t->set_role(pb::ROLE_TRAINER);
    pb::PlanWorker* r = s->add_workers();
    r->set_worker_id("rollout/0");
    r->set_node_id("n1");
    r->set_role(pb::ROLE_ROLLOUT);
    (*r->mutable_transport_instances())["host_tcp"] = "n1-instance";
    return req;
  }

  pb::ExchangeRegionsRequest Exchange(uint64_t version) {
    pb::ExchangeRegionsRequest req;
    req.set_model_id("m");
    req.set_version(version);
    req.set_plan_epoch(1);
    req.set_from_node("n1");
    req.set_transport_kind("host_tcp");
    return req;
  }

  NoCoordinator coordinator_;
};

TEST_F(VersionsTest, CommitOfAVersionThisNodeNeverHeldIsRefusedAndAbortsItsWaiters) {
  InstallPlan();
  pb::CommitVersionRequest c;
  c.set_model_id("m");
  c.set_version(3);
  absl::Status s = versions_->CommitVersion(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("no longer holds the staging of version 3"), std::string::npos) << s;
  EXPECT_EQ(versions_->Committed("m"), 0u);
  // The node-local outcome: version 3 is aborted here (Apply's waiters learn it).
  EXPECT_TRUE(local_->AbortReason("m", 3).has_value());
}

// Issue 11 (e): one-step-off / async, a node that restarted before the commit reached it has no
// staging of the version. The coordinator still commits it cluster-wide and counts this node's
// rollouts as not holding it (they are caught up), so the node records no abort of the version:
// a local rollout's Apply(3) asks the coordinator (and waits for its catch-up) instead of
// answering ABORTED. Before: NoteAborted, and Apply(3) answered ABORTED at once.
TEST_F(VersionsTest, ACommitWithoutStagingInOneStepOffIsNoAbortOfTheVersion) {
  for (pb::Mode mode : {pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC}) {
    SCOPED_TRACE(pb::Mode_Name(mode));
    InstallPlan(mode);
    LocalWorkers::Worker w;
    w.model_id = "m";
    w.role = planner::Role::kRollout;
    w.mode = mode;
    local_->Add({"m", "rollout/0"}, std::move(w), std::nullopt);
    const uint64_t v = mode == pb::MODE_ASYNC ? 4 : 3;
    pb::CommitVersionRequest c;
    c.set_model_id("m");
    c.set_version(v);
    absl::Status s = versions_->CommitVersion(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("no longer holds the staging"), std::string::npos) << s;
    EXPECT_EQ(versions_->Committed("m"), 0u);
    EXPECT_FALSE(local_->AbortReason("m", v).has_value()) << "recorded as aborted: " << *local_->AbortReason("m", v);
    EXPECT_TRUE(local_->CatchUpAbortReason("m", v).has_value());
    // Apply(v) of the local rollout: ask the coordinator (it answers once the catch-up landed).
    absl::StatusOr<LocalWorkers::Applicable> a =
        local_->AwaitApplicable({"m", "rollout/0"}, v, clock_.Now() + absl::Seconds(10), /*ask_on_catch_up_abort=*/true);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(a->ask_coordinator);
  }
}

// The same with no plan installed and no worker of the model here yet (a node that just
// restarted): the mode is unknown, the coordinator decides - no abort recorded either.
TEST_F(VersionsTest, ACommitWithoutStagingOrPlanIsNoAbortOfTheVersion) {
  pb::CommitVersionRequest c;
  c.set_model_id("m");
  c.set_version(2);
  absl::Status s = versions_->CommitVersion(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_FALSE(local_->AbortReason("m", 2).has_value());
  EXPECT_TRUE(local_->CatchUpAbortReason("m", 2).has_value());
}

// Sync (the model's plan says so): the coordinator fails the version when this node does not
// acknowledge it, so the node records it aborted (as before); a later CommitVersion of a version
// aborted here answers ABORTED naming the abort.
TEST_F(VersionsTest, ACommitWithoutStagingInSyncAbortsTheVersionHere) {
  InstallPlan(pb::MODE_SYNC);
  pb::CommitVersionRequest c;
  c.set_model_id("m");
  c.set_version(3);
  EXPECT_EQ(versions_->CommitVersion(c).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(local_->AbortReason("m", 3).has_value());
  absl::Status again = versions_->CommitVersion(c);
  EXPECT_EQ(again.code(), absl::StatusCode::kAborted) << again;
  EXPECT_NE(again.message().find("was aborted here"), std::string::npos) << again;
}

TEST_F(VersionsTest, CommitBeforeTheVersionLandedIsRefusedThenAbortEndsThePeersWait) {
  InstallPlan();
  // A peer's ExchangeRegions arrives before our ExecuteVersion: it creates the version here and
  // waits (on the clock) for our executor's regions.
  const absl::Time deadline = clock_.Now() + absl::Seconds(60);
  absl::Status exchanged;
  std::thread peer([&] {
    pb::ExchangeRegionsResponse resp;
    exchanged = versions_->ExchangeRegions(Exchange(2), &resp);
  });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  pb::CommitVersionRequest c;
  c.set_model_id("m");
  c.set_version(2);
  absl::Status s = versions_->CommitVersion(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("has not fully landed"), std::string::npos) << s;
  EXPECT_NE(s.message().find("has not started here"), std::string::npos) << s;
  pb::AbortVersionRequest a;
  a.set_model_id("m");
  a.set_version(2);
  a.set_reason("test abort");
  ASSERT_TRUE(versions_->AbortVersion(a).ok());
  peer.join();
  EXPECT_EQ(exchanged.code(), absl::StatusCode::kAborted) << exchanged;
  EXPECT_NE(exchanged.message().find("test abort"), std::string::npos) << exchanged;
  EXPECT_EQ(versions_->Committed("m"), 0u);
}

// An abort naming a plan epoch (a voided catch-up attempt's) that reaches the node after the
// version runs here on another epoch leaves that execution alone: no waiter is told "aborted", the
// peer's wait goes on; the abort of the running epoch ends it.
TEST_F(VersionsTest, AnAbortOfAnotherEpochLeavesTheRunningExecutionAlone) {
  InstallPlan();
  const absl::Time deadline = clock_.Now() + absl::Seconds(60);
  absl::Status exchanged;
  absl::Notification done;
  std::thread peer([&] {
    pb::ExchangeRegionsResponse resp;
    exchanged = versions_->ExchangeRegions(Exchange(2), &resp);  // version 2 on plan epoch 1
    done.Notify();
  });
  ASSERT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  pb::AbortVersionRequest a;
  a.set_model_id("m");
  a.set_version(2);
  a.set_plan_epoch(7);
  a.set_reason("abort of epoch 7");
  ASSERT_TRUE(versions_->AbortVersion(a).ok());
  EXPECT_FALSE(local_->AbortReason("m", 2).has_value()) << "the abort of epoch 7 was noted for version 2";
  EXPECT_TRUE(local_->CatchUpAbortReason("m", 2).has_value()) << "Apply(2) waiters are not sent to the coordinator";
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(50))) << exchanged;
  a.set_plan_epoch(1);
  a.set_reason("abort of epoch 1");
  ASSERT_TRUE(versions_->AbortVersion(a).ok());
  peer.join();
  EXPECT_EQ(exchanged.code(), absl::StatusCode::kAborted) << exchanged;
  EXPECT_NE(exchanged.message().find("abort of epoch 1"), std::string::npos) << exchanged;
  EXPECT_TRUE(local_->AbortReason("m", 2).has_value());
}

// A catch-up attempt's abort (it names a plan epoch) of a version with no execution here - the
// attempt that could not start, or whose execution already ended - records no abort of the
// version: Apply waiters ask the coordinator, later rollouts are not failed by it.
TEST_F(VersionsTest, ACatchUpAbortIsNoAbortOfTheVersion) {
  InstallPlan();
  pb::AbortVersionRequest a;
  a.set_model_id("m");
  a.set_version(3);
  a.set_plan_epoch(9);
  a.set_reason("catch-up of model m version 3 failed: worker r0 left");
  ASSERT_TRUE(versions_->AbortVersion(a).ok());
  EXPECT_FALSE(local_->AbortReason("m", 3).has_value());
  EXPECT_EQ(local_->CatchUpAbortReason("m", 3), a.reason());
  a.set_plan_epoch(0);  // a version abort
  ASSERT_TRUE(versions_->AbortVersion(a).ok());
  EXPECT_TRUE(local_->AbortReason("m", 3).has_value());
}

// A catch-up slice's certified boxes name the form of their digest: a quantised digest
// (CertifyBox.quantized) only on a quantised piece, a canonical one only on an unquantised piece,
// quantized_here only with quantized. Anything else is refused at install, naming the piece.
TEST_F(VersionsTest, CertifiedBoxesMustMatchTheFormOfTheirPiece) {
  auto slice = [](bool quantized, bool here, int32_t piece) {
    pb::InstallPlanRequest req;
    pb::PlanSlice* s = req.mutable_slice();
    s->set_model_id("m");
    s->set_plan_epoch(3);
    s->set_catch_up(true);
    s->set_num_buckets(1);
    pb::TensorSpec* t = s->add_tensors();
    t->set_name("w");
    t->add_shape(4);
    t->add_shape(4);
    t->set_dtype(pb::DTYPE_BF16);
    pb::PlanWorker* w = s->add_workers();  // a source rollout, a trainer of the catch-up slice
    w->set_worker_id("r0");
    w->set_node_id("n0");
    w->set_role(pb::ROLE_TRAINER);
    pb::ResolvedLayout* l = w->mutable_layout();
    pb::BufferSpec* b = l->add_buffers();
    b->set_buffer_id(0);
    b->set_size_bytes(256);
    for (int p = 0; p < 2; ++p) {  // piece 0 rows 0-1 unquantised, piece 1 rows 2-3 fp8 (1x4 blocks)
      pb::Piece* pc = l->add_pieces();
      pc->set_tensor("w");
      pc->mutable_box()->add_begin(2 * p);
      pc->mutable_box()->add_begin(0);
      pc->mutable_box()->add_end(2 * p + 2);
      pc->mutable_box()->add_end(4);
      pc->set_offset_bytes(p == 0 ? 0 : 64);
      pc->add_strides(4);
      pc->add_strides(1);
      if (p == 1) {
        pc->set_quant_dtype(pb::DTYPE_F8_E4M3);
        pc->add_quant_block(1);
        pc->add_quant_block(4);
        pc->set_scale_offset_bytes(128);
      }
    }
    pb::CertifyBox* c = s->add_certify();
    c->set_worker(0);
    c->set_piece(piece);
    c->set_tensor(0);
    c->mutable_box()->add_begin(piece == 0 ? 0 : 2);
    c->mutable_box()->add_begin(0);
    c->mutable_box()->add_end(piece == 0 ? 2 : 4);
    c->mutable_box()->add_end(4);
    c->set_digest(1);
    c->set_quantized(quantized);
    c->set_quantized_here(here);
    return req;
  };
  EXPECT_TRUE(versions_->InstallPlan(slice(false, false, 0)).ok()) << versions_->InstallPlan(slice(false, false, 0));
  EXPECT_TRUE(versions_->InstallPlan(slice(true, false, 1)).ok()) << versions_->InstallPlan(slice(true, false, 1));
  EXPECT_TRUE(versions_->InstallPlan(slice(true, true, 1)).ok()) << versions_->InstallPlan(slice(true, true, 1));
  absl::Status s = versions_->InstallPlan(slice(true, false, 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("piece 0 of worker r0 is not quantised, the digest covers quantised bytes"), std::string::npos) << s;
  s = versions_->InstallPlan(slice(false, false, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("is quantised, the digest covers canonical bytes"), std::string::npos) << s;
  s = versions_->InstallPlan(slice(false, true, 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("quantized_here without quantized"), std::string::npos) << s;
}

TEST_F(VersionsTest, ExchangeRegionsWaitTimesOutInSimulatedTime) {
  InstallPlan();
  const absl::Time deadline = clock_.Now() + absl::Seconds(60);
  absl::Status exchanged = daemon::testing::EndsAtSimulatedDeadline(clock_, deadline, [&] {
    pb::ExchangeRegionsResponse resp;
    return versions_->ExchangeRegions(Exchange(1), &resp);
  });
  EXPECT_EQ(exchanged.code(), absl::StatusCode::kDeadlineExceeded) << exchanged;
  EXPECT_NE(exchanged.message().find("version 1 did not start in time"), std::string::npos) << exchanged;
}

TEST_F(VersionsTest, ExchangeRegionsForAnUninstalledPlanEpochNamesIt) {
  InstallPlan();
  pb::ExchangeRegionsRequest req = Exchange(1);
  req.set_plan_epoch(7);
  pb::ExchangeRegionsResponse resp;
  absl::Status s = versions_->ExchangeRegions(req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("plan epoch 7 of model m is not installed on node n0"), std::string::npos) << s;
}

// A catch-up slice belongs to the coordinator session that installed it. After a coordinator
// restart the new session numbers its plan epochs from 1 again; a slice left here under the number
// of the new plan made every peer's ExchangeRegions of that epoch run the catch-up slice, which
// does not name the peer ("node 'n0' is not in plan epoch 4"): every version of the new session
// failed (chaos run). The re-join drops the old session's catch-up slices.
TEST_F(VersionsTest, ACatchUpSliceOfTheLastCoordinatorSessionIsNotThePlanOfTheNext) {
  pb::InstallPlanRequest cu;
  pb::PlanSlice* s = cu.mutable_slice();
  s->set_model_id("m");
  s->set_plan_epoch(1);
  s->set_catch_up(true);
  s->set_num_buckets(1);
  pb::PlanWorker* src = s->add_workers();
  src->set_worker_id("rollout/1");
  src->set_node_id("n2");
  src->set_role(pb::ROLE_ROLLOUT);
  pb::PlanWorker* late = s->add_workers();
  late->set_worker_id("rollout/0");
  late->set_node_id("n0");
  late->set_role(pb::ROLE_ROLLOUT);
  ASSERT_TRUE(versions_->InstallPlan(cu).ok());
  (void)versions_->AbortAllForRejoin("coordinator restarted");
  InstallPlan();  // the new session's plan epoch 1: trainer on n0, rollout on n1
  const absl::Time deadline = clock_.Now() + absl::Seconds(60);
  absl::Status exchanged = daemon::testing::EndsAtSimulatedDeadline(clock_, deadline, [&] {
    pb::ExchangeRegionsResponse resp;
    return versions_->ExchangeRegions(Exchange(1), &resp);  // from n1
  });
  // Accepted (n1 is in the plan): it waits for the version to start here.
  EXPECT_EQ(exchanged.code(), absl::StatusCode::kDeadlineExceeded) << exchanged;
  EXPECT_NE(exchanged.message().find("version 1 did not start in time"), std::string::npos) << exchanged;
}

// ExecuteVersion says whether it runs a catch-up: a catch-up of an epoch whose catch-up slice is
// not installed here is refused, naming it (not run with the plan of the same number).
TEST_F(VersionsTest, ACatchUpOfAnEpochWithoutItsSliceIsRefused) {
  InstallPlan();
  pb::ExecuteVersionRequest e;
  e.set_model_id("m");
  e.set_version(1);
  e.set_plan_epoch(1);
  e.set_catch_up(true);
  absl::Status s = versions_->ExecuteVersion(e);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("catch-up slice of plan epoch 1 of model m is not installed on node n0"), std::string::npos) << s;
}

// A peer's ExchangeRegions for a version this node is never told of (hostile, or a peer that
// raced an abort) made an execution that reserved the rollouts' staging until a restart: every
// later version was RESOURCE_EXHAUSTED. Now that execution goes at its deadline, and a node that
// is not in the plan is refused without one.
TEST_F(VersionsTest, PeerExchangeForAVersionNeverStartedReleasesItsStaging) {
  pb::InstallPlanRequest req;
  pb::PlanSlice* s = req.mutable_slice();
  s->set_model_id("m");
  s->set_plan_epoch(1);
  s->set_num_buckets(1);
  pb::TensorSpec* t = s->add_tensors();
  t->set_name("w");
  t->add_shape(153600);
  t->set_dtype(pb::DTYPE_F32);
  pb::PlanWorker* tr = s->add_workers();
  tr->set_worker_id("trainer/0");
  tr->set_node_id("n1");
  tr->set_role(pb::ROLE_TRAINER);
  (*tr->mutable_transport_instances())["host_tcp"] = "n1-instance";
  pb::PlanWorker* r = s->add_workers();
  r->set_worker_id("rollout/0");
  r->set_node_id("n0");
  r->set_role(pb::ROLE_ROLLOUT);
  pb::BufferSpec* b = r->mutable_layout()->add_buffers();
  b->set_buffer_id(0);
  b->set_size_bytes(614400);  // over half the node's 1 MiB staging budget
  b->set_shm_name("/wb-peer-reap");
  b->set_gpu(-1);
  pb::Piece* pc = r->mutable_layout()->add_pieces();
  pc->set_tensor("w");
  pc->mutable_box()->add_begin(0);
  pc->mutable_box()->add_end(153600);
  pc->add_strides(1);
  pc->set_buffer_id(0);
  ASSERT_TRUE(versions_->InstallPlan(req).ok());
  pb::ExchangeRegionsRequest stranger = Exchange(1000001);
  stranger.set_from_node("n7");
  pb::ExchangeRegionsResponse resp;
  absl::Status refused = versions_->ExchangeRegions(stranger, &resp);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_NE(refused.message().find("'n7' is not in plan epoch 1"), std::string::npos) << refused;
  const absl::Time deadline = clock_.Now() + absl::Seconds(60);
  absl::Status exchanged = daemon::testing::EndsAtSimulatedDeadline(clock_, deadline, [&] {
    pb::ExchangeRegionsResponse r2;
    return versions_->ExchangeRegions(Exchange(1000000), &r2);
  });
  EXPECT_EQ(exchanged.code(), absl::StatusCode::kDeadlineExceeded) << exchanged;
  pb::ExecuteVersionRequest e = ExecuteRequest(2);
  absl::Status st = versions_->ExecuteVersion(e);
  EXPECT_TRUE(st.ok()) << st;
  pb::AbortVersionRequest a;
  a.set_model_id("m");
  a.set_version(2);
  a.set_reason("cleanup");
  versions_->AbortVersion(a).IgnoreError();
}

// A version whose execution a re-join aborted may run again for the coordinator re-joined (its
// trainers' Publish re-sent: WorkerCalls::PublishAgainAfterRestart), once; a version aborted by
// an AbortVersion - before or after that - is refused as before. Before, the re-join's record
// refused it ("version 34 was aborted: the coordinator restarted", chaos seed 1002): re-sent
// publishes of a version that had started were lost anyway.
TEST_F(VersionsTest, AVersionAbortedByAReJoinRunsAgainForTheNewCoordinator) {
  InstallPlan(pb::MODE_SYNC);
  pb::ExecuteVersionRequest e = ExecuteRequest(2);
  ASSERT_TRUE(versions_->ExecuteVersion(e).ok());
  (void)versions_->AbortAllForRejoin("the coordinator restarted (instance A -> B)");
  EXPECT_TRUE(local_->AbortReason("m", 2).has_value()) << "Apply waiters of the old session are answered";
  InstallPlan(pb::MODE_SYNC);  // the new session's plan epoch 1
  absl::Status again = versions_->ExecuteVersion(e);
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_FALSE(local_->AbortReason("m", 2).has_value());
  pb::AbortVersionRequest a;
  a.set_model_id("m");
  a.set_version(2);
  a.set_reason("a node failed");
  ASSERT_TRUE(versions_->AbortVersion(a).ok());
  absl::Status third = versions_->ExecuteVersion(e);
  EXPECT_EQ(third.code(), absl::StatusCode::kAborted) << third;
  EXPECT_NE(third.message().find("a node failed"), std::string::npos) << third;
  // Aborted by the re-join, then by the new coordinator before it started here: refused.
  e.set_version(3);
  ASSERT_TRUE(versions_->ExecuteVersion(e).ok());
  (void)versions_->AbortAllForRejoin("the coordinator restarted (instance B -> C)");
  InstallPlan(pb::MODE_SYNC);
  a.set_version(3);
  ASSERT_TRUE(versions_->AbortVersion(a).ok());
  absl::Status fourth = versions_->ExecuteVersion(e);
  EXPECT_EQ(fourth.code(), absl::StatusCode::kAborted) << fourth;
}

// Status.md items 20 / 24: an ExecuteVersion of the coordinator this node left for a restarted one
// (a frozen node, or a handler scheduled after the re-join) is refused, naming both instances,
// before anything is recorded: it does not count as run by the new session, so an Apply(v) of a
// number below the new session's still asks the new coordinator instead of waiting for that
// execution to fail; nor does it use up the run-again mark of a version the re-join aborted.
// Before, it started an execution (its ReportDone ignored by instance) and NoteSessionVersion(3)
// made Apply(3) wait on the node.
TEST_F(VersionsTest, AnExecuteVersionOfTheCoordinatorBeforeTheReJoinIsRefusedAndNotCountedAsRun) {
  LocalWorkers::Worker r;
  r.model_id = "m";
  r.role = planner::Role::kRollout;
  r.mode = pb::MODE_SYNC;
  local_->Add({"m", "r0"}, std::move(r), std::nullopt);
  coordinator_.instance = "A";
  InstallPlan(pb::MODE_SYNC);
  pb::ExecuteVersionRequest e = ExecuteRequest(2, "A");
  ASSERT_TRUE(versions_->ExecuteVersion(e).ok());
  coordinator_.instance = "B";  // registered with the restarted coordinator, then the re-join:
  (void)versions_->AbortAllForRejoin("the coordinator restarted (instance A -> B)");
  InstallPlan(pb::MODE_SYNC);  // the new session's plan epoch 1
  for (uint64_t v : {3, 2}) {  // one the old coordinator had not run here, and the one the re-join aborted
    e.set_version(v);
    absl::Status stale = versions_->ExecuteVersion(e);
    EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
    EXPECT_NE(stale.message().find(absl::StrCat("version ", v, " refused on node n0: it comes from coordinator instance A, but the node is "
                                                "registered with coordinator instance B")),
              std::string::npos)
        << stale;
  }
  // Not counted as run by the new session: Apply(3) of the local rollout asks the coordinator.
  absl::StatusOr<LocalWorkers::Applicable> a = local_->AwaitApplicable({"m", "r0"}, 3, clock_.Now(), /*ask_on_catch_up_abort=*/false,
                                                                       /*ask_if_unknown_since_rejoin=*/true);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->unknown_since_rejoin);
  EXPECT_TRUE(a->ask_coordinator);
  // The new coordinator's ExecuteVersion of the version the re-join aborted runs (its mark is
  // left), and from then on the node's own record decides Apply(3): it waits here.
  e.set_coordinator_instance("B");
  absl::Status fresh = versions_->ExecuteVersion(e);
  EXPECT_TRUE(fresh.ok()) << fresh;
  EXPECT_FALSE(local_->AbortReason("m", 2).has_value());
  a = local_->AwaitApplicable({"m", "r0"}, 3, clock_.Now(), false, /*ask_if_unknown_since_rejoin=*/true);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDeadlineExceeded) << a.status();
  // A coordinator built before the field stamps nothing: accepted, as before.
  e.set_version(4);
  e.set_coordinator_instance("");
  absl::Status old_peer = versions_->ExecuteVersion(e);
  EXPECT_TRUE(old_peer.ok()) << old_peer;
}

// The dead coordinator's late InstallPlan (after the re-join) is refused like its ExecuteVersion,
// before the slice replaces the new session's plan: the new session numbers plan epochs from 1
// again, so the old slice would make its next versions fail "not installed" or run the old slice.
TEST_F(VersionsTest, AnInstallPlanOfTheCoordinatorBeforeTheReJoinIsRefusedAndKeepsThePlan) {
  coordinator_.instance = "B";
  pb::InstallPlanRequest fresh = PlanRequest(pb::MODE_SYNC, 1);
  fresh.set_coordinator_instance("B");
  ASSERT_TRUE(versions_->InstallPlan(fresh).ok());
  pb::InstallPlanRequest stale = PlanRequest(pb::MODE_SYNC, 2);
  stale.set_coordinator_instance("A");
  absl::Status refused = versions_->InstallPlan(stale);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("InstallPlan of model m plan epoch 2 refused on node n0: it comes from coordinator instance A, but the "
                                   "node is registered with coordinator instance B"),
            std::string::npos)
      << refused;
  pb::ExecuteVersionRequest e = ExecuteRequest(2, "B");
  absl::Status run = versions_->ExecuteVersion(e);
  EXPECT_TRUE(run.ok()) << "the new session's plan epoch 1 was replaced: " << run;
  // A coordinator built before the field stamps nothing: installed, as before.
  stale.clear_coordinator_instance();
  absl::Status old_peer = versions_->InstallPlan(stale);
  EXPECT_TRUE(old_peer.ok()) << old_peer;
}

// The dead coordinator's late CommitVersion is refused before the node looks the version up: it
// commits nothing (a re-run the new coordinator has not decided) and records nothing - here, a
// sync version with no staging would otherwise be noted aborted on the node.
TEST_F(VersionsTest, ACommitVersionOfTheCoordinatorBeforeTheReJoinIsRefusedAndRecordsNothing) {
  coordinator_.instance = "B";
  InstallPlan(pb::MODE_SYNC);
  pb::CommitVersionRequest c;
  c.set_model_id("m");
  c.set_version(3);
  c.set_coordinator_instance("A");
  absl::Status stale = versions_->CommitVersion(c);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_NE(stale.message().find("CommitVersion of model m version 3 refused on node n0: it comes from coordinator instance A, but the "
                                 "node is registered with coordinator instance B"),
            std::string::npos)
      << stale;
  EXPECT_FALSE(local_->AbortReason("m", 3).has_value()) << *local_->AbortReason("m", 3);
  EXPECT_EQ(versions_->Committed("m"), 0u);
  // The new coordinator's commit is handled as before (no staging here, sync: aborted here).
  c.set_coordinator_instance("B");
  absl::Status fresh = versions_->CommitVersion(c);
  EXPECT_NE(fresh.message().find("no longer holds the staging of version 3"), std::string::npos) << fresh;
  EXPECT_TRUE(local_->AbortReason("m", 3).has_value());
}

// The dead coordinator's late AbortVersion of a version the re-join aborted is refused: the
// run-again mark stays, so the new coordinator's re-run of it (its trainers' Publish re-sent)
// still runs here instead of being refused ABORTED with the dead coordinator's reason.
TEST_F(VersionsTest, AnAbortVersionOfTheCoordinatorBeforeTheReJoinIsRefusedAndKeepsTheReRun) {
  coordinator_.instance = "A";
  InstallPlan(pb::MODE_SYNC);
  pb::ExecuteVersionRequest e = ExecuteRequest(2, "A");
  ASSERT_TRUE(versions_->ExecuteVersion(e).ok());
  coordinator_.instance = "B";
  (void)versions_->AbortAllForRejoin("the coordinator restarted (instance A -> B)");
  InstallPlan(pb::MODE_SYNC);  // the new session's plan epoch 1
  pb::AbortVersionRequest a;
  a.set_model_id("m");
  a.set_version(2);
  a.set_reason("the old coordinator gave up");
  a.set_coordinator_instance("A");
  absl::Status stale = versions_->AbortVersion(a);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_NE(stale.message().find("AbortVersion of model m version 2 refused on node n0: it comes from coordinator instance A, but the "
                                 "node is registered with coordinator instance B"),
            std::string::npos)
      << stale;
  e.set_coordinator_instance("B");
  absl::Status rerun = versions_->ExecuteVersion(e);
  EXPECT_TRUE(rerun.ok()) << rerun;
  // The new coordinator's abort ends it, as before.
  a.set_coordinator_instance("B");
  EXPECT_TRUE(versions_->AbortVersion(a).ok());
  EXPECT_TRUE(local_->AbortReason("m", 2).has_value());
}

}  // namespace
}  // namespace wb::daemon::node
