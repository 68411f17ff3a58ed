// The coordinator's driver never waits for a node (docs/daemon.md "The driver never waits for a
// node"): a node that stops answering without closing its connection (frozen: SIGSTOP, a hung
// host) holds an ExecuteVersion until its timeout. Before lanes (rpc_lanes.h) the driver ran that
// call itself, so for up to the transfer timeout (60 s) no other model's version started or
// committed and no lease was swept - the frozen node's own version was aborted only when the call
// gave up. Here the fake n1 holds model a's ExecuteVersion until the test releases it (a real-time
// bound makes a broken driver fail the test, never hang it).
#include <memory>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);  // the frozen call's own bound
constexpr absl::Duration kPrompt = absl::Seconds(8);  // well below it: what "not held" means here

class DriverLanesTest : public ::testing::Test {
 protected:
  void StartCore(Clock* clock, absl::Duration lease) {
    CoordinatorOptions o;
    o.clock = clock;
    o.lease = lease;
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      fake->on_install = [this, node](const pb::PlanSlice& slice) {
        if (freeze_installs_ && node == "n1" && slice.model_id() == "a") {
          // (A retry after the release - a re-plan, another start - comes here again; the
          // lane runs one call of the model at a time.)
          if (!executing_frozen_.HasBeenNotified()) executing_frozen_.Notify();
          release_frozen_.WaitForNotificationWithTimeout(kReal);
          return absl::DeadlineExceededError("frozen node: InstallPlan timed out");
        }
        return absl::OkStatus();
      };
      // As gRPC's TryCancel: the frozen call returns.
      fake->on_cancel = [this, node] {
        if (node == "n1" && cancel_releases_ && !release_frozen_.HasBeenNotified()) release_frozen_.Notify();
      };
      fake->on_execute = [this, node](const pb::ExecuteVersionRequest& req) {
        if (node == "n1" && req.model_id() == "a") {
          // (A retry after the release - a re-plan, another start - comes here again; the
          // lane runs one call of the model at a time.)
          if (!executing_frozen_.HasBeenNotified()) executing_frozen_.Notify();
          release_frozen_.WaitForNotificationWithTimeout(kReal);  // frozen until the test ends or cancels
          if (!frozen_call_ended_.HasBeenNotified()) frozen_call_ended_.Notify();
          return absl::DeadlineExceededError("frozen node: ExecuteVersion timed out");
        }
        pb::ReportDoneResponse resp;
        return core_->ReportDone(testing::DoneReport(node, req), &resp);
      };
      return fake;
    };
    core_ = std::make_unique<CoordinatorCore>(std::move(o));
    core_->Start();
  }
  void TearDown() override {
    if (!release_frozen_.HasBeenNotified()) release_frozen_.Notify();  // (a cancel may have, on_cancel)
    if (core_) core_->Shutdown();
  }
  uint64_t Register(const std::string& node) {
    pb::RegisterNodeRequest req;
    req.set_node_id(node);
    req.set_address(node + ":1");
    pb::RegisterNodeResponse resp;
    EXPECT_TRUE(core_->RegisterNode(req, &resp).ok());
    return resp.incarnation();
  }
  // `model`'s trainer on `trainer_node` and one rollout on `rollout_node` (async: a version
  // commits once every node of the plan reported it done).
  void JoinModel(const std::string& model, const std::string& trainer_node, const std::string& rollout_node,
                 bool await_installed = true) {
    pb::ModelSpec spec = testing::SmallModelSpec(model, 1);
    spec.set_mode(pb::MODE_ASYNC);
    for (const auto& [worker, node, role] :
         {std::tuple{model + "-t0", trainer_node, pb::ROLE_TRAINER}, std::tuple{model + "-r0", rollout_node, pb::ROLE_ROLLOUT}}) {
      pb::JoinWorkerRequest j;
      j.set_node_id(node);
      j.set_worker_id(worker);
      j.set_model_id(model);
      j.set_role(role);
      *j.mutable_model() = spec;
      pb::JoinWorkerResponse jr;
      ASSERT_TRUE(core_->JoinWorker(j, &jr).ok());
      pb::SubmitLayoutRequest l = testing::WholeTensorLayout(node, worker);
      l.set_model_id(model);
      pb::SubmitLayoutResponse lr;
      absl::Status s = core_->SubmitLayout(l, &lr);
      ASSERT_TRUE(s.ok()) << s;
    }
    if (await_installed) ASSERT_TRUE(core_->AwaitPlanInstalled(model, absl::Now() + kReal)) << model;
  }
  absl::Status Publish(const std::string& model, const std::string& node, uint64_t v) {
    pb::CoordPublishRequest p;
    p.set_model_id(model);
    p.set_worker_id(model + "-t0");
    p.set_node_id(node);
    p.set_version(v);
    p.set_timeout_ms(absl::ToInt64Milliseconds(kReal));
    pb::PublishResponse resp;
    return core_->Publish(p, &resp);
  }
  absl::Status WaitVersion(const std::string& model, uint64_t v, absl::Duration timeout) {
    pb::WaitVersionRequest w;
    w.set_model_id(model);
    w.set_version(v);
    w.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    pb::WaitVersionResponse wr;
    return core_->WaitVersion(w, &wr);
  }

  // Simulated time (lease 3 s): model a on n0 and n1, n1 frozen in version 1's ExecuteVersion;
  // 4 s pass in 0.5 s steps, n0 heartbeating before each and a driver pass awaited after each
  // (none comes while the driver waits for the frozen node).
  void FreezeN1InVersion1AndOutliveItsLease() {
    StartCore(&clock_, absl::Seconds(3));
    const uint64_t inc0 = Register("n0");
    Register("n1");
    JoinModel("a", "n0", "n1");
    ASSERT_TRUE(Publish("a", "n0", 1).ok());
    ASSERT_TRUE(executing_frozen_.WaitForNotificationWithTimeout(kReal)) << "a's version 1 never started";
    for (int step = 0; step < 8; ++step) {  // 8 x 0.5 s = 4 s > the 3 s lease
      pb::HeartbeatRequest hb;
      hb.set_node_id("n0");
      hb.set_incarnation(inc0);
      pb::HeartbeatResponse resp;
      ASSERT_TRUE(core_->Heartbeat(hb, &resp).ok());
      clock_.Advance(absl::Milliseconds(500));
      ASSERT_TRUE(core_->AwaitDriverPassAt(clock_.Now(), absl::Now() + kPrompt))
          << "no driver pass at +" << (step + 1) * 0.5 << " s: the driver waits for the frozen node";
    }
  }

  bool cancel_releases_ = false;  // set before StartCore: n1's CancelCalls ends its frozen call
  absl::Notification frozen_call_ended_;
  bool freeze_installs_ = false;  // set before StartCore: n1 freezes in model a's InstallPlan
  FakeClock clock_;  // declared before core_: outlives it (TearDown shuts the core down)
  absl::Notification executing_frozen_, release_frozen_;
  std::unique_ptr<CoordinatorCore> core_;
};

// Model a's version waits on frozen n1; model b (on n2 alone) publishes meanwhile and commits at
// once. Before lanes b's version started only after a's call gave up.
TEST_F(DriverLanesTest, AFrozenNodeHoldsNoOtherModelsVersion) {
  StartCore(Clock::Real(), absl::Minutes(10));  // no lease runs out in this test
  for (const char* n : {"n0", "n1", "n2"}) Register(n);
  JoinModel("a", "n0", "n1");
  JoinModel("b", "n2", "n2");
  ASSERT_TRUE(Publish("a", "n0", 1).ok());
  ASSERT_TRUE(executing_frozen_.WaitForNotificationWithTimeout(kReal)) << "a's version 1 never started";
  ASSERT_TRUE(Publish("b", "n2", 1).ok());
  absl::Status b = WaitVersion("b", 1, kPrompt);
  EXPECT_TRUE(b.ok()) << "model b's version waited for model a's frozen node: " << b;
}

// Simulated time: n1 freezes inside a's ExecuteVersion and stops heartbeating; n0 goes on. The
// driver keeps sweeping leases, so n1 is lost after its 3 s lease and a's version 1 is aborted
// naming it - while the frozen call still runs. Before lanes no pass came until the call gave up.
TEST_F(DriverLanesTest, AFrozenNodesLeaseRunsOutWhileItsCallIsHeld) {
  ASSERT_NO_FATAL_FAILURE(FreezeN1InVersion1AndOutliveItsLease());
  absl::Status a = WaitVersion("a", 1, absl::Seconds(1));
  EXPECT_EQ(a.code(), absl::StatusCode::kAborted) << a;
  EXPECT_NE(a.message().find("node n1 lost its lease"), std::string::npos) << a;
  EXPECT_FALSE(release_frozen_.HasBeenNotified()) << "the abort came only after the frozen call ended";
}

// Model a's plan install waits on frozen n1 (InstallPlan, 30 s per node). Model b becomes ready
// meanwhile: its plan is made and installed at once. Before, the installs ran on the one planner
// thread, so b's plan waited for a's install to give up.
TEST_F(DriverLanesTest, AFrozenNodesInstallHoldsNoOtherModelsPlan) {
  freeze_installs_ = true;
  StartCore(Clock::Real(), absl::Minutes(10));
  for (const char* n : {"n0", "n1", "n2"}) Register(n);
  JoinModel("a", "n0", "n1", /*await_installed=*/false);
  ASSERT_TRUE(executing_frozen_.WaitForNotificationWithTimeout(kReal)) << "a's plan was never installed";
  JoinModel("b", "n2", "n2", /*await_installed=*/false);
  EXPECT_TRUE(core_->AwaitPlanInstalled("b", absl::Now() + kPrompt)) << "model b's plan waited for model a's frozen node";
  ASSERT_TRUE(Publish("b", "n2", 1).ok());
  absl::Status b = WaitVersion("b", 1, kPrompt);
  EXPECT_TRUE(b.ok()) << b;
}

// When the frozen node's lease runs out its calls in flight are cancelled (NodeClient::CancelCalls),
// so its held ExecuteVersion ends then - not at its deadline (the transfer timeout, 60 s), which
// held the model's lane, and its next plan and versions, that long.
TEST_F(DriverLanesTest, AFrozenNodesCallsAreCancelledWhenItsLeaseRunsOut) {
  cancel_releases_ = true;
  ASSERT_NO_FATAL_FAILURE(FreezeN1InVersion1AndOutliveItsLease());
  EXPECT_TRUE(frozen_call_ended_.WaitForNotificationWithTimeout(kPrompt)) << "n1's call was not cancelled when its lease ran out";
  EXPECT_TRUE(core_->AwaitNodeRpcsIdle(absl::Now() + kPrompt)) << "model a's lane is still held";
}

}  // namespace
}  // namespace wb::daemon
