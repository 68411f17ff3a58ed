// End-to-end: a sync rollout paused (BeginUpdate) and waiting (WaitVersion(v)) when the coordinator
// restarts gets v, not a spurious ABORTED. A coordinator and two node daemons as separate
// processes; a Megatron tp=1 trainer on n0 and a vLLM tp=1 rollout on n1; weights in shared
// memory, the reduced 2-layer Qwen2.5-0.5B.
//
//  - RestartWaitTest/*.APausedRolloutsWaitGetsTheVersionAfterACoordinatorRestart: v1 everywhere;
//    the rollout pauses for v2 and waits for it (the coordinator counts it paused). The coordinator
//    is then killed (-9) or shut down (SIGTERM), the trainer publishes v2 while it is away (its
//    node sends the publish again to the next coordinator, PublishAgainAfterRestart), and the
//    coordinator is started again on the same address. n1's re-join re-sends the rollout's pause
//    (WorkerCalls::ResendPause) and the rollout's wait is asked again of the new coordinator
//    (WaitAgainForRollout, docs/daemon.md "Coordinator restart"): v2 commits into the paused
//    rollout, its WaitVersion(2) answers OK and its live weights hold v2 byte for byte; v3
//    follows. Before, n1 answered the wait ABORTED ("the coordinator restarted"): the rollout
//    resumed, v2 became its committed copy and it never verified v2.
//  - RestartBeginUpdateTest.ABeginUpdateSentWhileTheCoordinatorIsDownIsHeldUntilItIsBack: the
//    rollout's BeginUpdate(2) goes out (its gate, begin-2) while the coordinator is killed; n1
//    holds it (WorkerCalls::ForwardHeld) until it re-joined the coordinator started 1.5 s later,
//    then sends it there: OK, v2 verified, v3 follows. Before, UNAVAILABLE at once, each retry too.
//  - RestartRegisterTest.ARolloutRegisteringWhileTheCoordinatorIsDownIsServedAfterItIsBack: the
//    coordinator is killed after the trainer registered; the rollout starts and registers on n1
//    while it is away (a rollout restarting during a rolling restart). n1 holds its RegisterWorker
//    (WorkerCalls::ForwardHeld, "RegisterWorker") until it re-joined the coordinator started 1.5 s
//    later, then joins it there; its RegisterLayout follows, and v1..v3 reach it byte for byte.
//    Before, the registration answered UNAVAILABLE at once and the rollout exited with it.
#include <signal.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {
namespace {

namespace pb = ::weightbridge::v1;

// Whether `s` shows `model`'s rollout paused (BeginUpdate recorded) with `committed` committed.
bool RolloutPausedAt(const pb::StatusResponse& s, const std::string& model, uint64_t committed) {
  bool committed_ok = false;
  for (const pb::ModelStatus& m : s.models()) {
    if (m.model_id() == model) committed_ok = m.committed_version() == committed;
  }
  if (!committed_ok) return false;
  for (const pb::WorkerStatus& w : s.workers()) {
    if (w.model_id() == model && w.role() == pb::ROLE_ROLLOUT) return w.paused();
  }
  return false;
}

// The end both tests share, once v3's gates are open: both workers exit cleanly, the rollout saw
// no mismatch and applied v1..v3 byte for byte, and n1's log shows each of `node_lines` (the path
// the restart took there).
void ExpectV3CleanAndNodeLogged(Cluster& cl, Process* trainer, Process* rollout, const std::vector<std::string>& node_lines) {
  absl::Status e = ExpectCleanExit(rollout, Scaled(absl::Seconds(120)));
  EXPECT_TRUE(e.ok()) << e;
  e = ExpectCleanExit(trainer, Scaled(absl::Seconds(60)));
  EXPECT_TRUE(e.ok()) << e;
  EXPECT_TRUE(EventsNamed(rollout, "mismatch").empty()) << rollout->LogTail();
  int64_t verified = 0;
  EXPECT_TRUE(CheckRolloutsApplied({rollout}, "sync", 3, &verified).ok()) << rollout->LogTail();
  std::ifstream log(cl.node(1)->log_path());
  std::stringstream text;
  text << log.rdbuf();
  for (const std::string& line : node_lines) {
    EXPECT_NE(text.str().find(line), std::string::npos) << line << "\n" << cl.node(1)->LogTail();
  }
}

// What the tests share: a coordinator and two node daemons; a sync run of v1..v3 with one Megatron
// tp=1 trainer on n0 (started here) and one vLLM tp=1 rollout on n1 (started by each test, when its
// case needs it); version v is published when the test opens its gate (publish-<v> in gate_dir).
// Members in this order: the cluster stops before its harness goes.
struct GatedSyncRun {
  std::unique_ptr<Harness> h;
  std::unique_ptr<Cluster> cl;
  RunOptions run;
  Process* trainer = nullptr;
};

absl::StatusOr<GatedSyncRun> StartGatedSyncRun(const std::string& tag, bool tolerate_failures) {
  GatedSyncRun r;
  ASSIGN_OR_RETURN(r.h, Harness::Create(tag));
  ClusterOptions copts;
  copts.num_nodes = 2;
  ASSIGN_OR_RETURN(r.cl, Cluster::Start(r.h.get(), copts));
  r.run.config = ModelConfigPath();
  r.run.mode = "sync";
  r.run.num_trainers = 1;
  r.run.num_rollouts = 1;
  r.run.versions = 3;
  r.run.tolerate_failures = tolerate_failures;
  r.run.timeout_ms = ScaledMs(60000);
  r.run.gate_dir = r.h->Path("gates");
  if (::mkdir(r.run.gate_dir.c_str(), 0700) != 0) return absl::InternalError("mkdir " + r.run.gate_dir);
  ASSIGN_OR_RETURN(r.trainer, r.cl->SpawnWorker(r.run, {true, 0, "megatron", 1, 1, 1, 1, 0, 0}));
  return r;
}

// The coordinator goes away by kill -9 (true) or a graceful shutdown, SIGTERM (false).
class RestartWaitTest : public ::testing::TestWithParam<bool> {};

TEST_P(RestartWaitTest, APausedRolloutsWaitGetsTheVersionAfterACoordinatorRestart) {
  // Failures tolerated: before the fix v2 fails for the rollout, and the run goes on to say how.
  auto r = StartGatedSyncRun(GetParam() ? "restartwait9" : "restartwaitterm", /*tolerate_failures=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  auto& h = r->h;
  Cluster& cl = *r->cl;
  const RunOptions& run = r->run;
  Process* trainer = r->trainer;
  auto rollout_or = cl.SpawnWorker(run, {false, 1, "vllm", 1, 1, 1, 1, 0, 0});
  ASSERT_TRUE(rollout_or.ok()) << rollout_or.status();
  Process* rollout = *rollout_or;

  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/publish-1")).ok());
  auto v1 = rollout->WaitForEvent("verified", 1, Scaled(absl::Seconds(90)));
  ASSERT_TRUE(v1.ok()) << v1.status() << rollout->LogTail();
  // The rollout paused for v2 (its BeginUpdate is recorded) and calls WaitVersion(2) right after;
  // v2 is not published yet (its gate is closed).
  auto paused = cl.WaitForStatus([&](const pb::StatusResponse& r) { return RolloutPausedAt(r, run.model_id, 1); },
                                 Scaled(absl::Seconds(30)), "the rollout paused for v2");
  ASSERT_TRUE(paused.ok()) << paused.status();

  if (GetParam()) {
    ASSERT_TRUE(cl.KillCoordinator().ok());
  } else {
    cl.coordinator()->Signal(SIGTERM);
    auto exited = cl.coordinator()->WaitExit(Scaled(absl::Seconds(30)));
    ASSERT_TRUE(exited.ok()) << exited.status() << cl.coordinator()->LogTail();
  }
  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/publish-2")).ok());
  ASSERT_TRUE(cl.RestartCoordinator().ok());

  // The rollout's WaitVersion(2) answered OK: v2 in its live weights, every byte checked.
  auto v2 = rollout->WaitForEvent("verified", 2, Scaled(absl::Seconds(90)));
  ASSERT_TRUE(v2.ok()) << v2.status() << rollout->LogTail();
  EXPECT_GT(VerifiedBytes(rollout, 2), 0);
  for (const nlohmann::json& f : EventsNamed(rollout, "version_failed")) {
    ADD_FAILURE() << "the rollout was told a version failed: " << f.dump();
  }
  bool applied2 = false;
  for (const nlohmann::json& a : EventsNamed(rollout, "applied")) {
    if (a.value("version", uint64_t{0}) == 2 && a.value("requested", uint64_t{0}) == 2) applied2 = true;
  }
  EXPECT_TRUE(applied2) << "no WaitVersion(2) answered 2: " << rollout->LogTail();
  auto published = trainer->WaitForEvent("published", 2, Scaled(absl::Seconds(30)));
  EXPECT_TRUE(published.ok()) << published.status() << trainer->LogTail();

  // The run goes on: v3, clean exits, no mismatch, versions 1, 2, 3 applied one by one.
  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/publish-3")).ok());
  // The path taken: n1 re-sent the pause and the wait.
  ExpectV3CleanAndNodeLogged(cl, trainer, rollout, {"paused rollout's pause re-sent at re-join"});
  EXPECT_TRUE(EventsNamed(trainer, "publish_failed").empty()) << trainer->LogTail();
}

// A sync rollout's BeginUpdate sent while the coordinator is down (killed -9, not restarted yet)
// is held by its node until the node re-joined the restarted coordinator, then sent there: OK,
// and v2 commits into the rollout. Before, the node answered UNAVAILABLE at once (chaos sync
// 1002, coordinator kills only: 28-53 such failures per rollout per run, each retried).
TEST(RestartBeginUpdateTest, ABeginUpdateSentWhileTheCoordinatorIsDownIsHeldUntilItIsBack) {
  // Failures tolerated: before the fix BeginUpdate(2) fails, and the run goes on to say how.
  auto r = StartGatedSyncRun("restartbegin", /*tolerate_failures=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  auto& h = r->h;
  Cluster& cl = *r->cl;
  const RunOptions& run = r->run;
  Process* trainer = r->trainer;
  WorkerSpec rs{false, 1, "vllm", 1, 1, 1, 1, 0, 0};
  rs.extra_flags = {"--gate_dir=" + run.gate_dir};  // the rollout's BeginUpdate of v waits for begin-<v>
  auto rollout_or = cl.SpawnWorker(run, rs);
  ASSERT_TRUE(rollout_or.ok()) << rollout_or.status();
  Process* rollout = *rollout_or;

  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/begin-1")).ok());
  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/publish-1")).ok());
  auto v1 = rollout->WaitForEvent("verified", 1, Scaled(absl::Seconds(90)));
  ASSERT_TRUE(v1.ok()) << v1.status() << rollout->LogTail();

  ASSERT_TRUE(cl.KillCoordinator().ok());
  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/begin-2")).ok());
  auto begun = rollout->WaitForEvent("begin_update", 2, Scaled(absl::Seconds(30)));
  ASSERT_TRUE(begun.ok()) << begun.status() << rollout->LogTail();
  // The outage: the coordinator is started again 1.5 s after the rollout's BeginUpdate(2) went out
  // (not a poll: how long it is away). n1 holds the call meanwhile (checked in its log below).
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_TRUE(cl.RestartCoordinator().ok());
  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/publish-2")).ok());

  auto v2 = rollout->WaitForEvent("verified", 2, Scaled(absl::Seconds(90)));
  ASSERT_TRUE(v2.ok()) << v2.status() << rollout->LogTail();
  EXPECT_GT(VerifiedBytes(rollout, 2), 0);
  for (const nlohmann::json& f : EventsNamed(rollout, "version_failed")) {
    ADD_FAILURE() << "the rollout was told a version failed: " << f.dump();
  }
  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/begin-3")).ok());
  ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/publish-3")).ok());
  // The path taken: n1 held the call (its ReportReady could not reach the coordinator) and sent it
  // again after its re-join.
  ExpectV3CleanAndNodeLogged(cl, trainer, rollout,
                             {"worker call held: the coordinator is unreachable", "worker call sent again after re-join"});
}

TEST(RestartRegisterTest, ARolloutRegisteringWhileTheCoordinatorIsDownIsServedAfterItIsBack) {
  auto r = StartGatedSyncRun("restartregister", /*tolerate_failures=*/false);
  ASSERT_TRUE(r.ok()) << r.status();
  auto& h = r->h;
  Cluster& cl = *r->cl;
  const RunOptions& run = r->run;
  Process* trainer = r->trainer;
  auto ready = trainer->WaitForEvent("ready", 0, Scaled(absl::Seconds(90)));
  ASSERT_TRUE(ready.ok()) << ready.status() << trainer->LogTail();

  ASSERT_TRUE(cl.KillCoordinator().ok());
  auto rollout_or = cl.SpawnWorker(run, {false, 1, "vllm", 1, 1, 1, 1, 0, 0});
  ASSERT_TRUE(rollout_or.ok()) << rollout_or.status();
  Process* rollout = *rollout_or;
  auto registering = rollout->WaitForEvent("registering", 0, Scaled(absl::Seconds(60)));
  ASSERT_TRUE(registering.ok()) << registering.status() << rollout->LogTail();
  // The outage: the coordinator is started again 1.5 s after the rollout's RegisterWorker went out
  // (not a poll: how long it is away). n1 holds the call meanwhile (checked in its log below).
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_TRUE(cl.RestartCoordinator().ok());
  auto rollout_ready = rollout->WaitForEvent("ready", 0, Scaled(absl::Seconds(60)));
  ASSERT_TRUE(rollout_ready.ok()) << rollout_ready.status() << rollout->LogTail() << cl.node(1)->LogTail();

  for (int v = 1; v <= 3; ++v) ASSERT_TRUE(h->Touch(absl::StrCat(run.gate_dir, "/publish-", v)).ok());
  // The path taken: n1 held the registration (its JoinWorker could not reach the coordinator) and
  // sent it again after its re-join.
  ExpectV3CleanAndNodeLogged(cl, trainer, rollout,
                             {"worker call held: the coordinator is unreachable", "call=RegisterWorker",
                              "worker call sent again after re-join"});
}

INSTANTIATE_TEST_SUITE_P(KillOrShutdown, RestartWaitTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Kill9" : "Sigterm"; });

}  // namespace
}  // namespace wb::e2e
