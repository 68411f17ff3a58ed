// Real daemons (a coordinator and a node in one process, daemon/multinode_fixture.h): the node is
// cut off from the SAME coordinator for a while (a network partition through a TCP forwarder; the
// coordinator process keeps running and the node keeps its lease, so nothing restarts and the node
// does not re-join). A Deregister during the cut gives up at its deadline; the node owes the
// coordinator the worker's leave and sends it once the coordinator answers again
// (WorkerCalls::SendOwedLeaves from the control tick). Before, the coordinator kept the departed
// worker as a member (until a re-join), so versions that waited for it were held to their timeouts.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// Forwards 127.0.0.1:<its port> to 127.0.0.1:<upstream>. Cut: every connection is closed and new
// ones are closed as soon as they are accepted (the far side is unreachable: calls fail at once);
// Heal: forwarded again. One thread, poll-driven; blocking writes of what was read (small control
// traffic only).
class LinkCutter {
 public:
  explicit LinkCutter(int upstream_port) : upstream_port_(upstream_port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ok_ = listen_fd_ >= 0 && ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && ::listen(listen_fd_, 64) == 0 &&
          ::pipe(wake_) == 0;
    socklen_t len = sizeof(a);
    if (ok_ && ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) port_ = ntohs(a.sin_port);
    if (ok_) thread_ = std::thread([this] { Loop(); });
  }
  ~LinkCutter() {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    Wake();
    if (thread_.joinable()) thread_.join();
    for (auto& [a, b] : pairs_) {
      ::close(a);
      ::close(b);
    }
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (ok_) {
      ::close(wake_[0]);
      ::close(wake_[1]);
    }
  }
  bool ok() const { return ok_ && port_ > 0; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  // Returns once every forwarded connection is closed (bounded: false when the loop did not get to
  // it within 10 s).
  bool Cut() { return Set(true); }
  bool Heal() { return Set(false); }

 private:
  bool Set(bool cut) {
    absl::MutexLock l(&mu_);
    cut_ = cut;
    const uint64_t want = ++asked_;
    Wake();
    auto applied = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return applied_ >= want; };
    return mu_.AwaitWithTimeout(absl::Condition(&applied), absl::Seconds(10));
  }
  void Wake() {
    const char c = 0;
    [[maybe_unused]] ssize_t n = ::write(wake_[1], &c, 1);
  }
  // Copies what `from` has to `to`; false when either side is done.
  static bool Pump(int from, int to) {
    char buf[65536];
    const ssize_t n = ::read(from, buf, sizeof(buf));
    if (n <= 0) return false;
    for (ssize_t off = 0; off < n;) {
      const ssize_t w = ::write(to, buf + off, n - off);
      if (w <= 0) return false;
      off += w;
    }
    return true;
  }
  void Loop() {
    while (true) {
      bool cut = false;
      {
        absl::MutexLock l(&mu_);
        if (stop_) return;
        cut = cut_;
        if (cut) {
          for (auto& [a, b] : pairs_) {
            ::close(a);
            ::close(b);
          }
          pairs_.clear();
        }
        applied_ = asked_;
      }
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      for (auto& [a, b] : pairs_) {
        fds.push_back({a, POLLIN, 0});
        fds.push_back({b, POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), 1000) <= 0) continue;
      if (fds[1].revents != 0) {
        char drain[64];
        [[maybe_unused]] ssize_t n = ::read(wake_[0], drain, sizeof(drain));
      }
      if (fds[0].revents != 0) {
        const int c = ::accept(listen_fd_, nullptr, nullptr);
        if (c >= 0 && cut) {
          ::close(c);  // unreachable: refused as soon as it connects
        } else if (c >= 0) {
          const int up = ::socket(AF_INET, SOCK_STREAM, 0);
          sockaddr_in a{};
          a.sin_family = AF_INET;
          a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          a.sin_port = htons(static_cast<uint16_t>(upstream_port_));
          if (up >= 0 && ::connect(up, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
            pairs_.push_back({c, up});
          } else {
            ::close(c);
            if (up >= 0) ::close(up);
          }
        }
      }
      std::vector<std::pair<int, int>> keep;
      for (size_t i = 0; i < pairs_.size(); ++i) {
        const short ra = fds[2 + 2 * i].revents, rb = fds[3 + 2 * i].revents;
        bool alive = true;
        if (ra != 0) alive = Pump(pairs_[i].first, pairs_[i].second);
        if (alive && rb != 0) alive = Pump(pairs_[i].second, pairs_[i].first);
        if (alive) {
          keep.push_back(pairs_[i]);
        } else {
          ::close(pairs_[i].first);
          ::close(pairs_[i].second);
        }
      }
      pairs_ = std::move(keep);
    }
  }

  const int upstream_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  bool ok_ = false;
  std::vector<std::pair<int, int>> pairs_;  // (accepted, upstream); the loop's own
  absl::Mutex mu_;
  bool cut_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t asked_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

auto HasWorker(const std::string& id) {
  return [id](const pb::StatusResponse& st) {
    for (const pb::WorkerStatus& w : st.workers()) {
      if (w.worker_id() == id) return true;
    }
    return false;
  };
}

TEST(OwedLeaveTest, ADeregisterTheCutOffCoordinatorMissedReachesItOnceItAnswersAgain) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  // A lease longer than the cut: the node stays registered there, so no re-join rebuilds the
  // membership - only the owed leave can take r1 out.
  c.StartCoordinator(absl::Seconds(30));
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  LinkCutter link(c.coord_->port());
  ASSERT_TRUE(link.ok());
  c.StartNode(0, nullptr, nullptr, [&](ServerOptions& o) { o.coordinator = link.address(); });
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(2);
  const std::vector<PieceDef> whole = {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}};
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, whole));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, whole));
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, whole));
  for (TestWorker* w : {&t0, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  ASSERT_TRUE(c.WaitForCoordinator(HasWorker("r1"), absl::Seconds(10)).ok());

  ASSERT_TRUE(link.Cut());
  // The worker's deadline passes while the coordinator cannot be reached: the node removes r1
  // here, holds its leave until then, and owes it.
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));  // the node answers 1 s before
  pb::DeregisterRequest req;
  req.set_model_id("m");
  req.set_worker_id("r1");
  pb::DeregisterResponse resp;
  grpc::Status s = r1.stub->Deregister(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("node n0 owes the coordinator the worker's leave"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find(absl::StrCat("the coordinator at ", link.address(), " could not be reached since")), std::string::npos)
      << s.error_message();
  ASSERT_TRUE(c.WaitForCoordinator(HasWorker("r1"), absl::Seconds(10)).ok()) << "the coordinator got the leave through the cut";

  ASSERT_TRUE(link.Heal());
  absl::StatusOr<pb::StatusResponse> after =
      c.WaitForCoordinator([](const pb::StatusResponse& st) { return !HasWorker("r1")(st); }, absl::Seconds(20));
  ASSERT_TRUE(after.ok()) << "r1 is still a member of the coordinator back from the cut: " << after.status();
  // The same coordinator and the same session: the other workers were never dropped.
  EXPECT_TRUE(HasWorker("t0")(*after));
  EXPECT_TRUE(HasWorker("r0")(*after));
  c.Stop();
}

}  // namespace
}  // namespace wb::daemon
