// Planning is fair across models (docs/daemon.md "Planning one model at a time, fairly"): one
// planner thread plans every model, so a slow model's plan (a hostile or huge layout just under the
// planner's work budgets) holds the others up - but by one planning at most, however often it asks
// again; a model's waiting plan is made once, for its newest membership; and a layout set that
// failed fails again at once instead of holding the planner once more. Deterministic: the injected
// planner blocks a slow model's plans until the test releases them (a real-time deadline fails the
// test instead of hanging it), and the test waits for queue states, never sleeps.
#include <map>
#include <memory>
#include <set>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/synchronization/mutex.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"
#include "planner/planner.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);  // real-time bound on any wait in these tests

// The injected planner. Workers are named "<model>-<name>", so each call knows its model. A slow
// model's call waits for a permit (Release); a failing model's call fails "hostile layout #<call>".
class TestPlanner {
 public:
  struct Call {
    std::string model;
    size_t workers = 0;
  };

  absl::StatusOr<planner::Plan> Plan(const planner::Problem& p, planner::Strategy s) {
    const std::string model = p.workers.empty() ? "" : p.workers.front().id.substr(0, p.workers.front().id.find('-'));
    size_t call = 0;
    {
      absl::MutexLock l(&mu_);
      calls_.push_back({model, p.workers.size()});
      call = calls_.size();
      if (slow_.count(model)) {
        auto permitted = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return permits_[model] > 0; };
        if (!mu_.AwaitWithTimeout(absl::Condition(&permitted), kReal)) return absl::InternalError("the test never released the plan");
        --permits_[model];
      }
      if (failing_.count(model)) return absl::InvalidArgumentError(absl::StrCat("hostile layout #", call));
    }
    return planner::MakePlan(p, s);
  }

  void SetSlow(const std::string& model) {
    absl::MutexLock l(&mu_);
    slow_.insert(model);
  }
  void SetFailing(const std::string& model) {
    absl::MutexLock l(&mu_);
    failing_.insert(model);
  }
  // Lets one held plan of `model` go on.
  void Release(const std::string& model) {
    absl::MutexLock l(&mu_);
    ++permits_[model];
  }
  // Waits until `n` calls have started.
  bool AwaitCalls(size_t n) {
    absl::MutexLock l(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return calls_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), kReal);
  }
  std::vector<Call> calls() {
    absl::MutexLock l(&mu_);
    return calls_;
  }

 private:
  absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> slow_ ABSL_GUARDED_BY(mu_), failing_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> permits_ ABSL_GUARDED_BY(mu_);
};

class PlanFairnessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions o;
    o.make_plan = [this](const planner::Problem& p, planner::Strategy s) { return planner_.Plan(p, s); };
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      fakes_[node] = fake;
      return fake;
    };
    core_ = std::make_unique<CoordinatorCore>(std::move(o));
    core_->Start();
    for (const char* node : {"n0", "n1"}) {
      pb::RegisterNodeRequest req;
      req.set_node_id(node);
      req.set_address(absl::StrCat(node, ":1"));
      pb::RegisterNodeResponse resp;
      ASSERT_TRUE(core_->RegisterNode(req, &resp).ok());
    }
  }
  void TearDown() override {
    // Let any plan still held go (Shutdown joins the planner thread).
    for (const char* model : {"a", "b", "c", "d", "e"}) {
      for (int i = 0; i < 4; ++i) planner_.Release(model);
    }
    core_->Shutdown();
  }

  // `model`-`name` joins `model` (one trainer, one rollout expected) on `node` and submits a layout
  // holding the model's tensor whole in its shm buffer (`shm`, default "/wb-test-<worker>").
  void Join(const std::string& node, const std::string& model, const std::string& name, pb::Role role) {
    const std::string worker = absl::StrCat(model, "-", name);
    pb::JoinWorkerRequest j;
    j.set_node_id(node);
    j.set_worker_id(worker);
    j.set_model_id(model);
    j.set_role(role);
    *j.mutable_model() = testing::SmallModelSpec(model);
    pb::JoinWorkerResponse jr;
    ASSERT_TRUE(core_->JoinWorker(j, &jr).ok());
    Layout(node, model, worker, "");
  }
  void Layout(const std::string& node, const std::string& model, const std::string& worker, const std::string& shm) {
    pb::SubmitLayoutRequest l = testing::WholeTensorLayout(node, worker);
    l.set_model_id(model);
    if (!shm.empty()) l.mutable_buffers(0)->set_shm_name(shm);
    pb::SubmitLayoutResponse lr;
    absl::Status s = core_->SubmitLayout(l, &lr);
    ASSERT_TRUE(s.ok()) << s;
  }
  std::string PlanError(const std::string& model) {
    pb::StatusResponse st;
    EXPECT_TRUE(core_->ClusterStatus(pb::StatusRequest(), &st).ok());
    for (const pb::ModelStatus& m : st.models()) {
      if (m.model_id() == model) return m.plan_error();
    }
    return "(no such model)";
  }
  absl::Time Deadline() const { return absl::Now() + kReal; }

  TestPlanner planner_;
  std::map<std::string, std::shared_ptr<FakeNodeClient>> fakes_;
  std::unique_ptr<CoordinatorCore> core_;
};

// Model a's plan is slow; while it is being made, a changes twice (its next plan is queued at once,
// one job for both changes) and model b becomes ready. When a's plan ends, b is planned before a's
// second plan: b waited for one planning of a, not for everything a asked for. (Served first come
// first served, a's second plan - queued before b's - would go first.)
TEST_F(PlanFairnessTest, ASlowModelDelaysAnotherModelsPlanByOnePlanningAtMost) {
  planner_.SetSlow("a");
  Join("n0", "a", "t0", pb::ROLE_TRAINER);
  Join("n0", "a", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(planner_.AwaitCalls(1)) << "a was never planned";
  Join("n0", "a", "r1", pb::ROLE_ROLLOUT);  // a changes while its plan is made: queued again at once
  ASSERT_TRUE(core_->AwaitPlansWaiting(1, Deadline()));
  Join("n0", "a", "r2", pb::ROLE_ROLLOUT);  // ... and again: still one waiting job for a
  Join("n1", "b", "t0", pb::ROLE_TRAINER);
  Join("n1", "b", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(core_->AwaitPlansWaiting(2, Deadline())) << "a and b each wait with one job";

  planner_.Release("a");  // a's first plan ends (and is discarded: a changed meanwhile)
  ASSERT_TRUE(planner_.AwaitCalls(2));
  EXPECT_EQ(planner_.calls()[1].model, "b") << "b's plan waited behind a's second plan";
  EXPECT_TRUE(core_->AwaitPlanInstalled("b", Deadline()));

  ASSERT_TRUE(planner_.AwaitCalls(3));
  EXPECT_EQ(planner_.calls()[2].model, "a");
  EXPECT_EQ(planner_.calls()[2].workers, 4u) << "a's second plan is of its newest membership (t0, r0, r1, r2)";
  planner_.Release("a");
  EXPECT_TRUE(core_->AwaitPlanInstalled("a", Deadline()));
  EXPECT_EQ(planner_.calls().size(), 3u) << "a: one discarded plan and one for both later changes; b: one";
}

// While c's slow plan holds the planner, model d becomes ready (its plan is queued) and then
// changes three times. Its queued plan takes its snapshot only when it starts: d is planned and
// installed once, for its newest membership - not once per change, nor first for a stale one.
TEST_F(PlanFairnessTest, AModelsWaitingPlanIsMadeOnceForItsNewestMembership) {
  planner_.SetSlow("c");
  Join("n0", "c", "t0", pb::ROLE_TRAINER);
  Join("n0", "c", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(planner_.AwaitCalls(1)) << "c was never planned";
  Join("n1", "d", "t0", pb::ROLE_TRAINER);
  Join("n1", "d", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(core_->AwaitPlansWaiting(1, Deadline())) << "d's plan is queued";
  Join("n1", "d", "r1", pb::ROLE_ROLLOUT);
  Join("n1", "d", "r2", pb::ROLE_ROLLOUT);
  Layout("n1", "d", "d-r2", "/wb-test-d-r2-again");  // a new layout before any plan holds it
  // The driver has seen every change (a pass started after them) before c's plan ends.
  ASSERT_TRUE(core_->AwaitDriverPassAt(absl::Now(), Deadline()));
  EXPECT_TRUE(core_->AwaitPlansWaiting(1, Deadline())) << "d's changes were coalesced into its one waiting job";

  planner_.Release("c");
  ASSERT_TRUE(core_->AwaitPlanInstalled("d", Deadline()));
  ASSERT_TRUE(core_->AwaitPlanInstalled("c", Deadline()));
  std::vector<TestPlanner::Call> d_calls;
  for (const TestPlanner::Call& c : planner_.calls()) {
    if (c.model == "d") d_calls.push_back(c);
  }
  ASSERT_EQ(d_calls.size(), 1u) << "d was planned once";
  EXPECT_EQ(d_calls[0].workers, 4u) << "for its newest membership (t0, r0, r1, r2)";
  EXPECT_EQ(fakes_["n1"]->calls().install, 1) << "and its plan installed once";
}

// A layout set whose plan failed fails again at once, with the same error, when it comes back:
// the planner is not called for it again (a hostile layout just under the planner's budgets would
// otherwise hold the planner thread once more each time it is re-submitted).
TEST_F(PlanFairnessTest, ALayoutSetThatFailedFailsAgainAtOnceWithTheSameError) {
  planner_.SetFailing("e");
  Join("n0", "e", "t0", pb::ROLE_TRAINER);
  Join("n0", "e", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(core_->AwaitPlanSettled("e", Deadline()));
  EXPECT_EQ(PlanError("e"), "hostile layout #1");
  ASSERT_EQ(planner_.calls().size(), 1u);

  // Another layout of the rollout: another layout set, planned (and failing) again.
  Layout("n0", "e", "e-r0", "/wb-test-e-r0-b");
  ASSERT_TRUE(core_->AwaitPlanSettled("e", Deadline()));
  EXPECT_EQ(PlanError("e"), "hostile layout #2");
  ASSERT_EQ(planner_.calls().size(), 2u);

  // The first layout again: the layout set of the first plan, which failed.
  Layout("n0", "e", "e-r0", "/wb-test-e-r0");
  ASSERT_TRUE(core_->AwaitPlanSettled("e", Deadline()));
  EXPECT_EQ(PlanError("e"), "hostile layout #1") << "the first failure, remembered";
  EXPECT_EQ(planner_.calls().size(), 2u) << "the planner was called again for a layout set that failed";
}


// ---- Cancelling a superseded plan: PlanQueue and PlanCache as the coordinator wires them ----
// (PlanCache::Options::cancelled = PlanQueue::CurrentJobCancelled, no PlanFn: the cancellable
// planner). docs/planner.md "Cancelling a plan".

// The planner thread runs model m's plan job; at the planner's 5th poll (mid-plan) the driver
// queues a newer plan of m (its membership changed). The running plan stops at that poll,
// CANCELLED "a newer plan job of the model is queued", and the next job - the newer plan - runs
// and plans. The same for CancelRunning (the coordinator's shutdown).
TEST(PlanCancelTest, ASupersededPlanIsCancelledAndTheNextOneRuns) {
  for (const bool shutdown : {false, true}) {
    PlanQueue queue;  // the test thread plays the driver (CoordinatorCore keeps it under its mu_)
    absl::Notification at_poll, pushed;
    int polls = 0;
    PlanCache::Options o;
    o.cancelled = [&]() -> std::optional<std::string> {
      if (++polls == 5) {
        at_poll.Notify();
        EXPECT_TRUE(pushed.WaitForNotificationWithTimeout(kReal));
      }
      return PlanQueue::CurrentJobCancelled();
    };
    PlanCache cache(o);
    const SliceInput in = testing::BigSliceInput("m", 4096);
    std::vector<absl::StatusOr<PlanOutcome>> outcomes;
    auto plan_job = [&] { outcomes.push_back(cache.PlanAndSlice(in, PlanSettings(), PlanFn())); };
    queue.Push("m", "plan", plan_job);
    std::optional<PlanQueue::Job> first = queue.Pop();
    ASSERT_TRUE(first.has_value());
    std::thread planner_thread([&] { (*first)(); });
    ASSERT_TRUE(at_poll.WaitForNotificationWithTimeout(kReal));
    if (shutdown) {
      EXPECT_TRUE(queue.CancelRunning("coordinator shutting down"));
    } else {
      EXPECT_FALSE(queue.Push("m", "plan", plan_job));  // no waiting job replaced: queued
    }
    pushed.Notify();
    planner_thread.join();
    ASSERT_EQ(outcomes.size(), 1u);
    ASSERT_EQ(outcomes[0].status().code(), absl::StatusCode::kCancelled) << outcomes[0].status();
    EXPECT_EQ(polls, 5) << "stopped at the first poll after the cancel";
    const std::string why = shutdown ? "coordinator shutting down" : "a newer plan job of the model is queued";
    EXPECT_NE(outcomes[0].status().message().find(absl::StrCat(": ", why, " (planner stopped ")), std::string::npos)
        << outcomes[0].status();
    EXPECT_TRUE(absl::StartsWith(outcomes[0].status().message(), "model m: plan cancelled after ")) << outcomes[0].status();
    if (shutdown) continue;

    std::optional<PlanQueue::Job> next = queue.Pop();
    ASSERT_TRUE(next.has_value());
    (*next)();
    ASSERT_EQ(outcomes.size(), 2u);
    ASSERT_TRUE(outcomes[1].ok()) << outcomes[1].status();
    EXPECT_EQ(outcomes[1]->plan->stats.num_ops, 4096 * 16);
    EXPECT_FALSE(outcomes[1]->cached);
    EXPECT_FALSE(queue.Pop().has_value());
  }
}

// CoordinatorCore wires the cancellable planner: with no injected PlanFn its plans go through
// PlanCache with CoordinatorOptions::plan_deadline (and the planner thread's cancellation). A
// deadline of 1 ns has passed before the planner starts: the model's plan error says it was
// abandoned; the default deadline plans and installs the same model.
TEST(PlanCancelCoreTest, TheCoordinatorsPlansRunUnderItsPlanDeadline) {
  for (const bool tiny : {true, false}) {
    CoordinatorOptions o;
    if (tiny) o.plan_deadline = absl::Nanoseconds(1);
    o.make_node_client = [](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      return std::make_shared<FakeNodeClient>(node);
    };
    CoordinatorCore core(std::move(o));
    core.Start();
    pb::RegisterNodeRequest n;
    n.set_node_id("n0");
    n.set_address("n0:1");
    pb::RegisterNodeResponse nr;
    ASSERT_TRUE(core.RegisterNode(n, &nr).ok());
    for (const auto& [name, role] : {std::pair{"m-t0", pb::ROLE_TRAINER}, std::pair{"m-r0", pb::ROLE_ROLLOUT}}) {
      pb::JoinWorkerRequest j;
      j.set_node_id("n0");
      j.set_worker_id(name);
      j.set_model_id("m");
      j.set_role(role);
      *j.mutable_model() = testing::SmallModelSpec("m");
      pb::JoinWorkerResponse jr;
      ASSERT_TRUE(core.JoinWorker(j, &jr).ok());
      pb::SubmitLayoutRequest l = testing::WholeTensorLayout("n0", name);
      l.set_model_id("m");
      pb::SubmitLayoutResponse lr;
      ASSERT_TRUE(core.SubmitLayout(l, &lr).ok());
    }
    const absl::Time deadline = absl::Now() + kReal;
    if (tiny) {
      ASSERT_TRUE(core.AwaitPlanSettled("m", deadline));
      pb::StatusResponse st;
      ASSERT_TRUE(core.ClusterStatus(pb::StatusRequest(), &st).ok());
      ASSERT_EQ(st.models_size(), 1);
      EXPECT_NE(st.models(0).plan_error().find("model m: plan abandoned after "), std::string::npos) << st.models(0).plan_error();
      EXPECT_NE(st.models(0).plan_error().find("past the plan deadline of 1ns"), std::string::npos) << st.models(0).plan_error();
    } else {
      EXPECT_TRUE(core.AwaitPlanInstalled("m", deadline));
    }
    core.Shutdown();
  }
}

}  // namespace
}  // namespace wb::daemon
