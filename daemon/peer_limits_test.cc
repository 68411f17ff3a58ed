// Resource bounds between daemons (issue 15.10 transport part, 15.15): message sizes where
// inventories travel (node -> coordinator), a bound on blocked calls instead of one thread each
// without limit, and a message on every refusal (garbage requests included). Real servers on
// 127.0.0.1:0 and a real worker socket.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/limits.h"
#include "daemon/server.h"
#include "gtest/gtest.h"
#include "proto/weightbridge.grpc.pb.h"
#include "transport/factory.h"

namespace wb::daemon {
namespace {

pb::ModelSpec ManyTensors(const std::string& id, int n, int name_bytes) {
  pb::ModelSpec spec;
  spec.set_model_id(id);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  auto* t = spec.mutable_explicit_tensors();
  for (int i = 0; i < n; ++i) {
    pb::TensorSpec* ts = t->add_tensors();
    std::string name = absl::StrCat("model.layers.", i, ".");
    name.resize(static_cast<size_t>(name_bytes), 'w');
    ts->set_name(name);
    ts->add_shape(16);
    ts->set_dtype(pb::DTYPE_BF16);
  }
  return spec;
}

// The largest inventory the limits allow (131,072 tensors, 1,024-byte names, 8 dims) fits the
// message size the daemons set between them, twice over (JoinWorkerResponse carries the tensors
// and the spec).
TEST(PeerLimitsTest, WorstCaseInventoryFitsThePeerMessageSize) {
  const Limits limits;
  pb::JoinWorkerResponse resp;
  pb::TensorSpec worst;
  worst.set_name(std::string(static_cast<size_t>(limits.max_name_bytes), 'n'));
  for (int d = 0; d < limits.max_dims; ++d) worst.add_shape(limits.max_tensor_elements);
  worst.set_dtype(pb::DTYPE_F8_E4M3);
  // Sizes add up linearly: measure one tensor in both places, scale by the count.
  resp.add_tensors()->CopyFrom(worst);
  resp.mutable_model()->mutable_explicit_tensors()->add_tensors()->CopyFrom(worst);
  const int64_t per_tensor = static_cast<int64_t>(resp.ByteSizeLong());
  const int64_t worst_bytes = per_tensor * limits.max_tensors_per_model + (1 << 20);
  EXPECT_GE(PeerMessageBytes(limits), worst_bytes);
  EXPECT_LE(PeerMessageBytes(limits), int64_t{INT32_MAX});
}

class PeerLimitsServerTest : public ::testing::Test {
 protected:
  void StartCoordinator(Limits limits) {
    ServerOptions co;
    co.role = DaemonRole::kCoordinator;
    co.security.limits = limits;
    auto c = Server::Start(co);
    ASSERT_TRUE(c.ok()) << c.status();
    coord_ = std::move(*c);
    stub_ = pb::CoordinatorService::NewStub(grpc::CreateChannel(coord_->address(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (node_) node_->Shutdown();
    if (coord_) coord_->Shutdown();
  }
  std::unique_ptr<Server> coord_, node_;
  std::unique_ptr<pb::CoordinatorService::Stub> stub_;
};

// Issue 15.10: an inventory reply over gRPC's default 4 MiB failed on the node -> coordinator hop.
TEST_F(PeerLimitsServerTest, LargeInventoryCrossesTheNodeToCoordinatorHop) {
  StartCoordinator(Limits{});
  ServerOptions no;
  no.role = DaemonRole::kNode;
  no.node_id = "n0";
  no.coordinator = coord_->address();
  no.worker_socket = absl::StrCat("/tmp/wbpl-", ::getpid(), ".sock");
  no.make_transports = [] {
    transport::TransportConfig tc;
    tc.kinds = {"host_shm"};
    return transport::CreateTransports(tc);
  };
  auto n = Server::Start(no);
  ASSERT_TRUE(n.ok()) << n.status();
  node_ = std::move(*n);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto worker = pb::WorkerService::NewStub(
      grpc::CreateCustomChannel("unix:" + node_->worker_socket(), grpc::InsecureChannelCredentials(), args));
  pb::RegisterWorkerRequest req;
  req.set_model_id("big");
  req.set_worker_id("t0");
  req.set_role(pb::ROLE_TRAINER);
  req.set_gpu(-1);
  req.set_pid(getpid());
  *req.mutable_model() = ManyTensors("big", 131072, 48);  // ~14 MB of inventory per copy
  pb::RegisterWorkerResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  grpc::Status s = worker->RegisterWorker(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
}

// Blocked calls are bounded (Limits::max_blocked_calls): over it a WaitVersion is refused at once
// with RESOURCE_EXHAUSTED naming the limit, instead of taking another thread; other calls still
// get through.
TEST_F(PeerLimitsServerTest, BlockedWaitVersionCallsAreBounded) {
  Limits limits;
  limits.max_blocked_calls = 4;
  StartCoordinator(limits);
  {
    pb::CreateModelRequest req;
    *req.mutable_model() = ManyTensors("m", 2, 16);
    pb::CreateModelResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->CreateModel(&ctx, req, &resp).ok());
  }
  constexpr int kCalls = 12;
  std::vector<grpc::Status> got(kCalls);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] {
      pb::WaitVersionRequest req;
      req.set_model_id("m");
      req.set_version(7);
      req.set_timeout_ms(2000);
      pb::WaitVersionResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
      got[i] = stub_->WaitVersion(&ctx, req, &resp);
    });
  }
  for (auto& t : threads) t.join();
  int exhausted = 0, timed_out = 0;
  for (const grpc::Status& s : got) {
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++exhausted;
      EXPECT_NE(s.error_message().find("limit 4"), std::string::npos) << s.error_message();
    }
    timed_out += s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
  }
  EXPECT_EQ(timed_out, 4);
  EXPECT_EQ(exhausted, kCalls - 4);
}

// Issue 15.15: a request that is not a protobuf of the method's type got INTERNAL with no
// message; it must say what is wrong.
TEST_F(PeerLimitsServerTest, GarbageRequestIsRefusedWithAMessage) {
  StartCoordinator(Limits{});
  grpc::GenericStub generic(grpc::CreateChannel(coord_->address(), grpc::InsecureChannelCredentials()));
  const std::string garbage = "\xff\xff\xff\xff\x0f garbage";
  grpc::Slice slice(garbage);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  grpc::Status status;
  auto call = generic.PrepareUnaryCall(&ctx, "/weightbridge.v1.CoordinatorService/ClusterStatus", request, &cq);
  call->StartCall();
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_NE(status.error_code(), grpc::StatusCode::OK);
  EXPECT_FALSE(status.error_message().empty()) << "code " << status.error_code();
  EXPECT_NE(status.error_message().find("ClusterStatus"), std::string::npos) << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace
}  // namespace wb::daemon
