// The auth gate over a real gRPC server (127.0.0.1:0) and a counting fake service: a refused call
// never reaches the handler, a method without a rule is refused, a guarded service served
// without its interceptor answers nothing (fails closed), a rule may rewrite the request, and the
// after-hook sees the handler's status before the reply.
#include "daemon/auth_gate.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr char kNode[] = "/weightbridge.v1.NodeService/";

class FakeNode final : public pb::NodeService::Service {
 public:
  std::atomic<int> calls{0};
  absl::Mutex mu;
  std::string last_drain_node ABSL_GUARDED_BY(mu);  // (a plain string: TSan sees no order through the socket)
  grpc::Status Status(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse* r) override {
    calls++;
    r->set_node_id("fake");
    return grpc::Status::OK;
  }
  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest* req, pb::DrainResponse*) override {
    calls++;
    absl::MutexLock l(&mu);
    last_drain_node = req->node_id();
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "drain refused by the fake");
  }
};

class AuthGateTest : public ::testing::Test {
 protected:
  void Start(bool with_interceptor) {
    gate_ = std::make_unique<AuthGate>([this](const std::string& method, const std::string& what) {
      absl::MutexLock l(&mu_);
      refusals_.push_back(method + " " + what);
    });
    // Status: refused when the caller sends "x-refuse"; Drain: the rule rewrites the request and
    // watches the handler's answer. No rule for the other NodeService methods.
    gate_->Add(std::string(kNode) + "Status", Rule<pb::StatusRequest>([](AuthCall& call, pb::StatusRequest&) {
                 if (call.ctx->client_metadata().count("x-refuse") > 0) return Verdict{absl::PermissionDeniedError("not you"), "test"};
                 return Verdict::Ok();
               }));
    gate_->Add(std::string(kNode) + "Drain", Rule<pb::DrainRequest>([this](AuthCall& call, pb::DrainRequest& req) {
                 req.set_node_id("rewritten");
                 call.after = [this](const grpc::Status& s, const void*) { after_code_ = s.error_code(); };
                 return Verdict::Ok();
               }));
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    if (with_interceptor) {
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
      interceptors.push_back(gate_->Interceptor());
      b.experimental().SetInterceptorCreators(std::move(interceptors));
    }
    b.RegisterService(gate_->Guard<pb::NodeService>(&fake_));
    server_ = b.BuildAndStart();
    ASSERT_TRUE(server_ && port > 0);
    stub_ = pb::NodeService::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  grpc::Status Status(bool refuse) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (refuse) ctx.AddMetadata("x-refuse", "1");
    pb::StatusResponse resp;
    return stub_->Status(&ctx, pb::StatusRequest(), &resp);
  }

  FakeNode fake_;
  std::unique_ptr<AuthGate> gate_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<pb::NodeService::Stub> stub_;
  absl::Mutex mu_;
  std::vector<std::string> refusals_;
  std::atomic<int> after_code_{-1};
};

TEST_F(AuthGateTest, RefusedCallNeverReachesTheHandler) {
  Start(true);
  EXPECT_TRUE(Status(false).ok());
  EXPECT_EQ(fake_.calls, 1);
  grpc::Status s = Status(true);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_EQ(s.error_message(), "not you");
  EXPECT_EQ(fake_.calls, 1) << "a refused call reached the service";
  // Many refused calls in a row: each is answered, none runs, the gate keeps no verdict behind.
  for (int i = 0; i < 50; ++i) ASSERT_EQ(Status(true).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Status(false).ok());
  EXPECT_EQ(fake_.calls, 2);
  absl::MutexLock l(&mu_);
  ASSERT_EQ(refusals_.size(), 51u);
  EXPECT_EQ(refusals_[0], "/weightbridge.v1.NodeService/Status test");
}

TEST_F(AuthGateTest, MethodWithoutRuleIsRefused) {
  Start(true);
  grpc::ClientContext ctx;
  pb::InstallPlanResponse resp;
  grpc::Status s = stub_->InstallPlan(&ctx, pb::InstallPlanRequest(), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("InstallPlan: no access rule"), std::string::npos) << s.error_message();
  EXPECT_EQ(fake_.calls, 0);
}

TEST_F(AuthGateTest, GuardedServiceWithoutItsInterceptorFailsClosed) {
  Start(false);
  grpc::Status s = Status(false);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL) << s.error_message();
  EXPECT_EQ(fake_.calls, 0);
}

TEST_F(AuthGateTest, RuleRewritesTheRequestAndSeesTheHandlersStatus) {
  Start(true);
  grpc::ClientContext ctx;
  pb::DrainRequest req;
  req.set_node_id("original");
  pb::DrainResponse resp;
  grpc::Status s = stub_->Drain(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  {
    absl::MutexLock l(&fake_.mu);
    EXPECT_EQ(fake_.last_drain_node, "rewritten");
  }
  // The after-hook ran before the reply left (the client has it now).
  EXPECT_EQ(after_code_.load(), grpc::StatusCode::FAILED_PRECONDITION);
}

}  // namespace
}  // namespace wb::daemon
