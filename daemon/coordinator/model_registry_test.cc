// ModelRegistry alone: creation and its spec checks, the model cap and idle-model eviction (in
// simulated time), lookup, the reply-size check that leaves nothing behind, workers and their
// layouts.
#include "daemon/coordinator/model_registry.h"

#include <string>

#include "base/clock.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

using testing::SmallModelSpec;
using testing::WholeTensorLayout;

ModelRegistry::Options Opts(int max_models = 4, int64_t max_reply_bytes = int64_t{4} << 20) {
  ModelRegistry::Options o;
  o.max_models = max_models;
  o.max_reply_bytes = max_reply_bytes;
  return o;
}

bool Contains(const absl::Status& s, const std::string& text) { return s.message().find(text) != absl::string_view::npos; }

// Eviction tests: a registry on a FakeClock with a 60 s idle grace.
ModelRegistry::Options SimOpts(FakeClock* clock, int max_models) {
  ModelRegistry::Options o = Opts(max_models);
  o.clock = clock;
  o.idle_grace = absl::Seconds(60);
  return o;
}

TEST(ModelRegistry, CreateThenSameSpecAgainThenADifferentOne) {
  ModelRegistry r(Opts());
  auto created = r.Create(SmallModelSpec("m"));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(*created);
  ASSERT_EQ(r.size(), 1u);
  const ModelRegistry::Model* m = r.Find("m");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->inventory->tensors.size(), 1u);
  EXPECT_GT(m->inventory_bytes, 0u);
  ASSERT_NE(m->machine, nullptr);

  created = r.Create(SmallModelSpec("m"));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_FALSE(*created);

  created = r.Create(SmallModelSpec("m", /*rollouts=*/2));
  EXPECT_TRUE(absl::IsAlreadyExists(created.status())) << created.status();
  EXPECT_TRUE(Contains(created.status(), "model m")) << created.status();
  EXPECT_EQ(r.size(), 1u);
}

TEST(ModelRegistry, RefusesBadSpecsAndStoresNothing) {
  ModelRegistry r(Opts());
  pb::ModelSpec no_workers = SmallModelSpec("a");
  no_workers.set_num_rollout_workers(0);
  EXPECT_TRUE(absl::IsInvalidArgument(r.Create(no_workers).status()));
  pb::ModelSpec no_inventory = SmallModelSpec("b");
  no_inventory.clear_explicit_tensors();
  absl::Status s = r.Create(no_inventory).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(Contains(s, "no inventory")) << s;
  pb::ModelSpec bad_mode = SmallModelSpec("c");
  bad_mode.set_mode(static_cast<pb::Mode>(99));
  EXPECT_TRUE(absl::IsInvalidArgument(r.Create(bad_mode).status()));
  EXPECT_EQ(r.size(), 0u);
}

TEST(ModelRegistry, ModelCapNamesTheLimit) {
  ModelRegistry r(Opts(/*max_models=*/2));
  ASSERT_TRUE(r.Create(SmallModelSpec("a")).ok());
  ASSERT_TRUE(r.Create(SmallModelSpec("b")).ok());
  absl::Status s = r.Create(SmallModelSpec("c")).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "max_models")) << s;
  EXPECT_TRUE(Contains(s, "model c")) << s;
  // An existing model is still found at the cap.
  EXPECT_TRUE(r.Create(SmallModelSpec("a")).ok());
  EXPECT_EQ(r.size(), 2u);
}

// The inventories of all models together are bounded: a model whose inventory would pass the total
// is refused naming the limit and leaves nothing; the same spec of a model held is no new inventory.
TEST(ModelRegistry, InventoryTotalNamesTheLimit) {
  ModelRegistry::Options o = Opts();
  ModelRegistry probe(Opts());
  ASSERT_TRUE(probe.Create(SmallModelSpec("x")).ok());
  const int64_t one = static_cast<int64_t>(probe.Find("x")->inventory_bytes);
  o.max_inventory_bytes_total = 2 * one;  // room for two models of SmallModelSpec's inventory
  ModelRegistry r(o);
  ASSERT_TRUE(r.Create(SmallModelSpec("a")).ok());
  ASSERT_TRUE(r.Create(SmallModelSpec("b")).ok());
  auto third = r.Create(SmallModelSpec("c"));
  EXPECT_TRUE(absl::IsResourceExhausted(third.status())) << third.status();
  EXPECT_TRUE(Contains(third.status(), "model c refused")) << third.status();
  EXPECT_TRUE(Contains(third.status(), "max_inventory_bytes_total")) << third.status();
  EXPECT_EQ(r.size(), 2u);
  EXPECT_EQ(r.Find("c"), nullptr);
  auto again = r.Create(SmallModelSpec("a"));  // the same spec again is no new inventory
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST(ModelRegistry, UnknownModel) {
  ModelRegistry r(Opts());
  absl::Status s = r.Get("nope").status();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_TRUE(Contains(s, "unknown model 'nope'")) << s;
  EXPECT_EQ(r.Find("nope"), nullptr);
}

TEST(ModelRegistry, OversizedReplyRemovesTheModelItCreatedOnly) {
  ModelRegistry r(Opts(4, /*max_reply_bytes=*/64));
  ASSERT_TRUE(r.Create(SmallModelSpec("m")).ok());
  const size_t inventory = r.Find("m")->inventory_bytes;
  ASSERT_LT(inventory, 64u);
  // Not created by this call: refused but kept.
  absl::Status s = r.CheckReplySize("m", 64, /*created=*/false);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "max_reply_bytes")) << s;
  EXPECT_NE(r.Find("m"), nullptr);
  // Created by this call: removed, so the failed attempt leaves nothing.
  s = r.CheckReplySize("m", 64, /*created=*/true);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "not kept")) << s;
  EXPECT_EQ(r.Find("m"), nullptr);
  EXPECT_EQ(r.size(), 0u);
  EXPECT_TRUE(r.CheckReplySize("m", 1 << 20, true).ok());  // unknown: nothing to check
}

pb::JoinWorkerRequest Join(const std::string& worker, pb::Role role, const pb::ModelSpec* spec) {
  pb::JoinWorkerRequest req;
  req.set_node_id("n1");
  req.set_model_id("m");
  req.set_worker_id(worker);
  req.set_role(role);
  if (spec != nullptr) *req.mutable_model() = *spec;
  return req;
}

TEST(ModelRegistry, JoinCreatesOrChecksTheDeclaredSpecNamingFields) {
  ModelRegistry r(Opts());
  pb::ModelSpec spec = SmallModelSpec("");  // the id comes from the request
  bool created = false;
  auto m = r.ForJoin(Join("t0", pb::ROLE_TRAINER, &spec), &created);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(created);
  EXPECT_EQ((*m)->spec.model_id(), "m");

  m = r.ForJoin(Join("r0", pb::ROLE_ROLLOUT, &spec), &created);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(created);
  m = r.ForJoin(Join("r1", pb::ROLE_ROLLOUT, nullptr), &created);  // no spec declared: joins
  ASSERT_TRUE(m.ok()) << m.status();

  pb::ModelSpec other = spec;
  other.set_num_rollout_workers(8);
  other.set_mode(pb::MODE_ASYNC);
  m = r.ForJoin(Join("r2", pb::ROLE_ROLLOUT, &other), &created);
  EXPECT_TRUE(absl::IsAlreadyExists(m.status())) << m.status();
  EXPECT_FALSE(created);
  EXPECT_TRUE(Contains(m.status(), "r2")) << m.status();
  EXPECT_TRUE(Contains(m.status(), "num_rollout_workers 8")) << m.status();
  EXPECT_TRUE(Contains(m.status(), "MODE_ASYNC")) << m.status();

  // No spec and no model: unknown model, nothing created.
  pb::JoinWorkerRequest lost = Join("x", pb::ROLE_ROLLOUT, nullptr);
  lost.set_model_id("other");
  m = r.ForJoin(lost, &created);
  EXPECT_TRUE(absl::IsNotFound(m.status())) << m.status();
  EXPECT_EQ(r.size(), 1u);
}

TEST(ModelRegistry, WorkersGetFreshSerialsAndLayouts) {
  ModelRegistry r(Opts());
  ASSERT_TRUE(r.Create(SmallModelSpec("m")).ok());
  ModelRegistry::Model& m = *r.Find("m");
  ModelRegistry::WorkerRec rec;
  rec.node = "n1";
  rec.role = planner::Role::kRollout;
  const uint64_t first = r.AddWorker(m, "r0", rec).serial;
  const uint64_t again = r.AddWorker(m, "r0", rec).serial;  // registered again: a new serial
  EXPECT_GT(again, first);
  EXPECT_EQ(m.workers.size(), 1u);

  pb::SubmitLayoutResponse resp;
  pb::SubmitLayoutRequest unknown = WholeTensorLayout("n1", "nobody");
  EXPECT_TRUE(absl::IsNotFound(r.SetLayout(m, unknown, &resp).status()));

  auto changed = r.SetLayout(m, WholeTensorLayout("n1", "r0"), &resp);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  EXPECT_TRUE(m.workers.at("r0").has_layout);
  EXPECT_NE(m.workers.at("r0").layout, nullptr);
  EXPECT_EQ(resp.layout().pieces_size(), 1);

  // The same layout again changes nothing.
  changed = r.SetLayout(m, WholeTensorLayout("n1", "r0"), &resp);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_FALSE(*changed);

  // Another layout replaces it before a plan includes the worker, and is refused after.
  pb::SubmitLayoutRequest other = WholeTensorLayout("n1", "r0");
  other.mutable_buffers(0)->set_size_bytes(64);
  changed = r.SetLayout(m, other, &resp);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  m.plan.worker_ids = {"r0"};
  EXPECT_TRUE(m.InPlan("r0"));
  changed = r.SetLayout(m, WholeTensorLayout("n1", "r0"), &resp);
  EXPECT_TRUE(absl::IsFailedPrecondition(changed.status())) << changed.status();
  EXPECT_TRUE(Contains(changed.status(), "r0")) << changed.status();

  // A layout that does not fit the inventory is refused naming the worker.
  ModelRegistry::WorkerRec t;
  t.node = "n1";
  r.AddWorker(m, "t0", t);
  pb::SubmitLayoutRequest bad = WholeTensorLayout("n1", "t0");
  bad.mutable_layout()->mutable_pieces()->mutable_pieces(0)->set_tensor("missing");
  changed = r.SetLayout(m, bad, &resp);
  EXPECT_FALSE(changed.ok());
  EXPECT_FALSE(m.workers.at("t0").has_layout);
}

// The registry keeps a worker's layout once (docs/security.md, the size probe's entry): the
// buffers parsed without the pieces, the pieces encoded (stored_pieces.h) and the planner's form;
// the answer is the whole resolved layout, and the pieces kept give it back byte for byte. A
// layout that differs only in a piece is another layout.
TEST(ModelRegistryTest, ALayoutIsKeptOnceAndItsPiecesDecideWhetherItIsTheSame) {
  ModelRegistry r(ModelRegistry::Options{});
  ASSERT_TRUE(r.Create(SmallModelSpec("m")).ok());
  ModelRegistry::Model& m = *r.Find("m");
  ModelRegistry::WorkerRec rec;
  rec.node = "n1";
  rec.role = planner::Role::kRollout;
  r.AddWorker(m, "r0", rec);
  pb::SubmitLayoutResponse resp;
  auto changed = r.SetLayout(m, WholeTensorLayout("n1", "r0"), &resp);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed);
  const ModelRegistry::WorkerRec& w = m.workers.at("r0");
  ASSERT_NE(w.layout_proto, nullptr);
  ASSERT_NE(w.layout_pieces, nullptr);
  EXPECT_EQ(w.layout_proto->pieces_size(), 0) << "the pieces are kept once, encoded";
  EXPECT_EQ(w.layout_pieces->size(), 1);
  pb::ResolvedLayout kept = *w.layout_proto;
  ASSERT_TRUE(w.layout_pieces->AppendTo(&kept).ok());
  EXPECT_EQ(kept.SerializeAsString(), resp.layout().SerializeAsString());
  EXPECT_EQ(resp.layout().pieces_size(), 1);

  // The same buffers, the piece transposed (strides 1, 4): another layout, which replaces the
  // first before a plan includes the worker and is refused after.
  pb::SubmitLayoutRequest transposed = WholeTensorLayout("n1", "r0");
  transposed.mutable_layout()->mutable_pieces()->mutable_pieces(0)->set_strides(0, 1);
  transposed.mutable_layout()->mutable_pieces()->mutable_pieces(0)->set_strides(1, 4);
  changed = r.SetLayout(m, transposed, &resp);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_TRUE(*changed) << "another layout";
  EXPECT_EQ(m.workers.at("r0").layout->Unpack().pieces[0].strides, (std::vector<int64_t>{1, 4}));
  changed = r.SetLayout(m, transposed, &resp);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_FALSE(*changed) << "the same again";
  m.plan.worker_ids = {"r0"};
  changed = r.SetLayout(m, WholeTensorLayout("n1", "r0"), &resp);
  EXPECT_TRUE(absl::IsFailedPrecondition(changed.status())) << changed.status();
}

// At the cap, a new model evicts the evictable model idle longest (untouched for the 60 s
// grace): creation order does not decide, the last call touching a model does.
TEST(ModelRegistryEviction, NewModelEvictsTheModelIdleLongest) {
  FakeClock clock;
  ModelRegistry r(SimOpts(&clock, 3));
  ASSERT_TRUE(r.Create(SmallModelSpec("a")).ok());  // t = 0
  clock.Advance(absl::Seconds(10));
  ASSERT_TRUE(r.Create(SmallModelSpec("b")).ok());  // t = 10
  clock.Advance(absl::Seconds(10));
  ASSERT_TRUE(r.Create(SmallModelSpec("c")).ok());  // t = 20
  clock.Advance(absl::Seconds(10));
  ASSERT_TRUE(r.Get("a").ok());  // a call touches a: t = 30
  // t = 75: b (idle 65 s) is past the grace, c (55 s) and a (45 s) are not.
  clock.Advance(absl::Seconds(45));
  auto created = r.Create(SmallModelSpec("d"));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(*created);
  EXPECT_EQ(r.size(), 3u);
  EXPECT_EQ(r.Find("b"), nullptr);
  EXPECT_NE(r.Find("a"), nullptr);
  EXPECT_NE(r.Find("c"), nullptr);
  // t = 95: c (75 s) and a (65 s) are both past it: c, idle longer, goes first.
  clock.Advance(absl::Seconds(20));
  ASSERT_TRUE(r.Create(SmallModelSpec("e")).ok());
  EXPECT_EQ(r.Find("c"), nullptr);
  EXPECT_NE(r.Find("a"), nullptr);
  // An evicted id is created afresh later (another spec than before is fine: nothing is left).
  ASSERT_TRUE(r.Create(SmallModelSpec("b", /*rollouts=*/2)).ok());
  ASSERT_NE(r.Find("b"), nullptr);
  EXPECT_EQ(r.Find("b")->spec.num_rollout_workers(), 2u);
  EXPECT_EQ(r.Find("a"), nullptr);  // idle 65 s at t = 95: made room for b
}

// Never evicted: a model with a worker, one that had a version, one held by a waiting call or
// the planner, one touched within the grace. The refusal counts each; once the hold ends (and
// the grace passes again) that model makes room.
TEST(ModelRegistryEviction, KeptModelsAreCountedInTheRefusal) {
  FakeClock clock;
  ModelRegistry r(SimOpts(&clock, 4));
  for (const char* id : {"worker", "version", "held"}) ASSERT_TRUE(r.Create(SmallModelSpec(id)).ok());
  ModelRegistry::WorkerRec rec;
  rec.node = "n1";
  r.AddWorker(*r.Find("worker"), "t0", rec);
  r.Find("version")->machine->RestoreCommitted(1);  // as a re-joining node reports it
  r.Hold(*r.Find("held"));
  clock.Advance(absl::Hours(1));
  ASSERT_TRUE(r.Create(SmallModelSpec("fresh")).ok());
  clock.Advance(absl::Seconds(59));
  absl::Status s = r.Create(SmallModelSpec("new")).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  for (const char* text : {"model new refused: 4 models exist, the limit (max_models) is 4", "1 held by workers",
                           "1 have had a version", "1 in use", "1 used within the idle grace period (1m)"}) {
    EXPECT_TRUE(Contains(s, text)) << text << " not in: " << s;
  }
  EXPECT_EQ(r.size(), 4u);
  // The hold ends: the model counts as used then, so it waits out the grace first.
  r.Release(*r.Find("held"));
  EXPECT_TRUE(absl::IsResourceExhausted(r.Create(SmallModelSpec("new")).status()));
  clock.Advance(absl::Seconds(60));  // now "fresh" (119 s) and "held" (60 s) are idle: fresh goes
  ASSERT_TRUE(r.Create(SmallModelSpec("new")).ok());
  EXPECT_EQ(r.Find("fresh"), nullptr);
  for (const char* id : {"worker", "version", "held", "new"}) EXPECT_NE(r.Find(id), nullptr) << id;
}

// A version published (not only committed) keeps the model too: its number bounds later ones.
TEST(ModelRegistryEviction, APublishedVersionKeepsTheModel) {
  FakeClock clock;
  ModelRegistry r(SimOpts(&clock, 1));
  ASSERT_TRUE(r.Create(SmallModelSpec("m")).ok());
  ModelRegistry::Model& m = *r.Find("m");
  m.machine->SetTrainers({"t0"});
  ASSERT_TRUE(m.machine->RecordPublish("t0", 1).ok());
  clock.Advance(absl::Hours(1));
  EXPECT_EQ(r.WhyKept(m, clock.Now()), ModelRegistry::Kept::kVersions);
  absl::Status s = r.Create(SmallModelSpec("x")).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Contains(s, "1 have had a version")) << s;
}

// A spec that fails to build evicts nothing: the idle model stays.
TEST(ModelRegistryEviction, AFailedCreationEvictsNothing) {
  FakeClock clock;
  ModelRegistry r(SimOpts(&clock, 1));
  ASSERT_TRUE(r.Create(SmallModelSpec("idle")).ok());
  clock.Advance(absl::Hours(1));
  pb::ModelSpec no_inventory = SmallModelSpec("bad");
  no_inventory.clear_explicit_tensors();
  EXPECT_TRUE(absl::IsInvalidArgument(r.Create(no_inventory).status()));
  EXPECT_NE(r.Find("idle"), nullptr);
  // The same spec again touches the model (a CreateModel is a use of it).
  ASSERT_TRUE(r.Create(SmallModelSpec("idle")).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(r.Create(SmallModelSpec("other")).status()));
}

}  // namespace
}  // namespace wb::daemon
