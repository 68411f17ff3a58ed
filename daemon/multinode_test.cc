// Coordinator + two node daemons as objects in one process on 127.0.0.1:0, workers as gRPC clients
// on the nodes' Unix sockets with shared-memory weights, bytes moved by the real transports
// (host_shm same-node, host_tcp cross-node) on plans from planner::MakePlan: every rollout byte
// must equal the canonical weights of the applied version, in every mode and strategy.
// Shared setup: daemon/multinode_fixture.h.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "daemon/metrics.h"
#include "daemon/metrics_scrape.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/model_config.h"
#include "planner/presets.h"
#include "transport/factory.h"

namespace wb::daemon {
namespace {

class MultiNodeTest : public ::testing::TestWithParam<std::tuple<pb::Mode, pb::Strategy>> {
 protected:
  void SetUp() override {
    c_.StartCoordinator();
    c_.StartNode(0);
    c_.StartNode(1);
  }
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = SmallInventory();
};

TEST_P(MultiNodeTest, BytesArriveByteExact) {
  const auto [mode, strategy] = GetParam();
  pb::ModelSpec spec = SmallSpec(mode, strategy);
  // Trainers split `a` by rows across nodes; rollouts split it by columns (one transposed).
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& t1 = c_.AddWorker("t1", pb::ROLE_TRAINER, 1, &inv_, LayoutOf(inv_, {{0, {4, 0}, {8, 16}, false}}));
  TestWorker& r0 = c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {8, 8}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r1 = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, LayoutOf(inv_, {{0, {0, 8}, {8, 16}, true}, {1, {0, 0}, {4, 6}, true}}));
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c_.Register(*w, spec).ok()) << w->id;

  // A malformed layout is rejected naming tensor and box, and changes nothing.
  {
    TestWorker& bad = c_.AddWorker("bad", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {9, 16}, false}}));
    grpc::Status s = c_.Register(bad, spec);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("[0:9, 0:16]"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("a"), std::string::npos) << s.error_message();
  }

  for (uint64_t v : {1u, 2u}) {
    for (auto& s : c_.Publish("m", mode, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : {&r0, &r1}) {
      pb::ApplyResponse resp;
      grpc::Status s = c_.Apply(*r, "m", v, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.applied_version(), v);
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
  }
  ASSERT_TRUE(WaitCommitted(t0, "m", 2).ok());
  pb::StatusResponse status = c_.Status(r0);
  ASSERT_EQ(status.models_size(), 1);
  EXPECT_EQ(status.models(0).committed_version(), 2u);
  EXPECT_EQ(status.models(0).strategy(), strategy);
  EXPECT_GT(status.models(0).last_transfer_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(ModesAndStrategies, MultiNodeTest,
                         ::testing::Combine(::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                                            ::testing::Values(pb::STRATEGY_WEIGHTBRIDGE, pb::STRATEGY_RANK0_BROADCAST,
                                                              pb::STRATEGY_P2P_NO_DEDUP)));

// Rolling upgrade: n1 acts as a node built before connection rounds (it neither asks for nor grants
// them in ExchangeRegions, and connects in the empty round, whose host_tcp hello is the one before
// rounds). n0 has rounds: the two agree on the empty round for their channel and every version
// still lands byte exact, in every mode (before the negotiation the new node connected in its own
// round and the old one in none: no version crossed nodes until both were upgraded).
class RollingUpgradeTest : public ::testing::TestWithParam<pb::Mode> {};

TEST_P(RollingUpgradeTest, ANodeWithoutConnectionRoundsStillExchangesVersions) {
  const pb::Mode mode = GetParam();
  const planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1, nullptr, nullptr,
              [](ServerOptions& o) { o.configure_node = [](NodeDaemon::Options& no) { no.test_connect_rounds = false; }; });
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = AddTwoNodeWorkers(c, inv);
  for (TestWorker* x : {&w.t0, &w.t1, &w.r0, &w.r1}) ASSERT_TRUE(c.Register(*x, spec).ok()) << x->id;
  for (uint64_t v : {1u, 2u, 3u}) {
    for (auto& s : c.Publish("m", mode, v, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << "v" << v << ": " << s.error_message();
    for (TestWorker* r : {&w.r0, &w.r1}) {
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "m", v, &resp);
      ASSERT_TRUE(s.ok()) << r->id << " v" << v << ": " << s.error_message();
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
  }
  c.Stop();
}

INSTANTIATE_TEST_SUITE_P(Modes, RollingUpgradeTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC));

// ------------------------------------------------------------------ presets on a tiny Qwen2
constexpr char kTinyQwen2[] = R"({"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":64,
  "intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":2,
  "vocab_size":256,"tie_word_embeddings":false})";

class PresetTest : public ::testing::TestWithParam<pb::Strategy> {};

// Adds worker t<rank> (trainer) or r<rank> (rollout) on `node` with preset `preset` (tp / replicas) and registers it.
void AddPresetWorker(Cluster& c, const planner::ModelConfig& config, const planner::Inventory& inv, const pb::ModelSpec& spec,
                     pb::Role role, int node, const std::string& preset, int tp, int replicas, int rank, std::vector<TestWorker*>* out) {
  planner::ParallelConfig pc;  // 0: the preset's default, unset in the request too
  pc.preset = preset;
  if (tp > 0) pc.tp = tp;
  if (replicas > 0) pc.replicas = replicas;
  auto layout = planner::MakePresetLayout(config, inv, pc, rank);
  ASSERT_TRUE(layout.ok()) << layout.status();
  TestWorker& w = c.AddWorker(absl::StrCat(role == pb::ROLE_TRAINER ? "t" : "r", rank), role, node, &inv, layout->layout);
  pb::ParallelConfig ppc;
  ppc.set_preset(preset);
  if (tp > 0) ppc.set_tp(tp);
  if (replicas > 0) ppc.set_replicas(replicas);
  ppc.set_rank(rank);
  ASSERT_TRUE(c.Register(w, spec, &ppc).ok()) << w.id;
  out->push_back(&w);
}

// Megatron TP=2 trainers (one per node) -> vLLM TP=1 x 4 replicas (two per node), one-step-off.
TEST_P(PresetTest, MegatronToVllmByteExact) {
  const pb::Strategy strategy = GetParam();
  auto config = planner::ParseHfConfig(kTinyQwen2);
  ASSERT_TRUE(config.ok()) << config.status();
  auto inv = planner::BuildInventory(*config, planner::DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec;
  spec.set_model_id("qwen");
  spec.set_hf_config_json(kTinyQwen2);
  spec.set_dtype(pb::DTYPE_BF16);
  spec.set_num_trainer_workers(2);
  spec.set_num_rollout_workers(4);
  spec.set_mode(pb::MODE_ONE_STEP_OFF);
  spec.set_strategy(strategy);
  std::vector<TestWorker*> trainers, rollouts;
  for (int rank = 0; rank < 2; ++rank) {
    AddPresetWorker(c, *config, *inv, spec, pb::ROLE_TRAINER, rank, "megatron", 2, 0, rank, &trainers);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
  }
  for (int rank = 0; rank < 4; ++rank) {
    AddPresetWorker(c, *config, *inv, spec, pb::ROLE_ROLLOUT, rank / 2, "vllm", 0, 4, rank, &rollouts);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
  }
  for (uint64_t v : {1u, 2u}) {
    for (auto& s : c.Publish("qwen", pb::MODE_ONE_STEP_OFF, v, trainers, rollouts)) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : rollouts) {
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "qwen", v, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.applied_version(), v);
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
  }
  pb::StatusResponse status = c.Status(*rollouts[0]);
  ASSERT_EQ(status.models_size(), 1);
  const pb::PlanStats& ps = status.models(0).plan_stats();
  EXPECT_TRUE(ps.complete());
  // Every rollout needs the whole model: without dedup node n1 receives it twice over the network.
  int64_t model_bytes = 0;
  for (const planner::TensorSpec& t : inv->tensors) model_bytes += planner::BoxVolume(planner::FullBox(t.shape)) * 2;
  if (strategy == pb::STRATEGY_WEIGHTBRIDGE) {
    EXPECT_LE(ps.bytes_inter_node(), model_bytes);
  }
  if (strategy == pb::STRATEGY_P2P_NO_DEDUP) {
    EXPECT_GT(ps.bytes_inter_node(), model_bytes);
  }
  c.Stop();
}

INSTANTIATE_TEST_SUITE_P(Strategies, PresetTest,
                         ::testing::Values(pb::STRATEGY_WEIGHTBRIDGE, pb::STRATEGY_RANK0_BROADCAST, pb::STRATEGY_P2P_NO_DEDUP));

// Sync mode, Megatron TP=2 trainers on n0 -> vLLM TP=1 x 2 replicas on n1: n1 receives the model
// once and relays it to its second replica. Those relays are left to the commit, which copies them
// from the first replica's staging straight into the second's live buffers; every byte must still
// be exact, and from the second version on the staging comes from the pool.
TEST(SyncRelayTest, RelaysLeftToTheCommitAreByteExactAndStagingIsReused) {
  auto config = planner::ParseHfConfig(kTinyQwen2);
  ASSERT_TRUE(config.ok()) << config.status();
  auto inv = planner::BuildInventory(*config, planner::DType::kBF16);
  ASSERT_TRUE(inv.ok()) << inv.status();
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  auto scrape = [&] {
    auto m = ScrapeMetrics((*endpoint)->port(), absl::Seconds(10));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : std::map<std::string, double>{};
  };
  const auto before = scrape();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec;
  spec.set_model_id("qwen-sync");
  spec.set_hf_config_json(kTinyQwen2);
  spec.set_dtype(pb::DTYPE_BF16);
  spec.set_num_trainer_workers(2);
  spec.set_num_rollout_workers(2);
  spec.set_mode(pb::MODE_SYNC);
  spec.set_strategy(pb::STRATEGY_WEIGHTBRIDGE);
  std::vector<TestWorker*> trainers, rollouts;
  for (int rank = 0; rank < 2; ++rank) {
    AddPresetWorker(c, *config, *inv, spec, pb::ROLE_TRAINER, 0, "megatron", 2, 0, rank, &trainers);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
  }
  for (int rank = 0; rank < 2; ++rank) {
    AddPresetWorker(c, *config, *inv, spec, pb::ROLE_ROLLOUT, 1, "vllm", 0, 2, rank, &rollouts);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
  }
  for (uint64_t v : {1u, 2u, 3u}) {
    for (auto& s : c.Publish("qwen-sync", pb::MODE_SYNC, v, trainers, rollouts)) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : rollouts) {
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;  // live at commit, before any Apply
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "qwen-sync", v, &resp);  // sync: nothing left to copy
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.applied_version(), v);
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v << " after Apply";
    }
  }
  c.Stop();
  const auto after = scrape();
  auto grew = [&](const std::string& name, const std::string& labels) {
    return MetricSum(after, name, labels) - MetricSum(before, name, labels);
  };
  // The model is ~0.1 MB; three versions relay (most of) it to the second replica.
  EXPECT_GT(grew("wb_relay_at_commit_bytes_total", "node=\"n1\""), 0);
  EXPECT_GT(grew("wb_staging_bytes_total", "result=\"reused\""), 0);
}

}  // namespace
}  // namespace wb::daemon

namespace wb::daemon {
namespace {

// A stranger dialing a node's host_tcp data port, claiming an instance the node never made an
// endpoint for, is refused before the handshake; the node's control tick carries the transport's
// count into wb_transport_guard_events_total without any version running (daemon/guard_meter.h).
TEST(GuardMetricsTest, AStrangerOnTheDataPortShowsInTheNodesMetrics) {
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", Metrics().registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const std::string series = "wb_transport_guard_events_total{node=\"n0\",transport=\"host_tcp\",what=\"hellos_unknown_instance\"}";
  auto value = [&] {
    auto m = ScrapeMetrics((*endpoint)->port(), absl::Seconds(10));
    return m.ok() ? std::max(0.0, MetricValue(*m, series)) : -1.0;
  };
  const double before = value();
  ASSERT_GE(before, 0);
  // Only the smaller instance dials: a stranger whose id sorts before n0's. Instance ids are random
  // (before, the stranger was looked for among 64 new ids below n0's, which failed when n0's was
  // among the smallest: about 1 run in 65): the stranger is the smallest of 64, and n0's transports
  // are made again until its host_tcp id sorts after it (1 try in 65 needs a second).
  std::unique_ptr<transport::Transport> stranger;
  for (int i = 0; i < 64; ++i) {
    transport::TransportConfig tc;
    auto t = transport::CreateTransport("host_tcp", tc);
    ASSERT_TRUE(t.ok()) << t.status();
    if (stranger == nullptr || (*t)->instance_id() < stranger->instance_id()) stranger = std::move(*t);
  }
  Cluster c;
  c.StartCoordinator();
  transport::Transport* node_tcp = nullptr;  // owned by n0's transport set
  c.StartNode(0, nullptr, nullptr, [&node_tcp, &stranger](ServerOptions& o) {
    o.make_transports = [&node_tcp, &stranger]() -> absl::StatusOr<transport::TransportSet> {
      for (int i = 0; i < 100; ++i) {
        auto set = HostTransports();
        if (!set.ok()) return set;
        transport::Transport* tcp = set->Find("host_tcp");
        if (tcp != nullptr && stranger->instance_id() < tcp->instance_id()) {
          node_tcp = tcp;
          return set;
        }
      }
      return absl::InternalError("100 host_tcp instance ids in a row sorted before the stranger's");
    };
  });
  ASSERT_NE(node_tcp, nullptr);
  // n0's endpoint made for another peer: the stranger learns the port, not a secret for itself.
  auto for_other = node_tcp->ExportEndpoint("!someone-else");
  ASSERT_TRUE(for_other.ok()) << for_other.status();
  auto dialed = stranger->Connect(*for_other, absl::Now() + absl::Seconds(2));
  EXPECT_FALSE(dialed.ok()) << "a stranger without n0's secret for it got a channel";
  // The count reaches the metric on n0's next control ticks (every heartbeat period, 500 ms).
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (value() <= before && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));  // a scrape interval
  EXPECT_GT(value(), before) << series;
  c.Stop();
}

}  // namespace
}  // namespace wb::daemon
