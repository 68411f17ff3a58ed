// The coordinator's status push (WatchStatus) on a coordinator + two node daemons in one process
// (daemon/multinode_fixture.h).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <thread>

#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// The coordinator's status push (CoordinatorService.WatchStatus, through the daemon's auth/limit
// front): the first message comes at once, a commit is pushed as it happens (the safety-net resend
// is set to 30 s here, so nothing but the change signal can deliver it in time), a stream ends OK
// at its deadline, watchers over the limit get RESOURCE_EXHAUSTED, a cancelled client frees its
// slot, and Shutdown ends an open stream promptly with UNAVAILABLE.
TEST(StatusPushTest, PushesChangesHonoursDeadlineLimitCancelAndShutdown) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [](ServerOptions& o) {
    o.security.limits.max_status_watchers = 2;
    o.status_resend = absl::Seconds(30);
  });
  c.StartNode(0);
  c.StartNode(1);
  Coordinator* coordinator = c.coord_->coordinator();
  ASSERT_NE(coordinator, nullptr);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_ASYNC, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitCommitted(r0, "m", 1).ok());

  auto channel = grpc::CreateChannel(c.coord_->address(), grpc::InsecureChannelCredentials());
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5)));
  auto stub = pb::CoordinatorService::NewStub(channel);
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<pb::StatusResponse>> reader;
  };
  auto open = [&](int64_t timeout_ms) {
    auto s = std::make_unique<Stream>();
    s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    pb::WatchStatusRequest req;
    req.set_timeout_ms(timeout_ms);
    s->reader = stub->WatchStatus(&s->ctx, req);
    return s;
  };

  // First message at once (nothing changes meanwhile: the 30 s resend would be the only other
  // source), then a commit pushes its status as it happens.
  {
    const absl::Time opened = absl::Now();
    auto w = open(20000);
    pb::StatusResponse msg;
    ASSERT_TRUE(w->reader->Read(&msg));
    EXPECT_LT(absl::Now() - opened, absl::Seconds(5));
    EXPECT_EQ(msg.role(), "coordinator");
    EXPECT_EQ(CommittedOf(msg, "m"), 1u);
    for (auto& s : c.Publish("m", pb::MODE_ASYNC, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(WaitCommitted(r0, "m", 2).ok());
    const absl::Time committed = absl::Now();
    int messages = 1;
    bool seen = false;
    while (!seen && w->reader->Read(&msg)) {
      ++messages;
      seen = CommittedOf(msg, "m") == 2;
    }
    ASSERT_TRUE(seen) << "the commit of version 2 was not pushed";
    // Well under the 30 s resend, so only the change signal can have delivered it; not a tighter
    // bound: a loaded 2-core CI machine can leave the watcher's thread unscheduled for a second.
    const absl::Duration lag = absl::Now() - committed;
    EXPECT_LT(lag, absl::Seconds(5)) << "commit pushed " << lag << " after WaitVersion returned";
    EXPECT_GE(messages, 3) << "publish / transfer steps should have been pushed before the commit";
    w->ctx.TryCancel();
    (void)w->reader->Finish();
  }
  // The cancelled stream's slot comes back.
  ASSERT_TRUE(coordinator->AwaitStatusWatchersAtMost(0, absl::Now() + absl::Seconds(5)));

  // A stream ends OK at its deadline and frees its slot.
  {
    const absl::Time opened = absl::Now();
    auto w = open(300);
    pb::StatusResponse msg;
    int messages = 0;
    while (w->reader->Read(&msg)) ++messages;
    grpc::Status end = w->reader->Finish();
    const absl::Duration took = absl::Now() - opened;
    EXPECT_TRUE(end.ok()) << end.error_message();
    EXPECT_GE(messages, 1);
    EXPECT_GE(took, absl::Milliseconds(290));
    EXPECT_LT(took, absl::Seconds(5));
    ASSERT_TRUE(coordinator->AwaitStatusWatchersAtMost(0, absl::Now() + absl::Seconds(5)));
  }

  // Limit 2: a third watcher is refused; cancelling one lets the next in.
  {
    auto a = open(20000), b = open(20000);
    pb::StatusResponse msg;
    ASSERT_TRUE(a->reader->Read(&msg));
    ASSERT_TRUE(b->reader->Read(&msg));
    auto refused = open(20000);
    EXPECT_FALSE(refused->reader->Read(&msg));
    grpc::Status st = refused->reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_NE(st.error_message().find("max_status_watchers"), std::string::npos) << st.error_message();
    a->ctx.TryCancel();
    (void)a->reader->Finish();
    ASSERT_TRUE(coordinator->AwaitStatusWatchersAtMost(1, absl::Now() + absl::Seconds(5)))
        << "a cancelled watcher did not free its slot";
    auto next = open(20000);
    EXPECT_TRUE(next->reader->Read(&msg)) << next->reader->Finish().error_message();

    // Shutdown ends open streams at once with UNAVAILABLE (and is not held up by them).
    std::atomic<bool> ended{false};
    grpc::Status shut_status;
    std::thread reader([&] {
      pb::StatusResponse m;
      while (b->reader->Read(&m)) {}
      shut_status = b->reader->Finish();
      ended = true;
    });
    const absl::Time shutdown_start = absl::Now();
    c.coord_->Shutdown();
    const absl::Duration shutdown_took = absl::Now() - shutdown_start;
    reader.join();
    EXPECT_LT(shutdown_took, absl::Seconds(1.5)) << "the server's 2 s grace ran out: a stream held Shutdown up";
    EXPECT_TRUE(ended.load());
    EXPECT_EQ(shut_status.error_code(), grpc::StatusCode::UNAVAILABLE) << shut_status.error_message();
    while (next->reader->Read(&msg)) {}
    EXPECT_EQ(next->reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  c.Stop();
}

}  // namespace
}  // namespace wb::daemon
