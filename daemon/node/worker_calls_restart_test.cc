// node::WorkerCalls::Publish (and a trainer's WaitVersion) when the coordinator goes away while the call is in flight, on a
// scripted coordinator: the node re-sends the publish to the coordinator it re-joined
// (PublishAgainAfterRestart, docs/daemon.md "Coordinator restart") and answers what that one
// says; a refusal "not newer" becomes ABORTED naming the restart; without a re-join the first
// answer stands; a worker that was not re-joined is not sent for. (The end-to-end case with real
// daemons: //tests/e2e:e2e_restart_publish_test.)
#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/shm_segment.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/deadlines.h"
#include "daemon/node/fake_gpu_import.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/worker_calls.h"
#include "daemon/testing/node_parts.h"

namespace wb::daemon::node {
namespace {

// Publish answers from a script, one per call, recording the session each call was sent in; every
// other call UNAVAILABLE. `restarts` is how many coordinator changes AwaitCoordinatorChange may
// report (each bumps the session), after which it reports none (the same coordinator).
class ScriptedCoordinator final : public CoordinatorAccess, public CoordinatorClient {
 public:
  std::deque<absl::Status> publish_answers;
  int restarts = 0;
  std::function<void()> on_publish;  // runs inside each Publish call (before its answer)

  CoordinatorClient& client() override { return *this; }
  bool AwaitRegistered(absl::Time) override { return true; }
  uint64_t session() override {
    absl::MutexLock l(&mu_);
    return session_;
  }
  // Runs (without the lock) for each change, before the session bumps: the node's re-join.
  std::function<void()> on_rejoin;
  // The coordinator is down (GoDown) until simulated time `back_at`: ReportReady answers
  // UNAVAILABLE and AwaitCoordinatorChange waits on `clock` until then (nullopt at its deadline).
  // Back, it is a restarted coordinator while `restarts` > 0, else the same one (nullopt).
  Clock* clock = nullptr;
  void GoDown(absl::Time back_at, std::optional<absl::Time> unreachable_since = std::nullopt) {
    absl::MutexLock l(&mu_);
    down_ = true;
    back_at_ = back_at;
    unreachable_since_ = unreachable_since;
  }
  // What the node's heartbeats know of the outage (GoDown's `unreachable_since`, while down).
  std::optional<absl::Time> UnreachableSince() override {
    absl::MutexLock l(&mu_);
    return down_ ? unreachable_since_ : std::nullopt;
  }
  std::optional<std::string> AwaitCoordinatorChange(uint64_t session0, absl::Time deadline) override {
    bool rejoin = false;
    {
      absl::MutexLock l(&mu_);
      ++change_waits_;
      if (down_ && session_ == session0) {
        auto back = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return clock->Now() >= back_at_; };
        if (!clock->WaitUntil(&mu_, absl::Condition(&back), deadline)) return std::nullopt;
        down_ = false;
      }
      if (session_ == session0) {
        if (restarts == 0) return std::nullopt;
        restarts -= 1;
        rejoin = true;
      }
    }
    if (rejoin) {
      if (on_rejoin) on_rejoin();
      absl::MutexLock l(&mu_);
      session_ += 1;
    }
    return "the coordinator restarted (instance A -> B)";
  }
  void TrackProgress(const std::string&, uint64_t, std::weak_ptr<const std::atomic<uint64_t>>) override {}
  // Tests: until AwaitCoordinatorChange was entered `n` times (bounded in real time). A call's clock
  // waits before its hold (a join's BeginJoin) may share the hold's deadline: a test waits for
  // this first, then for the hold's waiter on the clock.
  bool AwaitChangeWaits(int n) {
    absl::MutexLock l(&mu_);
    auto entered = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return change_waits_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&entered), absl::Seconds(10));
  }
  std::vector<uint64_t> publish_sessions() {
    absl::MutexLock l(&mu_);
    return publish_sessions_;
  }

  absl::Status Publish(const pb::CoordPublishRequest& req, pb::PublishResponse* resp, absl::Duration) override {
    absl::Status answer;
    {
      absl::MutexLock l(&mu_);
      publish_sessions_.push_back(session_);
      answer = publish_answers.empty() ? absl::InternalError("no scripted answer") : publish_answers.front();
      if (!publish_answers.empty()) publish_answers.pop_front();
    }
    if (on_publish) on_publish();
    if (answer.ok()) resp->set_version(req.version());
    return answer;
  }
  // WaitVersion answers from a script too (OK: committed_version = the version asked); counted.
  std::deque<absl::Status> wait_answers;
  absl::Status WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Duration) override {
    absl::Status answer;
    {
      absl::MutexLock l(&mu_);
      ++waits_;
      wait_workers_.push_back(req.worker_id());
      answer = wait_answers.empty() ? absl::InternalError("no scripted answer") : wait_answers.front();
      if (!wait_answers.empty()) wait_answers.pop_front();
    }
    if (answer.ok()) resp->set_committed_version(req.version());
    return answer;
  }
  int waits() {
    absl::MutexLock l(&mu_);
    return waits_;
  }
  std::vector<std::string> wait_workers() {  // WaitVersionRequest.worker_id of each call
    absl::MutexLock l(&mu_);
    return wait_workers_;
  }
  // ReportReady: OK (committed_version 1), recorded as "paused@<session>" / "resumed@<session>".
  std::function<void()> on_ready;  // runs inside each ReportReady (before its answer)
  absl::Status ReportReady(const pb::ReportReadyRequest& req, pb::ReportReadyResponse* resp, absl::Duration) override {
    {
      absl::MutexLock l(&mu_);
      if (down_) {
        readies_.push_back(absl::StrCat("unreachable@", session_));
        return absl::UnavailableError("failed to connect to all addresses");
      }
      readies_.push_back(absl::StrCat(req.resumed() ? "resumed@" : "paused@", session_));
    }
    if (on_ready) on_ready();
    resp->set_committed_version(1);
    return absl::OkStatus();
  }
  std::vector<std::string> readies() {
    absl::MutexLock l(&mu_);
    return readies_;
  }
  // JoinWorker / SubmitLayout / LeaveWorker: UNAVAILABLE while down, else OK (LeaveWorker: the
  // next of `leave_answers`, OK when none); recorded in log() as "<call> <worker> unreachable@<session>"
  // or "<call> <worker>@<session>", next to what Note adds (the test's re-join).
  std::deque<absl::Status> leave_answers;
  std::deque<absl::Status> join_answers;  // JoinWorker's likewise
  absl::Status JoinWorker(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse*, absl::Duration) override {
    return Record("join", req.worker_id(), NextAnswer(join_answers));
  }
  absl::Status SubmitLayout(const pb::SubmitLayoutRequest& req, pb::SubmitLayoutResponse*, absl::Duration) override {
    return Record("layout", req.worker_id(), absl::OkStatus());
  }
  absl::Status LeaveWorker(const pb::LeaveWorkerRequest& req, pb::LeaveWorkerResponse*, absl::Duration) override {
    return Record("leave", req.worker_id(), NextAnswer(leave_answers));
  }
  void Note(const std::string& what) {
    absl::MutexLock l(&mu_);
    log_.push_back(absl::StrCat(what, "@", session_));
  }
  std::vector<std::string> log() {
    absl::MutexLock l(&mu_);
    return log_;
  }
#define WB_UNAVAILABLE_(Name, Req, Resp) \
  absl::Status Name(const pb::Req&, pb::Resp*, absl::Duration) override { return absl::UnavailableError(#Name); }
  WB_UNAVAILABLE_(RegisterNode, RegisterNodeRequest, RegisterNodeResponse)
  WB_UNAVAILABLE_(Heartbeat, HeartbeatRequest, HeartbeatResponse)
  WB_UNAVAILABLE_(ReportDone, ReportDoneRequest, ReportDoneResponse)
  WB_UNAVAILABLE_(ReportApplied, ReportAppliedRequest, ReportAppliedResponse)
  WB_UNAVAILABLE_(ExchangeMagnitudes, ExchangeMagnitudesRequest, ExchangeMagnitudesResponse)
  WB_UNAVAILABLE_(ClusterStatus, StatusRequest, StatusResponse)
  WB_UNAVAILABLE_(Drain, DrainRequest, DrainResponse)
#undef WB_UNAVAILABLE_

 private:
  absl::Status NextAnswer(std::deque<absl::Status>& answers) {
    absl::MutexLock l(&mu_);
    if (down_ || answers.empty()) return absl::OkStatus();
    absl::Status answer = answers.front();
    answers.pop_front();
    return answer;
  }
  absl::Status Record(const std::string& call, const std::string& worker, const absl::Status& answer) {
    absl::MutexLock l(&mu_);
    if (down_) {
      log_.push_back(absl::StrCat(call, " ", worker, " unreachable@", session_));
      return absl::UnavailableError("failed to connect to all addresses");
    }
    log_.push_back(absl::StrCat(call, " ", worker, "@", session_));
    return answer;
  }

  absl::Mutex mu_;
  uint64_t session_ ABSL_GUARDED_BY(mu_) = 0;
  bool down_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::Time> unreachable_since_ ABSL_GUARDED_BY(mu_);
  int change_waits_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
  absl::Time back_at_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> publish_sessions_ ABSL_GUARDED_BY(mu_);
  int waits_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> wait_workers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> readies_ ABSL_GUARDED_BY(mu_);
};

class PublishRestartTest : public ::testing::Test, public daemon::testing::NodeParts {
 protected:
  PublishRestartTest() : NodeParts({}) {
    MakeVersions(coordinator_);
    WorkerCalls::Options wo;
    wo.node_id = "n0";
    wo.coordinator = "coord.test:7070";
    wo.clock = &clock_;
    coordinator_.clock = &clock_;
    wo.metrics = &metrics_;
    wo.gpu_import = std::make_shared<FakeGpuImport>();
    calls_ = std::make_unique<WorkerCalls>(wo, *local_, *staging_, *versions_, *transports_, coordinator_);
    // A sync trainer with its layout (no buffers: a sync Publish takes no snapshot).
    LocalWorkers::Worker w;
    w.model_id = "m";
    w.role = planner::Role::kTrainer;
    w.mode = pb::MODE_SYNC;
    w.has_layout = true;
    local_->Add({"m", "t0"}, std::move(w), std::nullopt);
  }
  ~PublishRestartTest() override {
    calls_.reset();
    versions_.reset();
    local_.reset();
  }
  absl::Status Publish(uint64_t version) {
    pb::PublishRequest req;
    req.set_model_id("m");
    req.set_worker_id("t0");
    req.set_version(version);
    req.set_timeout_ms(10000);
    pb::PublishResponse resp;
    return calls_->Publish(req, &resp);
  }

  absl::Status WaitVersion(const std::string& worker, uint64_t version, pb::WaitVersionResponse* resp) {
    pb::WaitVersionRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    req.set_version(version);
    req.set_timeout_ms(10000);
    return calls_->WaitVersion(req, resp);
  }

  ScriptedCoordinator coordinator_;
  std::unique_ptr<WorkerCalls> calls_;
};

TEST_F(PublishRestartTest, APublishLostToACoordinatorRestartIsSentAgainAndCommits) {
  coordinator_.restarts = 1;
  coordinator_.publish_answers = {absl::UnavailableError("Socket closed"), absl::OkStatus()};
  absl::Status s = Publish(2);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.publish_sessions(), (std::vector<uint64_t>{0, 1})) << "sent again once, in the new session";
}

TEST_F(PublishRestartTest, APublishIsSentAgainAfterEachRestart) {
  coordinator_.restarts = 2;
  coordinator_.publish_answers = {absl::CancelledError("server shut down"), absl::UnavailableError("connection reset"), absl::OkStatus()};
  absl::Status s = Publish(2);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.publish_sessions(), (std::vector<uint64_t>{0, 1, 2}));
}

TEST_F(PublishRestartTest, TheNewCoordinatorsAnswerIsReturned) {
  // The new coordinator knows the number as used (a rollout re-joined holding it): its ABORTED.
  coordinator_.restarts = 1;
  coordinator_.publish_answers = {absl::UnavailableError("Socket closed"), absl::AbortedError("version 2 of model m is not committed and its number is used")};
  absl::Status s = Publish(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("its number is used"), std::string::npos) << s;
}

TEST_F(PublishRestartTest, ANotNewerRefusalAfterARestartIsAbortedNamingTheRestart) {
  // The old coordinator committed it and another node was told: restored as committed.
  coordinator_.restarts = 1;
  coordinator_.publish_answers = {absl::UnavailableError("Socket closed"),
                                  absl::FailedPreconditionError("publish by t0: version 2 is not newer than version 2")};
  absl::Status s = Publish(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("the coordinator restarted (instance A -> B)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("is not newer than version 2"), std::string::npos) << s;
  EXPECT_NE(s.message().find("publish a newer version"), std::string::npos) << s;
}

// The same refusal, but the new coordinator holds v2 committed (asked: WaitVersion(2) OK with
// committed 2): this rank, still blocked in Publish(2), is part of that commit - OK, not ABORTED
// (chaos seed 1002, coordinator kills only: v99 and v50 committed and verified everywhere, both
// ranks told ABORTED).
TEST_F(PublishRestartTest, ANotNewerRefusalOfAVersionCommittedThereIsOk) {
  coordinator_.restarts = 1;
  coordinator_.publish_answers = {absl::UnavailableError("Socket closed"),
                                  absl::FailedPreconditionError("publish by t0: version 2 is not newer than version 2")};
  coordinator_.wait_answers = {absl::OkStatus()};
  pb::PublishRequest req;
  req.set_model_id("m");
  req.set_worker_id("t0");
  req.set_version(2);
  req.set_timeout_ms(10000);
  pb::PublishResponse resp;
  absl::Status s = calls_->Publish(req, &resp);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.version(), 2u);
  EXPECT_EQ(coordinator_.waits(), 1);
}

TEST_F(PublishRestartTest, WithoutACoordinatorChangeTheAnswerStands) {
  coordinator_.restarts = 0;
  coordinator_.publish_answers = {absl::UnavailableError("cluster is draining: version 2 refused")};
  absl::Status s = Publish(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(coordinator_.publish_sessions().size(), 1u);
}

TEST_F(PublishRestartTest, AWorkerNotReJoinedIsNotSentFor) {
  coordinator_.restarts = 1;
  coordinator_.publish_answers = {absl::UnavailableError("Socket closed"), absl::OkStatus()};
  coordinator_.on_publish = [this] { local_->Remove({"m", "t0"}); };  // its process exited meanwhile
  absl::Status s = Publish(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("was not re-joined"), std::string::npos) << s;
  EXPECT_EQ(coordinator_.publish_sessions().size(), 1u);
}

// A trainer's WaitVersion in flight at a coordinator restart: the version may have committed before
// it (chaos, seed 1002 with only coordinator kills: v33 and v75 committed on every node, both
// trainer ranks told ABORTED; v54: one rank told committed, the other ABORTED). The node asks the
// re-joined coordinator once, briefly; its OK is the answer.
TEST_F(PublishRestartTest, ATrainersWaitLostToARestartIsAskedAgainAndAnsweredCommitted) {
  coordinator_.restarts = 1;
  coordinator_.wait_answers = {absl::UnavailableError("Socket closed"), absl::OkStatus()};
  pb::WaitVersionResponse resp;
  absl::Status s = WaitVersion("t0", 2, &resp);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.committed_version(), 2u);
  EXPECT_EQ(coordinator_.waits(), 2);
}

// The new coordinator does not hold it committed (in time): ABORTED naming the restart, as before.
TEST_F(PublishRestartTest, ATrainersWaitForAVersionNotCommittedAfterARestartIsAborted) {
  coordinator_.restarts = 1;
  coordinator_.wait_answers = {absl::UnavailableError("Socket closed"), absl::DeadlineExceededError("version 2 of model m not committed in time")};
  pb::WaitVersionResponse resp;
  absl::Status s = WaitVersion("t0", 2, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("the coordinator restarted (instance A -> B)"), std::string::npos) << s;
}

// A rollout that never paused (no BeginUpdate recorded): the new coordinator would wait for its
// BeginUpdate, so its wait is not asked again - ABORTED, as before.
TEST_F(PublishRestartTest, ARolloutsWaitLostToARestartStaysAborted) {
  LocalWorkers::Worker r;
  r.model_id = "m";
  r.role = planner::Role::kRollout;
  r.mode = pb::MODE_SYNC;
  local_->Add({"m", "r0"}, std::move(r), std::nullopt);
  coordinator_.restarts = 1;
  coordinator_.wait_answers = {absl::UnavailableError("Socket closed"), absl::OkStatus()};
  pb::WaitVersionResponse resp;
  absl::Status s = WaitVersion("r0", 2, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(coordinator_.waits(), 1);
}

// A sync rollout paused by BeginUpdate (recorded by the old coordinator) whose WaitVersion is in
// flight at a restart (docs/daemon.md "Coordinator restart").
class RolloutWaitRestartTest : public PublishRestartTest {
 protected:
  RolloutWaitRestartTest() {
    LocalWorkers::Worker r;
    r.model_id = "m";
    r.role = planner::Role::kRollout;
    r.mode = pb::MODE_SYNC;
    local_->Add({"m", "r0"}, std::move(r), std::nullopt);
    // The node's re-join (NodeDaemon::Rejoin): versions aborted, the rollout's pause re-sent.
    coordinator_.on_rejoin = [this] {
      versions_->AbortAllForRejoin("the coordinator restarted (instance A -> B)");
      calls_->ResendPause({"m", "r0"});
    };
  }
  absl::Status BeginUpdate(int64_t timeout_ms = 10000) {
    pb::BeginUpdateRequest req;
    req.set_model_id("m");
    req.set_worker_id("r0");
    req.set_timeout_ms(timeout_ms);
    pb::BeginUpdateResponse resp;
    return calls_->BeginUpdate(req, &resp);
  }
};

// The re-join reports the pause again (in the new session, before any version could start there)
// and the wait is asked again of the new coordinator: its OK is the answer. Before, ABORTED: the
// re-sent version committed into the rollout while it waited for the next one, never verified.
TEST_F(RolloutWaitRestartTest, APausedRolloutsWaitIsAskedAgainAfterItsPauseWasReSent) {
  ASSERT_TRUE(BeginUpdate().ok());
  coordinator_.restarts = 1;
  coordinator_.wait_answers = {absl::UnavailableError("Socket closed"), absl::OkStatus()};
  pb::WaitVersionResponse resp;
  absl::Status s = WaitVersion("r0", 2, &resp);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.committed_version(), 2u);
  EXPECT_EQ(coordinator_.waits(), 2);
  EXPECT_EQ(coordinator_.readies(), (std::vector<std::string>{"paused@0", "paused@0"}))
      << "BeginUpdate's report, then the re-join's, both before the new session opened";
}

// Asked again after each further restart, within the call's deadline.
TEST_F(RolloutWaitRestartTest, APausedRolloutsWaitIsAskedAgainAfterEachRestart) {
  ASSERT_TRUE(BeginUpdate().ok());
  coordinator_.restarts = 2;
  coordinator_.wait_answers = {absl::UnavailableError("Socket closed"), absl::CancelledError("server shut down"), absl::OkStatus()};
  pb::WaitVersionResponse resp;
  absl::Status s = WaitVersion("r0", 2, &resp);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.waits(), 3);
  EXPECT_EQ(coordinator_.readies().size(), 3u) << "the pause re-sent at each re-join";
}

// The new coordinator's real outcome is the answer (the number is used there: ABORTED naming it).
TEST_F(RolloutWaitRestartTest, TheNewCoordinatorsOutcomeIsTheAnswer) {
  ASSERT_TRUE(BeginUpdate().ok());
  coordinator_.restarts = 1;
  coordinator_.wait_answers = {absl::UnavailableError("Socket closed"), absl::AbortedError("version 2 of model m is not committed and its number is used")};
  pb::WaitVersionResponse resp;
  absl::Status s = WaitVersion("r0", 2, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("its number is used"), std::string::npos) << s;
}

// EndUpdate while the re-join's report was on its way: reported resumed right after, and the wait
// (which would wait for a BeginUpdate) is ABORTED naming the restart.
TEST_F(RolloutWaitRestartTest, ARolloutThatResumedWhileItsPauseWasReSentIsReportedResumed) {
  ASSERT_TRUE(BeginUpdate().ok());
  coordinator_.on_ready = [this] {
    if (coordinator_.readies().size() != 2) return;  // the re-join's report
    ASSERT_TRUE(local_->EndUpdate({"m", "r0"}, clock_.Now() + absl::Seconds(1)).ok());
  };
  coordinator_.restarts = 1;
  coordinator_.wait_answers = {absl::UnavailableError("Socket closed"), absl::OkStatus()};
  pb::WaitVersionResponse resp;
  absl::Status s = WaitVersion("r0", 2, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("the coordinator restarted (instance A -> B)"), std::string::npos) << s;
  EXPECT_EQ(coordinator_.waits(), 1);
  EXPECT_EQ(coordinator_.readies(), (std::vector<std::string>{"paused@0", "paused@0", "resumed@0"}));
}

// A commit since its BeginUpdate took the pause at the old coordinator (it released the rollout):
// not re-sent - the next version must wait for its next BeginUpdate - and a wait for a newer
// version is ABORTED as before.
TEST_F(RolloutWaitRestartTest, APauseACommitTookIsNotReSent) {
  ASSERT_TRUE(BeginUpdate().ok());
  local_->Commit("m", 2, {{"r0", nullptr}}, {});  // v2 committed into it (its copy not run here)
  coordinator_.restarts = 1;
  coordinator_.wait_answers = {absl::UnavailableError("Socket closed"), absl::OkStatus()};
  pb::WaitVersionResponse resp;
  absl::Status s = WaitVersion("r0", 3, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(coordinator_.waits(), 1);
  EXPECT_EQ(coordinator_.readies(), (std::vector<std::string>{"paused@0"}));
}

// A BeginUpdate sent while the coordinator is down (killed, not restarted yet): its ReportReady
// answers UNAVAILABLE. Held (the call's deadline) until the node re-joined the restarted
// coordinator, then sent there once: OK. Before, UNAVAILABLE at once (chaos sync 1002, coordinator
// kills only: 28-53 such failures per rollout per run, each retried by the client).
class CoordinatorDownTest : public RolloutWaitRestartTest {
 protected:
  // BeginUpdate(timeout_ms) on its own thread, once the coordinator went down (back after `down_for`).
  absl::Status BeginUpdateWhileDown(int64_t timeout_ms, absl::Duration down_for, absl::Duration advance) {
    const absl::Time t0 = clock_.Now();
    coordinator_.GoDown(t0 + down_for);
    absl::Status s;
    std::thread call([&] { s = BeginUpdate(timeout_ms); });
    // Held: waiting for the node's session, bounded by the call's deadline (not answered at once).
    EXPECT_TRUE(clock_.AwaitWaiter(t0 + absl::Milliseconds(timeout_ms), absl::Now() + absl::Seconds(10))) << "the call is not held";
    clock_.Advance(advance);
    call.join();
    return s;
  }
};

TEST_F(CoordinatorDownTest, ABeginUpdateSentWhileTheCoordinatorIsDownIsHeldAndSentAfterTheReJoin) {
  coordinator_.restarts = 1;
  absl::Status s = BeginUpdateWhileDown(10000, absl::Seconds(2), absl::Seconds(2));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.readies(), (std::vector<std::string>{"unreachable@0", "paused@1"}))
      << "sent again once, to the re-joined coordinator (session 1)";
  // Recorded as a pause the coordinator holds: the next re-join re-sends it (ResendPause).
  EXPECT_TRUE(local_->PauseToResend({"m", "r0"}).has_value());
}

// The coordinator is not back by the call's deadline: UNAVAILABLE naming the coordinator and the
// wait; the node's pause stays as after any failed BeginUpdate (not a pause the coordinator holds:
// a later re-join does not re-send it).
TEST_F(CoordinatorDownTest, ABeginUpdateWhoseDeadlinePassesFirstIsUnavailableNamingTheWait) {
  coordinator_.restarts = 1;
  absl::Status s = BeginUpdateWhileDown(3000, absl::Seconds(30), absl::Seconds(3));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("the coordinator at coord.test:7070 could not be reached"), std::string::npos) << s;
  EXPECT_NE(s.message().find("held 3s"), std::string::npos) << s;
  EXPECT_EQ(coordinator_.readies(), (std::vector<std::string>{"unreachable@0"}));
  EXPECT_FALSE(local_->PauseToResend({"m", "r0"}).has_value());
}

// The same coordinator answers again (stalled, not restarted: no re-join): sent once more.
TEST_F(CoordinatorDownTest, ABeginUpdateIsSentOnceMoreWhenTheSameCoordinatorIsBack) {
  coordinator_.restarts = 0;
  absl::Status s = BeginUpdateWhileDown(10000, absl::Seconds(2), absl::Seconds(2));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.readies(), (std::vector<std::string>{"unreachable@0", "paused@0"}));
}

// The other worker calls that forward to the coordinator (RegisterWorker's JoinWorker,
// RegisterLayout's SubmitLayout, Deregister's LeaveWorker), sent while the coordinator is down: a
// trainer or rollout restarting during a coordinator restart (a cluster-wide rolling restart).
// Held like BeginUpdate, within what is left of the worker's gRPC deadline (CallerDeadline).
// Before, each answered UNAVAILABLE at once and the worker's client errored out.
class HeldCallsTest : public CoordinatorDownTest {
 protected:
  HeldCallsTest() {
    // The node's re-join, recorded: every worker it re-sends (NodeDaemon::Rejoin's list).
    coordinator_.on_rejoin = [this] {
      versions_->AbortAllForRejoin("the coordinator restarted (instance A -> B)");
      for (const LocalWorkers::JoinInfo& j : local_->Joins()) coordinator_.Note(absl::StrCat("rejoin ", j.key.second));
    };
  }
  // `call` on its own thread, once the coordinator went down (back after `down_for`; the node's
  // heartbeats found it unreachable 5 s before). `time_left`: the worker's gRPC deadline.
  absl::Status WhileDown(absl::Duration time_left, absl::Duration down_for, absl::Duration advance,
                         const std::function<absl::Status(absl::Duration)>& call) {
    const absl::Time t0 = clock_.Now();
    const absl::Time deadline = CallerDeadline(&clock_, time_left);
    coordinator_.GoDown(t0 + down_for, t0 - absl::Seconds(5));
    absl::Status s;
    std::thread caller([&] { s = call(time_left); });
    EXPECT_TRUE(coordinator_.AwaitChangeWaits(1)) << "the call is not held";
    EXPECT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(10))) << "the call is not held";
    clock_.Advance(advance);
    caller.join();
    return s;
  }
  absl::Status RegisterWorker(const std::string& worker, absl::Duration time_left) {
    pb::RegisterWorkerRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    req.set_role(pb::ROLE_ROLLOUT);
    pb::RegisterWorkerResponse resp;
    return calls_->RegisterWorker(req, &resp, time_left);
  }
  absl::Status Deregister(const std::string& worker, absl::Duration time_left) {
    pb::DeregisterRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    return calls_->Deregister(req, time_left);
  }
  std::string Since(absl::Time t) { return absl::FormatTime("%Y-%m-%d %H:%M:%E3S UTC", t, absl::UTCTimeZone()); }
};

// Joined once, by the held call, after the re-join (which re-sent only the workers the node had:
// t0 and r0, not r1) - no duplicate, no race with the re-join's re-registration.
TEST_F(HeldCallsTest, ARegisterWorkerSentWhileTheCoordinatorIsDownIsHeldAndJoinedOnceAfterTheReJoin) {
  coordinator_.restarts = 1;
  absl::Status s = WhileDown(absl::Seconds(10), absl::Seconds(2), absl::Seconds(2), [&](absl::Duration left) { return RegisterWorker("r1", left); });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"join r1 unreachable@0", "rejoin r0@0", "rejoin t0@0", "join r1@1"}));
  EXPECT_TRUE(local_->Has({"m", "r1"}));
}

// The coordinator is back (restarted) but the node has not noticed yet: the join is refused "node
// n0 is not registered" (FAILED_PRECONDITION, nothing recorded). Held until the node's re-join,
// then joined there once. Before, the refusal was the answer.
TEST_F(HeldCallsTest, ARegisterWorkerRefusedByARestartedCoordinatorBeforeTheReJoinIsSentAfterIt) {
  coordinator_.restarts = 1;
  coordinator_.join_answers = {absl::FailedPreconditionError("node n0 is not registered")};
  absl::Status s = RegisterWorker("r1", absl::Seconds(10));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"join r1@0", "rejoin r0@0", "rejoin t0@0", "join r1@1"}));
  EXPECT_TRUE(local_->Has({"m", "r1"}));
}

TEST_F(HeldCallsTest, ARegisterWorkerIsSentOnceMoreWhenTheSameCoordinatorIsBack) {
  coordinator_.restarts = 0;
  absl::Status s = WhileDown(absl::Seconds(10), absl::Seconds(2), absl::Seconds(2), [&](absl::Duration left) { return RegisterWorker("r1", left); });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"join r1 unreachable@0", "join r1@0"}));
  EXPECT_TRUE(local_->Has({"m", "r1"}));
}

// Not back within the worker's deadline (4 s, answered 1 s before it): UNAVAILABLE naming the
// coordinator, since when the node's heartbeats found it unreachable, and the wait; nothing joined.
TEST_F(HeldCallsTest, ARegisterWorkerWhoseDeadlinePassesFirstNamesTheCoordinatorAndSinceWhen) {
  coordinator_.restarts = 1;
  const absl::Time t0 = clock_.Now();
  absl::Status s = WhileDown(absl::Seconds(4), absl::Seconds(30), absl::Seconds(3), [&](absl::Duration left) { return RegisterWorker("r1", left); });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  for (const std::string& want : {std::string("RegisterWorker of worker r1 of model m on node n0: the coordinator at coord.test:7070 could not be reached since "),
                                  Since(t0 - absl::Seconds(5)), std::string("(8s ago; failed to connect to all addresses)"), std::string("held 3s"),
                                  std::string("call it again")}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << " missing in: " << s;
  }
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"join r1 unreachable@0"}));
  EXPECT_FALSE(local_->Has({"m", "r1"}));
}

// A rollout registered (r0), its RegisterLayout sent while the coordinator is down: the re-join
// re-sends its join (no layout yet), then the held call submits the layout there, once.
TEST_F(HeldCallsTest, ARegisterLayoutSentWhileTheCoordinatorIsDownIsHeldAndSubmittedAfterTheReJoin) {
  auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("held"), 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  pb::RegisterLayoutRequest req;
  req.set_model_id("m");
  req.set_worker_id("r0");
  pb::BufferSpec* b = req.add_buffers();
  b->set_buffer_id(0);
  b->set_shm_name(seg->name());
  b->set_size_bytes(4096);
  coordinator_.restarts = 1;
  absl::Status s = WhileDown(absl::Seconds(10), absl::Seconds(2), absl::Seconds(2), [&](absl::Duration left) {
    pb::RegisterLayoutResponse resp;
    return calls_->RegisterLayout(req, &resp, left);
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"layout r0 unreachable@0", "rejoin r0@0", "rejoin t0@0", "layout r0@1"}));
  std::optional<LocalWorkers::View> r0 = local_->Get({"m", "r0"});
  ASSERT_TRUE(r0.has_value());
  EXPECT_TRUE(r0->worker.has_layout);
}

// Deregister removes the worker here first, so the re-join does not re-send it; the held
// LeaveWorker then reaches the restarted coordinator, which does not know the model (no other
// worker of it re-joined): NOT_FOUND there means nothing is left to leave - OK.
TEST_F(HeldCallsTest, ADeregisterSentWhileTheCoordinatorIsDownIsHeldAndDoneAfterTheReJoin) {
  coordinator_.restarts = 1;
  coordinator_.leave_answers = {absl::NotFoundError("unknown model \"m\"")};
  absl::Status s = WhileDown(absl::Seconds(10), absl::Seconds(2), absl::Seconds(2), [&](absl::Duration left) { return Deregister("r0", left); });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unreachable@0", "rejoin t0@0", "leave r0@1"})) << "no re-join of r0";
  EXPECT_FALSE(local_->Has({"m", "r0"}));
}

TEST_F(HeldCallsTest, ADeregisterIsSentOnceMoreWhenTheSameCoordinatorIsBack) {
  coordinator_.restarts = 0;
  absl::Status s = WhileDown(absl::Seconds(10), absl::Seconds(2), absl::Seconds(2), [&](absl::Duration left) { return Deregister("r0", left); });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unreachable@0", "leave r0@0"}));
}

// The node owes the coordinator the leave (sent when it answers again, worker_calls_stall_test;
// dropped at a re-join) and says so. Before: "the coordinator may still count it: call Deregister
// again".
TEST_F(HeldCallsTest, ADeregisterWhoseDeadlinePassesFirstSaysTheNodeOwesTheLeave) {
  coordinator_.restarts = 1;
  absl::Status s = WhileDown(absl::Seconds(4), absl::Seconds(30), absl::Seconds(3), [&](absl::Duration left) { return Deregister("r0", left); });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("Deregister of worker r0 of model m on node n0: the coordinator at coord.test:7070 could not be reached since"),
            std::string::npos) << s;
  EXPECT_NE(s.message().find("the worker is removed on this node; node n0 owes the coordinator the worker's leave"), std::string::npos) << s;
  EXPECT_EQ(local_->OwedLeaves(), 1u);
}

// A Publish whose deadline passes while the coordinator is down (it keeps its own re-send after a
// re-join, PublishAgainAfterRestart): the answer names the wait, like a held BeginUpdate's, not the
// transport's last words ("failed to connect to all addresses", all it said before).
TEST_F(HeldCallsTest, APublishWhoseDeadlinePassesWhileTheCoordinatorIsDownNamesTheWait) {
  coordinator_.restarts = 1;
  coordinator_.publish_answers = {absl::UnavailableError("failed to connect to all addresses")};
  const absl::Time t0 = clock_.Now();
  coordinator_.GoDown(t0 + absl::Seconds(30), t0 - absl::Seconds(5));
  absl::Status s;
  std::thread caller([&] { s = Publish(2); });
  EXPECT_TRUE(coordinator_.AwaitChangeWaits(1)) << "the publish is not held";
  EXPECT_TRUE(clock_.AwaitWaiter(t0 + absl::Seconds(10), absl::Now() + absl::Seconds(10))) << "the publish is not held";
  clock_.Advance(absl::Seconds(10));
  caller.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  for (const std::string& want : {std::string("Publish of version 2 by worker t0 of model m on node n0: the coordinator at coord.test:7070 could not be "
                                              "reached since "),
                                  Since(t0 - absl::Seconds(5)), std::string("(15s ago; failed to connect to all addresses)"), std::string("held 10s"),
                                  std::string("publish it again")}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << " missing in: " << s;
  }
  EXPECT_EQ(coordinator_.publish_sessions(), (std::vector<uint64_t>{0}));
}

// status.md item 24 (e2e KillCoordinatorMidTransfer, once in a clean-clone run): a one-step-off
// rollout's Apply(2) reaches its node only after the node re-joined a restarted coordinator, and
// no execution of version 2 ever reached this node (its ExecuteVersion was not delivered before
// the kill), so the re-join recorded no abort of it and ended no wait. The node asks the
// coordinator (WaitVersion without the worker: the model's answer, no sync pause recorded), whose
// ABORTED - the number is used, a trainer re-joined having published it - is the answer, at once.
// Before, the Apply waited on the node until its deadline.
class ApplyAfterRejoinTest : public PublishRestartTest {
 protected:
  ApplyAfterRejoinTest() {
    LocalWorkers::Worker r;
    r.model_id = "m";
    r.role = planner::Role::kRollout;
    r.mode = pb::MODE_ONE_STEP_OFF;
    local_->Add({"m", "r0"}, std::move(r), std::nullopt);
    versions_->AbortAllForRejoin("the coordinator restarted (instance A -> B)");  // the re-join, before the Apply
  }
  // Apply(version) of r0 with a 10 s timeout on the fake clock. A call still waiting after 30 s of
  // real time is moved past its deadline, so that a wait on the node fails the test (its error
  // says so) instead of hanging it.
  absl::Status Apply(uint64_t version, bool expect_local_wait = false) {
    pb::ApplyRequest req;
    req.set_model_id("m");
    req.set_worker_id("r0");
    req.set_version(version);
    req.set_timeout_ms(10000);
    const absl::Time deadline = clock_.Now() + absl::Seconds(10);
    absl::Status s = absl::UnknownError("not run");
    absl::Notification done;
    std::thread t([&] {
      pb::ApplyResponse resp;
      s = calls_->Apply(req, &resp);
      done.Notify();
    });
    if (expect_local_wait) EXPECT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30))) << "no wait on the node";
    if (expect_local_wait || !done.WaitForNotificationWithTimeout(absl::Seconds(30))) clock_.Advance(absl::Seconds(11));
    t.join();
    return s;
  }
};

TEST_F(ApplyAfterRejoinTest, AnApplyOfAVersionUnknownHereSinceTheReJoinIsAnsweredByTheCoordinator) {
  coordinator_.wait_answers = {absl::AbortedError(
      "wait for version 2: version 2 of model m is not committed and its number is used: trainer t0 on node n0 re-joined having "
      "published version 2 to the coordinator before the coordinator restarted")};
  absl::Status s = Apply(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("its number is used"), std::string::npos) << s;
  EXPECT_NE(s.message().find("coordinator restarted"), std::string::npos) << s;
  EXPECT_EQ(coordinator_.wait_workers(), (std::vector<std::string>{""})) << "asked once, for the model";
}

// A version that is coming (the coordinator answers OK once it is committed there) is still awaited
// on the node: the node's own commit, not the coordinator's answer, decides what is copied.
TEST_F(ApplyAfterRejoinTest, AVersionTheCoordinatorCommitsIsAwaitedOnTheNode) {
  coordinator_.wait_answers = {absl::OkStatus()};
  absl::Status s = Apply(2, /*expect_local_wait=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("version 2 not committed on node n0 in time"), std::string::npos) << s;
  EXPECT_EQ(coordinator_.waits(), 1);
}

// The trainer's side: a one-step-off publish the coordinator answered is what the node's re-join
// reports as published (JoinWorkerRequest.published_version); a sync trainer's is not (its Publish
// returns once the version is committed).
TEST_F(PublishRestartTest, AnAnsweredOneStepOffPublishIsReportedAtTheReJoin) {
  LocalWorkers::Worker w;
  w.model_id = "m";
  w.role = planner::Role::kTrainer;
  w.mode = pb::MODE_ONE_STEP_OFF;
  w.has_layout = true;
  local_->Add({"m", "t1"}, std::move(w), std::nullopt);
  coordinator_.publish_answers = {absl::OkStatus(), absl::OkStatus()};
  pb::PublishRequest req;
  req.set_model_id("m");
  req.set_worker_id("t1");
  req.set_version(2);
  req.set_timeout_ms(10000);
  pb::PublishResponse resp;
  absl::Status s = calls_->Publish(req, &resp);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(Publish(2).ok());  // the sync trainer t0
  for (const LocalWorkers::JoinInfo& j : local_->Joins()) {
    EXPECT_EQ(j.published_version, j.key.second == "t1" ? 2u : 0u) << j.key.second;
  }
}

}  // namespace
}  // namespace wb::daemon::node
