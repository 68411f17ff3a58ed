// GrpcNodeClient over a real gRPC channel to an in-process NodeService whose ExecuteVersion never
// answers (a frozen node): CancelCalls ends the call at once, CANCELLED, long before its deadline;
// a later call is not affected. (The coordinator cancels a node's calls when its lease runs out:
// driver_lanes_test.)
#include "daemon/coordinator/grpc_node_client.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <thread>

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

}  // namespace
}  // namespace wb::daemon
