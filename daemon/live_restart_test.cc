// kill -9 of a node daemon while it copies a version into a rollout's live memory (issue 15.2;
// docs/daemon.md "Live weights: whole or TORN"): the rollout's node runs as its own process
// (live_restart_node_main.cc), is held midway through the copy (half of it landed) and killed
// with SIGKILL there, then restarted on the same live state directory. When the rollout registers
// the same memory again its live weights are TORN (status, Apply, WaitVersion say so, naming
// worker, node and versions) until the next Apply copies a whole version, byte for byte.
#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

extern char** environ;

namespace wb::daemon {
namespace {

std::string NodeBinary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return absl::StrCat(srcdir != nullptr ? srcdir : ".", "/weightbridge/daemon/live_restart_node");
}

// Waits (bounded) for one byte on `fd`.
bool WaitByte(int fd, absl::Duration timeout) {
  struct pollfd p = {fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) return false;
  char b;
  return ::read(fd, &b, 1) == 1;
}

int CountMarkers(const std::string& dir) {
  int n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (struct dirent* e = ::readdir(d)) n += std::string(e->d_name).rfind("live-", 0) == 0;
    ::closedir(d);
  }
  return n;
}

class NodeProcess {
 public:
  // Starts node n1; false (with a test failure) when it does not come up within 20 s.
  bool Start(const std::string& coordinator, const std::string& socket, const std::string& state_dir, const std::string& stall_at) {
    int ready[2], stalled[2];
    if (::pipe(ready) != 0 || ::pipe(stalled) != 0) return false;
    std::vector<std::string> args = {NodeBinary(), "--coordinator=" + coordinator, "--node_id=n1", "--worker_socket=" + socket,
                                     "--live_state_dir=" + state_dir, "--stall_at=" + stall_at,
                                     absl::StrCat("--ready_fd=", ready[1]), absl::StrCat("--stalled_fd=", stalled[1])};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ);
    ::close(ready[1]);
    ::close(stalled[1]);
    ready_ = ready[0];
    stalled_ = stalled[0];
    if (rc != 0) {
      ADD_FAILURE() << "cannot start " << argv[0] << ": rc " << rc;
      pid_ = -1;
      return false;
    }
    if (!WaitByte(ready_, absl::Seconds(20))) {
      ADD_FAILURE() << "node n1 (pid " << pid_ << ") did not come up";
      return false;
    }
    return true;
  }
  bool WaitStalled(absl::Duration timeout) { return WaitByte(stalled_, timeout); }
  void Kill(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    ::close(ready_);
    ::close(stalled_);
  }
  ~NodeProcess() { Kill(SIGKILL); }

 private:
  pid_t pid_ = -1;
  int ready_ = -1, stalled_ = -1;
};

TEST(LiveRestartTest, NodeKilledMidLiveCopyReportsTornAfterRestartUntilTheNextApply) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string state_dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/live-state-", ::getpid());
  const std::string socket = absl::StrCat("/tmp/wblr-", ::getpid(), ".sock");
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  c.external_sockets_[1] = socket;
  NodeProcess n1;
  ASSERT_TRUE(n1.Start(c.coord_->address(), socket, state_dir, "apply r1 v2 midway"));

  pb::ModelSpec spec = SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(1);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}, {1, {0, 0}, {4, 6}, false}}));
  for (TestWorker* w : {&t0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  pb::ApplyResponse resp;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0}, {&r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(c.Apply(r1, "m", 1, &resp).ok());
  ASSERT_EQ(CountBad(r1, 1), 0);
  EXPECT_EQ(CountMarkers(state_dir), 0) << "a copy that ended whole leaves no marker";

  // Version 2: n1 is held halfway through the copy into r1's live memory, and killed there.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0}, {&r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitCommitted(r1, "m", 2).ok());
  grpc::Status during;
  std::thread apply([&] {
    pb::ApplyResponse r;
    during = c.Apply(r1, "m", 2, &r);
  });
  const bool stalled = n1.WaitStalled(absl::Seconds(20));
  if (stalled) n1.Kill(SIGKILL);
  apply.join();
  ASSERT_TRUE(stalled) << "the copy into r1 never reached its midpoint: " << during.error_message();
  EXPECT_FALSE(during.ok()) << "the node died mid-copy";
  EXPECT_GT(CountBad(r1, 1), 0) << "part of version 2 landed";
  EXPECT_GT(CountBad(r1, 2), 0) << "part of version 1 is left";
  EXPECT_EQ(CountMarkers(state_dir), 1) << "the copy was recorded before its first byte";

  // The node comes back on the same state directory; r1 (same process, same segment) registers again.
  ASSERT_TRUE(n1.Start(c.coord_->address(), socket, state_dir, ""));
  c.Connect(r1);
  ASSERT_TRUE(c.Register(r1, spec).ok());
  pb::WorkerStatus ws = LocalStatus(c, r1);
  EXPECT_EQ(ws.live_state(), "torn");
  EXPECT_EQ(ws.live_writing_version(), 2u);
  EXPECT_EQ(ws.live_over_version(), 1u);
  grpc::Status s = c.Apply(r1, "m", 0, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  for (const char* want : {"worker r1", "node n1", "TORN", "version 2", "over version 1", "node daemon"}) {
    EXPECT_NE(s.error_message().find(want), std::string::npos) << want << " missing in: " << s.error_message();
  }
  grpc::Status w = WaitCommitted(r1, "m", 2);
  EXPECT_EQ(w.error_code(), grpc::StatusCode::DATA_LOSS) << "WaitVersion must not report a version r1 does not hold: " << w.error_message();

  // The next version restores whole weights, and the marker goes.
  for (auto& p : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0}, {&r1})) ASSERT_TRUE(p.ok()) << p.error_message();
  grpc::Status a = c.Apply(r1, "m", 3, &resp);
  ASSERT_TRUE(a.ok()) << a.error_message();
  EXPECT_EQ(resp.applied_version(), 3u);
  EXPECT_EQ(CountBad(r1, 3), 0);
  EXPECT_EQ(LocalStatus(c, r1).live_state(), "whole");
  EXPECT_EQ(CountMarkers(state_dir), 0);
  n1.Kill(SIGTERM);
  c.Stop();
}

}  // namespace
}  // namespace wb::daemon
