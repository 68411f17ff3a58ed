// CoordinatorCore over fake nodes (FakeNodeClient), in simulated time where time matters:
// the version driver's commit contract (issue 15.2), leases, transfer timeouts and request
// deadlines on a FakeClock.
#include "daemon/coordinator/core.h"

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "daemon/testing/sim_deadline.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);  // real-time bound on any wait in these tests

pb::ModelSpec Spec(const std::string& id, int rollouts, pb::Mode mode) {
  pb::ModelSpec spec = testing::SmallModelSpec(id, rollouts);
  spec.set_mode(mode);
  return spec;
}

// A coordinator with fake nodes. Nodes report done as soon as they are told to execute (unless
// `report_done` is off), as a node whose transfer takes no time would.
class Cluster {
 public:
  explicit Cluster(Clock* clock = Clock::Real(), absl::Duration transfer_timeout = absl::Seconds(60),
                   const std::function<void(CoordinatorOptions&)>& configure = nullptr) {
    CoordinatorOptions o;
    o.clock = clock;
    o.transfer_timeout = transfer_timeout;
    if (configure) configure(o);
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      fake->on_execute = [this, node](const pb::ExecuteVersionRequest& req) {
        if (!report_done) return absl::OkStatus();
        pb::ReportDoneResponse resp;
        return core->ReportDone(testing::DoneReport(node, req), &resp);
      };
      if (auto it = commit_hooks.find(node); it != commit_hooks.end()) fake->on_commit = it->second;
      if (auto it = abort_hooks.find(node); it != abort_hooks.end()) fake->on_abort = it->second;
      fakes[node] = fake;
      return fake;
    };
    core = std::make_unique<CoordinatorCore>(std::move(o));
    core->Start();
  }
  ~Cluster() { core->Shutdown(); }

  std::map<std::string, std::string> node_of;     // worker -> the node it joined through
  std::map<std::string, std::string> process_of;  // worker -> JoinWorkerRequest.process of its next Join
  uint64_t Register(const std::string& node) {
    pb::RegisterNodeRequest req;
    req.set_node_id(node);
    req.set_address(node + ":1");
    pb::RegisterNodeResponse resp;
    EXPECT_TRUE(core->RegisterNode(req, &resp).ok());
    return resp.incarnation();
  }
  void Join(const std::string& node, const std::string& worker, pb::Role role, const pb::ModelSpec& spec,
            std::optional<pb::SubmitLayoutRequest> layout = std::nullopt) {
    pb::JoinWorkerRequest j;
    j.set_node_id(node);
    j.set_worker_id(worker);
    j.set_model_id(spec.model_id());
    j.set_role(role);
    *j.mutable_model() = spec;
    if (auto p = process_of.find(worker); p != process_of.end()) j.set_process(p->second);
    pb::JoinWorkerResponse jr;
    ASSERT_TRUE(core->JoinWorker(j, &jr).ok());
    node_of[worker] = node;
    pb::SubmitLayoutRequest l = layout.has_value() ? *layout : testing::WholeTensorLayout(node, worker);
    pb::SubmitLayoutResponse lr;
    absl::Status s = core->SubmitLayout(l, &lr);
    ASSERT_TRUE(s.ok()) << s;
  }
  absl::Status Ready(const std::string& rollout) {
    pb::ReportReadyRequest r;
    r.set_node_id(node_of[rollout]);  // a worker's calls come from its node (else PERMISSION_DENIED)
    r.set_model_id("m");
    r.set_worker_id(rollout);
    pb::ReportReadyResponse resp;
    return core->ReportReady(r, &resp);
  }
  absl::Status Publish(uint64_t v, int64_t timeout_ms = 10000, const std::string& trainer = "t0") {
    pb::CoordPublishRequest p;
    p.set_model_id("m");
    p.set_worker_id(trainer);
    p.set_node_id(trainer == "t0" ? "n0" : node_of[trainer]);
    p.set_version(v);
    p.set_timeout_ms(timeout_ms);
    pb::PublishResponse resp;
    return core->Publish(p, &resp);
  }
  // `worker`: the rollout whose node forwards the wait (empty: the cluster-wide commit only).
  absl::Status WaitVersion(uint64_t v, int64_t timeout_ms = 20000, const std::string& worker = "") {
    pb::WaitVersionRequest w;
    w.set_model_id("m");
    w.set_version(v);
    w.set_timeout_ms(timeout_ms);
    w.set_worker_id(worker);
    pb::WaitVersionResponse wr;
    return core->WaitVersion(w, &wr);
  }
  pb::StatusResponse Status() {
    pb::StatusResponse st;
    EXPECT_TRUE(core->ClusterStatus(pb::StatusRequest(), &st).ok());
    return st;
  }

  std::atomic<bool> report_done{true};  // read on the driver's threads (fake ExecuteVersion)
  std::map<std::string, std::function<absl::Status(const std::string&, uint64_t)>> commit_hooks;  // set before Register
  std::map<std::string, std::function<absl::Status(const std::string&, uint64_t)>> abort_hooks;   // set before Register
  std::map<std::string, std::shared_ptr<FakeNodeClient>> fakes;
  std::unique_ptr<CoordinatorCore> core;
};

// Issue 15.2: a sync version counts as committed (Publish OK) only when every node acknowledged
// CommitVersion. A node whose rollout's live copy failed makes Publish fail naming the node and
// rollout; the next version that commits everywhere succeeds.
TEST(CoreCommitTest, SyncPublishFailsNamingTheNodeThatCouldNotCommit) {
  Cluster c;
  bool fail_n1 = true;
  c.commit_hooks["n1"] = [&](const std::string&, uint64_t v) {
    return fail_n1 ? absl::InternalError(absl::StrCat("rollout r1: copy of version ", v, " into live memory failed (torn)"))
                   : absl::OkStatus();
  };
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 2, pb::MODE_SYNC);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, spec);
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  ASSERT_TRUE(c.Ready("r1").ok());
  absl::Status s = c.Publish(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("node n1 (rollouts r1)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("into live memory failed"), std::string::npos) << s;
  EXPECT_NE(s.message().find("nodes n0 hold it"), std::string::npos) << s;
  pb::StatusResponse st = c.Status();
  EXPECT_EQ(st.models(0).committed_version(), 0u) << "a version not every rollout holds counts as committed";
  // n1 was told to drop it.
  EXPECT_TRUE(c.fakes.at("n1")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.abort >= 1; }, absl::Now() + kReal));
  // n0 acknowledged the commit and is told too (issue 11 (a)): it rolls its committed version
  // back, so that its re-join at a restarted coordinator never restores version 1 as committed.
  // Before: only the failed nodes got AbortVersion.
  EXPECT_TRUE(c.fakes.at("n0")->AwaitCalls(
      [](const FakeNodeClient::Calls& k) { return k.aborted.size() == 1 && k.aborted[0] == 1 && k.aborted_epochs[0] == 0; },
      absl::Now() + kReal))
      << "the node that acknowledged the failed sync commit was not told it was aborted";
  // The next version, committed everywhere, succeeds.
  fail_n1 = false;
  ASSERT_TRUE(c.Ready("r0").ok());
  ASSERT_TRUE(c.Ready("r1").ok());
  s = c.Publish(2);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.Status().models(0).committed_version(), 2u);
}

// Sync: the trainer's live weights are the version's source, and a trainer whose Publish failed
// writes them again (its next step). A Publish that hits its deadline before the version committed
// withdraws the version: it never starts later from weights that already hold the next step. (Chaos
// run: rollouts still generating past the trainers' publish deadline paused a moment later, the
// queued version started then and committed the trainers' next weights under its number; every
// rollout reported version v holding other bytes.)
TEST(CoreCommitTest, SyncPublishPastItsDeadlineWithdrawsTheVersion) {
  Cluster c;
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 1, pb::MODE_SYNC);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n1", "r0", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  // r0 is still generating (not paused): version 1 cannot start before the trainer's deadline.
  absl::Status s = c.Publish(1, /*timeout_ms=*/300);
  ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  // r0 pauses now; version 1 must not run from the trainer's (rewritten) weights.
  ASSERT_TRUE(c.Ready("r0").ok());
  s = c.WaitVersion(1, /*timeout_ms=*/5000);
  EXPECT_TRUE(absl::IsAborted(s)) << "version 1 ran after its trainer's publish had failed: " << s;
  EXPECT_EQ(c.fakes.at("n0")->calls().execute, 0) << "version 1 was started after its trainer's publish had failed";
  EXPECT_EQ(c.Status().models(0).committed_version(), 0u);
  // The next version goes through as usual.
  ASSERT_TRUE(c.Ready("r0").ok());
  s = c.Publish(2);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.Status().models(0).committed_version(), 2u);
}

// Sync: a version is read from its trainers' live memory when it starts. Its trainer killed while
// the version waited (queued: a rollout still generating) and a new process registering the same
// trainer id, before its node noticed the exit, must not make the version start from the new
// process's memory (chaos run: rollouts were told v22 and held the new trainer's v23 bytes). The
// same process registering again (a restarted node's worker replaying its registration) keeps it.
// `leave`: the old process's exit is reported (LeaveWorker) instead, before the new one joins.
void ReplaceTrainerProcessWhileQueued(bool same_process, bool leave) {
  FakeClock clock;
  Cluster c(&clock, absl::Seconds(30));
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 1, pb::MODE_SYNC);
  c.process_of["t0"] = "4100@777";
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n1", "r0", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  // r0 is generating (not paused): version 1, published by process 4100, waits.
  absl::Status published;
  const absl::Time publish_deadline = clock.Now() + absl::Seconds(10);
  std::thread publish([&] { published = c.Publish(1, 10000); });
  ASSERT_TRUE(clock.AwaitWaiter(publish_deadline, absl::Now() + kReal));
  if (leave) {
    pb::LeaveWorkerRequest l;
    l.set_node_id("n0");
    l.set_model_id("m");
    l.set_worker_id("t0");
    l.set_reason("its process exited");
    pb::LeaveWorkerResponse lr;
    ASSERT_TRUE(c.core->LeaveWorker(l, &lr).ok());
  }
  c.process_of["t0"] = same_process ? "4100@777" : "5200@901";
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  publish.join();
  if (same_process && !leave) {
    EXPECT_TRUE(published.ok()) << published;
    EXPECT_EQ(c.Status().models(0).committed_version(), 1u);
    return;
  }
  EXPECT_TRUE(absl::IsAborted(published)) << "version 1 went on after the process that published it was replaced: " << published;
  EXPECT_NE(published.message().find(leave ? "before version 1, which it published, was read" : "registered again from another process"),
            std::string::npos)
      << published;
  EXPECT_EQ(c.fakes.at("n0")->calls().execute, 0) << "version 1 was started from the new process's memory";
  EXPECT_EQ(c.Status().models(0).committed_version(), 0u);
  // The new process's own version goes through.
  ASSERT_TRUE(c.Ready("r0").ok());
  published = c.Publish(2, 10000);
  EXPECT_TRUE(published.ok()) << published;
  EXPECT_EQ(c.Status().models(0).committed_version(), 2u);
}

// Sync, two trainer ranks: a version one rank published and the other skipped (it published the
// next one: its Publish of the first was answered ABORTED when the coordinator restarted, while the
// other rank's was sent again to the new coordinator) can never be published by both. The rank
// blocked in its Publish hears ABORTED at once and publishes the next version too, which commits;
// before, each version waited for the other's rank until the publish deadline (chaos seed 1002,
// 15.6 s). Simulated time: nothing here may wait for a deadline.
TEST(CoreCommitTest, SyncVersionSkippedByATrainerRankIsAbortedAtOnce) {
  FakeClock clock;
  Cluster c(&clock, absl::Seconds(30));
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 1, pb::MODE_SYNC);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n1", "t1", pb::ROLE_TRAINER, spec);
  c.Join("n1", "r0", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  const absl::Time publish_deadline = clock.Now() + absl::Seconds(10);
  absl::Status t1_v1, t0_v2, t1_v2;
  absl::Notification t1_v1_done;
  std::thread t1_first([&] {
    t1_v1 = c.Publish(1, 10000, "t1");
    t1_v1_done.Notify();
  });
  ASSERT_TRUE(clock.AwaitWaiter(publish_deadline, absl::Now() + kReal));  // version 1 waits for t0
  std::thread t0_next([&] { t0_v2 = c.Publish(2, 10000, "t0"); });
  const bool answered = t1_v1_done.WaitForNotificationWithTimeout(absl::Seconds(10));
  EXPECT_TRUE(answered) << "t1's publish of version 1 still waits for t0, which published version 2";
  if (!answered) clock.Advance(absl::Seconds(11));  // let the threads end at their deadline
  t1_first.join();
  EXPECT_TRUE(absl::IsAborted(t1_v1)) << t1_v1;
  EXPECT_NE(t1_v1.message().find("trainer t0 published version 2 without publishing version 1"), std::string::npos) << t1_v1;
  ASSERT_TRUE(c.Ready("r0").ok());  // released by the abort (its wait for version 1 failed): pauses again
  t1_v2 = c.Publish(2, 10000, "t1");
  t0_next.join();
  EXPECT_TRUE(t1_v2.ok()) << t1_v2;
  EXPECT_TRUE(t0_v2.ok()) << t0_v2;
  EXPECT_EQ(c.Status().models(0).committed_version(), 2u);
  EXPECT_EQ(c.fakes.at("n0")->calls().execute, 1) << "version 1 started";
}

TEST(CoreCommitTest, SyncVersionOfAReplacedTrainerProcessNeverStarts) { ReplaceTrainerProcessWhileQueued(false, false); }
TEST(CoreCommitTest, SyncVersionOfATrainerWhoseProcessLeftNeverStarts) { ReplaceTrainerProcessWhileQueued(false, true); }
TEST(CoreCommitTest, SyncVersionSurvivesItsTrainerProcessRegisteringAgain) { ReplaceTrainerProcessWhileQueued(true, false); }

// Sync: a rollout paused (BeginUpdate) and waiting for version v + 1 when version v commits stays
// paused: the commit writes v into its live weights, but its engine waits on. The coordinator
// counted every commit as resuming every paused rollout, so v + 1 then waited for a BeginUpdate
// the rollout would only send after its wait for v + 1 timed out - and the same again for every
// later version, each one wait timeout late (chaos run, sync, seeds 1004 / 1003: a rollout told
// v90 aborted at a coordinator restart, while its trainers' node re-published v90 to the new
// coordinator, paused for v91 as v90 committed; v91, v92, ... each came 15 s late). `abort`: v is
// aborted instead (its publish withdrawn), which released the paused rollouts the same way.
void RolloutWaitingForTheNextVersionStaysPaused(bool abort) {
  FakeClock clock;
  Cluster c(&clock, absl::Seconds(30));
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 1, pb::MODE_SYNC);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n1", "r0", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  // r0 is paused and waits for version 2 (through its node, with its worker id).
  absl::Status waited;
  // (Deadlines no timer of the coordinator has, so that AwaitWaiter finds the call's own wait.)
  const absl::Time wait_deadline = clock.Now() + absl::Milliseconds(15013);
  std::thread wait([&] { waited = c.WaitVersion(2, 15013, "r0"); });
  ASSERT_TRUE(clock.AwaitWaiter(wait_deadline, absl::Now() + kReal));
  if (abort) {
    c.report_done = false;  // version 1 stays transferring until its publish deadline
    absl::Status p1;
    const absl::Time publish_deadline = clock.Now() + absl::Milliseconds(1237);
    std::thread publish([&] { p1 = c.Publish(1, 1237); });
    ASSERT_TRUE(clock.AwaitWaiter(publish_deadline, absl::Now() + kReal));
    // Started (transferring) before its deadline passes: the driver thread starts it a moment after
    // the publish is recorded (under TSan the deadline came first, version 1 never started, and n1
    // saw one ExecuteVersion in all).
    ASSERT_TRUE(c.fakes.at("n1")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.execute >= 1; }, absl::Now() + kReal));
    clock.Advance(absl::Milliseconds(1237));
    publish.join();
    ASSERT_TRUE(absl::IsDeadlineExceeded(p1)) << p1;
    c.report_done = true;
  } else {
    ASSERT_TRUE(c.Publish(1).ok());  // r0 was paused: version 1 is in its live weights; it waits on
  }
  // Version 2 starts without another ReportReady: r0 is still paused in its wait for it.
  absl::Status p2;
  std::thread publish2([&] { p2 = c.Publish(2, 10000); });
  const bool started = c.fakes.at("n1")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.execute >= 2; }, absl::Now() + kReal);
  EXPECT_TRUE(started) << "version 2 waited for a BeginUpdate of r0, which was still paused waiting for version 2";
  if (!started) clock.Advance(absl::Seconds(20));  // past both deadlines: the threads end
  publish2.join();
  wait.join();
  if (!started) return;
  EXPECT_TRUE(p2.ok()) << p2;
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_EQ(c.Status().models(0).committed_version(), 2u);
  // Its wait answered, r0 resumed: version 3 waits for its next pause.
  absl::Status p3;
  const absl::Time publish3_deadline = clock.Now() + absl::Milliseconds(5011);
  std::thread publish3([&] { p3 = c.Publish(3, 5011); });
  ASSERT_TRUE(clock.AwaitWaiter(publish3_deadline, absl::Now() + kReal));
  EXPECT_EQ(c.fakes.at("n1")->calls().execute, 2) << "version 3 started while r0 was generating";
  ASSERT_TRUE(c.Ready("r0").ok());
  publish3.join();
  EXPECT_TRUE(p3.ok()) << p3;
}

TEST(CoreCommitTest, SyncRolloutWaitingForTheNextVersionStaysPausedOverACommit) { RolloutWaitingForTheNextVersionStaysPaused(false); }
TEST(CoreCommitTest, SyncRolloutWaitingForTheNextVersionStaysPausedOverAnAbort) { RolloutWaitingForTheNextVersionStaysPaused(true); }

// The AbortVersion of a failed sync commit that a node which acknowledged the commit did not get
// (UNAVAILABLE) is sent again until the node answers: before, it was sent once, and the node kept
// the version as committed - a rollout resumed before the commit (EndUpdate) would have copied the
// aborted version into its live weights at its next BeginUpdate.
TEST(CoreCommitTest, SyncAbortMissedByANodeThatCommittedIsSentAgain) {
  Cluster c;
  c.commit_hooks["n1"] = [](const std::string&, uint64_t) { return absl::InternalError("copy into live memory failed"); };
  std::atomic<int> n0_misses{2};
  c.abort_hooks["n0"] = [&](const std::string&, uint64_t) {
    return n0_misses.fetch_sub(1) > 0 ? absl::UnavailableError("connection reset") : absl::OkStatus();
  };
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 2, pb::MODE_SYNC);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, spec);
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  ASSERT_TRUE(c.Ready("r1").ok());
  EXPECT_EQ(c.Publish(1).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(c.fakes.at("n0")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.abort >= 3; }, absl::Now() + kReal))
      << "the abort n0 missed was not sent again (" << c.fakes.at("n0")->calls().abort << " calls)";
  for (size_t i = 0; i < c.fakes.at("n0")->calls().aborted.size(); ++i) {
    EXPECT_EQ(c.fakes.at("n0")->calls().aborted[i], 1u);
    EXPECT_EQ(c.fakes.at("n0")->calls().aborted_epochs[i], 0u);
  }
  // n1 answered its abort at once: told once. Read once no posted call is left: n0's retries run
  // in its own lane while n1's first abort may still be on its way in the model's.
  ASSERT_TRUE(c.core->AwaitNodeRpcsIdle(absl::Now() + kReal));
  EXPECT_EQ(c.fakes.at("n1")->calls().abort, 1);
}

// Owed aborts in simulated time: retried every commit_retry while the node keeps its incarnation;
// a node that answers with an error (it got the call) is not asked again; a node that restarted
// (new incarnation: it rolls back at its re-join what it was not told) is not asked again either.
TEST(CoreSimulatedTimeTest, OwedAbortsRetriedUntilAnsweredOrTheNodeRestarts) {
  FakeClock clock;
  Cluster c(&clock, absl::Seconds(30));
  c.report_done = false;
  std::atomic<bool> n0_answers{false};
  c.abort_hooks["n0"] = [&](const std::string&, uint64_t) {
    return n0_answers ? absl::NotFoundError("no such version") : absl::UnavailableError("unreachable");
  };
  c.abort_hooks["n1"] = [](const std::string&, uint64_t) { return absl::DeadlineExceededError("no answer"); };
  uint64_t inc[2] = {c.Register("n0"), c.Register("n1")};
  const pb::ModelSpec spec = Spec("m", 2, pb::MODE_ONE_STEP_OFF);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, spec);
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Publish(1).ok());
  ASSERT_TRUE(c.fakes.at("n0")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.execute == 1; }, absl::Now() + kReal));
  // Steps of 100 ms (commit_retry is 200 ms), heartbeats keeping both leases.
  auto step = [&] {
    for (int i = 0; i < 2; ++i) {
      pb::HeartbeatRequest hb;
      hb.set_node_id(i == 0 ? "n0" : "n1");
      hb.set_incarnation(inc[i]);
      pb::HeartbeatResponse resp;
      c.core->Heartbeat(hb, &resp).IgnoreError();
    }
    clock.Advance(absl::Milliseconds(100));
    // The pass's retries are posted to lanes, not yet sent: a retry still running when the clock
    // moves on makes the next pass skip its node (one call per lane), so the counts below would
    // depend on thread timing. Each step therefore ends when every posted call was answered.
    return c.core->AwaitDriverPassAt(clock.Now(), absl::Now() + kReal) && c.core->AwaitNodeRpcsIdle(absl::Now() + kReal);
  };
  // Past the 30 s transfer timeout: version 1 aborted, both nodes told, neither gets it.
  const absl::Time start = clock.Now();
  while (c.fakes.at("n1")->calls().abort == 0 || c.fakes.at("n0")->calls().abort == 0) {
    ASSERT_LT(clock.Now(), start + absl::Seconds(120)) << "version 1 never aborted";
    ASSERT_TRUE(step());
  }
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(step());  // 2 s: about 10 retries each
  const int n0_tries = c.fakes.at("n0")->calls().abort, n1_tries = c.fakes.at("n1")->calls().abort;
  EXPECT_GE(n0_tries, 5) << "an abort n0 did not get was not retried";
  EXPECT_GE(n1_tries, 5) << "an abort n1 did not answer was not retried";
  // n0 now answers (an error: it got the call): not asked again. n1 restarts: not asked again.
  n0_answers = true;
  for (int i = 0; i < 20 && c.fakes.at("n0")->calls().abort == n0_tries; ++i) ASSERT_TRUE(step());
  pb::RegisterNodeRequest again;
  again.set_node_id("n1");
  again.set_address("n1:1");
  pb::RegisterNodeResponse again_resp;
  ASSERT_TRUE(c.core->RegisterNode(again, &again_resp).ok());
  ASSERT_NE(again_resp.incarnation(), inc[1]);
  inc[1] = again_resp.incarnation();
  ASSERT_TRUE(step());  // a retry of n1 already taken before the re-registration may still land
  const int n0_final = c.fakes.at("n0")->calls().abort, n1_final = c.fakes.at("n1")->calls().abort;
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(step());
  EXPECT_EQ(c.fakes.at("n0")->calls().abort, n0_final) << "n0 answered its abort and was asked again";
  EXPECT_EQ(c.fakes.at("n1")->calls().abort, n1_final) << "n1 restarted and was still sent its old incarnation's abort";
}

// A node lost during the commit (unreachable) counts as not holding the version too.
TEST(CoreCommitTest, SyncPublishFailsWhenANodeIsUnreachableAtCommit) {
  Cluster c;
  c.commit_hooks["n1"] = [](const std::string&, uint64_t) { return absl::UnavailableError("connection refused"); };
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 2, pb::MODE_SYNC);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, spec);
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Ready("r0").ok());
  ASSERT_TRUE(c.Ready("r1").ok());
  absl::Status s = c.Publish(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("node n1 (rollouts r1): connection refused"), std::string::npos) << s;
}

// Async: commit only marks staging committed on the nodes; an unreachable node is owed the
// commit and retried (documented contract), the version is committed.
TEST(CoreCommitTest, AsyncCommitOwedToAnUnreachableNodeIsRetried) {
  Cluster c;
  int failures_left = 2;
  c.commit_hooks["n1"] = [&](const std::string&, uint64_t) {
    return failures_left-- > 0 ? absl::UnavailableError("unreachable") : absl::OkStatus();
  };
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 2, pb::MODE_ASYNC);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, spec);
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Publish(1).ok());
  ASSERT_TRUE(c.WaitVersion(1).ok());
  EXPECT_TRUE(c.fakes.at("n1")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.committed.size() == 1; }, absl::Now() + kReal))
      << "the owed commit was never delivered";
}

// Leases in simulated time: a node that stops heartbeating is lost after its lease, one that
// heartbeats is kept, with no real waiting.
TEST(CoreSimulatedTimeTest, LeaseExpiresOnlyInSimulatedTime) {
  FakeClock clock;
  Cluster c(&clock);
  const uint64_t inc0 = c.Register("n0");
  c.Register("n1");
  for (int step = 0; step < 8; ++step) {  // 8 x 0.5 s = 4 s > the 3 s lease
    pb::HeartbeatRequest hb;
    hb.set_node_id("n0");
    hb.set_incarnation(inc0);
    pb::HeartbeatResponse resp;
    ASSERT_TRUE(c.core->Heartbeat(hb, &resp).ok());
    clock.Advance(absl::Milliseconds(500));
    ASSERT_TRUE(c.core->AwaitDriverPassAt(clock.Now(), absl::Now() + kReal));
  }
  pb::StatusResponse st = c.Status();
  ASSERT_EQ(st.nodes_size(), 2);
  EXPECT_TRUE(st.nodes(0).alive()) << "n0 heartbeat and was dropped";
  EXPECT_FALSE(st.nodes(1).alive()) << "n1 never heartbeat in 4 s of a 3 s lease";
}

// Moves simulated time on by `d` in 0.5 s steps, renewing n0's lease (incarnation 1) before each
// (steps below lease / 4) and waiting for the driver's pass at each new time; false if one never came.
bool AdvanceRenewing(Cluster& c, FakeClock& clock, absl::Duration d) {
  for (absl::Duration done; done < d; done += absl::Milliseconds(500)) {
    pb::HeartbeatRequest hb;
    hb.set_node_id("n0");
    hb.set_incarnation(1);
    pb::HeartbeatResponse resp;
    c.core->Heartbeat(hb, &resp).IgnoreError();
    clock.Advance(absl::Milliseconds(500));
    if (!c.core->AwaitDriverPassAt(clock.Now(), absl::Now() + kReal)) return false;
  }
  return true;
}

// Transfer timeout and request deadlines in simulated time: a version whose nodes never report
// done is aborted after transfer_timeout; the trainer's Publish sees why.
TEST(CoreSimulatedTimeTest, TransferTimeoutAbortsInSimulatedTime) {
  FakeClock clock;
  Cluster c(&clock, absl::Seconds(30));
  c.report_done = false;
  c.Register("n0");
  const pb::ModelSpec spec = Spec("m", 1, pb::MODE_ONE_STEP_OFF);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  ASSERT_TRUE(c.Publish(1).ok());  // one-step-off: returns once recorded
  ASSERT_TRUE(c.fakes.at("n0")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.execute == 1; }, absl::Now() + kReal));
  // WaitVersion with a 10 s (simulated) deadline, answered when the clock passes it.
  absl::Status waited;
  absl::Notification returned;
  const absl::Time wait_deadline = clock.Now() + absl::Seconds(10);
  std::thread waiter([&] {
    waited = c.WaitVersion(1, 10000);
    returned.Notify();
  });
  // The waiter must be waiting on the clock before simulated time moves: a thread that starts
  // late would take its 10 s from a later time and outlive the 30 s transfer timeout.
  ASSERT_TRUE(clock.AwaitWaiter(wait_deadline, absl::Now() + kReal));
  // Lease renewals keep n0 alive while simulated time runs (steps below lease / 4). Exactly up to
  // the waiter's 10 s deadline, then its answer is awaited in real time: advancing on until it
  // returned could pass the 30 s transfer timeout before a woken but not yet scheduled waiter
  // (loaded machine) ran, and it would see the abort instead of its deadline.
  ASSERT_TRUE(AdvanceRenewing(c, clock, absl::Seconds(10)));
  ASSERT_TRUE(returned.WaitForNotificationWithTimeout(kReal));
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  // Past 30 s of simulated time the version is aborted as timed out.
  ASSERT_TRUE(AdvanceRenewing(c, clock, absl::Seconds(25)));
  pb::StatusResponse st = c.Status();
  ASSERT_GE(st.versions_size(), 1);
  EXPECT_EQ(st.versions(0).state(), "aborted");
  EXPECT_NE(st.versions(0).error().find("timed out after 30s"), std::string::npos) << st.versions(0).error();
  EXPECT_TRUE(st.nodes(0).alive());
}

// A node whose transfer deadline passed closes its channels; its peer can report "peer vanished"
// before the timed-out node's own report arrives (thirty-fourth session's probe). A failure
// reported within the last second of the version's deadline names the timeout; an earlier one
// does not.
TEST(CoreSimulatedTimeTest, AFailureReportedAtTheDeadlineNamesTheTimeout) {
  FakeClock clock;
  Cluster c(&clock, absl::Seconds(30));
  c.report_done = false;
  c.Register("n0");
  const pb::ModelSpec spec = Spec("m", 1, pb::MODE_ONE_STEP_OFF);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, spec);
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  auto fail = [&](uint64_t v) {
    pb::ReportDoneRequest d;
    d.set_node_id("n0");
    d.set_model_id("m");
    d.set_version(v);
    d.set_ok(false);
    d.set_error("host_tcp peer n1 vanished (control connection closed)");
    pb::ReportDoneResponse resp;
    return c.core->ReportDone(d, &resp);
  };
  auto error_of = [&](uint64_t v) {
    pb::StatusResponse st = c.Status();
    for (const auto& r : st.versions()) {
      if (r.version() == v) return r.state() + ": " + r.error();
    }
    return std::string("version not in status");
  };
  // Version 1 fails 5 s into its 30 s: the node's error alone.
  ASSERT_TRUE(c.Publish(1).ok());
  ASSERT_TRUE(c.fakes.at("n0")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.execute == 1; }, absl::Now() + kReal));
  ASSERT_TRUE(AdvanceRenewing(c, clock, absl::Seconds(5)));
  ASSERT_TRUE(fail(1).ok());
  EXPECT_EQ(error_of(1), "aborted: node n0: host_tcp peer n1 vanished (control connection closed)");
  // Version 2 fails half a second before its deadline: the timeout is named first.
  ASSERT_TRUE(c.Publish(2).ok());
  ASSERT_TRUE(c.fakes.at("n0")->AwaitCalls([](const FakeNodeClient::Calls& k) { return k.execute == 2; }, absl::Now() + kReal));
  ASSERT_TRUE(AdvanceRenewing(c, clock, absl::Milliseconds(29500)));
  ASSERT_TRUE(fail(2).ok());
  EXPECT_EQ(error_of(2), "aborted: at the transfer deadline (30s): node n0: host_tcp peer n1 vanished (control connection closed)");
}

// H1 / H2 of the hostile review: timeout_ms 10^12 made a wait practically endless (its thread and
// blocked-call slot held for good). The core cuts every request's wait to max_wait (default 1 h):
// a WaitVersion for a version never published and a Publish of a trainer whose model is never
// planned (its rollout never joins) both end DEADLINE_EXCEEDED exactly 1 h later, in simulated
// time, naming what they waited for.
TEST(CoreSimulatedTimeTest, RequestedWaitsAreCutToMaxWait) {
  FakeClock clock;
  // n0's lease never expires (as a standalone daemon's own node): an hour passes without heartbeats.
  Cluster c(&clock, absl::Seconds(60), [](CoordinatorOptions& o) { o.local_node = "n0"; });
  c.Register("n0");
  c.Join("n0", "t0", pb::ROLE_TRAINER, Spec("m", 1, pb::MODE_ONE_STEP_OFF));
  absl::Status waited = testing::EndsAtSimulatedDeadline(clock, clock.Now() + absl::Hours(1), [&] {
    return c.WaitVersion((uint64_t{1} << 53) - 1, int64_t{1000000000000});
  });
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  EXPECT_NE(waited.message().find("not committed in time"), std::string::npos) << waited;
  absl::Status published = testing::EndsAtSimulatedDeadline(clock, clock.Now() + absl::Hours(1), [&] {
    return c.Publish(1, int64_t{1000000000000});
  });
  EXPECT_EQ(published.code(), absl::StatusCode::kDeadlineExceeded) << published;
  EXPECT_NE(published.message().find("publish of version 1 by 't0': model m has no plan with this trainer yet"), std::string::npos)
      << published;
}

// NVFP4 rollout rows [row0, row0 + 2) of w (4x4): e2m1 pairs at 0, e4m3 block scales at 8, the
// global scale (weight_scale_2) at 12.
pb::SubmitLayoutRequest Nvfp4Rows(const std::string& node, const std::string& worker, int64_t row0) {
  pb::SubmitLayoutRequest req = testing::WholeTensorLayout(node, worker);
  pb::Piece* p = req.mutable_layout()->mutable_pieces()->mutable_pieces(0);
  p->mutable_box()->set_begin(0, row0);
  p->mutable_box()->set_end(0, row0 + 2);
  p->set_quant_dtype(pb::DTYPE_F4_E2M1);
  p->add_quant_block(1);
  p->add_quant_block(16);
  p->set_scale_buffer_id(0);
  p->set_scale_offset_bytes(8);
  p->set_quant_scale_dtype(pb::DTYPE_F8_E4M3);
  p->set_quant_global_scale_offset(12);
  return req;
}

pb::ExchangeMagnitudesRequest Magnitudes(const std::string& node, uint64_t v, float amax, bool wait, int64_t timeout_ms = 20000) {
  pb::ExchangeMagnitudesRequest r;
  r.set_node_id(node);
  r.set_model_id("m");
  r.set_version(v);
  r.set_wait(wait);
  r.set_timeout_ms(timeout_ms);
  pb::TensorMagnitude* t = r.add_parts();
  t->set_tensor("w");
  t->set_amax(amax);
  return r;
}

// NVFP4 global scales across nodes: one engine's two ranks on n0 and n1, each holding half of w,
// in simulated time (each wait is seen blocked on the clock before the other side acts). A node
// that needs the whole tensor's magnitude waits until the other reported; the answer is the
// magnitude over both halves, whole; a catch-up of the committed version gets the same again; a
// version aborted meanwhile ends the wait (ABORTED), a node done without its magnitudes ends it
// (partial answer), a node that never reports ends it at the request's timeout (DEADLINE_EXCEEDED
// naming it).
TEST(CoreMagnitudesTest, HalvesOnTwoNodesGetTheWholeTensorsMagnitude) {
  FakeClock clock;
  Cluster c(&clock);
  c.report_done = false;
  c.Register("n0");
  c.Register("n1");
  const pb::ModelSpec spec = Spec("m", 2, pb::MODE_ASYNC);
  c.Join("n0", "t0", pb::ROLE_TRAINER, spec);
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, spec, Nvfp4Rows("n0", "r0", 0));
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, spec, Nvfp4Rows("n1", "r1", 2));
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  auto start = [&c](uint64_t v) {
    std::thread publish([&c, v] { (void)c.Publish(v); });
    const bool started =
        c.fakes.at("n0")->AwaitCalls([v](const FakeNodeClient::Calls& k) { return k.execute >= static_cast<int>(v); }, absl::Now() + kReal) &&
        c.fakes.at("n1")->AwaitCalls([v](const FakeNodeClient::Calls& k) { return k.execute >= static_cast<int>(v); }, absl::Now() + kReal);
    publish.join();
    return started;
  };
  auto done = [&c](const std::string& node, uint64_t v, bool ok) {
    pb::ReportDoneRequest d;
    d.set_node_id(node);
    d.set_model_id("m");
    d.set_version(v);
    d.set_ok(ok);
    if (!ok) d.set_error("rollout r1 went away");
    pb::ReportDoneResponse resp;
    return c.core->ReportDone(d, &resp);
  };
  // n0 asks with wait in a thread; returns once that call is blocked on the clock.
  struct Waiter {
    std::thread thread;
    absl::Status status;
    pb::ExchangeMagnitudesResponse resp;
  };
  auto wait_n0 = [&c, &clock](Waiter& w, uint64_t v, int64_t timeout_ms) {
    const absl::Time deadline = clock.Now() + absl::Milliseconds(timeout_ms);
    w.thread = std::thread([&c, &w, v, timeout_ms] { w.status = c.core->ExchangeMagnitudes(Magnitudes("n0", v, 2.0f, true, timeout_ms), &w.resp); });
    return clock.AwaitWaiter(deadline, absl::Now() + kReal);
  };
  ASSERT_TRUE(start(1));

  // A node outside the book, and a tensor the node holds no NVFP4 piece of.
  pb::ExchangeMagnitudesResponse resp;
  absl::Status s = c.core->ExchangeMagnitudes(Magnitudes("n7", 1, 1.0f, false), &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  pb::ExchangeMagnitudesRequest bad = Magnitudes("n1", 1, 1.0f, false);
  bad.mutable_parts(0)->set_tensor("v");
  s = c.core->ExchangeMagnitudes(bad, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  // n0 waits for n1's half.
  Waiter w1;
  ASSERT_TRUE(wait_n0(w1, 1, 20000));
  pb::ExchangeMagnitudesResponse got1;
  ASSERT_TRUE(c.core->ExchangeMagnitudes(Magnitudes("n1", 1, 5.0f, false), &got1).ok());
  EXPECT_EQ(got1.tensors_size(), 0);  // only reported
  w1.thread.join();
  ASSERT_TRUE(w1.status.ok()) << w1.status;
  ASSERT_EQ(w1.resp.tensors_size(), 1) << w1.resp.ShortDebugString();
  EXPECT_EQ(w1.resp.tensors(0).tensor(), "w");
  EXPECT_EQ(w1.resp.tensors(0).amax(), 5.0f);
  EXPECT_TRUE(w1.resp.tensors(0).whole());
  ASSERT_TRUE(done("n0", 1, true).ok());
  ASSERT_TRUE(done("n1", 1, true).ok());
  ASSERT_TRUE(c.WaitVersion(1).ok());

  // A catch-up of version 1 (say r1 restarted) asks without adding: the same answer.
  pb::ExchangeMagnitudesRequest ask = Magnitudes("n1", 1, 0.5f, true);
  ask.set_catch_up(true);
  pb::ExchangeMagnitudesResponse again;
  ASSERT_TRUE(c.core->ExchangeMagnitudes(ask, &again).ok());
  ASSERT_EQ(again.tensors_size(), 1);
  EXPECT_EQ(again.tensors(0).amax(), 5.0f);
  EXPECT_TRUE(again.tensors(0).whole());
  ask.set_version(7);
  s = c.core->ExchangeMagnitudes(ask, &again);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;

  // Version 2 aborted while n0 waits: ABORTED with the reason.
  ASSERT_TRUE(start(2));
  Waiter w2;
  ASSERT_TRUE(wait_n0(w2, 2, 20000));
  ASSERT_TRUE(done("n1", 2, false).ok());
  w2.thread.join();
  EXPECT_EQ(w2.status.code(), absl::StatusCode::kAborted) << w2.status;
  EXPECT_NE(w2.status.message().find("went away"), std::string::npos) << w2.status;

  // Version 3: n1 reports the version done without its magnitudes (its report was lost): n0 is
  // answered at once with its own half, not whole.
  ASSERT_TRUE(start(3));
  Waiter w3;
  ASSERT_TRUE(wait_n0(w3, 3, 20000));
  ASSERT_TRUE(done("n1", 3, true).ok());
  w3.thread.join();
  ASSERT_TRUE(w3.status.ok()) << w3.status;
  ASSERT_EQ(w3.resp.tensors_size(), 1);
  EXPECT_EQ(w3.resp.tensors(0).amax(), 2.0f);
  EXPECT_FALSE(w3.resp.tensors(0).whole());
  ASSERT_TRUE(done("n0", 3, true).ok());
  ASSERT_TRUE(c.WaitVersion(3).ok());

  // Version 4: n1 never reports; n0's wait ends at its timeout, naming n1.
  ASSERT_TRUE(start(4));
  Waiter w4;
  ASSERT_TRUE(wait_n0(w4, 4, 200));
  clock.Advance(absl::Milliseconds(300));
  w4.thread.join();
  EXPECT_EQ(w4.status.code(), absl::StatusCode::kDeadlineExceeded) << w4.status;
  EXPECT_NE(w4.status.message().find("n1"), std::string::npos) << w4.status;
  // The committed version's book (3) is there for catch-ups; version 1's is gone.
  ask.set_version(3);
  EXPECT_TRUE(c.core->ExchangeMagnitudes(ask, &again).ok());
  ask.set_version(1);
  EXPECT_EQ(c.core->ExchangeMagnitudes(ask, &again).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace wb::daemon
