// End-to-end: a coordinator restart must not cost the sync version whose Publish calls are in
// flight. A coordinator and three node daemons as separate processes; a Megatron tp=2 trainer pair
// with rank 0 on n0 and rank 1 on n1 (so each rank's Publish goes through its own node) and one
// vLLM tp=1 rollout on n2; weights in shared memory, the reduced 2-layer Qwen2.5-0.5B.
//
//  - AnInFlightSyncVersionIsPublishedAfterACoordinatorRestart: v1 everywhere; n2 is frozen
//    (SIGSTOP) while its rollout generates after v1, so the rollout's BeginUpdate for v2 waits on
//    it; both ranks publish v2 and the coordinator holds it fully published, waiting for that
//    rollout. Then the coordinator is killed (-9) and started again on the same address, and n2
//    resumed. Each node re-sends its rank's Publish(2) to the new coordinator
//    (WorkerCalls::PublishAgainAfterRestart, docs/daemon.md "Coordinator restart"): v2 is
//    committed there, both ranks' Publish(2) answer OK, and the rollout holds v2 byte for byte;
//    v3 follows. Before, each node answered its rank's in-flight Publish ABORTED ("the coordinator
//    restarted ... publish a newer version"): the trainers counted v2 failed and the rollout's
//    WaitVersion(2) was never answered.
#include <signal.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/cluster.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {
namespace {

namespace pb = ::weightbridge::v1;

// The trainer's first answer for version `v`: its "published" or its "publish_failed" event.
absl::StatusOr<nlohmann::json> PublishOutcome(const Process* trainer, uint64_t v, absl::Duration timeout) {
  auto line = trainer->WaitForLine(
      [v](const std::string& l) {
        nlohmann::json e = nlohmann::json::parse(l, nullptr, /*allow_exceptions=*/false);
        if (!e.is_object() || e.value("version", uint64_t{0}) != v) return false;
        const std::string ev = e.value("event", "");
        return ev == "published" || ev == "publish_failed";
      },
      timeout);
  if (!line.ok()) return line.status();
  return nlohmann::json::parse(*line);
}

TEST(RestartPublishTest, AnInFlightSyncVersionIsPublishedAfterACoordinatorRestart) {
  auto h = Harness::Create("restartpub");
  ASSERT_TRUE(h.ok()) << h.status();
  ClusterOptions copts;
  // n2 is frozen from v1 until after the restart: a lease that ended meanwhile would drop its
  // rollout at the old coordinator and re-plan without it.
  copts.lease_ms = ScaledMs(20000);
  copts.transfer_timeout_ms = ScaledMs(20000);
  auto c = Cluster::Start(h->get(), copts);
  ASSERT_TRUE(c.ok()) << c.status();
  Cluster& cl = **c;
  RunOptions run;
  run.config = ModelConfigPath();
  run.mode = "sync";
  run.num_trainers = 2;
  run.num_rollouts = 1;
  run.versions = 3;
  run.tolerate_failures = true;  // before the fix v2 fails: the run goes on to say how
  run.timeout_ms = ScaledMs(60000);
  run.gate_dir = (*h)->Path("gates");
  ASSERT_EQ(::mkdir(run.gate_dir.c_str(), 0700), 0);
  std::vector<Process*> trainers;
  for (int r = 0; r < 2; ++r) {
    auto p = cl.SpawnWorker(run, {true, r, "megatron", 2, 1, 1, 1, r, r});  // rank r on node r
    ASSERT_TRUE(p.ok()) << p.status();
    trainers.push_back(*p);
  }
  // The rollout generates for 3 s after each version it verified: the window in which n2 is
  // frozen before its BeginUpdate for the next version.
  auto rollout_or = cl.SpawnWorker(run, {false, 2, "vllm", 1, 1, 1, 1, 0, 0, ScaledMs(3000)});
  ASSERT_TRUE(rollout_or.ok()) << rollout_or.status();
  Process* rollout = *rollout_or;

  ASSERT_TRUE((*h)->Touch(absl::StrCat(run.gate_dir, "/publish-1")).ok());
  auto v1 = rollout->WaitForEvent("verified", 1, Scaled(absl::Seconds(90)));
  ASSERT_TRUE(v1.ok()) << v1.status() << rollout->LogTail();
  cl.node(2)->Signal(SIGSTOP);
  ASSERT_TRUE((*h)->Touch(absl::StrCat(run.gate_dir, "/publish-2")).ok());
  // Both ranks' Publish(2) are at the coordinator, which waits for the frozen rollout's
  // BeginUpdate before v2 starts.
  auto queued = cl.WaitForStatus([&](const pb::StatusResponse& r) { return VersionState(r, run.model_id, 2) == "queued"; },
                                 Scaled(absl::Seconds(15)), "v2 fully published, waiting for the frozen rollout");
  ASSERT_TRUE(queued.ok()) << queued.status();

  ASSERT_TRUE(cl.KillCoordinator().ok());
  ASSERT_TRUE(cl.RestartCoordinator().ok());
  cl.node(2)->Signal(SIGCONT);

  // Each rank's in-flight Publish(2) reached the new coordinator through its node and committed.
  for (Process* t : trainers) {
    auto outcome = PublishOutcome(t, 2, Scaled(absl::Seconds(90)));
    ASSERT_TRUE(outcome.ok()) << t->name() << ": " << outcome.status() << t->LogTail();
    EXPECT_EQ((*outcome)["event"], "published") << t->name() << " lost v2 to the restart: " << outcome->dump();
  }
  for (Process* t : trainers) {
    auto committed = t->WaitForEvent("committed", 2, Scaled(absl::Seconds(30)));
    EXPECT_TRUE(committed.ok()) << t->name() << ": " << committed.status();
  }
  // The rollout holds v2, every byte checked against the canonical weights of v2.
  auto v2 = rollout->WaitForEvent("verified", 2, Scaled(absl::Seconds(30)));
  ASSERT_TRUE(v2.ok()) << v2.status() << rollout->LogTail();
  EXPECT_GT(VerifiedBytes(rollout, 2), 0);
  auto st = cl.Status();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(VersionState(*st, run.model_id, 2), "committed");

  // The run goes on: v3, clean exits, no mismatch, versions 1, 2, 3 applied.
  ASSERT_TRUE((*h)->Touch(absl::StrCat(run.gate_dir, "/publish-3")).ok());
  absl::Status e = ExpectCleanExit(rollout, Scaled(absl::Seconds(120)));
  EXPECT_TRUE(e.ok()) << e;
  for (Process* t : trainers) {
    e = ExpectCleanExit(t, Scaled(absl::Seconds(60)));
    EXPECT_TRUE(e.ok()) << e;
    EXPECT_TRUE(EventsNamed(t, "publish_failed").empty()) << t->LogTail();
  }
  EXPECT_TRUE(EventsNamed(rollout, "mismatch").empty()) << rollout->LogTail();
  EXPECT_TRUE(EventsNamed(rollout, "version_failed").empty()) << rollout->LogTail();
  int64_t verified = 0;
  EXPECT_TRUE(CheckRolloutsApplied({rollout}, "sync", 3, &verified).ok()) << rollout->LogTail();
  // The restart was seen: each trainer's node re-sent its rank's publish.
  for (int n = 0; n < 2; ++n) {
    std::ifstream log(cl.node(n)->log_path());
    std::stringstream text;
    text << log.rdbuf();
    EXPECT_NE(text.str().find("publish in flight at a coordinator change sent again"), std::string::npos) << cl.node(n)->LogTail();
  }
}

}  // namespace
}  // namespace wb::e2e
