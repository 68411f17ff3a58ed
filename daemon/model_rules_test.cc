// Model and worker rules (issue 16.5) against real daemons, standalone and coordinator + node: a
// worker joining an existing model with a different spec is refused naming the worker, the model
// and every differing field (before: the first spec won silently); layout errors name worker and
// model.
#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr char kTinyQwen2[] = R"({"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":64,
  "intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":2,
  "vocab_size":256,"tie_word_embeddings":false})";

class ModelRulesTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam()) {
      // One standalone daemon: coordinator and node in one process.
      ServerOptions o;
      o.role = DaemonRole::kStandalone;
      o.node_id = "n0";
      o.worker_socket = absl::StrCat("/tmp/wbmr-", ::getpid(), ".sock");
      o.heartbeat = absl::Milliseconds(100);
      o.make_transports = HostTransports;
      auto s = Server::Start(o);
      ASSERT_TRUE(s.ok()) << s.status();
      c_.nodes_.push_back(std::move(*s));
    } else {
      c_.StartCoordinator();
      c_.StartNode(0);
    }
  }
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = SmallInventory();
};

TEST_P(ModelRulesTest, WorkerWithADifferentSpecIsRefusedNamingTheFields) {
  const pb::ModelSpec spec = SmallSpec(pb::MODE_SYNC, pb::STRATEGY_WEIGHTBRIDGE);
  const planner::WorkerLayout whole = LayoutOf(inv_, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}});
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, whole);
  ASSERT_TRUE(c_.Register(t0, spec).ok());

  TestWorker& r3 = c_.AddWorker("rollout/3", pb::ROLE_ROLLOUT, 0, &inv_, whole);
  pb::ModelSpec other = spec;
  other.set_mode(pb::MODE_ONE_STEP_OFF);
  other.set_num_rollout_workers(8);
  other.set_strategy(pb::STRATEGY_P2P_NO_DEDUP);
  grpc::Status s = c_.Register(r3, other);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  for (const char* want : {"model 'm'", "worker 'rollout/3' (rollout)", "mode MODE_ONE_STEP_OFF, the model has MODE_SYNC",
                           "num_rollout_workers 8, the model has 2", "strategy STRATEGY_P2P_NO_DEDUP, the model has STRATEGY_WEIGHTBRIDGE"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  EXPECT_EQ(s.error_message().find("num_trainer_workers"), std::string::npos) << "only differing fields: " << s.error_message();

  // Other tensors, dtype, counts, staleness: each named.
  other = spec;
  other.mutable_explicit_tensors()->mutable_tensors(1)->set_shape(0, 5);
  other.set_dtype(pb::DTYPE_F32);
  other.set_num_trainer_workers(1);
  other.set_max_staleness(3);
  s = c_.Register(r3, other);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  for (const char* want : {"explicit_tensors (2 tensors) that differ from the model's (2 tensors) at tensor 1 'b'", "dtype DTYPE_F32, the model has DTYPE_BF16",
                           "num_trainer_workers 1, the model has 2", "max_staleness 3, the model has 0"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  // A config instead of tensors.
  other = spec;
  other.set_hf_config_json(kTinyQwen2);
  s = c_.Register(r3, other);
  EXPECT_NE(s.error_message().find("inventory hf_config_json, the model has explicit_tensors"), std::string::npos) << s.error_message();

  // The model's own spec (unset enums are their defaults) is accepted, and the model still works.
  other = spec;
  other.set_mode(pb::MODE_UNSPECIFIED);
  other.set_strategy(pb::STRATEGY_UNSPECIFIED);
  other.set_dtype(pb::DTYPE_UNSPECIFIED);
  s = c_.Register(r3, other);
  EXPECT_TRUE(s.ok()) << s.error_message();
  pb::StatusResponse st = c_.Status(t0);
  ASSERT_EQ(st.models_size(), 1);
  EXPECT_EQ(st.models(0).mode(), pb::MODE_SYNC) << "the first spec stays";
}

// Worker t0 of a second model on the same node, from the same process: refused naming both
// models, and the first model's versions still reach its rollout byte for byte (before: the
// second registration replaced the first on the node and broke the first model's publish).
TEST_P(ModelRulesTest, SameWorkerIdOfAnotherModelDoesNotBreakTheFirst) {
  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  const planner::WorkerLayout whole = LayoutOf(inv_, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}});
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, whole);
  TestWorker& r0 = c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, whole);
  for (TestWorker* w : {&t0, &r0}) ASSERT_TRUE(c_.Register(*w, spec).ok()) << w->id;
  pb::ModelSpec second = spec;
  second.set_model_id("m2");
  TestWorker& other = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, whole);
  grpc::Status s = c_.Register(other, second);
  EXPECT_FALSE(s.ok());
  for (const char* want : {"worker t0 of model m2", "model m;", "node n0"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  pb::ApplyResponse resp;
  for (auto& p : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0}, {&r0})) ASSERT_TRUE(p.ok()) << p.error_message();
  ASSERT_TRUE(c_.Apply(r0, "m", 1, &resp).ok());
  EXPECT_EQ(CountBad(r0, 1), 0);
  // Errors about a worker name its model too.
  grpc::Status a = c_.Apply(t0, "m", 1, &resp);
  EXPECT_NE(a.error_message().find("worker t0 of model m is not a rollout worker on node n0"), std::string::npos) << a.error_message();
  grpc::ClientContext ctx;
  pb::PublishRequest pr;
  pr.set_model_id("m");
  pr.set_worker_id("r0");
  pr.set_version(2);
  pr.set_timeout_ms(5000);
  pb::PublishResponse presp;
  grpc::Status p = r0.stub->Publish(&ctx, pr, &presp);
  EXPECT_NE(p.error_message().find("worker r0 of model m is not a trainer"), std::string::npos) << p.error_message();
}

// A preset layout whose buffer is too small: the error names worker and model.
TEST_P(ModelRulesTest, PresetBufferTooSmallNamesWorkerAndModel) {
  pb::ModelSpec spec;
  spec.set_model_id("qwen");
  spec.set_hf_config_json(kTinyQwen2);
  spec.set_dtype(pb::DTYPE_BF16);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  spec.set_mode(pb::MODE_ONE_STEP_OFF);
  planner::WorkerLayout tiny;
  tiny.buffers.push_back({256});
  TestWorker& r9 = c_.AddWorker("r9", pb::ROLE_ROLLOUT, 0, &inv_, tiny);
  pb::ParallelConfig pc;
  pc.set_preset("vllm");
  pc.set_replicas(1);
  pc.set_rank(0);
  grpc::Status s = c_.Register(r9, spec, &pc);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  for (const char* want : {"r9", "qwen", "needs"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
}

INSTANTIATE_TEST_SUITE_P(StandaloneAndCluster, ModelRulesTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Standalone" : "CoordinatorAndNode"; });

}  // namespace
}  // namespace wb::daemon
