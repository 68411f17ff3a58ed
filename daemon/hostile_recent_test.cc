// Hostile probes of the surface added in the thirty-sixth to forty-first sessions (docs/security.md
// "Found by the forty-second session's probe"), with real daemons: a coordinator and two node
// daemons in this process (daemon/multinode_fixture.h) on 127.0.0.1:0, workers on the nodes' Unix
// sockets with shared-memory weights, every rollout byte checked against its version.
#include <grpcpp/grpcpp.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace wb::daemon {
namespace {

// What a rollout does to get version v: sync, WaitVersion with its worker id (OK once its live
// weights hold v); otherwise Apply(v).
grpc::Status Receive(Cluster& c, TestWorker& r, pb::Mode mode, uint64_t v) {
  if (mode == pb::MODE_SYNC) {
    pb::WaitVersionResponse resp;
    return WaitVersionAs(r, "m", v, 20000, &resp);
  }
  pb::ApplyResponse resp;
  return ApplyWithin(r, v, 20000, &resp);
}

// The coordinator's planner, held once on request: the next plan made after Arm() waits (Entered)
// until Release() (or 20 s), then plans as usual.
class PlanGate {
 public:
  PlanFn Fn() {
    return [this](const planner::Problem& p, planner::Strategy s) {
      bool hold = false;
      {
        absl::MutexLock l(&mu_);
        hold = armed_;
        armed_ = false;
      }
      if (hold) {
        entered_.Notify();
        release_.WaitForNotificationWithTimeout(absl::Seconds(20));
      }
      return planner::MakePlan(p, s);
    };
  }
  void Arm() {
    absl::MutexLock l(&mu_);
    armed_ = true;
  }
  bool Entered() { return entered_.WaitForNotificationWithTimeout(absl::Seconds(15)); }
  void Release() { NotifyOnce(release_); }

 private:
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification entered_, release_;
};

class UnservableLateRolloutTest : public ::testing::TestWithParam<pb::Mode> {
 protected:
  void TearDown() override { c_.Stop(); }
  planner::Inventory inv_ = SmallInventory();
  Cluster c_;
};

// A catch-up brings every late rollout of the model in one plan. A process on the worker socket
// joined as a rollout holding tensor b, which no rollout holds (they hold a only): the sources
// cannot serve it. Joined together with an ordinary late rollout r4 (holding a, as the others), the
// catch-up had no plan and failed for both: r4's WaitVersion(1) / Apply(1) answered ABORTED "no plan
// from the rollouts holding it ... tensor b" - one worker's layout failed another's catch-up (and
// without trainers no next version would come). Now the late rollouts that cannot be served alone
// fail alone, each told why, and the others are caught up: r4 holds version 1 byte for byte; x's
// call is ABORTED naming b. Version 2 then reaches every rollout, x included.
TEST_P(UnservableLateRolloutTest, ALateRolloutTheSourcesCannotServeFailsAloneNotWithTheOthers) {
  const pb::Mode mode = GetParam();
  PlanGate gate;
  const StopAtExit stop(c_, [&] { gate.Release(); });
  c_.StartCoordinator(absl::Seconds(3), "127.0.0.1:0", [&](ServerOptions& o) { o.make_plan = gate.Fn(); });
  c_.StartNode(0);
  c_.StartNode(1);
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  const planner::WorkerLayout only_a = LayoutOf(inv_, {{0, {0, 0}, {8, 16}, false}});
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& t1 = c_.AddWorker("t1", pb::ROLE_TRAINER, 1, &inv_, LayoutOf(inv_, {{0, {4, 0}, {8, 16}, false}}));
  TestWorker& r0 = c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, only_a);
  TestWorker& r1 = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, LayoutOf(inv_, {{0, {0, 0}, {8, 16}, true}}));
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c_.Register(*w, spec).ok()) << w->id;
  for (grpc::Status& s : c_.Publish("m", mode, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) {
    grpc::Status s = Receive(c_, *r, mode, 1);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  // The re-plan for x is held until r4 joined too: both are late in the plan the catch-up follows.
  gate.Arm();
  TestWorker& x = c_.AddWorker("x", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{1, {0, 0}, {4, 6}, false}}));
  ASSERT_TRUE(c_.Register(x, spec).ok());
  ASSERT_TRUE(gate.Entered()) << "no plan was made for x";
  TestWorker& r4 = c_.AddWorker("r4", pb::ROLE_ROLLOUT, 1, &inv_, only_a);
  ASSERT_TRUE(c_.Register(r4, spec).ok());
  gate.Release();
  grpc::Status s = Receive(c_, r4, mode, 1);
  ASSERT_TRUE(s.ok()) << "r4 failed with the rollout the sources cannot serve: " << s.error_message();
  EXPECT_EQ(CountBad(r4, 1), 0) << "r4 was told version 1 before holding it";
  s = Receive(c_, x, mode, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  for (const char* want : {"catch-up of model m version 1 failed", "worker `x` piece 0 (tensor `b`", "held by no source"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  // The model goes on, x included.
  for (grpc::Status& p : c_.Publish("m", mode, 2, {&t0, &t1}, {&r0, &r1, &r4, &x})) ASSERT_TRUE(p.ok()) << p.error_message();
  for (TestWorker* r : {&r0, &r1, &r4, &x}) {
    grpc::Status a = Receive(c_, *r, mode, 2);
    ASSERT_TRUE(a.ok()) << r->id << ": " << a.error_message();
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
}

// RegisterWorker / RegisterLayout / Deregister are held while the node's coordinator is down (up to
// the worker's deadline; fortieth session), each on a worker-socket server thread. They took no
// waiting-call slot: with the node's quota at 16 threads (max_blocked_calls 8 + 8 of headroom), 40
// RegisterWorker of one process during an outage took every thread (15 held, 25 turned away by
// gRPC) and another worker's Status was answered "Server Threadpool Exhausted" (3 of 3) until they
// timed out. Now they count against max_blocked_calls: at most 8 are held, the other 32 are
// answered RESOURCE_EXHAUSTED at once, and the other worker's Status gets a thread meanwhile.
TEST(HeldRegistrationsTest, RegistrationsHeldDuringACoordinatorOutageLeaveThreadsForOtherWorkers) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0, nullptr, nullptr, [](ServerOptions& o) {
    o.security.limits.max_blocked_calls = 8;
    o.security.limits.server_thread_headroom = 8;
  });
  const pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}}));
  ASSERT_TRUE(c.RegisterWorker(r0, spec).ok());
  c.coord_->Shutdown();  // down: the node holds what it would forward
  constexpr int kCalls = 40, kHeld = 8;
  absl::Mutex mu;
  int exhausted = 0;  // answered RESOURCE_EXHAUSTED (by the limit, or by gRPC for want of a thread)
  std::vector<std::thread> callers;
  for (int i = 0; i < kCalls; ++i) {
    callers.emplace_back([&, i] {
      auto stub = pb::WorkerService::NewStub(grpc::CreateChannel("unix://" + c.nodes_[0]->worker_socket(), grpc::InsecureChannelCredentials()));
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(14));
      pb::RegisterWorkerRequest rw;
      rw.set_model_id("m");
      rw.set_worker_id(absl::StrCat("h", i));
      rw.set_role(pb::ROLE_ROLLOUT);
      rw.set_gpu(-1);
      *rw.mutable_model() = spec;
      pb::RegisterWorkerResponse resp;
      grpc::Status s = stub->RegisterWorker(&ctx, rw, &resp);
      absl::MutexLock l(&mu);
      if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++exhausted;
    });
  }
  bool refused_at_once = false;
  {
    absl::MutexLock l(&mu);
    auto all_but_held = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return exhausted >= kCalls - kHeld; };
    // Before the held calls' own 13 s: only the calls refused at once count.
    refused_at_once = mu.AwaitWithTimeout(absl::Condition(&all_but_held), absl::Seconds(10));
  }
  grpc::Status status;
  if (refused_at_once) {
    // (The node asks the coordinator for the cluster's view first, up to 5 s, then answers its own.)
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(12));
    pb::StatusResponse st;
    status = r0.stub->Status(&ctx, pb::StatusRequest(), &st);
  }
  for (std::thread& t : callers) t.join();
  ASSERT_TRUE(refused_at_once) << "more than " << kHeld << " registrations held during the outage (RESOURCE_EXHAUSTED: " << exhausted << ")";
  // Served: whatever the node answers without its coordinator (its question to the coordinator
  // times out), not gRPC's "Server Threadpool Exhausted".
  EXPECT_NE(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << "another worker's Status while registrations are held: "
                                                                        << status.error_message();
  c.Stop();
}

INSTANTIATE_TEST_SUITE_P(Modes, UnservableLateRolloutTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF),
                         [](const ::testing::TestParamInfo<pb::Mode>& i) { return pb::Mode_Name(i.param); });

}  // namespace
}  // namespace wb::daemon
