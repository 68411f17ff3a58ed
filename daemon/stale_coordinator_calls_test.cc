// Real daemons (daemon/multinode_fixture.h): the calls a dead coordinator sent just before it died
// and a node handles only after its re-join of the restarted one (a frozen node, a handler
// scheduled late) - InstallPlan, CommitVersion, AbortVersion, stamped with the old coordinator
// instance as its GrpcNodeClient stamps them - are refused FAILED_PRECONDITION naming both
// instances, and do nothing to the new session's versions (status.md items 20 / 24; the unit
// tests are versions_test's, ExecuteVersion's real-daemon test multinode_fault_test's).
#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/coordinator/grpc_node_client.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// The instance of the coordinator at `address` (what it answers a RegisterNode: a probe node that
// holds no workers, so no plan lists it).
std::string CoordinatorInstance(const std::string& address) {
  auto stub = pb::CoordinatorService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  pb::RegisterNodeRequest req;
  req.set_node_id("instance-probe");
  req.set_address("127.0.0.1:1");
  pb::RegisterNodeResponse resp;
  grpc::Status s = stub->RegisterNode(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.coordinator_instance();
}

// The instance a refusal says the node is registered with ("" when it names none).
std::string RegisteredInstance(const absl::Status& refusal) {
  const std::string key = "but the node is registered with coordinator instance ";
  const size_t at = refusal.message().find(key);
  if (at == std::string::npos) return {};
  const size_t from = at + key.size();
  return std::string(refusal.message().substr(from, refusal.message().find(' ', from) - from));
}

// Version 2 of the new session is in flight (n0 holds its first bucket) when the dead coordinator's
// AbortVersion(2), CommitVersion(2) and InstallPlan reach both nodes. Each is refused naming the
// old and the new instance; version 2 then commits and lands byte for byte on both rollouts, and
// version 3 runs on the new session's plan (the stale slice did not replace it). Without the
// instance check the abort ended n0's execution of version 2 (its Apply failed), the commit was
// judged as the new session's, and the empty slice replaced the plan version 3 runs on.
TEST(StaleCoordinatorCallsTest, TheDeadCoordinatorsLateInstallPlanCommitAndAbortAreRefusedAfterTheReJoin) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  absl::Notification entered, release;
  const StopAtExit stop(c, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go
  auto [t0, t1, r0, r1] = StartTwoNodeCluster(c, inv, {.n0_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 2 || entered.HasBeenNotified()) return;  // hold the new session's version 2 once
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  }});
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitCommitted(t0, "m", 1).ok());

  const std::string old_instance = CoordinatorInstance(c.coord_->address());
  ASSERT_FALSE(old_instance.empty());
  const int port = c.coord_->port();
  c.coord_->Shutdown();
  c.coord_.reset();
  c.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto back = c.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        int with_layout = 0;
        for (const pb::WorkerStatus& ws : st.workers()) with_layout += ws.has_layout();
        return with_layout == 4;
      },
      absl::Seconds(30));
  ASSERT_TRUE(back.ok()) << back.status();  // both nodes re-joined the new coordinator

  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(20))) << "version 2 did not start in the new session";

  std::string new_instance;
  for (int n : {0, 1}) {
    SCOPED_TRACE(absl::StrCat("n", n));
    GrpcNodeClient stale(grpc::CreateChannel(c.nodes_[n]->address(), grpc::InsecureChannelCredentials()), old_instance);
    pb::PlanSlice slice;
    slice.set_model_id("m");
    slice.set_plan_epoch(1);
    const absl::Status refusals[] = {
        stale.AbortVersion("m", 2, 0, "the dead coordinator's abort", absl::Seconds(10)),
        stale.CommitVersion("m", 2, absl::Seconds(10)),
        stale.InstallPlan(slice, absl::Seconds(10)),
    };
    const std::string calls[] = {"AbortVersion of model m version 2", "CommitVersion of model m version 2", "InstallPlan of model m plan epoch 1"};
    for (int i = 0; i < 3; ++i) {
      const absl::Status& s = refusals[i];
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << calls[i] << ": " << s;
      EXPECT_NE(s.message().find(absl::StrCat(calls[i], " refused on node n", n, ": it comes from coordinator instance ", old_instance,
                                              ", but the node is registered with coordinator instance ")),
                std::string::npos)
          << s;
      const std::string registered = RegisteredInstance(s);
      EXPECT_FALSE(registered.empty()) << s;
      EXPECT_NE(registered, old_instance) << s;
      if (new_instance.empty()) new_instance = registered;
      EXPECT_EQ(registered, new_instance) << "every refusal names the same new instance: " << s;
    }
  }
  release.Notify();

  pb::ApplyResponse resp;
  for (TestWorker* r : {&r0, &r1}) {
    grpc::Status s = c.Apply(*r, "m", 2, &resp);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(resp.applied_version(), 2u) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
  ASSERT_TRUE(WaitCommitted(t0, "m", 2).ok());
  EXPECT_EQ(c.FinalVersion(2).state(), "committed");
  // The new session's plan is still installed: version 3 runs on it.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) {
    grpc::Status s = c.Apply(*r, "m", 3, &resp);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(resp.applied_version(), 3u) << r->id;
    EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  }
  c.Stop();
}

}  // namespace
}  // namespace wb::daemon
