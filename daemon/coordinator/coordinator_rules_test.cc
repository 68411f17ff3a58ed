// Coordinator input rules and bounds (issue 15 items 10, 12, 15), through the gRPC-facing
// Coordinator (handlers called in process; no node is contacted by these calls).
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

using testing::SmallModelSpec;

class CoordinatorRulesTest : public ::testing::Test {
 protected:
  CoordinatorRulesTest() : coord_(Coordinator::Options{}) {}
  grpc::Status Register(const std::string& node) {
    pb::RegisterNodeRequest req;
    req.set_node_id(node);
    req.set_address("127.0.0.1:1");  // never dialled by these tests
    pb::RegisterNodeResponse resp;
    return coord_.RegisterNode(nullptr, &req, &resp);
  }
  int NumModels() {
    pb::StatusRequest req;
    pb::StatusResponse resp;
    EXPECT_TRUE(coord_.ClusterStatus(nullptr, &req, &resp).ok());
    return resp.models_size();
  }
  Coordinator coord_;
};

TEST_F(CoordinatorRulesTest, RegisterNodeRefusesLongIdsAndControlCharactersNamingTheField) {
  grpc::Status s = Register(std::string(1 << 20, 'n'));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("node_id"), std::string::npos) << s.error_message();
  EXPECT_LT(s.error_message().size(), 400u) << "the value must not be echoed whole";
  s = Register("n0\r\nX-Injected: 1");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("node_id"), std::string::npos) << s.error_message();
  EXPECT_EQ(s.error_message().find('\n'), std::string::npos) << "control characters echoed: " << s.error_message();
  pb::RegisterNodeRequest req;
  req.set_node_id("n0");
  req.set_address(std::string(5000, 'a'));
  pb::RegisterNodeResponse resp;
  s = coord_.RegisterNode(nullptr, &req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("address"), std::string::npos) << s.error_message();
  EXPECT_TRUE(Register("n0").ok());
}

TEST_F(CoordinatorRulesTest, JoinWorkerRefusesUnknownEnumsAndBadIds) {
  ASSERT_TRUE(Register("n0").ok());
  auto join = [&](const std::string& worker, int role, int mode, int strategy) {
    pb::JoinWorkerRequest req;
    req.set_node_id("n0");
    req.set_worker_id(worker);
    req.set_model_id(absl::StrCat("m", mode, "-", strategy));
    req.set_role(static_cast<pb::Role>(role));
    *req.mutable_model() = SmallModelSpec(req.model_id());
    req.mutable_model()->set_mode(static_cast<pb::Mode>(mode));
    req.mutable_model()->set_strategy(static_cast<pb::Strategy>(strategy));
    pb::JoinWorkerResponse resp;
    return coord_.JoinWorker(nullptr, &req, &resp);
  };
  grpc::Status s = join("t0", 99, 1, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("role"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("99"), std::string::npos) << s.error_message();
  s = join("t0", 1, 99, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("mode"), std::string::npos) << s.error_message();
  s = join("t0", 1, 1, 99);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("strategy"), std::string::npos) << s.error_message();
  s = join(std::string(1 << 20, 'w'), 1, 1, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("worker_id"), std::string::npos) << s.error_message();
  EXPECT_LT(s.error_message().size(), 400u);
  s = join("t\r\n0", 1, 1, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("worker_id"), std::string::npos) << s.error_message();
  // None of the refused calls left a model behind.
  EXPECT_EQ(NumModels(), 0);
  EXPECT_TRUE(join("t0", 1, 1, 1).ok());
  EXPECT_EQ(NumModels(), 1);
}

// Issue 15.10: a model whose reply (the inventory) cannot reach the node leaves nothing behind.
TEST_F(CoordinatorRulesTest, ModelWhoseInventoryReplyIsTooLargeLeavesNothingBehind) {
  ASSERT_TRUE(Register("n0").ok());
  for (int attempt = 0; attempt < 12; ++attempt) {
    pb::JoinWorkerRequest req;
    req.set_node_id("n0");
    req.set_worker_id("t0");
    req.set_model_id(absl::StrCat("big", attempt));
    req.set_role(pb::ROLE_TRAINER);
    pb::ModelSpec spec = SmallModelSpec(req.model_id());
    spec.mutable_explicit_tensors()->clear_tensors();
    for (int i = 0; i < 40000; ++i) {  // ~5 MB of names: over the 4 MiB reply limit
      pb::TensorSpec* t = spec.mutable_explicit_tensors()->add_tensors();
      t->set_name(absl::StrCat("model.layers.", i, ".mlp.experts.0.some_rather_long_projection_name_for_this_test.weight"));
      t->add_shape(8);
      t->set_dtype(pb::DTYPE_BF16);
    }
    *req.mutable_model() = std::move(spec);
    pb::JoinWorkerResponse resp;
    grpc::Status s = coord_.JoinWorker(nullptr, &req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("max_reply_bytes"), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(NumModels(), 0) << "failed creations left models behind";
}

TEST_F(CoordinatorRulesTest, ModelCountIsCapped) {
  const int cap = 256;  // Coordinator::Options::max_models default
  for (int i = 0; i < cap; ++i) {
    pb::CreateModelRequest req;
    *req.mutable_model() = SmallModelSpec(absl::StrCat("m", i));
    pb::CreateModelResponse resp;
    ASSERT_TRUE(coord_.CreateModel(nullptr, &req, &resp).ok()) << i;
  }
  pb::CreateModelRequest req;
  *req.mutable_model() = SmallModelSpec("one-too-many");
  pb::CreateModelResponse resp;
  grpc::Status s = coord_.CreateModel(nullptr, &req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("max_models"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find(absl::StrCat(cap)), std::string::npos) << s.error_message();
  // An existing model is still found (idempotent create), not counted again.
  *req.mutable_model() = SmallModelSpec("m0");
  EXPECT_TRUE(coord_.CreateModel(nullptr, &req, &resp).ok());
}

TEST_F(CoordinatorRulesTest, EmptyDrainIsRefusedAndDrainsCanBeUndone) {
  ASSERT_TRUE(Register("n0").ok());
  pb::DrainRequest req;
  pb::DrainResponse resp;
  grpc::Status s = coord_.Drain(nullptr, &req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("all"), std::string::npos) << s.error_message();
  pb::StatusRequest sreq;
  pb::StatusResponse status;
  ASSERT_TRUE(coord_.ClusterStatus(nullptr, &sreq, &status).ok());
  EXPECT_FALSE(status.nodes(0).draining()) << "a refused drain drained anyway";

  req.set_node_id("n0");
  req.set_all(true);
  EXPECT_EQ(coord_.Drain(nullptr, &req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "node_id and all together";

  req.set_all(false);
  req.set_timeout_ms(1000);
  ASSERT_TRUE(coord_.Drain(nullptr, &req, &resp).ok());
  EXPECT_TRUE(resp.drained());
  status.Clear();
  ASSERT_TRUE(coord_.ClusterStatus(nullptr, &sreq, &status).ok());
  EXPECT_TRUE(status.nodes(0).draining());
  req.set_undo(true);
  ASSERT_TRUE(coord_.Drain(nullptr, &req, &resp).ok());
  status.Clear();
  ASSERT_TRUE(coord_.ClusterStatus(nullptr, &sreq, &status).ok());
  EXPECT_FALSE(status.nodes(0).draining()) << "undo did not lift the node's drain";

  // The whole cluster: drained with all = true, new versions refused, undone with all + undo.
  pb::CreateModelRequest creq;
  *creq.mutable_model() = SmallModelSpec("m");
  pb::CreateModelResponse cresp;
  ASSERT_TRUE(coord_.CreateModel(nullptr, &creq, &cresp).ok());
  pb::DrainRequest all;
  all.set_all(true);
  all.set_timeout_ms(1000);
  ASSERT_TRUE(coord_.Drain(nullptr, &all, &resp).ok());
  status.Clear();
  ASSERT_TRUE(coord_.ClusterStatus(nullptr, &sreq, &status).ok());
  EXPECT_TRUE(status.models(0).draining());
  all.set_undo(true);
  ASSERT_TRUE(coord_.Drain(nullptr, &all, &resp).ok());
  status.Clear();
  ASSERT_TRUE(coord_.ClusterStatus(nullptr, &sreq, &status).ok());
  EXPECT_FALSE(status.models(0).draining()) << "undo did not lift the cluster drain";
}

TEST_F(CoordinatorRulesTest, HeartbeatPayloadIsBounded) {
  pb::RegisterNodeRequest rreq;
  rreq.set_node_id("n0");
  rreq.set_address("127.0.0.1:1");
  pb::RegisterNodeResponse rresp;
  ASSERT_TRUE(coord_.RegisterNode(nullptr, &rreq, &rresp).ok());
  pb::CreateModelRequest creq;
  *creq.mutable_model() = SmallModelSpec("m");
  pb::CreateModelResponse cresp;
  ASSERT_TRUE(coord_.CreateModel(nullptr, &creq, &cresp).ok());
  pb::HeartbeatRequest hb;
  hb.set_node_id("n0");
  hb.set_incarnation(rresp.incarnation());
  for (int i = 0; i < 400000; ++i) {
    pb::VersionProgress* p = hb.add_progress();
    p->set_model_id("m");
    p->set_version(static_cast<uint64_t>(i) + 1);
    p->set_bytes_done(1);
  }
  pb::HeartbeatResponse resp;
  grpc::Status s = coord_.Heartbeat(nullptr, &hb, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("progress"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("400000"), std::string::npos) << s.error_message();
  // A normal heartbeat still renews the lease.
  hb.clear_progress();
  EXPECT_TRUE(coord_.Heartbeat(nullptr, &hb, &resp).ok());
}

}  // namespace
}  // namespace wb::daemon
