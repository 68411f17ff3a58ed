// Canary for the ThreadSanitizer set-up (docs/sanitizers.md).
//
// Under --config=tsan our binaries carry a shim that makes Debian's uninstrumented absl::Mutex
// visible to TSan, plus suppressions for libc calls made from inside uninstrumented gRPC /
// protobuf / absl libraries. Either could, if written too broadly, hide real races in our code.
// This test runs child processes of itself that contain deliberate races, each in a place our
// daemon code lives (a gRPC handler thread, a plain std::thread), and asserts TSan still reports
// them; and a control child with the same accesses under an absl::Mutex that must stay clean.
// Outside a TSan build there is nothing to check, so it skips.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/weightbridge.grpc.pb.h"

extern char** environ;

namespace {

// Deliberately unsynchronised in the racy modes. `volatile` keeps the compiler from folding the
// accesses away; it gives no ordering.
volatile long g_counter = 0;
absl::Mutex g_mu;

__attribute__((noinline)) void CanaryHandlerWrite() { g_counter = g_counter + 1; }
__attribute__((noinline)) void CanaryThreadWrite() { g_counter = g_counter + 1; }

void LockedWrite() {
  absl::MutexLock l(&g_mu);
  g_counter = g_counter + 1;
}

class RacyService final : public weightbridge::v1::WorkerService::Service {
 public:
  explicit RacyService(bool locked) : locked_(locked) {}
  grpc::Status Status(grpc::ServerContext*, const weightbridge::v1::StatusRequest*, weightbridge::v1::StatusResponse*) override {
    if (locked_) {
      LockedWrite();
    } else {
      CanaryHandlerWrite();
    }
    return grpc::Status::OK;
  }

 private:
  const bool locked_;
};

// mode "handler": a gRPC handler thread and a plain thread write the same word, unordered.
// mode "threads": two plain threads, unordered.
// mode "locked": the handler and the plain thread both write under g_mu: must be clean.
int RunChild(const std::string& mode) {
  const bool locked = mode == "locked";
  if (mode == "threads") {
    std::thread a(CanaryThreadWrite);
    std::thread b(CanaryThreadWrite);
    a.join();
    b.join();
    return 0;
  }
  RacyService service(locked);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "canary child: server failed to start\n");
    return 3;
  }
  // The plain thread's write is not ordered with the handler's by anything TSan can see (the
  // thread is only joined after the RPC), exactly like a daemon field touched by a background
  // thread and an RPC handler without a lock.
  std::thread t(locked ? LockedWrite : CanaryThreadWrite);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto stub = weightbridge::v1::WorkerService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  weightbridge::v1::StatusRequest req;
  weightbridge::v1::StatusResponse resp;
  grpc::Status st = stub->Status(&ctx, req, &resp);
  t.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!st.ok()) {
    std::fprintf(stderr, "canary child: RPC failed: %s\n", st.error_message().c_str());
    return 4;
  }
  return 0;
}

struct ChildResult {
  int exit_code = -1;
  std::string output;
};

// Runs this binary as `--canary_child=<mode>` with stdout+stderr in a file; waits at most 60 s.
ChildResult Spawn(const std::string& mode) {
  ChildResult r;
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string log = std::string(tmp ? tmp : "/tmp") + "/canary_" + mode + "_" + std::to_string(getpid()) + ".log";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::string exe = "/proc/self/exe", arg = "--canary_child=" + mode;
  char* argv[] = {exe.data(), arg.data(), nullptr};
  pid_t pid = -1;
  int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    r.output = "posix_spawn failed";
    return r;
  }
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  struct pollfd pfd = {pidfd, POLLIN, 0};
  if (pidfd < 0 || poll(&pfd, 1, 60000) != 1) {
    kill(pid, SIGKILL);
    r.output = "child did not exit within 60 s\n";
  }
  if (pidfd >= 0) close(pidfd);
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output += ss.str();
  return r;
}

#if defined(__SANITIZE_THREAD__)
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif

class TsanCanary : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kTsan) GTEST_SKIP() << "not a ThreadSanitizer build: run with --config=tsan";
  }
};

TEST_F(TsanCanary, RaceInGrpcHandlerIsReported) {
  ChildResult r = Spawn("handler");
  EXPECT_EQ(r.exit_code, 66) << r.output;  // TSan's exit code when it reported something
  EXPECT_NE(r.output.find("WARNING: ThreadSanitizer: data race"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CanaryHandlerWrite"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CanaryThreadWrite"), std::string::npos) << r.output;
}

TEST_F(TsanCanary, RaceBetweenPlainThreadsIsReported) {
  ChildResult r = Spawn("threads");
  EXPECT_EQ(r.exit_code, 66) << r.output;
  EXPECT_NE(r.output.find("CanaryThreadWrite"), std::string::npos) << r.output;
}

TEST_F(TsanCanary, SameAccessesUnderAbslMutexAreClean) {
  ChildResult r = Spawn("locked");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("WARNING: ThreadSanitizer"), std::string::npos) << r.output;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string flag = "--canary_child=";
  if (argc == 2 && std::string(argv[1]).rfind(flag, 0) == 0) return RunChild(std::string(argv[1]).substr(flag.size()));
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
