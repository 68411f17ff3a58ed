// Two clients of one process under one worker id (docs/status.md "Next steps" 17; docs/daemon.md
// "Registration"), end to end with real daemons (coordinator + 2 nodes, shm workers): the node's
// worker guard lets both through (the same process), so before RegisterWorkerRequest.client_instance
// the second client's identical request was answered as a replay of the first's - both clients then
// drove one registration, versions landing in the first one's memory. Now the second client is
// refused ALREADY_EXISTS naming the worker, the node and the process while the first holds the id,
// and changes nothing; the first client's own replay (its token) is still answered as before.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/worker_client.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// Apply(v) answered with v or newer (every rollout here is one-step-off).
grpc::Status Receive(Cluster& c, TestWorker& r, uint64_t v) {
  pb::ApplyResponse resp;
  grpc::Status s = c.Apply(r, "m", v, &resp);
  if (s.ok() && resp.applied_version() < v) return grpc::Status(grpc::StatusCode::INTERNAL, "applied an older version");
  return s;
}

// The version the node says r's live weights hold: Apply(0) answers at once with it.
uint64_t NodeApplied(Cluster& c, TestWorker& r) {
  pb::ApplyResponse resp;
  grpc::Status s = c.Apply(r, "m", 0, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.applied_version();
}

// The coordinator's record of worker `id` (as via's node answers Status).
pb::WorkerStatus CoordinatorRecord(Cluster& c, TestWorker& via, const std::string& id) {
  const pb::StatusResponse status = c.Status(via);
  for (const pb::WorkerStatus& ws : status.workers()) {
    if (ws.worker_id() == id) return ws;
  }
  return pb::WorkerStatus();
}

grpc::Status Deregister(TestWorker& w) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  pb::DeregisterRequest req;
  req.set_model_id("m");
  req.set_worker_id(w.id);
  pb::DeregisterResponse resp;
  return w.stub->Deregister(&ctx, req, &resp);
}

class SameProcessClientsTest : public ::testing::Test {
 protected:
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = SmallInventory();
};

// r1 is registered by client "a"; client "b" of the same process sends the very same
// RegisterWorker for r1 (same pid, role, gpu, spec) with its own token: refused ALREADY_EXISTS,
// and r1 stays as it was (applied version 1 on n1, its layout at the coordinator, not caught up).
// Client "a"'s replay (RegisterWorker and RegisterLayout again, its token) is answered OK and
// changes nothing either; version 2 lands in a's memory, none of it in b's. Once "a" deregistered,
// "b" registers r1 and is caught up to version 2.
TEST_F(SameProcessClientsTest, ASecondClientOfTheProcessIsRefusedWhileTheFirstsReplayIsNot) {
  const pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  c_.StartCoordinator();
  c_.StartNode(0);
  c_.StartNode(1);
  ASSERT_FALSE(HasFatalFailure());
  TwoNodeWorkers w = AddTwoNodeWorkers(c_, inv_);
  for (TestWorker* x : {&w.t0, &w.t1, &w.r0, &w.r1}) {
    x->client_instance = absl::StrCat("client-a-", x->id);
    ASSERT_TRUE(c_.Register(*x, spec).ok()) << x->id;
  }
  for (grpc::Status& s : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) ASSERT_TRUE(Receive(c_, *r, 1).ok()) << r->id;
  ASSERT_EQ(NodeApplied(c_, w.r1), 1u);

  TestWorker& b = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, w.r1.layout);  // other memory, zeroed
  b.client_instance = "client-b-r1";
  grpc::Status refused = c_.RegisterWorker(b, spec);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::ALREADY_EXISTS) << refused.error_message();
  for (const std::string& part : {std::string("worker r1 of model m on node n1"), std::string("another client of the same process"),
                                  absl::StrCat("pid ", ::getpid())}) {
    EXPECT_NE(refused.error_message().find(part), std::string::npos) << part << " in: " << refused.error_message();
  }
  EXPECT_EQ(NodeApplied(c_, w.r1), 1u) << "the refused client replaced r1's entry on its node";
  pb::WorkerStatus rec = CoordinatorRecord(c_, w.r1, "r1");
  EXPECT_TRUE(rec.has_layout()) << "the coordinator registered r1 anew";
  EXPECT_FALSE(rec.catching_up());

  // The first client's replay: its own token, the same requests.
  grpc::Status replayed = c_.RegisterWorker(w.r1, spec);
  EXPECT_TRUE(replayed.ok()) << replayed.error_message();
  replayed = c_.RegisterLayout(w.r1, spec);
  EXPECT_TRUE(replayed.ok()) << replayed.error_message();
  EXPECT_EQ(NodeApplied(c_, w.r1), 1u) << "the first client's replay registered r1 anew";
  EXPECT_TRUE(CoordinatorRecord(c_, w.r1, "r1").has_layout());

  for (grpc::Status& s : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) {
    ASSERT_TRUE(Receive(c_, *r, 2).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
  const auto* bytes = static_cast<const uint8_t*>(b.seg.data());
  EXPECT_TRUE(std::all_of(bytes, bytes + b.seg.size(), [](uint8_t x) { return x == 0; })) << "the refused client's memory was written";

  // The id is free once its first client deregistered: the second one takes it and is caught up.
  ASSERT_TRUE(Deregister(w.r1).ok());
  grpc::Status taken = c_.Register(b, spec);
  ASSERT_TRUE(taken.ok()) << taken.error_message();
  grpc::Status s = Receive(c_, b, 2);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(b, 2), 0);
}

// Clients that send no token (built before the field) keep today's behaviour: the same request
// from the same process is a replay, answered OK without registering anew.
TEST_F(SameProcessClientsTest, WithoutTokensTheSameRequestIsStillAReplay) {
  const pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {pb::MODE_ONE_STEP_OFF});
  ASSERT_FALSE(HasFatalFailure());
  for (grpc::Status& s : c_.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) ASSERT_TRUE(Receive(c_, *r, 1).ok()) << r->id;
  TestWorker& b = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, w.r1.layout);
  grpc::Status s = c_.RegisterWorker(b, spec);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(NodeApplied(c_, w.r1), 1u);
  EXPECT_TRUE(CoordinatorRecord(c_, w.r1, "r1").has_layout());
}

// The C++ WorkerClient: two clients of this process registering one worker id on a real node
// daemon - the second is refused ALREADY_EXISTS (its registration is not remembered: it
// deregisters nothing, replays nothing), the first keeps the id, and once the first deregistered
// the second registers.
TEST_F(SameProcessClientsTest, TwoCppWorkerClientsOfOneProcessCannotShareAWorkerId) {
  c_.StartCoordinator();
  c_.StartNode(0);
  ASSERT_FALSE(HasFatalFailure());
  client::ClientOptions o;
  o.call_timeout = absl::Seconds(20);
  auto first = client::WorkerClient::Connect(c_.nodes_[0]->worker_socket(), o);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = client::WorkerClient::Connect(c_.nodes_[0]->worker_socket(), o);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*first)->client_instance().size(), 32u);
  EXPECT_NE((*first)->client_instance(), (*second)->client_instance());
  client::ModelConfig model;
  model.model_id = "cpp";
  model.explicit_inventory.tensors.push_back({"w", {4, 8}, planner::DType::kBF16});
  model.num_trainer_workers = 1;
  model.num_rollout_workers = 1;
  model.mode = client::Mode::kOneStepOff;
  const client::WorkerIdentity who{"trainer/0", planner::Role::kTrainer, -1};
  ASSERT_TRUE((*first)->RegisterWorker(model, who).ok());
  absl::Status refused = (*second)->RegisterWorker(model, who);
  EXPECT_EQ(refused.code(), absl::StatusCode::kAlreadyExists) << refused;
  EXPECT_NE(refused.message().find("worker trainer/0 of model cpp on node n0 is registered by another client of the same process"),
            std::string::npos)
      << refused;
  EXPECT_EQ((*second)->Deregister().code(), absl::StatusCode::kFailedPrecondition) << "the refused registration was remembered";
  ASSERT_TRUE((*first)->Deregister().ok());
  absl::Status taken = (*second)->RegisterWorker(model, who);
  EXPECT_TRUE(taken.ok()) << taken;
}

}  // namespace
}  // namespace wb::daemon
