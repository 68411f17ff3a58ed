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
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

}  // namespace
}  // namespace wb::daemon
