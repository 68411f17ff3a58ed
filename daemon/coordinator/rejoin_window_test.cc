// The re-join window of a restarted coordinator (rejoin_window.cc; status.md "Next steps" 11's
// last point), on a FakeClock: a wait for a used number waits for nodes still re-joining, then
// answers ABORTED when the window closes.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kWindow = absl::Milliseconds(2917);  // apart from every other timer here
constexpr absl::Duration kReal = absl::Seconds(10);

// A restarted coordinator (sync model "m", one rollout expected for the first plan) on `clock_`,
// fake nodes that answer OK, and the nodes' re-joins as NodeDaemon::Rejoin sends them.
class RestartedCoordinator {
 public:
  explicit RestartedCoordinator(const std::vector<std::string>& nodes) {
    CoordinatorOptions o;
    o.clock = &clock_;
    o.rejoin_window = kWindow;
    o.make_node_client = [](const std::string& node, const std::string&) { return std::make_shared<FakeNodeClient>(node); };
    core_ = std::make_unique<CoordinatorCore>(std::move(o));
    core_->Start();
    window_end_ = clock_.Now() + kWindow;
    for (const std::string& n : nodes) {
      pb::RegisterNodeRequest req;
      req.set_node_id(n);
      req.set_address(n + ":1");
      pb::RegisterNodeResponse resp;
      EXPECT_TRUE(core_->RegisterNode(req, &resp).ok());
    }
  }
  ~RestartedCoordinator() { core_->Shutdown(); }

  // JoinWorker (rejoin: the node's committed version, the worker's applied and held ones), layout.
  void Rejoin(const std::string& node, const std::string& worker, pb::Role role, uint64_t committed, uint64_t holds) {
    pb::JoinWorkerRequest j;
    j.set_node_id(node);
    j.set_worker_id(worker);
    j.set_model_id("m");
    j.set_role(role);
    *j.mutable_model() = testing::SmallModelSpec("m", 1);
    j.mutable_model()->set_mode(pb::MODE_SYNC);
    j.set_rejoin(true);
    j.set_committed_version(committed);
    j.set_applied_version(holds);
    j.set_holds_version(holds);
    pb::JoinWorkerResponse jr;
    ASSERT_TRUE(core_->JoinWorker(j, &jr).ok());
    pb::SubmitLayoutResponse lr;
    ASSERT_TRUE(core_->SubmitLayout(testing::WholeTensorLayout(node, worker), &lr).ok());
  }
  absl::Status WaitFor(const std::string& worker, uint64_t v) {
    pb::WaitVersionRequest w;
    w.set_model_id("m");
    w.set_version(v);
    w.set_timeout_ms(20000);
    w.set_worker_id(worker);
    pb::WaitVersionResponse wr;
    return core_->WaitVersion(w, &wr);
  }
  // Sync version 2 committed cluster-wide before the restart, but n0 (trainer t0) and n1 (rollout
  // r1) were not told: they rolled it back at their re-join (committed 1) while r1's live weights
  // hold it - a used number. The first plan (t0 and one rollout) is made.
  void RejoinTheNodesNotTold() {
    Rejoin("n0", "t0", pb::ROLE_TRAINER, 1, 0);
    Rejoin("n1", "r1", pb::ROLE_ROLLOUT, 1, 2);
    ASSERT_TRUE(core_->AwaitPlanInstalled("m", absl::Now() + kReal));
  }

  FakeClock clock_;
  absl::Time window_end_;
  std::unique_ptr<CoordinatorCore> core_;
};

// Node n2 (rollout r2, beyond the spec's one rollout, so outside the first plan) heard the OK of
// version 2 and re-joins after the model was planned. A wait for version 2 landing in between
// waits, within the re-join window, for that re-join, which restores the commit: OK. Before, it
// was answered ABORTED at once ("its number is used") for a version committed cluster-wide.
TEST(RejoinWindowTest, AWaitForAUsedNumberWaitsForANodeStillReJoining) {
  RestartedCoordinator c({"n0", "n1", "n2"});
  ASSERT_NO_FATAL_FAILURE(c.RejoinTheNodesNotTold());
  absl::Status waited = absl::UnknownError("not answered");
  absl::Notification answered;
  std::thread wait([&] {
    waited = c.WaitFor("r1", 2);
    answered.Notify();
  });
  const bool held = c.clock_.AwaitWaiter(c.window_end_, absl::Now() + kReal);
  c.Rejoin("n2", "r2", pb::ROLE_ROLLOUT, 2, 2);
  // (A wait the re-join does not end is moved past its deadline: the test fails, never hangs.)
  if (!answered.WaitForNotificationWithTimeout(kReal)) c.clock_.Advance(absl::Seconds(30));
  wait.join();
  EXPECT_TRUE(held) << "the wait was not held in the re-join window";
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_TRUE(c.WaitFor("", 2).ok());
}

// The trainer's side: t0's node sends its Publish(2) again to the restarted coordinator (it was
// never answered). Within the window it waits for n2 too, whose re-join restores the commit; the
// publish is then refused "not newer" (FAILED_PRECONDITION), which a node answers by asking
// WaitVersion(2) (WorkerCalls::CommittedThere: OK). Before, ABORTED at once ("its number is used"):
// the trainer was told version 2 failed.
TEST(RejoinWindowTest, ATrainersPublishOfAUsedNumberWaitsForANodeStillReJoining) {
  RestartedCoordinator c({"n0", "n1", "n2"});
  ASSERT_NO_FATAL_FAILURE(c.RejoinTheNodesNotTold());
  absl::Status published = absl::UnknownError("not answered");
  absl::Notification answered;
  std::thread publish([&] {
    pb::CoordPublishRequest p;
    p.set_model_id("m");
    p.set_worker_id("t0");
    p.set_node_id("n0");
    p.set_version(2);
    p.set_timeout_ms(20000);
    pb::PublishResponse resp;
    published = c.core_->Publish(p, &resp);
    answered.Notify();
  });
  const bool held = c.clock_.AwaitWaiter(c.window_end_, absl::Now() + kReal);
  c.Rejoin("n2", "r2", pb::ROLE_ROLLOUT, 2, 2);
  if (!answered.WaitForNotificationWithTimeout(kReal)) c.clock_.Advance(absl::Seconds(30));
  publish.join();
  EXPECT_TRUE(held) << "the publish was not held in the re-join window";
  EXPECT_EQ(published.code(), absl::StatusCode::kFailedPrecondition) << published;
  EXPECT_NE(published.message().find("is not newer than version 2"), std::string::npos) << published;
  EXPECT_TRUE(c.WaitFor("", 2).ok());
}

// No node re-joins with the commit: at the window's end the wait is ABORTED naming the used
// number, and later waits are answered at once.
TEST(RejoinWindowTest, AWaitForAUsedNumberIsAbortedWhenTheWindowCloses) {
  RestartedCoordinator c({"n0", "n1"});
  ASSERT_NO_FATAL_FAILURE(c.RejoinTheNodesNotTold());
  absl::Status waited = absl::UnknownError("not answered");
  std::thread wait([&] { waited = c.WaitFor("r1", 2); });
  const bool held = c.clock_.AwaitWaiter(c.window_end_, absl::Now() + kReal);
  c.clock_.Advance(held ? kWindow : absl::Seconds(30));  // (not held: past its deadline, never a hang)
  wait.join();
  EXPECT_TRUE(held) << "the wait was not held in the re-join window";
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_NE(waited.message().find("its number is used: rollout r1 on node n1 re-joined holding version 2"), std::string::npos) << waited;
  absl::Status again = c.WaitFor("", 2);
  EXPECT_EQ(again.code(), absl::StatusCode::kAborted) << again;
}

}  // namespace
}  // namespace wb::daemon
