// GrpcNodeClient over a real gRPC channel to an in-process NodeService whose ExecuteVersion never
// answers (a frozen node): CancelCalls ends the call at once, CANCELLED, long before its deadline;
// a later call is not affected. (The coordinator cancels a node's calls when its lease runs out:
// driver_lanes_test.)
#include "daemon/coordinator/grpc_node_client.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);

class FrozenNode final : public pb::NodeService::Service {
 public:
  grpc::Status ExecuteVersion(grpc::ServerContext*, const pb::ExecuteVersionRequest*, pb::ExecuteVersionResponse*) override {
    entered.Notify();
    release.WaitForNotificationWithTimeout(kReal);
    return grpc::Status::OK;
  }
  grpc::Status CommitVersion(grpc::ServerContext*, const pb::CommitVersionRequest*, pb::CommitVersionResponse*) override {
    return grpc::Status::OK;
  }
  absl::Notification entered, release;
};

TEST(GrpcNodeClientTest, CancelCallsEndsACallAFrozenNodeHolds) {
  FrozenNode node;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&node);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  GrpcNodeClient client(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));

  absl::Status held;
  absl::Time returned;
  std::thread caller([&] {
    held = client.ExecuteVersion(pb::ExecuteVersionRequest(), kReal);
    returned = absl::Now();
  });
  ASSERT_TRUE(node.entered.WaitForNotificationWithTimeout(kReal)) << "the call never reached the node";
  const absl::Time cancelled = absl::Now();
  client.CancelCalls();
  caller.join();
  node.release.Notify();
  EXPECT_EQ(held.code(), absl::StatusCode::kCancelled) << held;
  EXPECT_LT(returned - cancelled, absl::Seconds(5)) << "the call ran on after CancelCalls";
  absl::Status later = client.CommitVersion("m", 1, absl::Seconds(10));
  EXPECT_TRUE(later.ok()) << later;
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// Every InstallPlan, CommitVersion and AbortVersion of a client is stamped with its coordinator's
// instance (the coordinator makes its clients with it: CoordinatorCore), so a node that re-joined
// a restarted coordinator can refuse the dead one's late calls (node::Versions).
class RecordingNode final : public pb::NodeService::Service {
 public:
  grpc::Status InstallPlan(grpc::ServerContext*, const pb::InstallPlanRequest* req, pb::InstallPlanResponse*) override {
    absl::MutexLock l(&mu);
    install = req->coordinator_instance();
    return grpc::Status::OK;
  }
  grpc::Status CommitVersion(grpc::ServerContext*, const pb::CommitVersionRequest* req, pb::CommitVersionResponse*) override {
    absl::MutexLock l(&mu);
    commit = req->coordinator_instance();
    return grpc::Status::OK;
  }
  grpc::Status AbortVersion(grpc::ServerContext*, const pb::AbortVersionRequest* req, pb::AbortVersionResponse*) override {
    absl::MutexLock l(&mu);
    abort = req->coordinator_instance();
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  std::string install ABSL_GUARDED_BY(mu), commit ABSL_GUARDED_BY(mu), abort ABSL_GUARDED_BY(mu);
};

TEST(GrpcNodeClientTest, InstallCommitAndAbortCarryTheCoordinatorInstance) {
  RecordingNode node;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&node);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  GrpcNodeClient client(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()), "inst-7");
  pb::PlanSlice slice;
  slice.set_model_id("m");
  ASSERT_TRUE(client.InstallPlan(slice, kReal).ok());
  ASSERT_TRUE(client.CommitVersion("m", 1, kReal).ok());
  ASSERT_TRUE(client.AbortVersion("m", 2, 0, "test", kReal).ok());
  {
    absl::MutexLock l(&node.mu);
    EXPECT_EQ(node.install, "inst-7");
    EXPECT_EQ(node.commit, "inst-7");
    EXPECT_EQ(node.abort, "inst-7");
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace wb::daemon
