// A WatchStatus client that never reads (security review): the server's Write blocks on HTTP/2 flow
// control and never returns by itself, so the stream's deadline check after it never ran and the
// stream held its watcher slot and a server thread until the client went away. The core's watchdog
// now cancels the call (ServerContext::TryCancel, through the adapter) once the stream is
// kWatchWriteGrace past its timeout, and the slot comes back. Real gRPC on 127.0.0.1:0.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator.h"
#include "daemon/coordinator/checks.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

TEST(WatchStatusStallTest, AClientThatNeverReadsLosesItsSlotShortlyAfterItsTimeout) {
  Coordinator::Options options;
  options.max_status_watchers = 1;
  Coordinator coord(std::move(options));  // not started: no driver, nothing dials the nodes
  // ~2.4 MiB of status (150 nodes at the registration caps), so a few messages fill any window
  // a client that does not read grants.
  auto request = [](int i) {
    pb::RegisterNodeRequest req;
    req.set_node_id(absl::StrCat("n", i));
    req.set_address("127.0.0.1:1");  // never dialled
    for (int nic = 0; nic < kMaxNodeDataNics; ++nic) req.add_data_nics(std::string(kMaxNodeEntryBytes - 8, 'a' + nic % 26));
    return req;
  };
  for (int i = 0; i < 150; ++i) {
    pb::RegisterNodeRequest req = request(i);
    pb::RegisterNodeResponse resp;
    ASSERT_TRUE(coord.RegisterNode(nullptr, &req, &resp).ok());
  }
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&coord);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  // Status changes all along (each re-registration bumps the status generation).
  std::atomic<bool> stop{false};
  std::thread changes([&] {
    for (int i = 0; !stop.load(); i = (i + 1) % 150) {
      pb::RegisterNodeRequest req = request(i);
      pb::RegisterNodeResponse resp;
      (void)coord.RegisterNode(nullptr, &req, &resp);
      absl::SleepFor(absl::Milliseconds(20));  // pacing the producer, not a wait for a condition
    }
  });

  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto stub = pb::CoordinatorService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  pb::WatchStatusRequest req;
  req.set_timeout_ms(500);
  const absl::Time opened = absl::Now();
  std::unique_ptr<grpc::ClientReader<pb::StatusResponse>> reader = stub->WatchStatus(&ctx, req);  // never Read
  // The server sends its initial metadata with the first message: the handler runs, holding its slot.
  reader->WaitForInitialMetadata();
  EXPECT_FALSE(coord.AwaitStatusWatchersAtMost(0, absl::Now())) << "the stream holds no slot";
  const bool freed = coord.AwaitStatusWatchersAtMost(0, opened + absl::Milliseconds(500) + CoordinatorCore::kWatchWriteGrace + absl::Seconds(5));
  const absl::Duration took = absl::Now() - opened;
  stop = true;
  changes.join();
  ctx.TryCancel();
  (void)reader->Finish();
  EXPECT_TRUE(freed) << "a watcher that never reads still holds its slot " << took << " after opening a 500 ms stream";
  EXPECT_GE(took, absl::Milliseconds(500));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  coord.Shutdown();
}

}  // namespace
}  // namespace wb::daemon
