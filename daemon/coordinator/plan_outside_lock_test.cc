// The planner runs OUTSIDE the coordinator's lock (issue 14): while a plan is being made,
// heartbeats and ClusterStatus are answered. Deterministic: the injected planner blocks until the
// test has seen a heartbeat and a status answered (or gives up after a deadline, failing the test
// instead of hanging it). The real Kimi-K2 plans (8-1024 nodes of 8 GPUs) and the heartbeat p99
// while they run are measured by bench:control_plane (docs/operations.md), not here.
#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/coordinator.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace wb::daemon {
namespace {

TEST(PlanOutsideLockTest, HeartbeatsAndStatusAreAnsweredWhilePlanning) {
  absl::Notification planning, release;
  Coordinator::Options o;
  o.make_plan = [&](const planner::Problem& p, planner::Strategy s) -> absl::StatusOr<planner::Plan> {
    planning.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(30));
    return planner::MakePlan(p, s);
  };
  Coordinator coord(o);
  coord.Start();
  pb::RegisterNodeRequest rn;
  rn.set_node_id("n0");
  rn.set_address("127.0.0.1:1");  // InstallPlan to it fails later; planning comes first
  pb::RegisterNodeResponse rnr;
  ASSERT_TRUE(coord.RegisterNode(nullptr, &rn, &rnr).ok());
  for (auto [worker, role] : {std::pair{"t0", pb::ROLE_TRAINER}, std::pair{"r0", pb::ROLE_ROLLOUT}}) {
    pb::JoinWorkerRequest j;
    j.set_node_id("n0");
    j.set_worker_id(worker);
    j.set_model_id("m");
    j.set_role(role);
    *j.mutable_model() = testing::SmallModelSpec("m");
    pb::JoinWorkerResponse jr;
    ASSERT_TRUE(coord.JoinWorker(nullptr, &j, &jr).ok());
    pb::SubmitLayoutRequest l = testing::WholeTensorLayout("n0", worker);
    pb::SubmitLayoutResponse lr;
    ASSERT_TRUE(coord.SubmitLayout(nullptr, &l, &lr).ok());
  }
  ASSERT_TRUE(planning.WaitForNotificationWithTimeout(absl::Seconds(10))) << "the driver never planned";
  // The planner is blocked now. A heartbeat and a status must be answered meanwhile.
  absl::Notification answered;
  std::thread caller([&] {
    pb::HeartbeatRequest hb;
    hb.set_node_id("n0");
    hb.set_incarnation(rnr.incarnation());
    pb::HeartbeatResponse hbr;
    grpc::Status s = coord.Heartbeat(nullptr, &hb, &hbr);
    EXPECT_TRUE(s.ok()) << s.error_message();
    pb::StatusRequest sr;
    pb::StatusResponse st;
    EXPECT_TRUE(coord.ClusterStatus(nullptr, &sr, &st).ok());
    answered.Notify();
  });
  const bool ok = answered.WaitForNotificationWithTimeout(absl::Seconds(5));
  release.Notify();
  caller.join();
  EXPECT_TRUE(ok) << "heartbeat / ClusterStatus waited for the planner (planning under the coordinator's lock)";
  coord.Shutdown();
}

}  // namespace
}  // namespace wb::daemon
