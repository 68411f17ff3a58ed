// Sync rollouts that do not pause (sync_pause.h, docs/daemon.md "Rollouts that never pause"), over
// fake nodes on a FakeClock: past CoordinatorOptions::sync_pause_timeout a rollout of the plan that
// did not call BeginUpdate is left out and the version commits for the paused ones; its next
// BeginUpdate puts it back, and it is caught up before its WaitVersion answers. No rollout paused,
// or a timeout of 0: the version waits as before, until the trainer's publish deadline.
#include "daemon/coordinator/sync_pause.h"

#include <atomic>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);  // real-time bound on any wait in these tests

TEST(RolloutsToLeaveOutTest, TheOnesNotPausedAndOnlyWhenOneIs) {
  const std::set<std::string> rollouts{"r0", "r1", "r2"};
  EXPECT_EQ(RolloutsToLeaveOut(rollouts, [](const std::string& r) { return r == "r0"; }),
            (std::vector<std::string>{"r1", "r2"}));
  EXPECT_TRUE(RolloutsToLeaveOut(rollouts, [](const std::string&) { return false; }).empty()) << "none paused: nobody left out";
  EXPECT_TRUE(RolloutsToLeaveOut(rollouts, [](const std::string&) { return true; }).empty());
}

// Trainer t0 and rollout r0 on n0, rollout r1 on n1, a sync model "m" of two rollouts; fake nodes
// report a version (or catch-up) done as soon as they are told to execute it.
class PauseCluster {
 public:
  PauseCluster(FakeClock* clock, absl::Duration sync_pause_timeout, PlanFn make_plan = nullptr) : clock_(clock) {
    CoordinatorOptions o;
    o.make_plan = std::move(make_plan);
    o.clock = clock;
    o.transfer_timeout = absl::Seconds(60);
    o.sync_pause_timeout = sync_pause_timeout;
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      fake->on_install = [this, node](const pb::PlanSlice& slice) {
        if (slice.catch_up()) return absl::OkStatus();
        absl::MutexLock l(&slices_mu_);
        slices_[{node, slice.plan_epoch()}] = slice;
        return absl::OkStatus();
      };
      fake->on_execute = [this, node](const pb::ExecuteVersionRequest& req) {
        (req.catch_up() ? catch_ups : executes)[node == "n0" ? 0 : 1]++;
        pb::ReportDoneRequest done = testing::DoneReport(node, req);
        if (!req.catch_up()) {
          // The digests of every op of its slice, both ends alike (a clean transfer): the version
          // is verified when every op of the plan it ran was reported.
          absl::MutexLock l(&slices_mu_);
          version_epoch_[req.version()] = req.plan_epoch();
          if (auto it = slices_.find({node, req.plan_epoch()}); it != slices_.end()) {
            for (const pb::TransferOp& op : it->second.ops()) {
              for (pb::OpDigest* d : {done.add_source_digests(), done.add_landed_digests()}) {
                d->set_op(op.index());
                d->set_digest(op.index() + 1000);
              }
            }
          }
        }
        done.set_catch_up(req.catch_up());
        done.set_plan_epoch(req.plan_epoch());
        pb::ReportDoneResponse resp;
        return core->ReportDone(done, &resp);
      };
      return fake;
    };
    core = std::make_unique<CoordinatorCore>(std::move(o));
    core->Start();
    for (const std::string n : {"n0", "n1"}) {
      pb::RegisterNodeRequest req;
      req.set_node_id(n);
      req.set_address(n + ":1");
      pb::RegisterNodeResponse resp;
      EXPECT_TRUE(core->RegisterNode(req, &resp).ok());
      incarnation_[n] = resp.incarnation();
    }
    pb::ModelSpec spec = testing::SmallModelSpec("m", 2);
    spec.set_mode(pb::MODE_SYNC);
    for (const auto& [node, worker, role] : {std::tuple{"n0", "t0", pb::ROLE_TRAINER}, std::tuple{"n0", "r0", pb::ROLE_ROLLOUT},
                                             std::tuple{"n1", "r1", pb::ROLE_ROLLOUT}}) {
      pb::JoinWorkerRequest j;
      j.set_node_id(node);
      j.set_worker_id(worker);
      j.set_model_id("m");
      j.set_role(role);
      *j.mutable_model() = spec;
      pb::JoinWorkerResponse jr;
      EXPECT_TRUE(core->JoinWorker(j, &jr).ok());
      pb::SubmitLayoutResponse lr;
      EXPECT_TRUE(core->SubmitLayout(testing::WholeTensorLayout(node, worker), &lr).ok());
      node_of_[worker] = node;
    }
  }
  ~PauseCluster() {
    core->Shutdown();
    if (publisher_.joinable()) publisher_.join();
  }

  absl::Status Ready(const std::string& rollout) {
    pb::ReportReadyRequest r;
    r.set_node_id(node_of_[rollout]);
    r.set_model_id("m");
    r.set_worker_id(rollout);
    pb::ReportReadyResponse resp;
    return core->ReportReady(r, &resp);
  }
  absl::Status WaitFor(const std::string& worker, uint64_t v, int64_t timeout_ms) {
    pb::WaitVersionRequest w;
    w.set_model_id("m");
    w.set_version(v);
    w.set_timeout_ms(timeout_ms);
    w.set_worker_id(worker);
    pb::WaitVersionResponse wr;
    return core->WaitVersion(w, &wr);
  }
  // WaitVersion(v) of `worker` that must be answered without simulated time moving (real-time
  // bound); one that is not is ended by moving simulated time past its deadline, and fails.
  absl::Status WaitAnswered(const std::string& worker, uint64_t v) {
    absl::Status out;
    absl::Notification done;
    std::thread waiter([&] {
      out = WaitFor(worker, v, 10000);
      done.Notify();
    });
    const bool answered = done.WaitForNotificationWithTimeout(kReal);
    if (!answered) clock_->Advance(absl::Seconds(11));
    waiter.join();
    return answered ? out : absl::InternalError(absl::StrCat("WaitVersion(", v, ") of ", worker, " not answered: ", out.ToString()));
  }
  // Publish(v) by t0 on its own thread, timeout `timeout_ms`; returns once it waits on the clock.
  // A publish that can commit without simulated time moving (every rollout paused) passes
  // `await_waiter` false: its wait on the clock may begin and end before AwaitWaiter looks (a
  // waiter seen only in passing is missed: 1 in 10 runs failed on a loaded machine).
  void StartPublish(uint64_t v, int64_t timeout_ms, bool await_waiter = true) {
    const absl::Time deadline = clock_->Now() + absl::Milliseconds(timeout_ms);
    if (publisher_.joinable()) publisher_.join();
    auto returned = std::make_shared<absl::Notification>();
    publish_returned_ = returned;
    publisher_ = std::thread([this, v, timeout_ms, returned] {
      pb::CoordPublishRequest p;
      p.set_model_id("m");
      p.set_worker_id("t0");
      p.set_node_id("n0");
      p.set_version(v);
      p.set_timeout_ms(timeout_ms);
      pb::PublishResponse resp;
      published_ = core->Publish(p, &resp);
      returned->Notify();
    });
    if (await_waiter) ASSERT_TRUE(clock_->AwaitWaiter(deadline, absl::Now() + kReal));
  }
  // The publish's answer (real-time bound).
  absl::Status Published() {
    // Not returned: the thread is left to the destructor (Shutdown ends its wait), the test fails.
    if (!publish_returned_->WaitForNotificationWithTimeout(kReal)) return absl::InternalError("Publish did not return");
    if (publisher_.joinable()) publisher_.join();
    return published_;
  }
  // Moves simulated time on by `d` in 0.5 s steps (below lease / 4), renewing both nodes' leases
  // before each and waiting for the driver's pass at each new time.
  bool Advance(absl::Duration d) {
    for (absl::Duration done; done < d; done += absl::Milliseconds(500)) {
      for (const auto& [node, incarnation] : incarnation_) {
        pb::HeartbeatRequest hb;
        hb.set_node_id(node);
        hb.set_incarnation(incarnation);
        pb::HeartbeatResponse resp;
        core->Heartbeat(hb, &resp).IgnoreError();
      }
      clock_->Advance(absl::Milliseconds(500));
      if (!core->AwaitDriverPassAt(clock_->Now(), absl::Now() + kReal)) return false;
    }
    return true;
  }
  pb::WorkerStatus Worker(const std::string& id) {
    pb::StatusResponse st;
    EXPECT_TRUE(core->ClusterStatus(pb::StatusRequest(), &st).ok());
    for (const pb::WorkerStatus& w : st.workers()) {
      if (w.worker_id() == id) return w;
    }
    ADD_FAILURE() << "no status of " << id;
    return {};
  }
  pb::VersionStatus Version(uint64_t v) {
    pb::StatusResponse st;
    EXPECT_TRUE(core->ClusterStatus(pb::StatusRequest(), &st).ok());
    for (const pb::VersionStatus& vs : st.versions()) {
      if (vs.version() == v) return vs;
    }
    ADD_FAILURE() << "no status of version " << v;
    return {};
  }
  // Ops of the plan (its num_ops, from n0's slice) version `v` was executed on; 0 if none.
  int64_t OpsOfPlanRun(uint64_t v) {
    absl::MutexLock l(&slices_mu_);
    auto e = version_epoch_.find(v);
    if (e == version_epoch_.end()) return 0;
    auto it = slices_.find({"n0", e->second});
    return it == slices_.end() ? 0 : it->second.stats().num_ops();
  }
  int64_t ModelPlanOps() {
    pb::StatusResponse st;
    EXPECT_TRUE(core->ClusterStatus(pb::StatusRequest(), &st).ok());
    return st.models_size() > 0 ? st.models(0).plan_stats().num_ops() : 0;
  }
  uint64_t Committed() {
    pb::StatusResponse st;
    EXPECT_TRUE(core->ClusterStatus(pb::StatusRequest(), &st).ok());
    return st.models_size() > 0 ? st.models(0).committed_version() : 0;
  }

  std::atomic<int> executes[2] = {0, 0}, catch_ups[2] = {0, 0};  // by node n0, n1
  std::unique_ptr<CoordinatorCore> core;

 private:
  FakeClock* clock_;
  std::map<std::string, uint64_t> incarnation_;
  std::map<std::string, std::string> node_of_;
  absl::Mutex slices_mu_;
  std::map<std::pair<std::string, uint64_t>, pb::PlanSlice> slices_ ABSL_GUARDED_BY(slices_mu_);  // by node, epoch
  std::map<uint64_t, uint64_t> version_epoch_ ABSL_GUARDED_BY(slices_mu_);  // version -> plan epoch it ran on
  std::thread publisher_;
  std::shared_ptr<absl::Notification> publish_returned_;
  absl::Status published_;
};

// r0 paused, r1 never: past the 5 s timeout r1 is left out (status says so, naming the version and
// the timeout), version 1 runs on n0 only and commits. r1's WaitVersion(1) does not answer while it
// does not hold version 1; its BeginUpdate puts it back, it is caught up (a catch-up on n1), and
// only then is it answered. Version 2 then waits for r1's pause again, as any rollout's.
TEST(SyncPauseTest, TimeoutLeavesOutTheRolloutNotPausedAndTheVersionCommits) {
  FakeClock clock;
  PauseCluster c(&clock, absl::Seconds(5));
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  c.StartPublish(1, 30000);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_TRUE(c.Advance(absl::Seconds(4)));
  EXPECT_EQ(c.executes[0] + c.executes[1], 0) << "version 1 started before the sync pause timeout";
  EXPECT_FALSE(c.Worker("r1").left_out()) << "left out before the timeout";
  ASSERT_TRUE(c.Advance(absl::Seconds(2)));
  absl::Status s = c.Published();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.Committed(), 1u);
  EXPECT_EQ(c.executes[0], 1);
  EXPECT_EQ(c.executes[1], 0) << "n1 (only r1) executed a version r1 was left out of";
  const pb::WorkerStatus r1 = c.Worker("r1");
  EXPECT_TRUE(r1.left_out());
  EXPECT_FALSE(r1.catching_up()) << "a left-out rollout is not caught up before it pauses";
  for (const char* part : {"version 1", "5s", "BeginUpdate"}) {
    EXPECT_NE(r1.left_out_reason().find(part), std::string::npos) << part << " missing in: " << r1.left_out_reason();
  }
  EXPECT_FALSE(c.Worker("r0").left_out());
  // r1 does not hold version 1: its wait is not answered OK.
  {
    absl::Status waited;
    absl::Notification returned;
    const absl::Time deadline = clock.Now() + absl::Seconds(2);
    std::thread waiter([&] {
      waited = c.WaitFor("r1", 1, 2000);
      returned.Notify();
    });
    ASSERT_TRUE(clock.AwaitWaiter(deadline, absl::Now() + kReal));
    ASSERT_TRUE(c.Advance(absl::Seconds(2)));
    ASSERT_TRUE(returned.WaitForNotificationWithTimeout(kReal));
    waiter.join();
    EXPECT_TRUE(absl::IsDeadlineExceeded(waited)) << "a left-out rollout was told it holds version 1: " << waited;
  }
  EXPECT_EQ(c.catch_ups[1], 0);
  // r1 pauses: back in the plan, caught up to version 1 before its wait answers.
  ASSERT_TRUE(c.Ready("r1").ok());
  s = c.WaitAnswered("r1", 1);  // without simulated time moving: the catch-up runs in real time
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.catch_ups[1].load(), 1) << "r1 was answered without a catch-up";
  EXPECT_FALSE(c.Worker("r1").left_out());
  // Version 2: both in the plan, both pause, it runs on both nodes at once.
  ASSERT_TRUE(c.Ready("r0").ok());
  ASSERT_TRUE(c.Ready("r1").ok());
  c.StartPublish(2, 30000, /*await_waiter=*/false);
  s = c.Published();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.executes[1], 1) << "version 2 did not reach n1";
}

// Issue H115: version 1 ran on the plan without r1 (fewer ops); r1 then came back and the model
// was planned again with it. Version 1's status still describes the plan it ran: its num_ops is that
// plan's, and with every op's digests reported, all of them verified (it read the model's new plan,
// so a verified version showed 1 of 2 ops verified and looked unproven).
TEST(SyncPauseTest, AVersionRunWithoutALeftOutRolloutShowsThePlanItRan) {
  FakeClock clock;
  PauseCluster c(&clock, absl::Seconds(5));
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  const int64_t full_ops = c.ModelPlanOps();
  ASSERT_TRUE(c.Ready("r0").ok());
  c.StartPublish(1, 30000);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_TRUE(c.Advance(absl::Seconds(6)));
  absl::Status s = c.Published();
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(c.Worker("r1").left_out());
  const int64_t ran_ops = c.OpsOfPlanRun(1);
  ASSERT_GT(ran_ops, 0);
  ASSERT_LT(ran_ops, full_ops) << "the plan without r1 is not smaller: the test shows nothing";
  // r1 pauses: back in the plan (planned again with it), caught up to version 1.
  ASSERT_TRUE(c.Ready("r1").ok());
  s = c.WaitAnswered("r1", 1);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_EQ(c.ModelPlanOps(), full_ops) << "the model was not planned again with r1";
  const pb::VersionStatus v1 = c.Version(1);
  EXPECT_EQ(v1.state(), "committed");
  EXPECT_EQ(v1.num_ops(), static_cast<uint32_t>(ran_ops)) << "version 1's num_ops is not that of the plan it ran";
  EXPECT_EQ(v1.ops_verified(), v1.num_ops());
  EXPECT_TRUE(v1.verified());
}

// The race at the timeout: r1 pauses while the plan that leaves it out is being made. That plan
// is void (membership changed), the next one has r1 in it, and version 1 runs on both nodes - r1 is
// in the version, and not caught up as well (never both, never neither).
TEST(SyncPauseTest, ARolloutPausingAsItIsLeftOutIsInTheVersion) {
  FakeClock clock;
  std::atomic<bool> hold_next_plan{false};
  absl::Notification planning, release;
  PauseCluster c(&clock, absl::Seconds(5), [&](const planner::Problem& p, planner::Strategy s) -> absl::StatusOr<planner::Plan> {
    if (hold_next_plan.exchange(false)) {
      planning.Notify();
      release.WaitForNotificationWithTimeout(kReal);
    }
    return planner::MakePlan(p, s);
  });
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  c.StartPublish(1, 30000);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  hold_next_plan = true;
  ASSERT_TRUE(c.Advance(absl::Seconds(6)));
  ASSERT_TRUE(planning.WaitForNotificationWithTimeout(kReal)) << "r1 was not left out (no plan without it)";
  EXPECT_TRUE(c.Worker("r1").left_out());
  ASSERT_TRUE(c.Ready("r1").ok());  // just as the plan without it is being made
  release.Notify();
  absl::Status s = c.Published();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.executes[1].load(), 1) << "r1 paused before version 1 started, but the version ran without it";
  s = c.WaitAnswered("r1", 1);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.catch_ups[1].load(), 0) << "r1 was in version 1 and caught up to it as well";
  EXPECT_FALSE(c.Worker("r1").left_out());
}

// No rollout paused: nobody is left out; version 1 waits until the trainer's publish deadline.
TEST(SyncPauseTest, NoRolloutPausedLeavesNobodyOut) {
  FakeClock clock;
  PauseCluster c(&clock, absl::Seconds(5));
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  c.StartPublish(1, 12000);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_TRUE(c.Advance(absl::Seconds(10)));
  EXPECT_FALSE(c.Worker("r0").left_out());
  EXPECT_FALSE(c.Worker("r1").left_out());
  EXPECT_EQ(c.executes[0] + c.executes[1], 0);
  ASSERT_TRUE(c.Advance(absl::Seconds(2)));
  absl::Status s = c.Published();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_EQ(c.Committed(), 0u);
}

// A generation step longer than the timeout on every rollout: nobody paused for 8 s (past the
// 5 s timeout), then r0 pauses and r1 follows 4 s later. The wait is timed from r0's pause, so r1
// is not left out at r0's pause and version 1 runs on both nodes, with no catch-up.
TEST(SyncPauseTest, TheTimeoutRunsFromTheFirstPauseNotFromThePublish) {
  FakeClock clock;
  PauseCluster c(&clock, absl::Seconds(5));
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  c.StartPublish(1, 30000);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_TRUE(c.Advance(absl::Seconds(8)));
  ASSERT_TRUE(c.Ready("r0").ok());
  ASSERT_TRUE(c.Advance(absl::Seconds(4)));
  EXPECT_FALSE(c.Worker("r1").left_out()) << "left out 4 s after the first pause (timeout 5 s)";
  EXPECT_EQ(c.executes[0] + c.executes[1], 0) << "version 1 started without r1 paused";
  ASSERT_TRUE(c.Ready("r1").ok());
  absl::Status s = c.Published();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.executes[1].load(), 1) << "version 1 did not reach n1";
  EXPECT_EQ(c.catch_ups[1].load(), 0);
  EXPECT_FALSE(c.Worker("r1").left_out());
}

// sync_pause_timeout 0: the old behaviour - r1 not paused holds version 1 for as long as the
// trainer waits (40 s here, far past any default), and once r1 pauses it runs on both nodes.
TEST(SyncPauseTest, ZeroTimeoutWaitsForEveryRolloutAsBefore) {
  FakeClock clock;
  PauseCluster c(&clock, absl::ZeroDuration());
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  c.StartPublish(1, 60000);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_TRUE(c.Advance(absl::Seconds(40)));
  EXPECT_FALSE(c.Worker("r1").left_out());
  EXPECT_EQ(c.executes[0] + c.executes[1], 0) << "version 1 started without r1 paused";
  ASSERT_TRUE(c.Ready("r1").ok());
  absl::Status s = c.Published();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.executes[1], 1);
  EXPECT_EQ(c.catch_ups[1], 0);
}

}  // namespace
}  // namespace wb::daemon
