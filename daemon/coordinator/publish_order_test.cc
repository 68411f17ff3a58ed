// Trainer ranks publish their versions in order. A rank's Publish of version v that reaches the
// coordinator after another rank published a newer version without v - a Publish re-sent by its
// node after a coordinator restart (docs/daemon.md "Coordinator restart") while the other rank's
// in-flight one was newer - is aborted at once, naming the rank that is past it: v could never be
// published by every trainer, and waiting for it held the rank until its publish deadline.
// (The other order, the skipped version published first: core_test
// SyncVersionSkippedByATrainerRankIsAbortedAtOnce.) Simulated time: nothing may wait for a deadline.
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);

class PublishOrderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions o;
    o.clock = &clock_;
    o.lease = absl::Hours(1);
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      fake->on_execute = [this, node](const pb::ExecuteVersionRequest& req) {
        pb::ReportDoneResponse resp;
        return core_->ReportDone(testing::DoneReport(node, req), &resp);
      };
      return fake;
    };
    core_ = std::make_unique<CoordinatorCore>(std::move(o));
    core_->Start();
    for (const char* n : {"n0", "n1"}) {
      pb::RegisterNodeRequest req;
      req.set_node_id(n);
      req.set_address(std::string(n) + ":1");
      pb::RegisterNodeResponse resp;
      ASSERT_TRUE(core_->RegisterNode(req, &resp).ok());
    }
    pb::ModelSpec spec = testing::SmallModelSpec("m", 1);
    spec.set_mode(pb::MODE_SYNC);
    Join("n0", "t0", pb::ROLE_TRAINER, spec);
    Join("n1", "t1", pb::ROLE_TRAINER, spec);
    Join("n1", "r0", pb::ROLE_ROLLOUT, spec);
    ASSERT_TRUE(core_->AwaitPlanInstalled("m", absl::Now() + kReal));
  }
  void TearDown() override { core_->Shutdown(); }
  void Join(const std::string& node, const std::string& worker, pb::Role role, const pb::ModelSpec& spec) {
    pb::JoinWorkerRequest j;
    j.set_node_id(node);
    j.set_worker_id(worker);
    j.set_model_id("m");
    j.set_role(role);
    *j.mutable_model() = spec;
    pb::JoinWorkerResponse jr;
    ASSERT_TRUE(core_->JoinWorker(j, &jr).ok());
    pb::SubmitLayoutRequest l = testing::WholeTensorLayout(node, worker);
    pb::SubmitLayoutResponse lr;
    absl::Status s = core_->SubmitLayout(l, &lr);
    ASSERT_TRUE(s.ok()) << s;
  }
  absl::Status Ready() {
    pb::ReportReadyRequest r;
    r.set_node_id("n1");
    r.set_model_id("m");
    r.set_worker_id("r0");
    pb::ReportReadyResponse resp;
    return core_->ReportReady(r, &resp);
  }
  absl::Status Publish(const std::string& trainer, uint64_t v) {
    pb::CoordPublishRequest p;
    p.set_model_id("m");
    p.set_worker_id(trainer);
    p.set_node_id(trainer == "t0" ? "n0" : "n1");
    p.set_version(v);
    p.set_timeout_ms(10000);
    pb::PublishResponse resp;
    return core_->Publish(p, &resp);
  }

  FakeClock clock_;  // before core_: outlives it
  std::unique_ptr<CoordinatorCore> core_;
};

TEST_F(PublishOrderTest, AVersionPublishedAfterAnotherRankIsPastItIsAbortedAtOnce) {
  ASSERT_TRUE(Ready().ok());
  const absl::Time publish_deadline = clock_.Now() + absl::Seconds(10);
  absl::Status t0_v2;
  std::thread t0_first([&] { t0_v2 = Publish("t0", 2); });
  ASSERT_TRUE(clock_.AwaitWaiter(publish_deadline, absl::Now() + kReal));  // version 2 waits for t1
  absl::Status t1_v1;
  absl::Notification t1_v1_done;
  std::thread t1_late([&] {
    t1_v1 = Publish("t1", 1);
    t1_v1_done.Notify();
  });
  const bool answered = t1_v1_done.WaitForNotificationWithTimeout(absl::Seconds(10));
  EXPECT_TRUE(answered) << "t1's publish of version 1 waits for t0, which is past it";
  if (!answered) clock_.Advance(absl::Seconds(11));  // let the threads end at their deadline
  t1_late.join();
  EXPECT_TRUE(absl::IsAborted(t1_v1)) << t1_v1;
  EXPECT_NE(t1_v1.message().find("trainer t0 published a newer version without publishing version 1"), std::string::npos)
      << t1_v1;
  ASSERT_TRUE(Ready().ok());  // released by the abort: pauses again
  absl::Status t1_v2 = Publish("t1", 2);
  t0_first.join();
  EXPECT_TRUE(t1_v2.ok()) << t1_v2;
  EXPECT_TRUE(t0_v2.ok()) << t0_v2;
  pb::StatusResponse st;
  ASSERT_TRUE(core_->ClusterStatus(pb::StatusRequest(), &st).ok());
  EXPECT_EQ(st.models(0).committed_version(), 2u);
}

}  // namespace
}  // namespace wb::daemon
