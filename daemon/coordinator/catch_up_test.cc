// ChooseCatchUp (pure): which rollouts are late and which may serve as catch-up sources; and the
// coordinator's catch-up driver over fake nodes (timeout, not overtaking a newer version).
#include "daemon/coordinator/catch_up.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <ostream>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

CatchUpCandidate Rollout(const std::string& id, uint64_t holds) {
  CatchUpCandidate c;
  c.id = id;
  c.node = "n0";
  c.rollout = true;
  c.has_layout = true;
  c.in_plan = true;
  c.holds = holds;
  return c;
}

TEST(ChooseCatchUpTest, LateRolloutsAndSources) {
  CatchUpCandidate trainer = Rollout("t0", 3);
  trainer.rollout = false;
  CatchUpCandidate no_layout = Rollout("r9", 0);
  no_layout.has_layout = false;
  CatchUpCandidate not_planned = Rollout("r8", 0);
  not_planned.in_plan = false;
  CatchUpCandidate ahead = Rollout("r7", 4);  // holds an uncommitted newer version: not a source
  CatchUpChoice c = ChooseCatchUp(3, {trainer, Rollout("r0", 3), Rollout("r1", 0), Rollout("r2", 2), no_layout, not_planned, ahead,
                                      Rollout("r3", 3)});
  EXPECT_EQ(c.sources, (std::vector<std::string>{"r0", "r3"}));
  EXPECT_EQ(c.dests, (std::vector<std::string>{"r1", "r2"}));
  EXPECT_TRUE(c.no_source.empty());
}

TEST(ChooseCatchUpTest, NothingBeforeTheFirstCommitOrWhenEveryoneHoldsIt) {
  EXPECT_TRUE(ChooseCatchUp(0, {Rollout("r0", 0), Rollout("r1", 0)}).dests.empty());
  CatchUpChoice c = ChooseCatchUp(2, {Rollout("r0", 2), Rollout("r1", 2)});
  EXPECT_TRUE(c.dests.empty());
  EXPECT_TRUE(c.no_source.empty());
}

TEST(ChooseCatchUpTest, FailedForThisVersionIsNotTriedAgain) {
  CatchUpCandidate failed = Rollout("r1", 0);
  failed.catch_up_failed = 2;
  EXPECT_TRUE(ChooseCatchUp(2, {Rollout("r0", 2), failed}).dests.empty());
  // The next committed version makes it late again.
  EXPECT_EQ(ChooseCatchUp(3, {Rollout("r0", 3), failed}).dests, (std::vector<std::string>{"r1"}));
}

TEST(ChooseCatchUpTest, NoSourceWhenNoRolloutHoldsTheVersion) {
  // Quantised rollouts are sources too (the plan decides what each of their pieces may serve).
  CatchUpChoice c = ChooseCatchUp(2, {Rollout("r1", 2), Rollout("r2", 0)});
  EXPECT_EQ(c.sources, (std::vector<std::string>{"r1"}));
  EXPECT_TRUE(c.no_source.empty()) << c.no_source;
  c = ChooseCatchUp(2, {Rollout("r1", 1), Rollout("r2", 0)});
  EXPECT_TRUE(c.sources.empty());
  EXPECT_EQ(c.dests, (std::vector<std::string>{"r1", "r2"}));
  EXPECT_NE(c.no_source.find("no rollout holds version 2 (no rollout holds it at all)"), std::string::npos) << c.no_source;
}

// A holder whose memory a catch-up found changed (stale) is no source of that version; with no
// other holder the late rollouts are told so.
TEST(ChooseCatchUpTest, StaleHoldersAreNoSources) {
  CatchUpCandidate stale = Rollout("r1", 2);
  stale.stale = true;
  CatchUpChoice c = ChooseCatchUp(2, {stale, Rollout("r2", 2), Rollout("r3", 0)});
  EXPECT_EQ(c.sources, (std::vector<std::string>{"r2"}));
  EXPECT_EQ(c.dests, (std::vector<std::string>{"r3"}));
  c = ChooseCatchUp(2, {stale, Rollout("r3", 0)});
  EXPECT_TRUE(c.sources.empty());
  EXPECT_EQ(c.dests, (std::vector<std::string>{"r3"})) << "a stale holder is not late: the next version rewrites it";
  EXPECT_NE(c.no_source.find("no rollout holds version 2 (rollouts r1 held it, but a catch-up found their memory changed since)"),
            std::string::npos)
      << c.no_source;
}

// ------------------------------------------------------------------ the driver, over fake nodes

// One trainer (n0), rollout r0 (n0); versions run on fake nodes that report done at once, except
// catch-ups while `stall_catch_up` is set (they never report: the catch-up times out). Nodes in
// `old_nodes` register as built before ExecuteVersionRequest.bases_without_shadows
// (RegisterNodeRequest.understands_bases_without_shadows unset).
class FakeCluster {
 public:
  // `old_nodes` do not read bases_without_shadows; `in_place_nodes` decode deltas in place
  // (RegisterNodeRequest.delta_in_place).
  explicit FakeCluster(const std::set<std::string>& old_nodes = {}, const std::set<std::string>& in_place_nodes = {}) {
    CoordinatorOptions o;
    o.transfer_timeout = absl::Milliseconds(600);
    // A restart's re-join window well inside the fake nodes' lease (3 s: they never heartbeat).
    o.rejoin_window = absl::Seconds(1);
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      {
        absl::MutexLock l(&mu);
        fakes[node] = fake;
      }
      fake->on_execute = [this, node](const pb::ExecuteVersionRequest& req) {
        {
          absl::MutexLock l(&mu);
          log.push_back(absl::StrCat(req.catch_up() ? "catch-up " : "version ", req.version()));
          if (!req.catch_up()) executed[{node, req.version()}] = req;
        }
        if (req.catch_up() && stall_catch_up) return absl::OkStatus();
        pb::ReportDoneRequest done;
        done.set_node_id(node);
        done.set_model_id(req.model_id());
        done.set_version(req.version());
        done.set_ok(req.catch_up() || node != "n1" || req.version() != fail_version.load());
        if (!done.ok()) done.set_error("the test failed it");
        done.set_catch_up(req.catch_up());
        done.set_coordinator_instance(req.coordinator_instance());
        if (req.catch_up() && hold_catch_up) {
          absl::MutexLock l(&mu);
          held.push_back({done, req.plan_epoch()});
          return absl::OkStatus();
        }
        pb::ReportDoneResponse resp;
        return core->ReportDone(done, &resp);
      };
      fake->on_commit = [this, node](const std::string&, uint64_t v) {
        absl::MutexLock l(&mu);
        log.push_back(absl::StrCat("commit ", v, " on ", node));
        return absl::OkStatus();
      };
      return fake;
    };
    core = std::make_unique<CoordinatorCore>(std::move(o));
    core->Start();
    for (const std::string n : {"n0", "n1"}) {
      pb::RegisterNodeRequest req;
      req.set_node_id(n);
      req.set_address(n + ":1");
      req.set_understands_bases_without_shadows(old_nodes.count(n) == 0);
      req.set_delta_in_place(in_place_nodes.count(n) > 0);
      pb::RegisterNodeResponse resp;
      EXPECT_TRUE(core->RegisterNode(req, &resp).ok());
    }
  }
  ~FakeCluster() { core->Shutdown(); }
  // `rejoin`: as a node re-joining a restarted coordinator sends it (JoinWorkerRequest.rejoin),
  // with the node's committed version, the worker's applied version and what it holds.
  struct Rejoin {
    uint64_t committed = 0, applied = 0, holds = 0;
    bool without_shadows = false;  // JoinWorkerRequest.holds_without_shadows
    uint64_t published = 0;        // JoinWorkerRequest.published_version
  };
  void Join(const std::string& node, const std::string& worker, pb::Role role, std::optional<Rejoin> rejoin = std::nullopt) {
    pb::ModelSpec spec = testing::SmallModelSpec("m", 1);
    spec.set_mode(pb::MODE_ASYNC);
    pb::JoinWorkerRequest j;
    j.set_node_id(node);
    j.set_worker_id(worker);
    j.set_model_id("m");
    j.set_role(role);
    *j.mutable_model() = spec;
    if (rejoin) {
      j.set_rejoin(true);
      j.set_committed_version(rejoin->committed);
      j.set_applied_version(rejoin->applied);
      j.set_holds_version(rejoin->holds);
      j.set_holds_without_shadows(rejoin->without_shadows);
      j.set_published_version(rejoin->published);
    }
    pb::JoinWorkerResponse jr;
    ASSERT_TRUE(core->JoinWorker(j, &jr).ok());
    pb::SubmitLayoutResponse lr;
    ASSERT_TRUE(core->SubmitLayout(testing::WholeTensorLayout(node, worker), &lr).ok());
  }
  absl::Status Publish(uint64_t v) {
    pb::CoordPublishRequest p;
    p.set_model_id("m");
    p.set_worker_id("t0");
    p.set_node_id("n0");
    p.set_version(v);
    p.set_timeout_ms(10000);
    pb::PublishResponse resp;
    return core->Publish(p, &resp);
  }
  // Trainer t0 and rollout r0 on n0, version 1 committed and held by r0.
  void CommitVersion1() {
    Join("n0", "t0", pb::ROLE_TRAINER);
    Join("n0", "r0", pb::ROLE_ROLLOUT);
    ASSERT_TRUE(core->AwaitPlanInstalled("m", absl::Now() + absl::Seconds(10)));
    ASSERT_TRUE(Publish(1).ok());
    ASSERT_TRUE(WaitFor("r0", 1).ok());
  }
  absl::Status WaitFor(const std::string& worker, uint64_t v, int64_t timeout_ms = 10000) {
    pb::WaitVersionRequest w;
    w.set_model_id("m");
    w.set_version(v);
    w.set_timeout_ms(timeout_ms);
    w.set_worker_id(worker);
    pb::WaitVersionResponse wr;
    return core->WaitVersion(w, &wr);
  }
  std::vector<std::string> Log() {
    absl::MutexLock l(&mu);
    return log;
  }
  // The ExecuteVersion of version v (not a catch-up) that `node` got; a test failure when none.
  pb::ExecuteVersionRequest Executed(const std::string& node, uint64_t v) {
    absl::MutexLock l(&mu);
    auto it = executed.find({node, v});
    if (it == executed.end()) {
      ADD_FAILURE() << "no ExecuteVersion of version " << v << " on " << node;
      return {};
    }
    return it->second;
  }

  // Waits (real time, 10 s at most) until `n` catch-up reports are held.
  bool AwaitHeld(size_t n) {
    absl::MutexLock l(&mu);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return held.size() >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }

  std::atomic<uint64_t> fail_version{0};  // n1 reports this version (not a catch-up) failed
  std::atomic<bool> stall_catch_up{false};
  // Catch-up executions report nothing at once: their ReportDone goes to `held`, with the
  // ExecuteVersionRequest.plan_epoch of the execution, for the test to deliver (late) itself.
  std::atomic<bool> hold_catch_up{false};
  struct Held {
    pb::ReportDoneRequest report;
    uint64_t epoch = 0;
  };
  std::unique_ptr<CoordinatorCore> core;
  absl::Mutex mu;
  std::vector<std::string> log ABSL_GUARDED_BY(mu);
  std::map<std::pair<std::string, uint64_t>, pb::ExecuteVersionRequest> executed ABSL_GUARDED_BY(mu);  // (node, version)
  std::vector<Held> held ABSL_GUARDED_BY(mu);
  std::map<std::string, std::shared_ptr<FakeNodeClient>> fakes ABSL_GUARDED_BY(mu);  // by node
  std::shared_ptr<FakeNodeClient> Fake(const std::string& node) {
    absl::MutexLock l(&mu);
    return fakes.at(node);
  }
};

// A catch-up that never reports times out: the late rollout's WaitVersion is ABORTED naming the
// timeout (never OK), it is not tried again for that version, a version published meanwhile starts
// only after the catch-up ended, and that version reaches the late rollout.
TEST(CatchUpDriverTest, TimeoutIsReportedAndTheNextVersionBringsTheRollout) {
  FakeCluster c;
  ASSERT_NO_FATAL_FAILURE(c.CommitVersion1());
  c.stall_catch_up = true;
  c.Join("n1", "r1", pb::ROLE_ROLLOUT);
  absl::Status s = c.WaitFor("r1", 1);
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("timed out"), std::string::npos) << s;
  EXPECT_TRUE(c.WaitFor("r0", 1).ok()) << "r0 holds version 1: not affected";
  c.stall_catch_up = false;
  ASSERT_TRUE(c.Publish(2).ok());
  s = c.WaitFor("r1", 2);
  EXPECT_TRUE(s.ok()) << s;
  const std::vector<std::string> log = c.Log();
  int catch_ups = 0;
  for (const std::string& e : log) catch_ups += e.rfind("catch-up", 0) == 0;
  EXPECT_GE(catch_ups, 1);
  // Every catch-up execution of version 1 came before the first execution of version 2, and none after.
  bool seen_v2 = false;
  for (const std::string& e : log) {
    if (e == "version 2") seen_v2 = true;
    if (seen_v2) {
      EXPECT_NE(e, "catch-up 1") << "a catch-up of version 1 ran after version 2 started";
    }
  }
  EXPECT_TRUE(seen_v2);
}

// A restarted coordinator rebuilt from re-joining nodes: both nodes committed version 1, but only
// r0 holds it; r1 (a late rollout whose catch-up had not finished, or one re-joined by a node built
// before holds_version, which sends 0) holds nothing. r1 is late: WaitVersion(1) for it answers OK
// only after a catch-up of version 1 committed; r0 is answered at once. (Before: holds was the
// node's committed version, r1 counted as holding version 1 and no catch-up ran.)
TEST(CatchUpDriverTest, ARejoinedRolloutHoldsWhatItSaysNotWhatItsNodeCommitted) {
  FakeCluster c;
  c.Join("n0", "t0", pb::ROLE_TRAINER, FakeCluster::Rejoin{1, 0, 0});
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, FakeCluster::Rejoin{1, 1, 1});
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, FakeCluster::Rejoin{1, 0, 0});
  EXPECT_TRUE(c.WaitFor("r0", 1, 1000).ok());
  absl::Status s = c.WaitFor("r1", 1);
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<std::string> log = c.Log();
  EXPECT_NE(std::find(log.begin(), log.end(), "catch-up 1"), log.end()) << "r1 was counted as holding version 1";
  EXPECT_NE(std::find(log.begin(), log.end(), "commit 1 on n1"), log.end());
}

// status.md item 24: version 2 was published (one-step-off / async: the trainer's Publish answered
// at record) to a coordinator that died before committing it anywhere; the trainer never publishes
// it again. The restarted coordinator learns the number from the trainer's re-join
// (published_version) and counts it used: a wait for it (a rollout node's Apply(2) asking, without
// the worker) is ABORTED naming the restart once the re-join window closed (rejoin_window.cc; 1 s
// here), a re-sent publish of it too, and version 3 runs. Before, the wait lasted until its
// deadline: no coordinator ever runs version 2.
TEST(CatchUpDriverTest, AVersionATrainerPublishedBeforeTheRestartIsAbortedNotAwaited) {
  FakeCluster c;
  c.Join("n0", "t0", pb::ROLE_TRAINER, FakeCluster::Rejoin{1, 0, 0, false, /*published=*/2});
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, FakeCluster::Rejoin{1, 1, 1});
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, FakeCluster::Rejoin{1, 1, 1});
  const absl::Time start = absl::Now();
  absl::Status s = c.WaitFor("", 2, /*timeout_ms=*/5000);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(4)) << "answered at its deadline, not at once";
  EXPECT_NE(s.message().find("its number is used: trainer t0 on node n0"), std::string::npos) << s;
  EXPECT_NE(s.message().find("coordinator restarted"), std::string::npos) << s;
  EXPECT_TRUE(c.WaitFor("r1", 1).ok()) << "version 1 stays committed";
  s = c.Publish(2);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  ASSERT_TRUE(c.Publish(3).ok());
  s = c.WaitFor("r1", 3);
  EXPECT_TRUE(s.ok()) << s;
}

// A trainer's published version the nodes committed is no used number: nothing changes.
TEST(CatchUpDriverTest, APublishedVersionCommittedOnTheNodesIsNotUsed) {
  FakeCluster c;
  c.Join("n0", "t0", pb::ROLE_TRAINER, FakeCluster::Rejoin{2, 0, 0, false, /*published=*/2});
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, FakeCluster::Rejoin{2, 2, 2});
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, FakeCluster::Rejoin{2, 2, 2});
  EXPECT_TRUE(c.WaitFor("r1", 2).ok());
  ASSERT_TRUE(c.Publish(3).ok());
  EXPECT_TRUE(c.WaitFor("r1", 3).ok());
}

// A catch-up attempt made void by a re-registered late rollout (not final: tried again) leaves its
// nodes' executors running; their "done" reports may arrive during the next attempt of the SAME
// version. Those reports name that version, those nodes and "catch-up", so without the plan epoch
// they were counted for the new attempt: it committed on them although its own executions had not
// finished (the late rollout's staging not yet written by it). A report of another epoch is now
// refused, naming both epochs; the new attempt commits only on its own reports.
TEST(CatchUpDriverTest, StaleDoneReportOfAnEarlierAttemptIsRefused) {
  FakeCluster c;
  ASSERT_NO_FATAL_FAILURE(c.CommitVersion1());
  c.hold_catch_up = true;
  c.Join("n1", "r1", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(c.AwaitHeld(2)) << "attempt 1 did not start on n0 and n1";
  c.Join("n1", "r1", pb::ROLE_ROLLOUT);  // r1 restarted: attempt 1 is void, attempt 2 starts
  ASSERT_TRUE(c.AwaitHeld(4)) << "attempt 2 did not start on n0 and n1";
  std::vector<FakeCluster::Held> held;
  {
    absl::MutexLock l(&c.mu);
    held = c.held;
  }
  const uint64_t first = held[0].epoch, second = held[2].epoch;
  ASSERT_EQ(held[1].epoch, first);
  ASSERT_EQ(held[3].epoch, second);
  ASSERT_NE(first, second);
  // The voided attempt's aborts name its epoch (a node running attempt 2 by then keeps it).
  for (const std::string n : {"n0", "n1"}) {
    EXPECT_TRUE(c.Fake(n)->AwaitCalls(
        [&](const FakeNodeClient::Calls& k) { return std::count(k.aborted_epochs.begin(), k.aborted_epochs.end(), first) == 1; },
        absl::Now() + absl::Seconds(10)))
        << "no abort of epoch " << first << " on " << n;
  }
  for (int i = 0; i < 2; ++i) {
    pb::ReportDoneRequest stale = held[i].report;
    stale.set_plan_epoch(first);
    pb::ReportDoneResponse resp;
    absl::Status s = c.core->ReportDone(stale, &resp);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find(absl::StrCat("plan epoch ", first)), std::string::npos) << s;
    EXPECT_NE(s.message().find(absl::StrCat("epoch ", second, " is running")), std::string::npos) << s;
    EXPECT_NE(s.message().find(stale.node_id()), std::string::npos) << s;
  }
  // Attempt 2 has not reported: r1 must not be told it holds version 1 (before the fix the stale
  // reports completed attempt 2 and it committed within milliseconds).
  absl::Status early = c.WaitFor("r1", 1, /*timeout_ms=*/500);
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  {
    absl::MutexLock l(&c.mu);
    for (const std::string& e : c.log) EXPECT_NE(e, "commit 1 on n1") << "the catch-up committed on stale reports";
    c.log.push_back("attempt 2 reports");
  }
  for (int i = 2; i < 4; ++i) {
    pb::ReportDoneRequest own = held[i].report;
    own.set_plan_epoch(second);
    pb::ReportDoneResponse resp;
    EXPECT_TRUE(c.core->ReportDone(own, &resp).ok());
  }
  absl::Status s = c.WaitFor("r1", 1);
  EXPECT_TRUE(s.ok()) << s;
  const std::vector<std::string> log = c.Log();
  auto reports = std::find(log.begin(), log.end(), "attempt 2 reports");
  EXPECT_EQ(std::count(log.begin(), log.end(), "commit 1 on n1"), 1);
  EXPECT_NE(std::find(reports, log.end(), "commit 1 on n1"), log.end()) << "the catch-up committed before its own reports";
}

// ------------------------------------------------------------------ bases without shadows

std::map<std::string, uint64_t> BasesOf(const pb::ExecuteVersionRequest& req) { return {req.base_versions().begin(), req.base_versions().end()}; }
std::vector<std::string> WithoutShadowsOf(const pb::ExecuteVersionRequest& req) {
  return {req.bases_without_shadows().begin(), req.bases_without_shadows().end()};
}

// Late rollout r1 (n1) is caught up to version 1 from r0's bytes (n0): it holds version 1 without
// canonical shadows. Version 2 names it in bases_without_shadows (with its base) only when every
// node of the plan reads that field; when one of them - sender n0 or receiver n1 - is built before
// it (RegisterNodeRequest.understands_bases_without_shadows unset), r1 gets no base at all (every
// op into it in full, which nodes of both builds agree on), while r0 keeps its base. Version 3
// reached r1 through the plan: its base is version 2, with shadows, on every build.
class BasesWithoutShadowsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BasesWithoutShadowsTest, ACaughtUpRolloutHasABaseOnlyWhenEveryPlanNodeReadsTheMark) {
  const std::string old_node = GetParam();  // "" = every node is new
  FakeCluster c(old_node.empty() ? std::set<std::string>{} : std::set<std::string>{old_node});
  ASSERT_NO_FATAL_FAILURE(c.CommitVersion1());
  c.Join("n1", "r1", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(c.WaitFor("r1", 1).ok());
  ASSERT_TRUE(c.Publish(2).ok());
  ASSERT_TRUE(c.WaitFor("r1", 2).ok());
  for (const std::string n : {"n0", "n1"}) {
    const pb::ExecuteVersionRequest v2 = c.Executed(n, 2);
    if (old_node.empty()) {
      EXPECT_EQ(BasesOf(v2), (std::map<std::string, uint64_t>{{"r0", 1}, {"r1", 1}})) << n;
      EXPECT_EQ(WithoutShadowsOf(v2), std::vector<std::string>{"r1"}) << n;
    } else {
      EXPECT_EQ(BasesOf(v2), (std::map<std::string, uint64_t>{{"r0", 1}})) << n << ": " << old_node << " would not read the mark";
      EXPECT_TRUE(WithoutShadowsOf(v2).empty()) << n;
    }
  }
  ASSERT_TRUE(c.Publish(3).ok());
  ASSERT_TRUE(c.WaitFor("r1", 3).ok());
  for (const std::string n : {"n0", "n1"}) {
    const pb::ExecuteVersionRequest v3 = c.Executed(n, 3);
    EXPECT_EQ(BasesOf(v3), (std::map<std::string, uint64_t>{{"r0", 2}, {"r1", 2}})) << n;
    EXPECT_TRUE(WithoutShadowsOf(v3).empty()) << n << ": version 2 reached r1 through the plan";
  }
}

INSTANTIATE_TEST_SUITE_P(OldNode, BasesWithoutShadowsTest, ::testing::Values("", "n0", "n1"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param.empty() ? std::string("none") : i.param; });

// Version 3 starts and fails on n1 (aborted): on a node that decodes in place it may have decoded
// into the staging that held its rollout's version 2 - the only copy of the canonical shadows - so
// version 4 names each rollout it had named a base for on such a node in bases_without_shadows (its
// ops into shadows go full, nothing refused); a rollout on a node that copies its base keeps it
// unmarked. With a node in the plan that does not read the mark nothing is marked (that would cost
// the rollouts every base). Version 5: no mark (version 4 wrote every shadow).
struct AbortMarkCase {
  std::string name;
  std::set<std::string> old_nodes, in_place;
  std::vector<std::string> marked;
};
void PrintTo(const AbortMarkCase& k, std::ostream* os) { *os << k.name; }
class AbortMarksBasesTest : public ::testing::TestWithParam<AbortMarkCase> {};

TEST_P(AbortMarksBasesTest, AStartedVersionsAbortMarksTheBasesItMayHaveTorn) {
  const AbortMarkCase& k = GetParam();
  FakeCluster c(k.old_nodes, k.in_place);
  ASSERT_NO_FATAL_FAILURE(c.CommitVersion1());
  c.Join("n1", "r1", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(c.WaitFor("r1", 1).ok());
  ASSERT_TRUE(c.Publish(2).ok());
  ASSERT_TRUE(c.WaitFor("r1", 2).ok());
  c.fail_version = 3;
  ASSERT_TRUE(c.Publish(3).ok());
  EXPECT_TRUE(absl::IsAborted(c.WaitFor("r1", 3)));
  ASSERT_TRUE(c.Publish(4).ok());
  ASSERT_TRUE(c.WaitFor("r1", 4).ok());
  for (const std::string n : {"n0", "n1"}) {
    const pb::ExecuteVersionRequest v4 = c.Executed(n, 4);
    EXPECT_EQ(BasesOf(v4), (std::map<std::string, uint64_t>{{"r0", 2}, {"r1", 2}})) << n;
    EXPECT_EQ(WithoutShadowsOf(v4), k.marked) << n;
  }
  ASSERT_TRUE(c.Publish(5).ok());
  ASSERT_TRUE(c.WaitFor("r1", 5).ok());
  for (const std::string n : {"n0", "n1"}) EXPECT_TRUE(WithoutShadowsOf(c.Executed(n, 5)).empty()) << n;
}

INSTANTIATE_TEST_SUITE_P(Nodes, AbortMarksBasesTest,
                         ::testing::Values(AbortMarkCase{"both_in_place", {}, {"n0", "n1"}, {"r0", "r1"}},
                                           AbortMarkCase{"n1_copies", {}, {"n0"}, {"r0"}},
                                           AbortMarkCase{"n1_old", {"n1"}, {"n0", "n1"}, {}}),
                         [](const ::testing::TestParamInfo<AbortMarkCase>& i) { return i.param.name; });

// A restarted coordinator rebuilt from re-joining nodes keeps the mark: n1 says r1 holds version 1
// from a catch-up (JoinWorkerRequest.holds_without_shadows), so version 2 names r1 in
// bases_without_shadows as the coordinator before the restart would have; r0 is not named.
TEST(BasesWithoutShadowsRejoinTest, ARejoinedRolloutKeepsTheMarkItsNodeReports) {
  FakeCluster c;
  c.Join("n0", "t0", pb::ROLE_TRAINER, FakeCluster::Rejoin{1, 0, 0});
  c.Join("n0", "r0", pb::ROLE_ROLLOUT, FakeCluster::Rejoin{1, 1, 1});
  c.Join("n1", "r1", pb::ROLE_ROLLOUT, FakeCluster::Rejoin{1, 1, 1, /*without_shadows=*/true});
  ASSERT_TRUE(c.core->AwaitPlanInstalled("m", absl::Now() + absl::Seconds(10)));
  ASSERT_TRUE(c.Publish(2).ok());
  ASSERT_TRUE(c.WaitFor("r1", 2).ok());
  for (const std::string n : {"n0", "n1"}) {
    const pb::ExecuteVersionRequest v2 = c.Executed(n, 2);
    EXPECT_EQ(BasesOf(v2), (std::map<std::string, uint64_t>{{"r0", 1}, {"r1", 1}})) << n;
    EXPECT_EQ(WithoutShadowsOf(v2), std::vector<std::string>{"r1"}) << n << ": the mark was lost over the restart";
  }
  const std::vector<std::string> log = c.Log();
  EXPECT_EQ(std::find(log.begin(), log.end(), "catch-up 1"), log.end()) << "r1 holds version 1: not late";
}

}  // namespace
}  // namespace wb::daemon
