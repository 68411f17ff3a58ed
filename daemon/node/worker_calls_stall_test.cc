// node::WorkerCalls when the SAME coordinator stalls (no answer for a while, then answers again,
// no restart and so no re-join): the leaves it did not get are owed and re-sent once it answers
// (LeaveExited, SendOwedLeaves, Deregister; LocalWorkers' owed leaves), and a WaitVersion whose
// coordinator stays away to the call's deadline names it and since when (WaitUnreached), as the
// held calls do. Simulated time (FakeClock); a scripted coordinator. The restart cases (a new
// coordinator, a re-join) are worker_calls_restart_test's.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/fake_gpu_import.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/worker_calls.h"
#include "daemon/testing/node_parts.h"

namespace wb::daemon::node {
namespace {

// One coordinator that never restarts. Away (SetAway): LeaveWorker answers `away_error` (UNAVAILABLE:
// refused connections; DEADLINE_EXCEEDED: a stall), the node's heartbeats report it unreachable
// since the given time, and AwaitCoordinatorChange waits on the clock until its deadline (nothing
// changes). Back: calls answer, heartbeats too. Every LeaveWorker is logged as "leave <worker>
// (<reason>)" or "leave <worker> unanswered". WaitVersion answers from a script.
class StallingCoordinator final : public CoordinatorAccess, public CoordinatorClient {
 public:
  explicit StallingCoordinator(Clock* clock) : clock_(clock) {}
  ~StallingCoordinator() override { clock_->Forget(&mu_); }

  void SetAway(absl::Status away_error, absl::Time unreachable_since) {
    absl::MutexLock l(&mu_);
    away_ = std::move(away_error);
    unreachable_since_ = unreachable_since;
  }
  void Back() {
    absl::MutexLock l(&mu_);
    away_ = absl::OkStatus();
    unreachable_since_.reset();
  }
  std::vector<std::string> log() {
    absl::MutexLock l(&mu_);
    return log_;
  }
  int change_waits() {
    absl::MutexLock l(&mu_);
    return change_waits_;
  }
  // LeaveWorker calls get no answer until ReleaseLeaves (a coordinator that stalls them).
  void HoldLeaves() {
    absl::MutexLock l(&mu_);
    hold_leaves_ = true;
  }
  void ReleaseLeaves() {
    absl::MutexLock l(&mu_);
    hold_leaves_ = false;
  }
  // Waits (real time, bounded) until `n` LeaveWorker calls have begun; whether they did.
  bool AwaitLeavesEntered(int n) {
    absl::MutexLock l(&mu_);
    auto entered = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return leaves_entered_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&entered), absl::Seconds(30));
  }
  int wait_calls() {
    absl::MutexLock l(&mu_);
    return wait_calls_;
  }
  // Runs inside each WaitVersion with the call's timeout, before its answer (a test moves the
  // clock: a call that hangs).
  std::function<void(absl::Duration)> on_wait;
  std::deque<absl::Status> wait_answers;
  // The next LeaveWorker answers this once (then OK again) although the coordinator is back: it
  // stalled again.
  std::optional<absl::Status> next_leave;

  CoordinatorClient& client() override { return *this; }
  bool AwaitRegistered(absl::Time) override { return true; }
  uint64_t session() override { return 0; }
  std::optional<std::string> AwaitCoordinatorChange(uint64_t, absl::Time deadline) override {
    absl::MutexLock l(&mu_);
    ++change_waits_;
    auto back = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return away_.ok(); };
    clock_->WaitUntil(&mu_, absl::Condition(&back), deadline);
    return std::nullopt;  // the same coordinator (or the deadline)
  }
  std::optional<absl::Time> UnreachableSince() override {
    absl::MutexLock l(&mu_);
    return unreachable_since_;
  }
  void TrackProgress(const std::string&, uint64_t, std::weak_ptr<const std::atomic<uint64_t>>) override {}

  absl::Status LeaveWorker(const pb::LeaveWorkerRequest& req, pb::LeaveWorkerResponse*, absl::Duration) override {
    absl::MutexLock l(&mu_);
    ++leaves_entered_;
    // Held: no answer until ReleaseLeaves (bounded in real time: a test that never releases).
    auto released = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !hold_leaves_; };
    mu_.AwaitWithTimeout(absl::Condition(&released), absl::Seconds(10));
    absl::Status answer = away_;
    if (answer.ok() && next_leave) {
      answer = *next_leave;
      next_leave.reset();
    }
    log_.push_back(answer.ok() ? absl::StrCat("leave ", req.worker_id(), " (", req.reason(), ")") : absl::StrCat("leave ", req.worker_id(), " unanswered"));
    return answer;
  }
  absl::Status WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Duration timeout) override {
    if (on_wait) on_wait(timeout);
    absl::MutexLock l(&mu_);
    ++wait_calls_;
    absl::Status answer = wait_answers.empty() ? absl::InternalError("no scripted answer") : wait_answers.front();
    if (!wait_answers.empty()) wait_answers.pop_front();
    if (answer.ok()) resp->set_committed_version(req.version());
    return answer;
  }
#define WB_UNAVAILABLE_(Name, Req, Resp) \
  absl::Status Name(const pb::Req&, pb::Resp*, absl::Duration) override { return absl::UnavailableError(#Name); }
  WB_UNAVAILABLE_(RegisterNode, RegisterNodeRequest, RegisterNodeResponse)
  WB_UNAVAILABLE_(Heartbeat, HeartbeatRequest, HeartbeatResponse)
  WB_UNAVAILABLE_(JoinWorker, JoinWorkerRequest, JoinWorkerResponse)
  WB_UNAVAILABLE_(SubmitLayout, SubmitLayoutRequest, SubmitLayoutResponse)
  WB_UNAVAILABLE_(Publish, CoordPublishRequest, PublishResponse)
  WB_UNAVAILABLE_(ReportReady, ReportReadyRequest, ReportReadyResponse)
  WB_UNAVAILABLE_(ReportDone, ReportDoneRequest, ReportDoneResponse)
  WB_UNAVAILABLE_(ReportApplied, ReportAppliedRequest, ReportAppliedResponse)
  WB_UNAVAILABLE_(ExchangeMagnitudes, ExchangeMagnitudesRequest, ExchangeMagnitudesResponse)
  WB_UNAVAILABLE_(ClusterStatus, StatusRequest, StatusResponse)
  WB_UNAVAILABLE_(Drain, DrainRequest, DrainResponse)
#undef WB_UNAVAILABLE_

 private:
  Clock* const clock_;
  absl::Mutex mu_;
  absl::Status away_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Time> unreachable_since_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
  int change_waits_ ABSL_GUARDED_BY(mu_) = 0;
  int wait_calls_ ABSL_GUARDED_BY(mu_) = 0;
  bool hold_leaves_ ABSL_GUARDED_BY(mu_) = false;
  int leaves_entered_ ABSL_GUARDED_BY(mu_) = 0;
};

class StallTest : public ::testing::Test, public daemon::testing::NodeParts {
 protected:
  StallTest() : NodeParts({}), coordinator_(&clock_) {
    MakeVersions(coordinator_);
    WorkerCalls::Options wo;
    wo.node_id = "n0";
    wo.coordinator = "coord.test:7070";
    wo.clock = &clock_;
    wo.metrics = &metrics_;
    wo.gpu_import = std::make_shared<FakeGpuImport>();
    calls_ = std::make_unique<WorkerCalls>(wo, *local_, *staging_, *versions_, *transports_, coordinator_);
  }
  ~StallTest() override {
    calls_.reset();
    versions_.reset();
    local_.reset();
  }
  // A sync worker `id` of model m whose process has exited (a child that exits at once, reaped):
  // the liveness check (LeaveExited) finds it gone.
  void AddExitedWorker(const std::string& id, planner::Role role = planner::Role::kRollout) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::pause();
      ::_exit(0);
    }
    auto watch = PidWatch::Open(child, absl::StrCat("worker ", id));
    ASSERT_TRUE(watch.ok()) << watch.status();
    LocalWorkers::Worker w;
    w.model_id = "m";
    w.role = role;
    w.pid = *watch;
    local_->Add({"m", id}, std::move(w), std::nullopt);
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  }
  void AddWorker(const std::string& id, planner::Role role) {
    LocalWorkers::Worker w;
    w.model_id = "m";
    w.role = role;
    w.mode = pb::MODE_SYNC;
    local_->Add({"m", id}, std::move(w), std::nullopt);
  }
  // The control tick's two leave steps; each returns once its leaves are queued, so the test
  // waits (bounded) for the sender to finish them.
  void LeaveExited() {
    calls_->LeaveExited();
    EXPECT_TRUE(calls_->AwaitLeavesSent(absl::Seconds(30))) << "the leaves were not sent";
  }
  void SendOwedLeaves() {
    calls_->SendOwedLeaves();
    EXPECT_TRUE(calls_->AwaitLeavesSent(absl::Seconds(30))) << "the owed leaves were not sent";
  }
  absl::Status Deregister(const std::string& worker) {
    pb::DeregisterRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    return calls_->Deregister(req, absl::Seconds(10));
  }
  // WaitVersion(2) of `worker` with a 10 s timeout, on its own thread. `held`: the call waits on
  // the clock until its deadline (the coordinator stays away), which the test then passes.
  // `time_left`: what is left of the worker's gRPC deadline when the node gets the call.
  absl::Status WaitVersion(const std::string& worker, bool held, absl::Duration time_left = absl::InfiniteDuration()) {
    pb::WaitVersionRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    req.set_version(2);
    req.set_timeout_ms(10000);
    const absl::Time deadline = clock_.Now() + absl::Seconds(10);
    absl::Status s;
    std::thread caller([&] {
      pb::WaitVersionResponse resp;
      s = calls_->WaitVersion(req, &resp, time_left);
    });
    if (held) {
      EXPECT_TRUE(clock_.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30))) << "the wait is not held";
      clock_.Advance(absl::Seconds(10));
    }
    caller.join();
    return s;
  }
  std::string Since(absl::Time t) { return absl::FormatTime("%Y-%m-%d %H:%M:%E3S UTC", t, absl::UTCTimeZone()); }
  void ExpectIn(const absl::Status& s, const std::vector<std::string>& wants) {
    for (const std::string& want : wants) EXPECT_NE(s.message().find(want), std::string::npos) << want << " missing in: " << s;
  }

  StallingCoordinator coordinator_;
  std::unique_ptr<WorkerCalls> calls_;
};

// ---- (a) owed leaves

// A rollout's process exits while the coordinator stalls: its one leave finds no answer, so the
// leave is owed - not re-sent while the heartbeats find the coordinator away, sent once when it
// answers again, and then no more. Before, that one try was all: the coordinator back from the
// stall kept r0 as a member (later versions held, waiting on it, until their timeouts).
TEST_F(StallTest, AnExitedWorkersLeaveTheStalledCoordinatorMissedIsSentWhenItAnswersAgain) {
  AddExitedWorker("r0");
  ASSERT_FALSE(HasFatalFailure());
  coordinator_.SetAway(absl::DeadlineExceededError("Deadline Exceeded"), clock_.Now() - absl::Seconds(2));
  LeaveExited();
  EXPECT_FALSE(local_->Has({"m", "r0"}));
  EXPECT_EQ(local_->OwedLeaves(), 1u);
  SendOwedLeaves();  // still away: not tried
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered"}));
  coordinator_.Back();
  SendOwedLeaves();
  SendOwedLeaves();  // nothing owed any more
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r0 (its process exited)"}));
  EXPECT_EQ(local_->OwedLeaves(), 0u);
}

// Refused connections (UNAVAILABLE) are owed the same; a leave the coordinator answers (OK or
// NOT_FOUND) is not.
TEST_F(StallTest, OnlyUnansweredLeavesAreOwed) {
  AddExitedWorker("r0");
  ASSERT_FALSE(HasFatalFailure());
  coordinator_.SetAway(absl::UnavailableError("failed to connect to all addresses"), clock_.Now());
  LeaveExited();
  EXPECT_EQ(local_->OwedLeaves(), 1u);
  coordinator_.Back();
  coordinator_.next_leave = absl::NotFoundError("worker r0 is not on node n0");
  AddExitedWorker("r1");
  ASSERT_FALSE(HasFatalFailure());
  LeaveExited();  // answered NOT_FOUND: nothing owed for r1
  EXPECT_EQ(local_->OwedLeaves(), 1u);
  SendOwedLeaves();
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r1 unanswered", "leave r0 (its process exited)"}));
  EXPECT_EQ(local_->OwedLeaves(), 0u);
}

// The coordinator stalls again under the re-send: that leave and the ones after it stay owed
// (untried: each try would hold the node's control thread for its timeout) until it answers.
TEST_F(StallTest, AnOwedLeaveThatFindsTheCoordinatorAwayAgainStaysOwed) {
  AddExitedWorker("r0");
  AddExitedWorker("r1");
  ASSERT_FALSE(HasFatalFailure());
  coordinator_.SetAway(absl::UnavailableError("failed to connect to all addresses"), clock_.Now());
  LeaveExited();
  EXPECT_EQ(local_->OwedLeaves(), 2u);
  coordinator_.Back();
  coordinator_.next_leave = absl::DeadlineExceededError("Deadline Exceeded");
  SendOwedLeaves();
  EXPECT_EQ(local_->OwedLeaves(), 2u);
  SendOwedLeaves();
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r1 unanswered", "leave r0 unanswered",
                                                          "leave r0 (its process exited)", "leave r1 (its process exited)"}));
  EXPECT_EQ(local_->OwedLeaves(), 0u);
}

// The coordinator gives no answer at all to the leave of an exited worker: the node's control
// tick (LeaveExited) returns at once - the leave is on the sender's thread - and a second exited
// worker's leave queues behind it, also without holding the tick. When the stalled leave times
// out, the second is tried and times out too; both are owed and both are sent once the coordinator
// answers again: none is lost. Before, the tick sent each leave itself and waited up to 7 s for each, while the
// same thread was the one to re-register and re-join the node.
TEST_F(StallTest, AnExitedWorkersLeaveToAStalledCoordinatorDoesNotHoldTheControlTick) {
  AddExitedWorker("r0");
  ASSERT_FALSE(HasFatalFailure());
  coordinator_.HoldLeaves();
  calls_->LeaveExited();
  ASSERT_TRUE(coordinator_.AwaitLeavesEntered(1)) << "the leave was not sent";
  // The tick is back while the coordinator still holds the leave (no answer yet).
  EXPECT_EQ(coordinator_.log(), std::vector<std::string>{}) << "the tick waited for the leave's answer";
  AddExitedWorker("r1");
  ASSERT_FALSE(HasFatalFailure());
  calls_->LeaveExited();
  EXPECT_EQ(coordinator_.log(), std::vector<std::string>{}) << "the second tick waited for the leave's answer";
  EXPECT_FALSE(local_->Has({"m", "r1"}));
  // The held leave times out (a stall); the heartbeats find the coordinator away meanwhile.
  coordinator_.SetAway(absl::DeadlineExceededError("Deadline Exceeded"), clock_.Now());
  coordinator_.ReleaseLeaves();
  ASSERT_TRUE(calls_->AwaitLeavesSent(absl::Seconds(30)));
  EXPECT_EQ(local_->OwedLeaves(), 2u);
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r1 unanswered"}));
  coordinator_.Back();
  SendOwedLeaves();
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r1 unanswered", "leave r0 (its process exited)",
                                                          "leave r1 (its process exited)"}));
  EXPECT_EQ(local_->OwedLeaves(), 0u);
}

// A re-join rebuilds the coordinator's membership from the node's workers: the owed leaves are
// dropped, never sent to the new coordinator.
TEST_F(StallTest, AReJoinDropsTheOwedLeaves) {
  AddExitedWorker("r0");
  ASSERT_FALSE(HasFatalFailure());
  coordinator_.SetAway(absl::UnavailableError("failed to connect to all addresses"), clock_.Now());
  LeaveExited();
  ASSERT_EQ(local_->OwedLeaves(), 1u);
  versions_->AbortAllForRejoin("the coordinator restarted (instance A -> B)");  // NodeDaemon::Rejoin's first step
  coordinator_.Back();
  SendOwedLeaves();
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered"}));
  EXPECT_EQ(local_->OwedLeaves(), 0u);
}

// The id registered again (a new process, joined at the coordinator: that join dropped the old
// registration there): its owed leave is settled, never sent - it would drop the new process.
// One joining now is not handed out either.
TEST_F(StallTest, ANewRegistrationOfTheIdSettlesItsOwedLeave) {
  AddExitedWorker("r0");
  AddExitedWorker("r1");
  ASSERT_FALSE(HasFatalFailure());
  coordinator_.SetAway(absl::UnavailableError("failed to connect to all addresses"), clock_.Now());
  LeaveExited();
  ASSERT_EQ(local_->OwedLeaves(), 2u);
  AddWorker("r0", planner::Role::kRollout);  // joined again
  ASSERT_TRUE(local_->BeginJoin({"m", "r1"}, clock_.Now()).ok());  // joining now
  coordinator_.Back();
  SendOwedLeaves();
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r1 unanswered"}));
  EXPECT_EQ(local_->OwedLeaves(), 1u) << "r1's join may still fail: its leave stays owed";
  EXPECT_EQ(local_->OweLeave({"m", "r0"}, "deregistered"), LocalWorkers::Owed::kSuperseded);
  local_->EndJoin({"m", "r1"});  // its join failed
  SendOwedLeaves();
  EXPECT_EQ(coordinator_.log().back(), "leave r1 (its process exited)");
}

// A Deregister whose leave finds the coordinator stalled (no answer in time): the worker is
// removed here, the node owes the leave and says so, and sends it when the coordinator answers.
// Before: "the coordinator may still count it: call Deregister again".
TEST_F(StallTest, ADeregisterTheStalledCoordinatorDidNotAnswerIsFinishedByTheNode) {
  AddWorker("r0", planner::Role::kRollout);
  coordinator_.SetAway(absl::DeadlineExceededError("Deadline Exceeded"), clock_.Now());
  absl::Status s = Deregister("r0");
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  ExpectIn(s, {"node n0 owes the coordinator the worker's leave and sends it when the coordinator answers again",
               "no need to call Deregister again"});
  EXPECT_FALSE(local_->Has({"m", "r0"}));
  coordinator_.Back();
  SendOwedLeaves();
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r0 (deregistered)"}));
}

// At the bound the leave is not kept, and the caller is told to call Deregister again (true then).
TEST_F(StallTest, ADeregisterBeyondTheOwedBoundSaysToCallItAgain) {
  for (size_t i = 0; i < LocalWorkers::kMaxOwedLeaves; ++i) {
    ASSERT_EQ(local_->OweLeave({"m", absl::StrCat("gone", i)}, "its process exited"), LocalWorkers::Owed::kKept);
  }
  AddWorker("r0", planner::Role::kRollout);
  coordinator_.SetAway(absl::DeadlineExceededError("Deadline Exceeded"), clock_.Now());
  absl::Status s = Deregister("r0");
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  ExpectIn(s, {"the coordinator may still count it (node n0 owes it 4096 leaves already): call Deregister again"});
  EXPECT_EQ(local_->OwedLeaves(), LocalWorkers::kMaxOwedLeaves);
}

// ---- (b) WaitVersion whose coordinator stays away to its deadline

// Refused connections until the deadline: UNAVAILABLE naming the wait, the coordinator, since when
// the node's heartbeats found it unreachable and how long the call waited. Before, the transport's
// "failed to connect to all addresses" was the whole answer. A trainer's wait and a sync rollout's
// (its own restart rules, WaitAgainForRollout) alike.
TEST_F(StallTest, AWaitWhoseCoordinatorStaysAwayNamesItAndSinceWhen) {
  AddWorker("t0", planner::Role::kTrainer);
  AddWorker("r0", planner::Role::kRollout);
  const absl::Time t0 = clock_.Now();
  for (const std::string worker : {"t0", "r0"}) {
    SCOPED_TRACE(worker);
    const absl::Time start = clock_.Now();
    coordinator_.SetAway(absl::UnavailableError("failed to connect to all addresses"), t0 - absl::Seconds(5));
    coordinator_.wait_answers = {absl::UnavailableError("failed to connect to all addresses")};
    absl::Status s = WaitVersion(worker, /*held=*/true);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    ExpectIn(s, {absl::StrCat("WaitVersion of version 2 by worker ", worker, " of model m on node n0: the coordinator at coord.test:7070 could not "
                              "be reached since "),
                 Since(t0 - absl::Seconds(5)), absl::StrCat("(", absl::FormatDuration(start + absl::Seconds(15) - t0), " ago; failed to connect "
                                                            "to all addresses)"),
                 "held 10s", "the version may still be committed there: wait for it again"});
  }
}

// A stall: the call gets no answer until after its deadline (DEADLINE_EXCEEDED from the transport)
// while the node's heartbeats find the coordinator unreachable: the same UNAVAILABLE. A wait the
// coordinator itself timed out (it answers: no outage) keeps its DEADLINE_EXCEEDED and its words.
TEST_F(StallTest, AWaitOnAStalledCoordinatorNamesItButACoordinatorsOwnAnswerStands) {
  AddWorker("t0", planner::Role::kTrainer);
  const absl::Time t0 = clock_.Now();
  coordinator_.SetAway(absl::DeadlineExceededError("Deadline Exceeded"), t0 - absl::Seconds(1));
  coordinator_.on_wait = [this](absl::Duration) { clock_.Advance(absl::Seconds(12)); };  // hangs past the deadline
  coordinator_.wait_answers = {absl::DeadlineExceededError("Deadline Exceeded")};
  absl::Status s = WaitVersion("t0", /*held=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  ExpectIn(s, {"WaitVersion of version 2 by worker t0 of model m on node n0: the coordinator at coord.test:7070 could not be reached since ",
               Since(t0 - absl::Seconds(1)), "(13s ago; Deadline Exceeded)"});

  coordinator_.Back();
  coordinator_.wait_answers = {absl::DeadlineExceededError("version 2 of model m not committed in time")};
  s = WaitVersion("t0", /*held=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(s.message(), "version 2 of model m not committed in time");
}

// The stall again, as a worker sends it: its gRPC deadline is 2 s past the wait's (the clients'
// grace), and the coordinator gives no answer at all, so the forwarded call hangs for as long as
// the node lets it. The node's answer - UNAVAILABLE naming the coordinator - leaves before the
// worker's deadline. Before, the forwarded call ran to 2 s past the wait's deadline too, i.e. to
// the worker's own deadline, and the worker saw its transport's bare DEADLINE_EXCEEDED instead.
TEST_F(StallTest, AWaitOnACoordinatorThatNeverAnswersIsAnsweredBeforeTheWorkersDeadline) {
  AddWorker("t0", planner::Role::kTrainer);
  AddWorker("r0", planner::Role::kRollout);
  for (const std::string worker : {"t0", "r0"}) {
    SCOPED_TRACE(worker);
    const absl::Time start = clock_.Now();
    coordinator_.SetAway(absl::DeadlineExceededError("Deadline Exceeded"), start - absl::Seconds(1));
    coordinator_.on_wait = [this](absl::Duration timeout) { clock_.Advance(timeout); };  // no answer until cut
    coordinator_.wait_answers = {absl::DeadlineExceededError("Deadline Exceeded")};
    const absl::Duration grpc_left = absl::Seconds(12);  // timeout_ms 10000 + the clients' 2 s
    absl::Status s = WaitVersion(worker, /*held=*/false, grpc_left);
    const absl::Duration took = clock_.Now() - start;
    EXPECT_LT(took, grpc_left) << "the node's answer came at the worker's own deadline";
    EXPECT_GE(took, absl::Seconds(10)) << "the coordinator was not given the whole wait";
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    ExpectIn(s, {absl::StrCat("WaitVersion of version 2 by worker ", worker,
                              " of model m on node n0: the coordinator at coord.test:7070 could not be reached since "),
                 Since(start - absl::Seconds(1))});
  }
}

// Refused at once (the coordinator is down: refused connections), and the coordinator is back
// (it answers the node's heartbeats) well before the wait's deadline: the wait is asked again -
// after a short backoff on the clock - and its answer is the worker's. Before, the refusal was the
// answer, 7 s before the deadline of a wait the coordinator could still answer. A trainer's wait
// and a sync rollout's alike.
TEST_F(StallTest, AWaitRefusedByACoordinatorThatComesBackIsAskedAgain) {
  AddWorker("t0", planner::Role::kTrainer);
  AddWorker("r0", planner::Role::kRollout);
  for (const std::string worker : {"t0", "r0"}) {
    SCOPED_TRACE(worker);
    const int asked0 = coordinator_.wait_calls();
    const absl::Time start = clock_.Now();
    coordinator_.SetAway(absl::UnavailableError("failed to connect to all addresses"), start);
    coordinator_.wait_answers = {absl::UnavailableError("failed to connect to all addresses"), absl::OkStatus()};
    pb::WaitVersionRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    req.set_version(2);
    req.set_timeout_ms(10000);
    absl::Status s;
    pb::WaitVersionResponse resp;
    std::thread caller([&] { s = calls_->WaitVersion(req, &resp, absl::Seconds(12)); });
    // Held until the coordinator answers again (the same one: no re-join), which it does at 3 s.
    EXPECT_TRUE(clock_.AwaitWaiter(start + absl::Seconds(10), absl::Now() + absl::Seconds(30))) << "the refused wait is not held";
    clock_.Advance(absl::Seconds(3));
    coordinator_.Back();
    // Asked again after the first backoff.
    EXPECT_TRUE(clock_.AwaitWaiter(start + absl::Seconds(3) + absl::Milliseconds(100), absl::Now() + absl::Seconds(30)))
        << "not asked again after a backoff";
    clock_.Advance(absl::Milliseconds(100));
    caller.join();
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.committed_version(), 2u);
    EXPECT_EQ(coordinator_.wait_calls() - asked0, 2);
  }
}

// A coordinator that answers heartbeats but keeps refusing the wait (it is shutting down) is asked
// again at most once per backoff - 100 ms doubling to 1 s - and never past the deadline: its last
// refusal is the answer.
TEST_F(StallTest, AWaitKeptRefusedIsAskedAgainWithABoundedBackoffUntilItsDeadline) {
  AddWorker("t0", planner::Role::kTrainer);
  const absl::Time start = clock_.Now();
  std::deque<absl::Status> refusals(100, absl::UnavailableError("coordinator shutting down"));
  coordinator_.wait_answers = refusals;
  pb::WaitVersionRequest req;
  req.set_model_id("m");
  req.set_worker_id("t0");
  req.set_version(2);
  req.set_timeout_ms(5000);
  absl::Status s;
  std::thread caller([&] {
    pb::WaitVersionResponse resp;
    s = calls_->WaitVersion(req, &resp, absl::Seconds(7));
  });
  // Asked at 0, then after 0.1, 0.2, 0.4, 0.8, 1, 1 s (at 3.5 s): the next would be at 4.5 s, the
  // one after that past the deadline (5 s).
  absl::Time at = start;
  for (absl::Duration backoff : {absl::Milliseconds(100), absl::Milliseconds(200), absl::Milliseconds(400), absl::Milliseconds(800),
                                 absl::Seconds(1), absl::Seconds(1), absl::Seconds(1)}) {
    at += backoff;
    EXPECT_TRUE(clock_.AwaitWaiter(at, absl::Now() + absl::Seconds(30))) << "no backoff until " << at - start;
    clock_.Advance(backoff);
  }
  caller.join();
  EXPECT_EQ(coordinator_.wait_calls(), 8);
  EXPECT_LE(clock_.Now(), start + absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("coordinator shutting down"), std::string::npos) << s;
}

}  // namespace
}  // namespace wb::daemon::node
