// Hostile probe of the worker socket by another local process (the thirty-seventh session's probe
// of the surfaces the thirty-sixth changed: numbered registrations, ReportReadyRequest.resumed,
// the WaitVersion answer that resumes a sync rollout). A coordinator and two node daemons in this
// process (daemon/multinode_fixture.h) hold the model's workers; the intruder is a child process
// (this binary again, WB_PROBE_CHILD set) that registers a worker of its own on the model, which
// lets it onto the model's WaitVersion, and then names the test process's rollouts in its calls.
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"
#include "tests/e2e/harness.h"

namespace wb::daemon {
namespace {

// ------------------------------------------------------------------ the intruder (child process)

// WB_PROBE_CHILD=wait_as WB_SOCK=<worker socket> WB_VICTIM=<worker id or ""> WB_VERSION=<v>:
// registers trainer "intruder-<pid>" of model m (no layout) and calls WaitVersion(m, v) naming
// WB_VICTIM. Prints "code=<grpc code> message=<message>" and exits 0; 100+ on a setup failure.
int ChildMain() {
  const std::string action = std::getenv("WB_PROBE_CHILD");
  const char* sock = std::getenv("WB_SOCK");
  const char* victim = std::getenv("WB_VICTIM");
  uint64_t version = 0;
  if (sock == nullptr || victim == nullptr || !absl::SimpleAtoi(std::getenv("WB_VERSION") ? std::getenv("WB_VERSION") : "", &version)) return 100;
  if (action != "wait_as") return 101;
  auto stub = pb::WorkerService::NewStub(grpc::CreateChannel(absl::StrCat("unix:", sock), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    pb::RegisterWorkerRequest req;
    req.set_model_id("m");
    req.set_worker_id(absl::StrCat("intruder-", ::getpid()));
    req.set_role(pb::ROLE_TRAINER);
    req.set_gpu(-1);
    req.set_pid(::getpid());
    pb::RegisterWorkerResponse resp;
    grpc::Status s = stub->RegisterWorker(&ctx, req, &resp);
    if (!s.ok()) {
      std::printf("register failed: %d %s\n", static_cast<int>(s.error_code()), s.error_message().c_str());
      return 102;
    }
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  pb::WaitVersionRequest req;
  req.set_model_id("m");
  req.set_version(version);
  req.set_timeout_ms(5000);
  req.set_worker_id(victim);
  pb::WaitVersionResponse resp;
  grpc::Status s = stub->WaitVersion(&ctx, req, &resp);
  std::printf("code=%d message=%s\n", static_cast<int>(s.error_code()), s.error_message().c_str());
  std::fflush(stdout);
  return 0;
}

struct ChildAnswer {
  int code = -1;
  std::string message;
};

// Runs the intruder against `socket` and returns what its WaitVersion got.
ChildAnswer IntruderWaitsAs(const std::string& socket, const std::string& victim, uint64_t version) {
  ChildAnswer a;
  auto h = e2e::Harness::Create("wprobe");
  if (!h.ok()) {
    ADD_FAILURE() << h.status();
    return a;
  }
  auto p = (*h)->Spawn("intruder", {"/proc/self/exe"},
                       {"WB_PROBE_CHILD=wait_as", absl::StrCat("WB_SOCK=", socket), absl::StrCat("WB_VICTIM=", victim),
                        absl::StrCat("WB_VERSION=", version)});
  if (!p.ok()) {
    ADD_FAILURE() << p.status();
    return a;
  }
  absl::StatusOr<std::string> line =
      (*p)->WaitForLine([](const std::string& l) { return l.rfind("code=", 0) == 0 || l.rfind("register failed", 0) == 0; }, absl::Seconds(40));
  absl::StatusOr<int> code = (*p)->WaitExit(absl::Seconds(20));
  if (!line.ok() || !code.ok() || *code != 0) {
    ADD_FAILURE() << "intruder: " << (line.ok() ? *line : line.status().ToString()) << "\n" << (*p)->LogTail();
    return a;
  }
  const size_t sp = line->find(" message=");
  if (!absl::SimpleAtoi(line->substr(5, sp - 5), &a.code)) ADD_FAILURE() << *line;
  a.message = sp == std::string::npos ? "" : line->substr(sp + 9);
  return a;
}

class WorkerProbeTest : public ::testing::Test {
 protected:
  void TearDown() override { c_.Stop(); }
  planner::Inventory inv_ = SmallInventory();
  Cluster c_;
};

// WaitVersion carries the calling worker's id (clients set their own): for a rollout, the node
// acts on it - a paused sync rollout waiting for a version committed before its pause is resumed
// (reported to the coordinator, ReportReadyRequest.resumed), and a rollout whose committed copy is
// newer than its live weights gets that copy written into its live weights. The worker socket let
// any process with a worker of the model name another process's rollout there (only the waiting
// slot was counted for the caller). Found by the probe: an intruder's WaitVersion(1) naming r0
// resumed r0 while r0 was paused for version 2 (the coordinator then waited for r0's next
// BeginUpdate, which never came: sync lockstep broken, the trainers' Publish hung), and its
// WaitVersion(3) naming r0 wrote version 3 into r0's live weights while r0's engine ran on version 2
// (it had said EndUpdate). Now naming another process's worker is PERMISSION_DENIED naming both.
TEST_F(WorkerProbeTest, AWaitVersionNamingAnotherProcesssRolloutNeitherResumesNorWritesIt) {
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {.mode = pb::MODE_SYNC});
  ASSERT_FALSE(HasFatalFailure());
  const std::string n0_socket = c_.nodes_[0]->worker_socket();
  for (const grpc::Status& s : c_.Publish("m", pb::MODE_SYNC, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(CountBad(w.r0, 1), 0);

  // (a) r0 and r1 pause for version 2; the intruder's WaitVersion(1) names r0.
  ASSERT_TRUE(BeginUpdateAs(w.r0, 20000).ok());
  ASSERT_TRUE(BeginUpdateAs(w.r1, 20000).ok());
  ChildAnswer a = IntruderWaitsAs(n0_socket, "r0", 1);
  EXPECT_EQ(a.code, static_cast<int>(grpc::StatusCode::PERMISSION_DENIED)) << a.message;
  const std::string me = absl::StrCat("process ", ::getpid());
  for (const std::string& want : {std::string("worker r0"), me}) {
    EXPECT_NE(a.message.find(want), std::string::npos) << want << " missing in: " << a.message;
  }
  ASSERT_TRUE(LocalStatus(c_, w.r0).paused()) << "another process's WaitVersion resumed r0: version 2 now waits for a BeginUpdate r0 already sent";
  // The intruder's own waits still work: the cluster-wide commit, without a worker id.
  a = IntruderWaitsAs(n0_socket, "", 1);
  EXPECT_EQ(a.code, 0) << a.message;
  for (const grpc::Status& s : c_.Publish("m", pb::MODE_SYNC, 2, {&w.t0, &w.t1}, {})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::WaitVersionResponse wv;
  for (TestWorker* r : {&w.r0, &w.r1}) {
    ASSERT_TRUE(WaitVersionAs(*r, "m", 2, 5000, &wv).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }

  // (b) r0 resumes (EndUpdate: its engine reads version 2); version 3 commits as its committed
  // copy. The intruder's WaitVersion(3) names r0.
  ASSERT_TRUE(BeginUpdateAs(w.r0, 20000).ok());
  pb::EndUpdateResponse ended;
  ASSERT_TRUE(EndUpdateAs(w.r0, 20000, &ended).ok());
  ASSERT_TRUE(BeginUpdateAs(w.r1, 20000).ok());
  for (const grpc::Status& s : c_.Publish("m", pb::MODE_SYNC, 3, {&w.t0, &w.t1}, {})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(CountBad(w.r0, 2), 0);
  a = IntruderWaitsAs(n0_socket, "r0", 3);
  EXPECT_EQ(a.code, static_cast<int>(grpc::StatusCode::PERMISSION_DENIED)) << a.message;
  EXPECT_EQ(CountBad(w.r0, 2), 0) << "another process's WaitVersion wrote version 3 into r0's live weights while its engine read them";
  // r0's own next update brings version 3.
  ASSERT_TRUE(BeginUpdateAs(w.r0, 20000).ok());
  ASSERT_TRUE(WaitVersionAs(w.r0, "m", 3, 5000, &wv).ok());
  EXPECT_EQ(CountBad(w.r0, 3), 0);
  EXPECT_EQ(CountBad(w.r1, 3), 0);
}

// A daemon started on a path whose fd channel (<worker socket>.fd) a live process serves: the
// thirty-sixth session refused a live worker socket, and its fd channel refused the path too, but
// the daemon took that refusal as "no fd channel" and ran on silently - its CUDA VMM workers would
// offer their fds to the other process's channel, and nothing said why until a VMM registration
// failed. Now the daemon does not start, naming the path; the worker socket it bound is removed
// again. (A path too long for the ".fd" suffix still leaves only VMM buffers unserved, logged.)
TEST(WorkerProbeStartTest, ADaemonWhoseFdChannelPathIsInUseDoesNotStart) {
  const std::string sock = absl::StrCat("/tmp/wbprobe-fdc-", ::getpid(), ".sock");
  const std::string fd_path = sock + ".fd";
  ::unlink(sock.c_str());
  ::unlink(fd_path.c_str());
  const int other = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(other, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, fd_path.c_str(), fd_path.size() + 1);
  ASSERT_EQ(::bind(other, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(other, 4), 0);
  ServerOptions so;
  so.role = DaemonRole::kStandalone;
  so.worker_socket = sock;
  so.make_transports = HostTransports;
  auto server = Server::Start(so);
  EXPECT_FALSE(server.ok()) << "started beside a live fd channel at " << fd_path;
  if (!server.ok()) {
    EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition) << server.status();
    EXPECT_NE(server.status().message().find(fd_path), std::string::npos) << server.status();
    EXPECT_NE(server.status().message().find("in use"), std::string::npos) << server.status();
  } else {
    (*server)->Shutdown();
  }
  EXPECT_NE(::access(sock.c_str(), F_OK), 0) << "the refused daemon left its worker socket behind";
  EXPECT_EQ(::access(fd_path.c_str(), F_OK), 0) << "the refused daemon removed the other process's fd channel";
  ::close(other);
  ::unlink(fd_path.c_str());
  ::unlink(sock.c_str());
}

}  // namespace
}  // namespace wb::daemon

int main(int argc, char** argv) {
  if (std::getenv("WB_PROBE_CHILD")) return wb::daemon::ChildMain();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
