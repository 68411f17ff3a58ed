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
  // Runs inside each WaitVersion, before its answer (a test moves the clock: a call that hangs).
  std::function<void()> on_wait;
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
    absl::Status answer = away_;
    if (answer.ok() && next_leave) {
      answer = *next_leave;
      next_leave.reset();
    }
    log_.push_back(answer.ok() ? absl::StrCat("leave ", req.worker_id(), " (", req.reason(), ")") : absl::StrCat("leave ", req.worker_id(), " unanswered"));
    return answer;
  }
  absl::Status WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Duration) override {
    if (on_wait) on_wait();
    absl::MutexLock l(&mu_);
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
  absl::Status Deregister(const std::string& worker) {
    pb::DeregisterRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    return calls_->Deregister(req, absl::Seconds(10));
  }
  // WaitVersion(2) of `worker` with a 10 s timeout, on its own thread. `held`: the call waits on
  // the clock until its deadline (the coordinator stays away), which the test then passes.
  absl::Status WaitVersion(const std::string& worker, bool held) {
    pb::WaitVersionRequest req;
    req.set_model_id("m");
    req.set_worker_id(worker);
    req.set_version(2);
    req.set_timeout_ms(10000);
    const absl::Time deadline = clock_.Now() + absl::Seconds(10);
    absl::Status s;
    std::thread caller([&] {
      pb::WaitVersionResponse resp;
      s = calls_->WaitVersion(req, &resp);
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
  calls_->LeaveExited();
  EXPECT_FALSE(local_->Has({"m", "r0"}));
  EXPECT_EQ(local_->OwedLeaves(), 1u);
  calls_->SendOwedLeaves();  // still away: not tried
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered"}));
  coordinator_.Back();
  calls_->SendOwedLeaves();
  calls_->SendOwedLeaves();  // nothing owed any more
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r0 (its process exited)"}));
  EXPECT_EQ(local_->OwedLeaves(), 0u);
}

// Refused connections (UNAVAILABLE) are owed the same; a leave the coordinator answers (OK or
// NOT_FOUND) is not.
TEST_F(StallTest, OnlyUnansweredLeavesAreOwed) {
  AddExitedWorker("r0");
  ASSERT_FALSE(HasFatalFailure());
  coordinator_.SetAway(absl::UnavailableError("failed to connect to all addresses"), clock_.Now());
  calls_->LeaveExited();
  EXPECT_EQ(local_->OwedLeaves(), 1u);
  coordinator_.Back();
  coordinator_.next_leave = absl::NotFoundError("worker r0 is not on node n0");
  AddExitedWorker("r1");
  ASSERT_FALSE(HasFatalFailure());
  calls_->LeaveExited();  // answered NOT_FOUND: nothing owed for r1
  EXPECT_EQ(local_->OwedLeaves(), 1u);
  calls_->SendOwedLeaves();
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
  calls_->LeaveExited();
  EXPECT_EQ(local_->OwedLeaves(), 2u);
  coordinator_.Back();
  coordinator_.next_leave = absl::DeadlineExceededError("Deadline Exceeded");
  calls_->SendOwedLeaves();
  EXPECT_EQ(local_->OwedLeaves(), 2u);
  calls_->SendOwedLeaves();
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r1 unanswered", "leave r0 unanswered",
                                                          "leave r0 (its process exited)", "leave r1 (its process exited)"}));
  EXPECT_EQ(local_->OwedLeaves(), 0u);
}

// A re-join rebuilds the coordinator's membership from the node's workers: the owed leaves are
// dropped, never sent to the new coordinator.
TEST_F(StallTest, AReJoinDropsTheOwedLeaves) {
  AddExitedWorker("r0");
  ASSERT_FALSE(HasFatalFailure());
  coordinator_.SetAway(absl::UnavailableError("failed to connect to all addresses"), clock_.Now());
  calls_->LeaveExited();
  ASSERT_EQ(local_->OwedLeaves(), 1u);
  versions_->AbortAllForRejoin("the coordinator restarted (instance A -> B)");  // NodeDaemon::Rejoin's first step
  coordinator_.Back();
  calls_->SendOwedLeaves();
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
  calls_->LeaveExited();
  ASSERT_EQ(local_->OwedLeaves(), 2u);
  AddWorker("r0", planner::Role::kRollout);  // joined again
  ASSERT_TRUE(local_->BeginJoin({"m", "r1"}, clock_.Now()).ok());  // joining now
  coordinator_.Back();
  calls_->SendOwedLeaves();
  EXPECT_EQ(coordinator_.log(), (std::vector<std::string>{"leave r0 unanswered", "leave r1 unanswered"}));
  EXPECT_EQ(local_->OwedLeaves(), 1u) << "r1's join may still fail: its leave stays owed";
  EXPECT_EQ(local_->OweLeave({"m", "r0"}, "deregistered"), LocalWorkers::Owed::kSuperseded);
  local_->EndJoin({"m", "r1"});  // its join failed
  calls_->SendOwedLeaves();
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
  calls_->SendOwedLeaves();
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
// coordinator itself timed out (it answers: no outage) keeps its DEADLINE_EXCEEDED and its words,
// and a refusal before the deadline from a coordinator that answers again stands as it is.
TEST_F(StallTest, AWaitOnAStalledCoordinatorNamesItButACoordinatorsOwnAnswerStands) {
  AddWorker("t0", planner::Role::kTrainer);
  const absl::Time t0 = clock_.Now();
  coordinator_.SetAway(absl::DeadlineExceededError("Deadline Exceeded"), t0 - absl::Seconds(1));
  coordinator_.on_wait = [this] { clock_.Advance(absl::Seconds(12)); };  // hangs past the deadline
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

  coordinator_.on_wait = nullptr;
  coordinator_.wait_answers = {absl::UnavailableError("cluster is draining")};
  s = WaitVersion("t0", /*held=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(s.message(), "cluster is draining");
}

}  // namespace
}  // namespace wb::daemon::node
