// Floods of unauthenticated TCP connections against a real daemon's gRPC port (issue 15, item 6):
// idle connections from other processes and addresses must neither exhaust the daemon's fds nor
// wedge its accept loop; authenticated calls keep working during the flood and after it.
//
// The daemon (a coordinator Server in this process) runs under a lowered RLIMIT_NOFILE (512) so a
// flood of a few thousand connections would exhaust it; the flood comes from a forked child (its
// own fd table, like a remote attacker) with source addresses 127.0.0.2.. (one per "host").
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "daemon/server.h"
#include "tests/common/conn_flooder.h"
#include "gtest/gtest.h"
#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {
namespace {

constexpr int kSources = 20;          // 127.0.0.2 .. 127.0.0.21
constexpr int kPerSource = 100;       // 2,000 idle connections in all
constexpr rlim_t kDaemonFds = 512;    // the daemon's soft limit during the test

// Lowers this process's soft fd limit for the test's lifetime.
class FdLimitScope {
 public:
  explicit FdLimitScope(rlim_t soft) {
    getrlimit(RLIMIT_NOFILE, &old_);
    rlimit low = old_;
    low.rlim_cur = std::min(soft, old_.rlim_max);
    setrlimit(RLIMIT_NOFILE, &low);
  }
  ~FdLimitScope() { setrlimit(RLIMIT_NOFILE, &old_); }

 private:
  rlimit old_{};
};

grpc::Status Status(const std::string& addr, const PeerAuthConfig& auth) {
  auto stub = pb::CoordinatorService::NewStub(MakePeerChannel(addr, auth));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  pb::StatusRequest req;
  pb::StatusResponse resp;
  return stub->ClusterStatus(&ctx, req, &resp);
}

TEST(FloodTest, IdleConnectionFloodNeitherExhaustsFdsNorWedgesTheGrpcPort) {
  FdLimitScope limit(kDaemonFds);
  auto auth = std::make_shared<PeerAuthConfig>();
  auth->token = "flood-token";
  ServerOptions co;
  co.role = DaemonRole::kCoordinator;
  co.security.peer_auth = auth;
  auto server = Server::Start(co);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string addr = (*server)->address();
  ASSERT_TRUE(Status(addr, *auth).ok());

  ConnFlooder flood;  // from a forked child (its own fd table, like a remote attacker)
  flood.Start((*server)->port(), kSources, kPerSource);
  ASSERT_GT(flood.WaitReady(), 0);
  // During the flood: 2,000 idle connections from 20 addresses, 4x the daemon's fd limit.
  for (int i = 0; i < 3; ++i) {
    grpc::Status s = Status(addr, *auth);
    EXPECT_TRUE(s.ok()) << "during the flood, call " << i << ": " << s.error_code() << " " << s.error_message();
  }
  flood.Stop();
  // After it: a fresh channel (new connection) must be accepted.
  grpc::Status s = Status(addr, *auth);
  EXPECT_TRUE(s.ok()) << "after the flood: " << s.error_code() << " " << s.error_message();
  (*server)->Shutdown();
}

// A raw TCP connection from `source` (127.0.0.x) to 127.0.0.1:port that never sends a byte.
int IdleConnection(uint32_t source, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  src.sin_addr.s_addr = htonl(source);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<uint16_t>(port));
  dst.sin_addr.s_addr = htonl(0x7f000001);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)), 0);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)), 0);
  return fd;
}

// Waits until the server closed `fd` (EOF or reset) or `deadline`. Bytes the server sends are
// read and dropped (a plaintext gRPC server speaks first: its HTTP/2 SETTINGS).
bool ClosedBy(int fd, absl::Time deadline) {
  while (true) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return false;
    pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(ms)) == 1) {
      char buf[4096];
      const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
    }
  }
}

class GuardedServerTest : public ::testing::Test {
 protected:
  void Start(ConnLimits limits) {
    auth_ = std::make_shared<PeerAuthConfig>();
    auth_->token = "flood-token";
    ServerOptions co;
    co.role = DaemonRole::kCoordinator;
    co.security.peer_auth = auth_;
    co.security.connections = limits;
    auto server = Server::Start(co);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override {
    for (int fd : fds_) close(fd);
    if (server_) server_->Shutdown();
  }
  std::shared_ptr<PeerAuthConfig> auth_;
  std::unique_ptr<Server> server_;
  std::vector<int> fds_;
};

TEST_F(GuardedServerTest, IdleConnectionIsClosedAfterTheTimeoutButAnAuthenticatedOneStays) {
  ConnLimits limits;
  limits.unauthenticated_timeout = absl::Milliseconds(300);
  Start(limits);
  const absl::Time t0 = absl::Now();
  fds_.push_back(IdleConnection(0x7f000005, server_->port()));
  EXPECT_TRUE(ClosedBy(fds_.back(), t0 + absl::Seconds(5)));
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(250));
  EXPECT_EQ(server_->connection_stats().timed_out, 1);
  // An authenticated call marks its connection: it no longer counts, and is never timed out.
  auto stub = pb::CoordinatorService::NewStub(MakePeerChannel(server_->address(), *auth_));
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    pb::StatusRequest req;
    pb::StatusResponse resp;
    ASSERT_TRUE(stub->ClusterStatus(&ctx, req, &resp).ok());
    const ConnGuardStats st = server_->connection_stats();
    EXPECT_EQ(st.unauthenticated, 0);
    EXPECT_EQ(st.open, 1);
  }
  // A wrong token does not count as authenticated (its own connection: a distinct channel arg
  // keeps gRPC from sharing the subchannel above).
  grpc::ChannelArguments args;
  args.SetInt("wb.test.distinct", 1);
  auto bad = pb::CoordinatorService::NewStub(
      grpc::CreateCustomChannel(server_->address(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer wrong");
  pb::StatusRequest req;
  pb::StatusResponse resp;
  EXPECT_EQ(bad->ClusterStatus(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(server_->connection_stats().unauthenticated, 1);
}

TEST_F(GuardedServerTest, UnauthenticatedConnectionsAreBoundedPerSource) {
  ConnLimits limits;
  limits.max_unauthenticated_per_source = 4;
  Start(limits);
  for (int i = 0; i < 10; ++i) fds_.push_back(IdleConnection(0x7f000009, server_->port()));
  // Refusals are immediate; the 4 admitted ones stay open (timeout 10 s).
  int closed = 0;
  for (int fd : fds_) closed += ClosedBy(fd, absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(closed, 6);
  ConnGuardStats st = server_->connection_stats();
  EXPECT_EQ(st.refused_per_source, 6);
  EXPECT_EQ(st.unauthenticated, 4);
  // Another address is not affected.
  fds_.push_back(IdleConnection(0x7f00000a, server_->port()));
  EXPECT_FALSE(ClosedBy(fds_.back(), absl::Now() + absl::Milliseconds(200)));
  EXPECT_EQ(server_->connection_stats().unauthenticated, 5);
}

}  // namespace
}  // namespace wb::daemon
