// Idle-model eviction through CoordinatorCore, in simulated time (FakeClock): at max_models a new
// model evicts a model no worker holds, that never had a version, that nothing waits on or plans,
// and that no call touched for model_idle_grace (docs/daemon.md "Idle models are evicted"). The
// rules alone are model_registry_test's; here: waiting calls and the planner hold the model,
// a committed version keeps it, and joins / layouts racing evictions never lose a registration.
#include <atomic>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);  // real-time bound on any wait in these tests
constexpr absl::Duration kGrace = absl::Seconds(60);

bool Contains(const absl::Status& s, const std::string& text) { return s.message().find(text) != absl::string_view::npos; }

// A coordinator on a FakeClock with one fake node "n0" whose lease outlasts any test. Nodes report
// a version done as soon as they are told to execute it.
class Sim {
 public:
  explicit Sim(int max_models, absl::Duration grace = kGrace) {
    CoordinatorOptions o;
    o.clock = &clock;
    o.lease = absl::Hours(1000);
    o.max_models = max_models;
    o.model_idle_grace = grace;
    o.make_node_client = [this](const std::string& node, const std::string&) -> std::shared_ptr<NodeClient> {
      auto fake = std::make_shared<FakeNodeClient>(node);
      fake->on_install = [this](const pb::PlanSlice& slice) { return on_install ? on_install(slice) : absl::OkStatus(); };
      fake->on_execute = [this, node](const pb::ExecuteVersionRequest& req) {
        pb::ReportDoneResponse resp;
        return core->ReportDone(testing::DoneReport(node, req), &resp);
      };
      return fake;
    };
    core = std::make_unique<CoordinatorCore>(std::move(o));
    core->Start();
    pb::RegisterNodeRequest req;
    req.set_node_id("n0");
    req.set_address("n0:1");
    pb::RegisterNodeResponse resp;
    EXPECT_TRUE(core->RegisterNode(req, &resp).ok());
  }
  ~Sim() { core->Shutdown(); }

  absl::Status Create(const std::string& id) {
    pb::CreateModelRequest req;
    *req.mutable_model() = testing::SmallModelSpec(id);
    pb::CreateModelResponse resp;
    return core->CreateModel(req, &resp);
  }
  // JoinWorker (with the model's spec unless `with_spec` is false), as node n0 forwards it.
  absl::Status Join(const std::string& model, const std::string& worker, pb::Role role, bool with_spec = true) {
    pb::JoinWorkerRequest req;
    req.set_node_id("n0");
    req.set_model_id(model);
    req.set_worker_id(worker);
    req.set_role(role);
    if (with_spec) *req.mutable_model() = testing::SmallModelSpec(model);
    pb::JoinWorkerResponse resp;
    return core->JoinWorker(req, &resp);
  }
  absl::Status Layout(const std::string& model, const std::string& worker) {
    pb::SubmitLayoutRequest req = testing::WholeTensorLayout("n0", worker);
    req.set_model_id(model);
    pb::SubmitLayoutResponse resp;
    return core->SubmitLayout(req, &resp);
  }
  absl::Status Leave(const std::string& model, const std::string& worker) {
    pb::LeaveWorkerRequest req;
    req.set_node_id("n0");
    req.set_model_id(model);
    req.set_worker_id(worker);
    pb::LeaveWorkerResponse resp;
    return core->LeaveWorker(req, &resp);
  }
  std::set<std::string> Models() {
    pb::StatusResponse st;
    EXPECT_TRUE(core->ClusterStatus(pb::StatusRequest(), &st).ok());
    std::set<std::string> out;
    for (const pb::ModelStatus& m : st.models()) out.insert(m.model_id());
    return out;
  }

  FakeClock clock;
  std::function<absl::Status(const pb::PlanSlice&)> on_install;  // set before anything is planned
  std::unique_ptr<CoordinatorCore> core;
};

using Ids = std::set<std::string>;

// Filled to max_models, past the grace: a new model is admitted and the oldest idle one is gone;
// within the grace the refusal says why each model is kept.
TEST(ModelEvictionTest, NewModelEvictsTheOldestIdleOneAfterTheGrace) {
  Sim sim(3);
  for (const char* id : {"a", "b", "c"}) {
    ASSERT_TRUE(sim.Create(id).ok());
    sim.clock.Advance(absl::Seconds(1));
  }
  absl::Status s = sim.Create("d");
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "3 models exist, the limit (max_models) is 3")) << s;
  EXPECT_TRUE(Contains(s, "0 held by workers, 0 have had a version, 0 in use")) << s;
  EXPECT_TRUE(Contains(s, "3 used within the idle grace period (1m)")) << s;
  EXPECT_EQ(sim.Models(), (Ids{"a", "b", "c"}));
  sim.clock.Advance(kGrace);
  ASSERT_TRUE(sim.Create("d").ok());
  EXPECT_EQ(sim.Models(), (Ids{"b", "c", "d"}));
  // A join naming an evicted id without a spec is told the model is unknown; with one, it
  // creates the model afresh (making room in turn).
  s = sim.Join("a", "r0", pb::ROLE_ROLLOUT, /*with_spec=*/false);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_TRUE(Contains(s, "unknown model 'a'")) << s;
  ASSERT_TRUE(sim.Join("a", "r0", pb::ROLE_ROLLOUT).ok());
  EXPECT_EQ(sim.Models(), (Ids{"a", "c", "d"}));
}

// A WaitVersion on a model without workers or versions holds it for as long as it waits: the
// other idle model is evicted instead, and the waited-on one only after the wait ended and a
// grace passed.
TEST(ModelEvictionTest, AWaitingCallHoldsTheModel) {
  Sim sim(2);
  ASSERT_TRUE(sim.Create("a").ok());
  absl::Status waited;
  const absl::Time deadline = sim.clock.Now() + absl::Minutes(10);
  std::thread waiter([&] {
    pb::WaitVersionRequest req;
    req.set_model_id("a");
    req.set_version(1);
    req.set_timeout_ms(absl::ToInt64Milliseconds(absl::Minutes(10)));
    pb::WaitVersionResponse resp;
    waited = sim.core->WaitVersion(req, &resp);
  });
  ASSERT_TRUE(sim.clock.AwaitWaiter(deadline, absl::Now() + kReal));
  sim.clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(sim.Create("b").ok());
  sim.clock.Advance(kGrace);
  ASSERT_TRUE(sim.Create("c").ok());  // "a" was touched first: without its hold it would go
  EXPECT_EQ(sim.Models(), (Ids{"a", "c"}));
  absl::Status s = sim.Create("d");
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "1 in use (a waiting call or a plan), 1 used within the idle grace period")) << s;
  sim.clock.Advance(deadline - sim.clock.Now());
  waiter.join();
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited)) << waited;
  sim.clock.Advance(kGrace);
  ASSERT_TRUE(sim.Create("d").ok());  // "c" idled longer than "a", whose wait just ended
  EXPECT_EQ(sim.Models(), (Ids{"a", "d"}));
}

// The planner keeps the model across its plan installs (outside the lock): even once every worker
// left and the grace passed, the model is not evicted until the installs ended.
TEST(ModelEvictionTest, ThePlannerHoldsTheModelAcrossItsInstalls) {
  Sim sim(1);
  absl::Notification installing, release;
  sim.on_install = [&](const pb::PlanSlice&) {
    installing.Notify();
    release.WaitForNotificationWithTimeout(kReal);
    return absl::OkStatus();
  };
  ASSERT_TRUE(sim.Join("m", "t0", pb::ROLE_TRAINER).ok());
  ASSERT_TRUE(sim.Layout("m", "t0").ok());
  ASSERT_TRUE(sim.Join("m", "r0", pb::ROLE_ROLLOUT).ok());
  ASSERT_TRUE(sim.Layout("m", "r0").ok());
  ASSERT_TRUE(installing.WaitForNotificationWithTimeout(kReal)) << "the plan was never installed";
  ASSERT_TRUE(sim.Leave("m", "t0").ok());
  ASSERT_TRUE(sim.Leave("m", "r0").ok());
  sim.clock.Advance(kGrace * 2);
  absl::Status s = sim.Create("x");
  release.Notify();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "1 in use")) << s;
  // Shutdown joins the planner thread: its installs ended and it let go of the model.
  sim.core->Shutdown();
  sim.clock.Advance(kGrace);
  ASSERT_TRUE(sim.Create("x").ok());
  EXPECT_EQ(sim.Models(), (Ids{"x"}));
}

// Workers dropped without a call to the model (here: their node restarted; a lost lease alike)
// start its idle grace then, not at the last call long before.
TEST(ModelEvictionTest, DroppedWorkersStartTheGrace) {
  Sim sim(1);
  ASSERT_TRUE(sim.Join("m", "r0", pb::ROLE_ROLLOUT).ok());
  sim.clock.Advance(absl::Hours(2));
  pb::RegisterNodeRequest again;  // n0 registers again: its old process and workers are gone
  again.set_node_id("n0");
  again.set_address("n0:1");
  pb::RegisterNodeResponse resp;
  ASSERT_TRUE(sim.core->RegisterNode(again, &resp).ok());
  absl::Status s = sim.Create("x");
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "0 held by workers, 0 have had a version, 0 in use (a waiting call or a plan), 1 used within")) << s;
  sim.clock.Advance(kGrace);
  ASSERT_TRUE(sim.Create("x").ok());
  EXPECT_EQ(sim.Models(), (Ids{"x"}));
}

// A model that had a committed version is never evicted, not even once its workers left.
TEST(ModelEvictionTest, AModelWithACommittedVersionIsKept) {
  Sim sim(1);
  pb::ModelSpec spec = testing::SmallModelSpec("m");
  for (auto [worker, role] : {std::pair{"t0", pb::ROLE_TRAINER}, std::pair{"r0", pb::ROLE_ROLLOUT}}) {
    ASSERT_TRUE(sim.Join("m", worker, role).ok());
    ASSERT_TRUE(sim.Layout("m", worker).ok());
  }
  ASSERT_TRUE(sim.core->AwaitPlanInstalled("m", absl::Now() + kReal));
  pb::CoordPublishRequest p;
  p.set_model_id("m");
  p.set_worker_id("t0");
  p.set_node_id("n0");
  p.set_version(1);
  p.set_timeout_ms(10000);
  pb::ReportReadyRequest ready;  // sync (the default mode): the rollout pauses for the version
  ready.set_node_id("n0");
  ready.set_model_id("m");
  ready.set_worker_id("r0");
  pb::ReportReadyResponse ready_resp;
  ASSERT_TRUE(sim.core->ReportReady(ready, &ready_resp).ok());
  pb::PublishResponse published;
  absl::Status s = sim.core->Publish(p, &published);  // sync: returns once committed
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(sim.Leave("m", "t0").ok());
  ASSERT_TRUE(sim.Leave("m", "r0").ok());
  sim.clock.Advance(absl::Hours(1));
  s = sim.Create("x");
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "1 have had a version")) << s;
  EXPECT_EQ(sim.Models(), (Ids{"m"}));
}

// The race: joiners (with and without a spec) register workers, submit their layouts and leave
// again on models that an evictor keeps evicting (simulated time jumps past a 1 s grace before
// each of its CreateModels). Every join either lands on a live model - its layout and its leave
// then succeed - or is refused clearly (RESOURCE_EXHAUSTED at the cap with a spec, NOT_FOUND for an
// evicted model without one); at the end exactly the workers that joined and did not leave are
// registered. Run it many times: --runs_per_test=30.
TEST(ModelEvictionTest, JoinsAndLayoutsRacingEvictionsLoseNoRegistration) {
  Sim sim(4, absl::Seconds(1));
  const std::vector<std::string> ids = {"m0", "m1", "m2", "m3", "m4", "m5"};
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(sim.Create(ids[i]).ok());
  constexpr int kJoiners = 3, kRounds = 300;
  std::vector<std::set<std::pair<std::string, std::string>>> kept(kJoiners);  // per joiner: (model, worker)
  std::atomic<int> joined{0}, refused{0}, evictions{0};
  absl::Notification start;  // every thread runs at once
  std::vector<std::thread> threads;
  for (int j = 0; j < kJoiners; ++j) {
    threads.emplace_back([&, j] {
      start.WaitForNotification();
      std::mt19937 rng(static_cast<uint32_t>(j) * 7919u + 1u);
      for (int i = 0; i < kRounds; ++i) {
        const std::string& model = ids[rng() % ids.size()];
        const std::string worker = absl::StrCat("w", j, "_", i);
        const bool with_spec = j != 0;  // joiner 0 names models only (as a worker without a spec)
        const pb::Role role = rng() % 2 ? pb::ROLE_TRAINER : pb::ROLE_ROLLOUT;
        absl::Status s = sim.Join(model, worker, role, with_spec);
        if (!s.ok()) {
          EXPECT_TRUE(with_spec ? absl::IsResourceExhausted(s) : absl::IsNotFound(s)) << s;
          ++refused;
          continue;
        }
        ++joined;
        s = sim.Layout(model, worker);
        EXPECT_TRUE(s.ok()) << "layout of " << worker << " of " << model << " (joined): " << s;
        // Workers stay on m0 and m1 only, now and then: the other models keep being emptied,
        // evicted and created again under the joiners.
        if ((model != "m0" && model != "m1") || rng() % 8 != 0) {
          s = sim.Leave(model, worker);
          EXPECT_TRUE(s.ok()) << "leave of " << worker << " of " << model << " (joined): " << s;
        } else {
          kept[j].insert({model, worker});
        }
      }
    });
  }
  std::thread evictor([&] {
    start.WaitForNotification();
    for (int i = 0; i < kRounds; ++i) {
      sim.clock.Advance(absl::Seconds(2));
      // Time passes every round, a model of its own only every fourth: most evictions are then
      // made by the joiners' creations, of models other joiners are joining and leaving.
      if (i % 4 != 0) continue;
      absl::Status s = sim.Create(absl::StrCat("e", i));
      if (s.ok()) {
        ++evictions;  // the cap was full from the start: every model created evicted one
      } else {
        EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
      }
    }
  });
  start.Notify();
  for (std::thread& t : threads) t.join();
  evictor.join();
  // Whether the evictor's own creations found an idle model during the race depends on the
  // scheduling (joiners touching every model within the grace keep them all; a CI run saw none),
  // so the count is only recorded. After the race, with time past the grace, a creation must
  // evict one of the models no worker holds - and never the workers that stayed.
  const int race_evictions = evictions.load();
  sim.clock.Advance(absl::Seconds(2));
  EXPECT_TRUE(sim.Create("after").ok()) << "no idle model evicted after the race";
  std::set<std::pair<std::string, std::string>> want, have;
  for (const auto& k : kept) want.insert(k.begin(), k.end());
  pb::StatusResponse st;
  ASSERT_TRUE(sim.core->ClusterStatus(pb::StatusRequest(), &st).ok());
  for (const pb::WorkerStatus& w : st.workers()) have.insert({w.model_id(), w.worker_id()});
  EXPECT_EQ(have, want);
  EXPECT_LE(st.models_size(), 4);
  ::testing::Test::RecordProperty("joined", joined.load());
  ::testing::Test::RecordProperty("refused", refused.load());
  ::testing::Test::RecordProperty("evictions", race_evictions);
  EXPECT_GT(joined.load(), 0);
}

}  // namespace
}  // namespace wb::daemon
