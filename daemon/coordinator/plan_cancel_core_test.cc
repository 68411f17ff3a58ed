// CoordinatorCore stops plans nobody will use (docs/daemon.md "Planning one model at a time,
// fairly", *Cancelling*), seen from the core's calls:
//  - Shutdown() cancels the plan being made, so it returns at once however long that plan would
//    run, and fails every waiting call UNAVAILABLE;
//  - a membership change cancels its model's plan being made at once and queues the newer plan,
//    also where the driver queues nothing: the model cannot be planned any more (its trainer
//    left), or the driver is busy in another model's node RPCs (a sync commit);
//  - a version in flight runs on its own plan: a membership change during it plans nothing until
//    it ends (commit, or abort when the change touches it), then the newest membership is planned.
// A long plan is the real planner's work, repeated until its job is cancelled or kPlanTakes has
// passed, polling the job's cancellation (PlanQueue::CurrentJobCancelled) as PlanCache does. Tests
// wait for states with real-time deadlines and never sleep; a test whose cancel is missing fails by
// its bound (kPrompt), then ends once the plan gives up by itself (kPlanTakes).
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
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

constexpr absl::Duration kReal = absl::Seconds(20);       // bound on any wait for what must happen
constexpr absl::Duration kPrompt = absl::Seconds(5);      // "at once": far below kPlanTakes
constexpr absl::Duration kPlanTakes = absl::Seconds(60);  // a long plan, never cancelled

// The planner problem of testing::BigSliceInput (tensors x 16 rollouts ops), as PlanCache builds it.
planner::Problem BigProblem(int tensors) {
  const SliceInput in = testing::BigSliceInput("long", tensors);
  planner::Problem p;
  p.inventory = *in.inventory;
  std::map<std::string, int32_t> slots;
  for (const SliceWorker& w : in.workers) {
    planner::Worker pw;
    pw.id = w.id;
    pw.role = w.role;
    pw.node = w.node == "n0" ? 0 : w.node == "n1" ? 1 : 2;
    pw.gpu = 1024 + slots[w.node]++;
    pw.layout = w.layout->Unpack();
    p.workers.push_back(std::move(pw));
  }
  return p;
}

// The injected planner. Workers are named "<model>-<name>", so each call knows its model. The next
// call of a model marked long (SetLong) is a long plan (see the top); every other call plans the
// problem it is given at once.
class LongPlanner {
 public:
  struct Call {
    std::string model;
    std::string first;  // the first worker: a plan job's lists the trainer first, a catch-up's a rollout
    size_t workers = 0;
    bool long_plan = false;
    int polls = 0;       // of a long plan: the planner's cancellation checks so far
    bool ended = false;  // the call returned
    absl::Status status;
  };

  LongPlanner() : big_(BigProblem(1024)) {}

  absl::StatusOr<planner::Plan> Plan(const planner::Problem& p, planner::Strategy s) {
    const std::string model = p.workers.empty() ? "" : p.workers.front().id.substr(0, p.workers.front().id.find('-'));
    size_t i = 0;
    bool long_plan = false;
    {
      absl::MutexLock l(&mu_);
      // A catch-up's problem lists rollouts only (its sources stand as trainers); a plan job's
      // lists the trainer ("<model>-t0") first.
      const bool catch_up = !p.workers.empty() && p.workers.front().id != model + "-t0";
      long_plan = long_.erase(catch_up ? model + kCatchUpSuffix : model) > 0;
      calls_.push_back({model, p.workers.empty() ? "" : p.workers.front().id, p.workers.size(), long_plan});
      i = calls_.size() - 1;
    }
    absl::StatusOr<planner::Plan> plan = long_plan ? Long(i, s) : planner::MakePlan(p, s);
    absl::MutexLock l(&mu_);
    calls_[i].ended = true;
    calls_[i].status = plan.status();
    return plan;
  }

  // The next plan job of `model` (or, with `catch_up`, its next catch-up plan) is a long plan.
  void SetLong(const std::string& model, bool catch_up = false) {
    absl::MutexLock l(&mu_);
    long_.insert(catch_up ? model + kCatchUpSuffix : model);
  }
  // Waits until a long plan has polled its cancellation; its call index, or nullopt at `deadline`.
  std::optional<size_t> AwaitLongPolled(absl::Time deadline) {
    std::optional<size_t> found;
    Await(
        [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          for (size_t i = 0; i < calls_.size(); ++i) {
            if (calls_[i].long_plan && calls_[i].polls > 0) found = i;
          }
          return found.has_value();
        },
        deadline);
    return found;
  }
  // Waits until call `i` (0-based, in call order) has polled its cancellation (a long plan: it is
  // in the planner's work), or has ended.
  bool AwaitPolled(size_t i, absl::Time deadline) {
    return Await([&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return calls_.size() > i && calls_[i].polls > 0; }, deadline);
  }
  bool AwaitEnded(size_t i, absl::Time deadline) {
    return Await([&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return calls_.size() > i && calls_[i].ended; }, deadline);
  }
  std::vector<Call> calls() {
    absl::MutexLock l(&mu_);
    return calls_;
  }

 private:
  // The planner's real work on big_, again and again, until the job is cancelled or kPlanTakes
  // has passed; the check is what PlanCache polls (its cancellation, then a deadline).
  absl::StatusOr<planner::Plan> Long(size_t i, planner::Strategy s) {
    const absl::Time give_up = absl::Now() + kPlanTakes;
    planner::PlanOptions options;
    options.cancel = [&]() -> absl::Status {
      {
        absl::MutexLock l(&mu_);
        ++calls_[i].polls;
      }
      if (std::optional<std::string> why = PlanQueue::CurrentJobCancelled()) return absl::CancelledError(*why);
      if (absl::Now() > give_up) return absl::DeadlineExceededError("the long plan ran its whole time: never cancelled");
      return absl::OkStatus();
    };
    while (true) {
      absl::StatusOr<planner::Plan> plan = planner::MakePlanWithOptions(big_, s, options);
      if (!plan.ok()) return plan.status();
    }
  }
  bool Await(const std::function<bool()>& pred, absl::Time deadline) {
    absl::MutexLock l(&mu_);
    return mu_.AwaitWithDeadline(absl::Condition(&pred), deadline);
  }

  static constexpr const char* kCatchUpSuffix = "/catch-up";
  const planner::Problem big_;
  absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> long_ ABSL_GUARDED_BY(mu_);
};

// A call run on its own thread, so the test can bound how long it takes.
class Background {
 public:
  explicit Background(std::function<absl::Status()> call)
      : thread_([this, call = std::move(call)] {
          result_ = call();
          done_.Notify();
        }) {}
  ~Background() { Join(kPlanTakes + kReal); }
  // Whether the call returned within `timeout`.
  bool Await(absl::Duration timeout) { return done_.WaitForNotificationWithTimeout(timeout); }
  bool done() const { return done_.HasBeenNotified(); }
  // Joins it (every call the tests make ends by a deadline of its own); its result.
  absl::Status Join(absl::Duration timeout) {
    EXPECT_TRUE(done_.WaitForNotificationWithTimeout(timeout)) << "a call outlived its own deadline";
    if (thread_.joinable()) thread_.join();
    return result_;
  }

 private:
  absl::Status result_;
  absl::Notification done_;
  std::thread thread_;
};

class PlanCancelCore : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions o;
    o.lease = absl::Minutes(10);  // no heartbeats here: a loaded machine must not lose the nodes
    o.make_plan = [this](const planner::Problem& p, planner::Strategy s) { return planner_.Plan(p, s); };
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      fake->on_execute = [this, node](const pb::ExecuteVersionRequest& req) {
        if (req.catch_up()) return CatchUpDone(node, req);  // a late rollout's catch-up lands at once
        if (manual_done_.count(node) == 0) return Done(node, req.model_id(), req.version());
        absl::MutexLock l(&executed_mu_);
        executed_.insert({node, req.version()});  // the test reports it done
        return absl::OkStatus();
      };
      if (auto it = commit_hooks_.find(node); it != commit_hooks_.end()) fake->on_commit = it->second;
      fakes_[node] = fake;
      return fake;
    };
    core_ = std::make_unique<CoordinatorCore>(std::move(o));
    core_->Start();
  }
  void TearDown() override { core_->Shutdown(); }

  void Register(const std::string& node) {
    pb::RegisterNodeRequest req;
    req.set_node_id(node);
    req.set_address(absl::StrCat(node, ":1"));
    pb::RegisterNodeResponse resp;
    ASSERT_TRUE(core_->RegisterNode(req, &resp).ok());
  }
  // `model`-`name` joins `model` (sync, one trainer, one rollout expected) on `node` with a layout
  // holding the model's tensor whole.
  void Join(const std::string& node, const std::string& model, const std::string& name, pb::Role role) {
    const std::string worker = absl::StrCat(model, "-", name);
    pb::JoinWorkerRequest j;
    j.set_node_id(node);
    j.set_worker_id(worker);
    j.set_model_id(model);
    j.set_role(role);
    *j.mutable_model() = testing::SmallModelSpec(model);
    j.mutable_model()->set_mode(pb::MODE_SYNC);
    pb::JoinWorkerResponse jr;
    ASSERT_TRUE(core_->JoinWorker(j, &jr).ok());
    pb::SubmitLayoutRequest l = testing::WholeTensorLayout(node, worker);
    l.set_model_id(model);
    pb::SubmitLayoutResponse lr;
    absl::Status s = core_->SubmitLayout(l, &lr);
    ASSERT_TRUE(s.ok()) << s;
  }
  absl::Status Leave(const std::string& node, const std::string& model, const std::string& worker) {
    pb::LeaveWorkerRequest req;
    req.set_node_id(node);
    req.set_model_id(model);
    req.set_worker_id(worker);
    pb::LeaveWorkerResponse resp;
    return core_->LeaveWorker(req, &resp);
  }
  absl::Status Ready(const std::string& node, const std::string& model, const std::string& rollout) {
    pb::ReportReadyRequest r;
    r.set_node_id(node);
    r.set_model_id(model);
    r.set_worker_id(rollout);
    pb::ReportReadyResponse resp;
    return core_->ReportReady(r, &resp);
  }
  absl::Status Publish(const std::string& node, const std::string& model, uint64_t v) {
    pb::CoordPublishRequest p;
    p.set_node_id(node);
    p.set_model_id(model);
    p.set_worker_id(model + "-t0");
    p.set_version(v);
    p.set_timeout_ms(absl::ToInt64Milliseconds(kPlanTakes + kReal));
    pb::PublishResponse resp;
    return core_->Publish(p, &resp);
  }
  absl::Status WaitVersion(const std::string& model, uint64_t v) {
    pb::WaitVersionRequest w;
    w.set_model_id(model);
    w.set_version(v);
    w.set_timeout_ms(absl::ToInt64Milliseconds(kPlanTakes + kReal));
    pb::WaitVersionResponse wr;
    return core_->WaitVersion(w, &wr);
  }
  absl::Status Done(const std::string& node, const std::string& model, uint64_t v) {
    pb::ReportDoneRequest done;
    done.set_node_id(node);
    done.set_model_id(model);
    done.set_version(v);
    done.set_ok(true);
    pb::ReportDoneResponse resp;
    return core_->ReportDone(done, &resp);
  }
  // The ops of the model's current plan (one per rollout here).
  int64_t PlanOps(const std::string& model) {
    pb::PlanRequest req;
    req.set_model_id(model);
    pb::PlanResponse resp;
    const absl::Status s = core_->Plan(req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    return resp.stats().num_ops();
  }
  absl::Status CatchUpDone(const std::string& node, const pb::ExecuteVersionRequest& req) {
    pb::ReportDoneRequest done;
    done.set_node_id(node);
    done.set_model_id(req.model_id());
    done.set_version(req.version());
    done.set_catch_up(true);
    done.set_plan_epoch(req.plan_epoch());
    done.set_ok(true);
    pb::ReportDoneResponse resp;
    return core_->ReportDone(done, &resp);
  }
  // Waits until `node` (in manual_done_) was told to execute version `v` (not a catch-up).
  bool AwaitExecuted(const std::string& node, uint64_t v, absl::Time deadline) {
    absl::MutexLock l(&executed_mu_);
    auto told = [&]() ABSL_SHARED_LOCKS_REQUIRED(executed_mu_) { return executed_.count({node, v}) > 0; };
    return executed_mu_.AwaitWithDeadline(absl::Condition(&told), deadline);
  }
  static absl::Time In(absl::Duration d) { return absl::Now() + d; }

  LongPlanner planner_;
  std::set<std::string> manual_done_;  // nodes whose ReportDone the test sends (set before Register)
  absl::Mutex executed_mu_;
  std::set<std::pair<std::string, uint64_t>> executed_ ABSL_GUARDED_BY(executed_mu_);  // by those nodes: (node, version)
  std::map<std::string, std::function<absl::Status(const std::string&, uint64_t)>> commit_hooks_;  // before Register
  std::map<std::string, std::shared_ptr<FakeNodeClient>> fakes_;
  std::unique_ptr<CoordinatorCore> core_;
};

// Shutdown() while the model's plan is being made (the planner mid-plan, a publish and a
// WaitVersion waiting on the model): the plan is cancelled ("coordinator shutting down"), so
// Shutdown - which joins the driver and planner threads - returns at once, not when the plan would
// have ended; both waiting calls end UNAVAILABLE and return. (Shutdown without the cancel returns
// only when the plan gives up after kPlanTakes.)
TEST_F(PlanCancelCore, ShutdownCancelsThePlanBeingMadeAndFailsTheWaiters) {
  planner_.SetLong("m");
  Register("n0");
  Join("n0", "m", "t0", pb::ROLE_TRAINER);
  Join("n0", "m", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(planner_.AwaitPolled(0, In(kReal))) << "m's plan never reached the planner";
  // The trainer's publish waits for a plan with it, the WaitVersion for version 1.
  Background publish([&] { return Publish("n0", "m", 1); });
  Background wait([&] { return WaitVersion("m", 1); });
  ASSERT_TRUE(core_->AwaitModelHolds("m", 3, In(kReal))) << "the plan job and both calls hold the model";
  ASSERT_FALSE(planner_.calls()[0].ended) << "the plan ended before the shutdown (kPlanTakes too short?)";

  absl::Duration took;
  Background shutdown([&] {
    const absl::Time start = absl::Now();
    core_->Shutdown();
    took = absl::Now() - start;
    return absl::OkStatus();
  });
  EXPECT_TRUE(shutdown.Await(kPrompt)) << "Shutdown still waits for the plan " << kPrompt << " after it began";
  ASSERT_TRUE(shutdown.Join(kPlanTakes + kReal).ok());
  EXPECT_LT(took, kPrompt);

  // The planner thread is gone (Shutdown joined it) and with it the plan: cancelled, not finished.
  const LongPlanner::Call plan = planner_.calls()[0];
  ASSERT_TRUE(plan.ended);
  EXPECT_EQ(plan.status.code(), absl::StatusCode::kCancelled) << plan.status;
  EXPECT_TRUE(absl::StartsWith(plan.status.message(), "coordinator shutting down")) << plan.status;
  for (Background* call : {&publish, &wait}) {
    ASSERT_TRUE(call->Await(kPrompt)) << "a waiting call outlived the shutdown";
    const absl::Status s = call->Join(kReal);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_EQ(s.message(), "coordinator shutting down");
  }
  EXPECT_EQ(planner_.calls().size(), 1u);
}

// Model a's plan is being made (long) and model b's waits behind it; then a's trainer leaves. a
// cannot be planned any more, so the driver queues nothing for it - and used to leave the stale
// plan running, holding the planner thread (and b) up to the plan deadline. The membership change
// cancels it at once, and b is planned right after.
TEST_F(PlanCancelCore, APlanOfAModelThatCanNoLongerBePlannedIsCancelledAtOnce) {
  Register("n0");
  Register("n1");
  planner_.SetLong("a");
  Join("n0", "a", "t0", pb::ROLE_TRAINER);
  Join("n0", "a", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(planner_.AwaitPolled(0, In(kReal))) << "a's plan never reached the planner";
  Join("n1", "b", "t0", pb::ROLE_TRAINER);
  Join("n1", "b", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(core_->AwaitPlansWaiting(1, In(kReal))) << "b's plan waits behind a's";

  ASSERT_TRUE(Leave("n0", "a", "a-t0").ok());
  EXPECT_TRUE(planner_.AwaitEnded(0, In(kPrompt))) << "a's stale plan still runs " << kPrompt << " after its trainer left";
  EXPECT_TRUE(core_->AwaitPlanInstalled("b", In(kPrompt))) << "b waited for a's stale plan";
  const std::vector<LongPlanner::Call> calls = planner_.calls();
  ASSERT_EQ(calls.size(), 2u) << "a (stale, cancelled) and b; a is not planned again without its trainer";
  EXPECT_EQ(calls[0].model, "a");
  EXPECT_EQ(calls[0].status.code(), absl::StatusCode::kCancelled) << calls[0].status;
  EXPECT_TRUE(absl::StartsWith(calls[0].status.message(), "the model's membership changed while its plan was being made"))
      << calls[0].status;
  EXPECT_EQ(calls[1].model, "b");
  EXPECT_TRUE(calls[1].status.ok()) << calls[1].status;
}

// Model c's sync version commits and its node's CommitVersion does not answer yet: the driver
// thread waits in that RPC. Meanwhile model a's plan is being made (long) and a gains a rollout.
// The driver cannot queue a's newer plan before c's commit returns; the membership change itself
// cancels the stale plan and queues the newer one, so a is planned and installed for its newest
// membership while c's commit still runs.
TEST_F(PlanCancelCore, AChangeWhileTheDriverWaitsOnAnotherModelsCommitCancelsAndQueuesAtOnce) {
  absl::Notification commit_started, commit_release;
  commit_hooks_["n2"] = [&](const std::string&, uint64_t) {
    commit_started.Notify();
    EXPECT_TRUE(commit_release.WaitForNotificationWithTimeout(kPlanTakes + kReal));
    return absl::OkStatus();
  };
  Register("n0");
  Register("n1");
  Register("n2");
  Join("n2", "c", "t0", pb::ROLE_TRAINER);
  Join("n2", "c", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(core_->AwaitPlanInstalled("c", In(kReal)));
  planner_.SetLong("a");
  Join("n0", "a", "t0", pb::ROLE_TRAINER);
  Join("n0", "a", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(planner_.AwaitPolled(1, In(kReal))) << "a's plan never reached the planner";
  ASSERT_TRUE(Ready("n2", "c", "c-r0").ok());
  Background publish([&] { return Publish("n2", "c", 1); });
  ASSERT_TRUE(commit_started.WaitForNotificationWithTimeout(kReal)) << "c's version 1 never reached its commit";

  Join("n1", "a", "r1", pb::ROLE_ROLLOUT);  // a changes while the driver waits on c's commit
  EXPECT_TRUE(planner_.AwaitEnded(1, In(kPrompt))) << "a's stale plan still runs " << kPrompt << " after a changed";
  EXPECT_TRUE(core_->AwaitPlanInstalled("a", In(kPrompt))) << "a's newer plan waited for the driver";
  EXPECT_FALSE(publish.done()) << "c's commit is still running";
  commit_release.Notify();
  EXPECT_TRUE(publish.Join(kReal).ok());

  const std::vector<LongPlanner::Call> calls = planner_.calls();
  ASSERT_EQ(calls.size(), 3u) << "c, a's stale plan, a's newer plan";
  EXPECT_EQ(calls[1].model, "a");
  EXPECT_EQ(calls[1].status.code(), absl::StatusCode::kCancelled) << calls[1].status;
  EXPECT_EQ(calls[2].model, "a");
  EXPECT_EQ(calls[2].workers, 3u) << "a's newest membership: t0, r0, r1";
  EXPECT_TRUE(calls[2].status.ok()) << calls[2].status;
}

// A version in flight runs on the plan it started with: no plan runs while it does (none starts
// while the model plans, none is queued while a version transfers), so a membership change during
// version 1 (a rollout joins) plans nothing until 1 ends, and 1 commits on its own plan's nodes;
// then the newest membership is planned once. A change that touches the version in flight (one of
// its rollouts leaves) aborts it at once and its model is re-planned right away.
TEST_F(PlanCancelCore, AVersionInFlightRunsOnItsOwnPlanAndTheNewerPlanFollowsIt) {
  manual_done_ = {"n0", "n1"};
  Register("n0");
  Register("n1");
  Join("n0", "a", "t0", pb::ROLE_TRAINER);
  Join("n0", "a", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(core_->AwaitPlanInstalled("a", In(kReal)));
  ASSERT_TRUE(Ready("n0", "a", "a-r0").ok());
  Background publish1([&] { return Publish("n0", "a", 1); });
  ASSERT_TRUE(AwaitExecuted("n0", 1, In(kReal)));

  Join("n1", "a", "r1", pb::ROLE_ROLLOUT);  // while version 1 transfers
  ASSERT_TRUE(core_->AwaitDriverPassAt(absl::Now(), In(kReal))) << "the driver has seen the change";
  EXPECT_EQ(planner_.calls().size(), 1u) << "a plan was made while version 1 was in flight";
  ASSERT_TRUE(Done("n0", "a", 1).ok());
  EXPECT_TRUE(publish1.Join(kReal).ok());
  EXPECT_EQ(fakes_.at("n0")->calls().committed, std::vector<uint64_t>{1});
  EXPECT_EQ(fakes_.at("n1")->calls().commit, 0) << "version 1 commits on its own plan (n0 only)";
  ASSERT_TRUE(core_->AwaitPlanInstalled("a", In(kReal)));
  std::vector<LongPlanner::Call> plans;  // the model's plans (r1's catch-up to version 1 is planned too)
  for (const LongPlanner::Call& c : planner_.calls()) {
    if (c.first == "a-t0") plans.push_back(c);
  }
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[1].workers, 3u) << "the newest membership (t0, r0, r1), planned once after version 1";
  EXPECT_EQ(PlanOps("a"), 2);

  // Version 2 on the newer plan (after r1's catch-up to version 1); a rollout of it leaves while it
  // transfers.
  ASSERT_TRUE(Ready("n0", "a", "a-r0").ok());
  ASSERT_TRUE(Ready("n1", "a", "a-r1").ok());
  Background publish2([&] { return Publish("n0", "a", 2); });
  ASSERT_TRUE(AwaitExecuted("n1", 2, In(kReal)));
  ASSERT_TRUE(Leave("n1", "a", "a-r1").ok());
  const absl::Status s = publish2.Join(kReal);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("worker a-r1 left"), std::string::npos) << s;
  ASSERT_TRUE(core_->AwaitPlanInstalled("a", In(kReal)));
  // (The plan of t0 and r0 is version 1's, from the plan cache: no planner call.)
  EXPECT_EQ(PlanOps("a"), 1) << "re-planned for t0 and r0 once version 2 was aborted";
}

// A late rollout's catch-up is given up while its plan is being made (the late rollout leaves):
// the catch-up's plan is cancelled at once (before: nothing cancelled it - the model's next plan
// job has another key - so it ran on, holding the planner thread and every other model's plan, up
// to the plan deadline), and the model goes on: version 2 commits on the remaining membership.
TEST_F(PlanCancelCore, AGivenUpCatchUpsPlanIsCancelledAtOnce) {
  Register("n0");
  Register("n1");
  Join("n0", "a", "t0", pb::ROLE_TRAINER);
  Join("n0", "a", "r0", pb::ROLE_ROLLOUT);
  ASSERT_TRUE(core_->AwaitPlanInstalled("a", In(kReal)));
  ASSERT_TRUE(Ready("n0", "a", "a-r0").ok());
  ASSERT_TRUE(Publish("n0", "a", 1).ok());

  planner_.SetLong("a", /*catch_up=*/true);
  Join("n1", "a", "r1", pb::ROLE_ROLLOUT);  // late: caught up to version 1 from r0
  const std::optional<size_t> catch_up = planner_.AwaitLongPolled(In(kReal));
  ASSERT_TRUE(catch_up.has_value()) << "r1's catch-up plan never reached the planner";
  ASSERT_TRUE(Leave("n1", "a", "a-r1").ok());
  EXPECT_TRUE(planner_.AwaitEnded(*catch_up, In(kPrompt))) << "the given-up catch-up's plan still runs " << kPrompt
                                                           << " after its late rollout left";
  const LongPlanner::Call plan = planner_.calls()[*catch_up];
  EXPECT_EQ(plan.status.code(), absl::StatusCode::kCancelled) << plan.status;
  EXPECT_TRUE(absl::StrContains(plan.status.message(), "catch-up of model a version 1 failed: worker a-r1 left")) << plan.status;

  ASSERT_TRUE(core_->AwaitPlanInstalled("a", In(kReal)));
  EXPECT_EQ(PlanOps("a"), 1) << "t0 and r0";
  ASSERT_TRUE(Ready("n0", "a", "a-r0").ok());
  EXPECT_TRUE(Publish("n0", "a", 2).ok());
}

}  // namespace
}  // namespace wb::daemon
