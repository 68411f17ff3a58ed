// status.md item 24, the leftover of the fortieth session's fix: the trainers' node restarts too.
// Real daemons in one process (daemon/multinode_fixture.h): coordinator, n0 (trainer t0, with a
// live state directory) and n1 (rollout r1), one-step-off. Version 1 is held on n1 mid-transfer,
// so version 2 - published by t0, answered OK at record - never starts; then the coordinator AND
// n0 restart. The same trainer process registers again with the new n0; r1's Apply(2) reaches n1
// after its re-join, for a version n1 knows nothing of, and n1 asks the new coordinator once. That
// one learns that 2 is used only from t0's node: n0 kept the record in its state directory
// (node::PublishRecord) and sends it with the trainer's join. Before, the new n0 knew nothing, the
// coordinator waited for a version 2 no one would publish, and the Apply ran into its deadline.
#include <atomic>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(30);

// A new coordinator process on the stopped one's port (the nodes find it there and re-join).
void RestartCoordinatorOnItsPort(Cluster& c) {
  const int port = c.coord_->port();
  c.coord_->Shutdown();
  c.coord_.reset();
  c.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
}

TEST(PublishRecordRestartTest, ATrainersNodeThatRestartedStillTellsANewCoordinatorItsPublishedVersion) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string state_dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/n0-state-", ::getpid());
  planner::Inventory inv = SmallInventory();
  Cluster c;
  absl::Notification held, release;
  std::atomic<bool> armed{true};
  const StopAtExit stop(c, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go
  c.StartCoordinator();
  const auto n0_state = [&](ServerOptions& o) { o.live_state_dir = state_dir; };
  c.StartNode(0, nullptr, nullptr, n0_state);
  c.StartNode(1, [&](const std::string&, uint64_t version, uint32_t) {
    if (version == 1 && armed.exchange(false)) {
      held.Notify();
      release.WaitForNotificationWithTimeout(kReal);
    }
  });
  ASSERT_FALSE(::testing::Test::HasFailure());
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}, {1, {0, 0}, {4, 6}, false}}));
  for (TestWorker* w : {&t0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;

  // Version 1 is held on n1 while it transfers; version 2 is recorded behind it (one-step-off:
  // answered OK at record) and never reaches n1.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0}, {&r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(kReal)) << "version 1 never reached n1's buckets";
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0}, {&r1})) ASSERT_TRUE(s.ok()) << s.error_message();

  // The trainers' node and the coordinator restart; the same trainer process registers again.
  c.nodes_[0]->Shutdown();
  c.nodes_[0].reset();
  ASSERT_NO_FATAL_FAILURE(RestartCoordinatorOnItsPort(c));
  release.Notify();
  c.StartNode(0, nullptr, nullptr, n0_state);
  ASSERT_FALSE(::testing::Test::HasFailure());
  c.Connect(t0);
  grpc::Status joined = c.Register(t0, spec);
  ASSERT_TRUE(joined.ok()) << joined.error_message();

  // Both back at the new coordinator: r1 re-joined by n1, t0 joined anew by the new n0.
  auto back = c.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        int with_layout = 0;
        for (const pb::WorkerStatus& ws : st.workers()) with_layout += ws.has_layout();
        return with_layout == 2;
      },
      kReal);
  ASSERT_TRUE(back.ok()) << back.status();

  // r1's Apply(2) after n1's re-join: n1 asks the new coordinator, which knows the number is used
  // (ABORTED at the re-join window's end at the latest; before, DEADLINE_EXCEEDED at 15 s).
  pb::ApplyResponse resp;
  grpc::Status s = ApplyWithin(r1, 2, 15000, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  for (const char* want : {"its number is used", "trainer t0 on node n0", "published version 2"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }

  // The cluster goes on with a newer number: version 3 reaches r1 byte for byte.
  for (auto& p : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0}, {&r1})) ASSERT_TRUE(p.ok()) << p.error_message();
  grpc::Status a = ApplyWithin(r1, 3, 20000, &resp);
  ASSERT_TRUE(a.ok()) << a.error_message();
  EXPECT_EQ(resp.applied_version(), 3u);
  EXPECT_EQ(CountBad(r1, 3), 0);
}

}  // namespace
}  // namespace wb::daemon
