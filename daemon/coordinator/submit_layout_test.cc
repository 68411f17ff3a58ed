// SubmitLayout resolves and validates its layout outside the coordinator's lock (core.h threading
// notes; docs/daemon.md "Layouts are resolved outside the lock"): the thirty-eighth session's size
// probe saw a 1e6-piece SubmitLayout hold every other call (a ClusterStatus of another model)
// for ~5 s. A hook holds SubmitLayout between its snapshot and its resolve until the test has seen
// other calls answered, so nothing here depends on timing. And what the snapshot saw may change
// meanwhile: a worker that joined again, left, or got another layout is resolved again.
#include <atomic>
#include <memory>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/fake_node_client.h"
#include "daemon/coordinator/test_specs.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(10);  // real-time bound on any wait in these tests

class SubmitLayoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions o;
    o.make_node_client = [](const std::string& node, const std::string&) { return std::make_shared<FakeNodeClient>(node); };
    o.test_before_layout_resolve = [this] {
      const int call = ++resolves_;
      if (on_resolve_) on_resolve_(call);
    };
    core_ = std::make_unique<CoordinatorCore>(std::move(o));
    core_->Start();
    for (const char* node : {"n0", "n1"}) {
      pb::RegisterNodeRequest req;
      req.set_node_id(node);
      req.set_address(std::string(node) + ":1");
      pb::RegisterNodeResponse resp;
      ASSERT_TRUE(core_->RegisterNode(req, &resp).ok());
    }
    Join("n0", "t0", pb::ROLE_TRAINER, testing::SmallModelSpec("m"));
  }
  void TearDown() override { core_->Shutdown(); }

  absl::Status Join(const std::string& node, const std::string& worker, pb::Role role, const pb::ModelSpec& spec) {
    pb::JoinWorkerRequest j;
    j.set_node_id(node);
    j.set_worker_id(worker);
    j.set_model_id(spec.model_id());
    j.set_role(role);
    *j.mutable_model() = spec;
    pb::JoinWorkerResponse jr;
    return core_->JoinWorker(j, &jr);
  }
  absl::Status Submit(const pb::SubmitLayoutRequest& req) {
    pb::SubmitLayoutResponse resp;
    return core_->SubmitLayout(req, &resp);
  }
  // t0's layout with its buffer one byte larger per `grow` (another layout of the same worker).
  static pb::SubmitLayoutRequest Layout(int grow = 0) {
    pb::SubmitLayoutRequest req = testing::WholeTensorLayout("n0", "t0");
    req.mutable_buffers(0)->set_size_bytes(req.buffers(0).size_bytes() + grow);
    return req;
  }
  bool HasLayout(const std::string& worker) {
    pb::StatusRequest req;
    req.set_model_id("m");
    pb::StatusResponse st;
    EXPECT_TRUE(core_->ClusterStatus(req, &st).ok());
    for (const pb::WorkerStatus& w : st.workers()) {
      if (w.worker_id() == worker) return w.has_layout();
    }
    return false;
  }

  std::atomic<int> resolves_{0};
  std::function<void(int call)> on_resolve_;  // set before the SubmitLayout it is for
  std::unique_ptr<CoordinatorCore> core_;
};

// While a SubmitLayout is being resolved, other calls of other models and of the same model are
// answered: the status of another model, a join and a status of the model itself. Fails when the
// resolve runs under mu_ (each call then waits for the hook's release, which waits for them).
TEST_F(SubmitLayoutTest, OtherCallsAreAnsweredWhileALayoutIsResolved) {
  ASSERT_TRUE(Join("n1", "x0", pb::ROLE_TRAINER, testing::SmallModelSpec("other")).ok());
  absl::Notification resolving, release;
  on_resolve_ = [&](int) {
    resolving.Notify();
    // Longer than the test waits for the calls below: they must be answered while this holds.
    release.WaitForNotificationWithTimeout(3 * kReal);
  };
  absl::Status submitted;
  std::thread submitter([&] { submitted = Submit(Layout()); });
  ASSERT_TRUE(resolving.WaitForNotificationWithTimeout(kReal));
  absl::Notification answered;
  absl::Status status_other, joined, status_same;
  std::thread caller([&] {
    pb::StatusRequest req;
    req.set_model_id("other");
    pb::StatusResponse st;
    status_other = core_->ClusterStatus(req, &st);
    joined = Join("n0", "r0", pb::ROLE_ROLLOUT, testing::SmallModelSpec("m"));
    req.set_model_id("m");
    status_same = core_->ClusterStatus(req, &st);
    answered.Notify();
  });
  const bool in_time = answered.WaitForNotificationWithTimeout(kReal);
  release.Notify();
  caller.join();
  submitter.join();
  EXPECT_TRUE(in_time) << "calls waited for the SubmitLayout being resolved";
  EXPECT_TRUE(status_other.ok()) << status_other;
  EXPECT_TRUE(joined.ok()) << joined;
  EXPECT_TRUE(status_same.ok()) << status_same;
  EXPECT_TRUE(submitted.ok()) << submitted;
  EXPECT_EQ(resolves_.load(), 1);
  EXPECT_TRUE(HasLayout("t0"));
}

// The worker joined again (a new registration, its old layout gone) while its layout was resolved:
// resolved again for the new registration, and stored.
TEST_F(SubmitLayoutTest, AWorkerThatJoinedAgainMeanwhileIsResolvedAgain) {
  on_resolve_ = [&](int call) {
    if (call == 1) {
      EXPECT_TRUE(Join("n0", "t0", pb::ROLE_TRAINER, testing::SmallModelSpec("m")).ok());
    }
  };
  absl::Status s = Submit(Layout());
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resolves_.load(), 2);
  EXPECT_TRUE(HasLayout("t0"));
}

// The worker left while its layout was resolved: the answer a call after the leave gets.
TEST_F(SubmitLayoutTest, AWorkerThatLeftMeanwhileIsNotFound) {
  on_resolve_ = [&](int call) {
    if (call != 1) return;
    pb::LeaveWorkerRequest req;
    req.set_node_id("n0");
    req.set_model_id("m");
    req.set_worker_id("t0");
    pb::LeaveWorkerResponse resp;
    EXPECT_TRUE(core_->LeaveWorker(req, &resp).ok());
  };
  absl::Status s = Submit(Layout());
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_EQ(resolves_.load(), 1);
}

// Another layout of the worker was stored while this one was resolved: this one was judged
// against no layout, so it is resolved again against the stored one (and, no plan holding the
// worker yet, replaces it) - never stored over it unjudged.
TEST_F(SubmitLayoutTest, ALayoutStoredMeanwhileIsJudgedAgain) {
  on_resolve_ = [&](int call) {
    if (call == 1) {
      EXPECT_TRUE(Submit(Layout(1)).ok());
    }
  };
  pb::SubmitLayoutResponse resp;
  absl::Status s = core_->SubmitLayout(Layout(), &resp);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resolves_.load(), 3);  // the first, the one inside it, the first again
  EXPECT_EQ(resp.layout().buffers(0).size_bytes(), Layout().buffers(0).size_bytes());
  // The same layout again: resolved, nothing changes.
  on_resolve_ = nullptr;
  EXPECT_TRUE(Submit(Layout()).ok());
}

// A worker that keeps changing under every attempt: a bounded number of attempts, then ABORTED
// saying why and that it may be submitted again.
TEST_F(SubmitLayoutTest, AWorkerChangingUnderEveryAttemptIsAbortedRetryably) {
  on_resolve_ = [&](int) { EXPECT_TRUE(Join("n0", "t0", pb::ROLE_TRAINER, testing::SmallModelSpec("m")).ok()); };
  absl::Status s = Submit(Layout());
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "changed while its layout was resolved")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "submit it again")) << s;
  EXPECT_EQ(resolves_.load(), 3);
  EXPECT_FALSE(HasLayout("t0"));
}

}  // namespace
}  // namespace wb::daemon
