// Catch-up of late rollouts (issue 16.6, docs/daemon.md "Catch-up"), end to end with real daemons
// (coordinator + 2 nodes, and a standalone daemon) and shm workers, in every mode: a rollout that
// registers or restarts after a version was committed gets that version byte for byte from the
// other rollouts' copies, without the trainer, before WaitVersion / Apply report it; a newer
// version published meanwhile is never overtaken; with no source the rollout is told why and the
// next version still reaches it.
#include <grpcpp/grpcpp.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// WaitVersion as the clients send it (with the worker's id).
grpc::Status WaitFor(TestWorker& w, uint64_t v, pb::WaitVersionResponse* resp, int64_t timeout_ms = 20000) {
  return WaitVersionAs(w, "m", v, timeout_ms, resp);
}

// What a rollout does to get version v: sync, WaitVersion (the commit writes live weights);
// otherwise Apply(v). OK only once it reports v (or newer) to the rollout.
grpc::Status Receive(Cluster& c, TestWorker& r, pb::Mode mode, uint64_t v) {
  if (mode == pb::MODE_SYNC) {
    pb::WaitVersionResponse resp;
    grpc::Status s = WaitFor(r, v, &resp);
    if (s.ok() && resp.committed_version() < v) return grpc::Status(grpc::StatusCode::INTERNAL, "reported an older version");
    return s;
  }
  pb::ApplyResponse resp;
  grpc::Status s = c.Apply(r, "m", v, &resp);
  if (s.ok() && resp.applied_version() < v) return grpc::Status(grpc::StatusCode::INTERNAL, "applied an older version");
  return s;
}

// One version through trainers `ts` to rollouts `rs`, every rollout then holds it byte for byte.
void Version(Cluster& c, pb::Mode mode, uint64_t v, const std::vector<TestWorker*>& ts, const std::vector<TestWorker*>& rs) {
  for (grpc::Status& s : c.Publish("m", mode, v, ts, rs)) ASSERT_TRUE(s.ok()) << "publish v" << v << ": " << s.error_message();
  for (TestWorker* r : rs) {
    grpc::Status s = Receive(c, *r, mode, v);
    ASSERT_TRUE(s.ok()) << r->id << " v" << v << ": " << s.error_message();
    EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
  }
}

planner::WorkerLayout Whole(const planner::Inventory& inv, bool transposed) {
  return LayoutOf(inv, {{0, {0, 0}, {8, 16}, transposed}, {1, {0, 0}, {4, 6}, transposed}});
}

class CatchUpTest : public ::testing::TestWithParam<pb::Mode> {
 protected:
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = SmallInventory();
};

// A rollout registering after versions 1 and 2 were committed: before WaitVersion / Apply report
// version 2 to it, its memory holds version 2 byte for byte (sync: WaitVersion(2) answered at once
// while its buffer was still zero; one-step-off / async: Apply(2) waited for the next publish).
// Then version 3 reaches all three rollouts.
TEST_P(CatchUpTest, LateRolloutGetsTheCommittedVersion) {
  const pb::Mode mode = GetParam();
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  for (uint64_t v : {1u, 2u}) {
    Version(c_, mode, v, {&w.t0, &w.t1}, {&w.r0, &w.r1});
    ASSERT_FALSE(HasFatalFailure());
  }
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, false));
  ASSERT_TRUE(c_.Register(r2, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok());
  grpc::Status s = Receive(c_, r2, mode, 2);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r2, 2), 0) << "the late rollout was told version 2 before holding it";
  Version(c_, mode, 3, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2});
}

// A rollout process restarting (same id, new zeroed memory) on n1 is caught up from r0 on the
// other node (host_tcp), then takes part in the next version.
TEST_P(CatchUpTest, RestartedRolloutIsCaughtUp) {
  const pb::Mode mode = GetParam();
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  TestWorker& r1b = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r1b, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok());
  grpc::Status s = Receive(c_, r1b, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r1b, 1), 0);
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&w.r0, &r1b});
}

// Version 2 is published while the catch-up of version 1 is held mid-transfer on n1: version 2
// is not committed before the catch-up ends, and the late rollout ends with version 2 whole
// (never version 1 over it).
TEST_P(CatchUpTest, NewerVersionDuringCatchUpIsNotOvertaken) {
  const pb::Mode mode = GetParam();
  std::atomic<bool> armed{false};
  absl::Notification entered, release;
  // The nodes' hooks below use this test's locals: the cluster stops before they go, also when an
  // assertion returns early (TearDown came after them: a hook still called by an execution then
  // locked a destroyed Notification, and the test hung until the test timeout), and a held hook is
  // released first (the stop waited 15-20 s for its own timeout).
  const StopAtExit stop(c_, [&] { NotifyOnce(release); });
  TwoNodeSetup setup{mode};
  setup.n1_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 1 || !armed.exchange(false)) return;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(15));
  };
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, setup);
  ASSERT_FALSE(HasFatalFailure());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  armed = true;  // from now on version 1 runs only as a catch-up
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r2, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok());
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(15))) << "no catch-up of version 1 ran on n1";
  std::vector<grpc::Status> published;
  std::thread publisher([&] { published = c_.Publish("m", mode, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2}); });
  if (mode != pb::MODE_SYNC) {
    publisher.join();  // recorded (the trainers' snapshots are taken); it cannot start yet
    EXPECT_EQ(CommittedOf(c_.Status(w.t0), "m"), 1u) << "version 2 committed while the catch-up of version 1 ran";
  }
  release.Notify();
  if (publisher.joinable()) publisher.join();
  for (grpc::Status& s : published) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1, &r2}) {
    grpc::Status s = Receive(c_, *r, mode, 2);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
  pb::ApplyResponse again;  // nothing older lands later
  if (mode != pb::MODE_SYNC) {
    ASSERT_TRUE(c_.Apply(r2, "m", 0, &again).ok());
  }
  EXPECT_EQ(CountBad(r2, 2), 0);
}

// Every rollout holding version 1 leaves; a new rollout has no source: WaitVersion / Apply say
// why (ABORTED naming the version and the missing source), ClusterStatus shows it, and version 2
// reaches it.
TEST_P(CatchUpTest, NoSourceIsReportedAndTheNextVersionWorks) {
  const pb::Mode mode = GetParam();
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  for (TestWorker* r : {&w.r0, &w.r1}) {
    grpc::ClientContext ctx;
    pb::DeregisterRequest req;
    req.set_model_id("m");
    req.set_worker_id(r->id);
    pb::DeregisterResponse resp;
    ASSERT_TRUE(r->stub->Deregister(&ctx, req, &resp).ok());
  }
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 0, &inv_, Whole(inv_, false));
  ASSERT_TRUE(c_.Register(r2, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok());
  pb::WaitVersionResponse wr;
  grpc::Status s = WaitFor(r2, 1, &wr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("cannot catch up to version 1"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("no rollout holds it"), std::string::npos) << s.error_message();
  if (mode != pb::MODE_SYNC) {
    pb::ApplyResponse ar;
    grpc::Status a = c_.Apply(r2, "m", 1, &ar);
    EXPECT_EQ(a.error_code(), grpc::StatusCode::ABORTED) << a.error_message();
    EXPECT_NE(a.error_message().find("cannot catch up"), std::string::npos) << a.error_message();
  }
  auto st = c_.WaitForCoordinator(
      [](const pb::StatusResponse& r) {
        for (const pb::WorkerStatus& ws : r.workers()) {
          if (ws.worker_id() == "r2") return !ws.catch_up_error().empty();
        }
        return false;
      },
      absl::Seconds(10));
  ASSERT_TRUE(st.ok()) << st.status();
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&r2});
}

// Both trainers exit (Deregister) after version 1 committed; then a rollout registers on n1. No
// plan can be made without trainers, but r0 and r1 hold version 1: the late rollout is caught up
// from them (WaitVersion(1) in sync, Apply(1) otherwise answers OK with version 1 byte for byte),
// and once the trainers are back version 2 reaches all three. Before (next steps 25), no catch-up
// started without a plan and the late rollout's WaitVersion / Apply ran to its deadline.
TEST_P(CatchUpTest, ALateRolloutIsCaughtUpAfterTheTrainersExited) {
  const pb::Mode mode = GetParam();
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  for (TestWorker* t : {&w.t0, &w.t1}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    pb::DeregisterRequest req;
    req.set_model_id("m");
    req.set_worker_id(t->id);
    pb::DeregisterResponse resp;
    ASSERT_TRUE(t->stub->Deregister(&ctx, req, &resp).ok()) << t->id;
  }
  // The coordinator knows them gone before the late rollout registers (else a plan with them could
  // still be made and the catch-up be the ordinary one).
  auto gone = c_.WaitForCoordinator([](const pb::StatusResponse& s) {
    for (const pb::ModelStatus& ms : s.models()) {
      if (ms.model_id() == "m") return ms.registered_trainers() == 0;
    }
    return false;
  }, absl::Seconds(10));
  ASSERT_TRUE(gone.ok()) << gone.status();
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, false));
  ASSERT_TRUE(c_.Register(r2, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok());
  grpc::Status s = Receive(c_, r2, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r2, 1), 0) << "the late rollout was told version 1 before holding it";
  for (TestWorker* t : {&w.t0, &w.t1}) ASSERT_TRUE(c_.Register(*t, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok()) << t->id;
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2});
}

// A catch-up attempt made void mid-transfer (a source, r0, leaves while n1 holds the attempt
// before a bucket) is followed by another from the remaining source: the late rollout's Apply(1)
// on n1 - one waiting since before, one sent while the retry is held there - does not answer
// ABORTED; it answers OK once the retry committed, and r2 holds version 1 byte for byte. The void
// attempt's abort ended its execution on n1; it is no outcome of version 1 for n1's rollouts.
// (Before: n1 recorded version 1 as aborted, and Apply(1) there answered ABORTED at once, during
// the retry and for good.)
TEST_P(CatchUpTest, AVoidedAttemptDoesNotFailTheRolloutsApply) {
  const pb::Mode mode = GetParam();
  std::atomic<bool> armed{false};
  std::atomic<int> entered{0};
  absl::Notification first, second, release_first, release_second;
  // The nodes' hooks below use this test's locals: the cluster stops before they go, also when an
  // assertion returns early (TearDown came after them: a hook still called by an execution then
  // locked a destroyed Notification, and the test hung until the test timeout), and a held hook is
  // released first (the stop waited 15-20 s for its own timeout).
  const StopAtExit stop(c_, [&] {
    NotifyOnce(release_first);
    NotifyOnce(release_second);
  });
  TwoNodeSetup setup{mode};
  setup.n1_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 1 || !armed) return;
    const int n = entered++;
    if (n == 0) {  // the first attempt's executor on n1: held until the retry runs there
      first.Notify();
      release_first.WaitForNotificationWithTimeout(absl::Seconds(20));
    } else if (n == 1) {  // the retry's executor (the first one is still held): held too
      second.Notify();
      release_second.WaitForNotificationWithTimeout(absl::Seconds(20));
    }
  };
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, setup);
  ASSERT_FALSE(HasFatalFailure());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  armed = true;  // from now on version 1 runs only as a catch-up
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r2, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok());
  ASSERT_TRUE(first.WaitForNotificationWithTimeout(absl::Seconds(15))) << "no catch-up of version 1 ran on n1";
  grpc::Status applied;
  pb::ApplyResponse ar;
  std::thread applier([&] { applied = c_.Apply(r2, "m", 1, &ar); });
  grpc::Status deregistered;
  {
    grpc::ClientContext ctx;
    pb::DeregisterRequest req;
    req.set_model_id("m");
    req.set_worker_id(w.r0.id);
    pb::DeregisterResponse resp;
    deregistered = w.r0.stub->Deregister(&ctx, req, &resp);
  }
  // The retry's executor on n1 exists only once the void attempt's execution was ended there.
  const bool retried = deregistered.ok() && second.WaitForNotificationWithTimeout(absl::Seconds(15));
  release_first.Notify();
  grpc::Status during;
  pb::ApplyResponse dr;
  if (retried) during = ApplyWithin(r2, 1, 300, &dr);  // while the retry is held on n1
  release_second.Notify();
  applier.join();
  ASSERT_TRUE(deregistered.ok()) << deregistered.error_message();
  ASSERT_TRUE(retried) << "no second catch-up attempt ran on n1";
  EXPECT_EQ(during.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "Apply(1) during the retry: " << during.error_message();
  ASSERT_TRUE(applied.ok()) << applied.error_message();
  EXPECT_GE(ar.applied_version(), 1u);
  grpc::Status s = Receive(c_, r2, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r2, 1), 0);
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&w.r1, &r2});
}

// A catch-up that fails for good (an end-to-end digest mismatch in r2's staging on n1) tells r2
// why: Apply(1) on n1 ABORTED naming the mismatch. A rollout registering on n1 afterwards (r3) is
// not failed by that record: it is caught up and Apply(1) answers OK with version 1 byte for byte.
// (Before: n1 had recorded version 1 as aborted, and r3's Apply(1) answered ABORTED at once.)
TEST_P(CatchUpTest, AFinalFailureIsToldToItsRolloutNotToLaterOnes) {
  const pb::Mode mode = GetParam();
  std::atomic<bool> armed{false};
  std::atomic<int> flips{0};
  // The nodes' hooks below use this test's locals: the cluster stops before they go, also when an
  // assertion returns early (TearDown came after them: a hook still called by an execution then
  // locked a destroyed Notification, and the test hung until the test timeout).
  const StopAtExit stop(c_);
  c_.StartCoordinator();
  c_.StartNode(0);
  c_.StartNode(1, nullptr, nullptr, [&](ServerOptions& o) {
    o.digest_overlap = false;  // the flip comes after the buckets
    o.configure_node = [&](NodeDaemon::Options& no) {
      no.test_after_buckets = [&](const std::string&, uint64_t v, const std::map<std::string, std::pair<uint8_t*, int64_t>>& regions) {
        auto r = regions.find("r2.b0");
        bool expected = true;
        if (v != 1 || r == regions.end() || r->second.second == 0 || !armed.compare_exchange_strong(expected, false)) return;
        r->second.first[5] ^= 0x10;
        ++flips;
      };
    };
  });
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = AddTwoNodeWorkers(c_, inv_);
  for (TestWorker* x : {&w.t0, &w.t1, &w.r0, &w.r1}) ASSERT_TRUE(c_.Register(*x, spec).ok()) << x->id;
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  armed = true;
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, false));
  ASSERT_TRUE(c_.Register(r2, spec).ok());
  pb::ApplyResponse ar;
  grpc::Status a = c_.Apply(r2, "m", 1, &ar);
  EXPECT_EQ(flips.load(), 1) << "the staging fault never fired";
  EXPECT_EQ(a.error_code(), grpc::StatusCode::ABORTED) << a.error_message();
  EXPECT_NE(a.error_message().find("end-to-end digest mismatch in the catch-up of model m version 1"), std::string::npos)
      << a.error_message();
  TestWorker& r3 = c_.AddWorker("r3", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r3, spec).ok());
  grpc::Status a3 = c_.Apply(r3, "m", 1, &ar);
  ASSERT_TRUE(a3.ok()) << a3.error_message();
  EXPECT_GE(ar.applied_version(), 1u);
  grpc::Status s = Receive(c_, r3, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r3, 1), 0);
  // r2 is still told why, and gets the next version.
  a = c_.Apply(r2, "m", 1, &ar);
  EXPECT_EQ(a.error_code(), grpc::StatusCode::ABORTED) << a.error_message();
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2, &r3});
}

// The coordinator restarts while the catch-up of late rollout r2 (n1) is held mid-transfer: n1
// ends that execution and re-joins its workers, each with what it itself holds - r2 nothing.
// The new coordinator counts r2 as late and catches it up: WaitVersion(1) / Apply(1) for r2
// answer OK only once r2 holds version 1 byte for byte. (Before: n1 sent its own committed
// version for every worker, the coordinator counted r2 as holding version 1, WaitVersion answered
// OK over r2's zeroed memory and no catch-up ever ran; Apply(1) ran into its deadline.)
TEST_P(CatchUpTest, ALateRolloutIsCaughtUpAfterACoordinatorRestart) {
  const pb::Mode mode = GetParam();
  std::atomic<bool> armed{false};
  absl::Notification entered, release;
  // The nodes' hooks below use this test's locals: the cluster stops before they go, also when an
  // assertion returns early (TearDown came after them: a hook still called by an execution then
  // locked a destroyed Notification, and the test hung until the test timeout), and a held hook is
  // released first (the stop waited 15-20 s for its own timeout).
  const StopAtExit stop(c_, [&] { NotifyOnce(release); });
  TwoNodeSetup setup{mode};
  setup.n1_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 1 || !armed.exchange(false)) return;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  };
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, setup);
  ASSERT_FALSE(HasFatalFailure());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  armed = true;  // the first catch-up of version 1 on n1 is held
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, false));
  ASSERT_TRUE(c_.Register(r2, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok());
  const bool held = entered.WaitForNotificationWithTimeout(absl::Seconds(15));
  const int port = c_.coord_->port();
  c_.coord_->Shutdown();
  c_.coord_.reset();
  release.Notify();  // the old session's execution ends (n1 aborts it when it re-joins)
  ASSERT_TRUE(held) << "no catch-up of version 1 ran on n1";
  c_.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
  ASSERT_FALSE(HasFatalFailure());
  // Every worker is back at the new coordinator (re-joined by its node, with its layout).
  auto back = c_.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        int with_layout = 0;
        for (const pb::WorkerStatus& ws : st.workers()) with_layout += ws.has_layout();
        return with_layout == 5;
      },
      absl::Seconds(15));
  ASSERT_TRUE(back.ok()) << back.status();
  grpc::Status s = Receive(c_, r2, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r2, 1), 0) << "r2 was told version 1 before holding it";
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2});
}

// A standalone daemon (coordinator and node in one process): the late rollout is caught up from
// the same node's rollout.
TEST_P(CatchUpTest, StandaloneLateRollout) {
  const pb::Mode mode = GetParam();
  ServerOptions o;
  o.role = DaemonRole::kStandalone;
  o.node_id = "n0";
  o.worker_socket = absl::StrCat("/tmp/wbcu-", ::getpid(), ".sock");
  o.heartbeat = absl::Milliseconds(100);
  o.transfer_timeout = absl::Seconds(20);
  o.bucket_bytes = 4096;
  o.make_transports = HostTransports;
  auto server = Server::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  c_.nodes_.push_back(std::move(*server));
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& t0 = c_.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {4, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& t1 = c_.AddWorker("t1", pb::ROLE_TRAINER, 0, &inv_, LayoutOf(inv_, {{0, {4, 0}, {8, 16}, false}}));
  TestWorker& r0 = c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, Whole(inv_, false));
  TestWorker& r1 = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 0, &inv_, Whole(inv_, true));
  for (TestWorker* x : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c_.Register(*x, spec).ok()) << x->id;
  Version(c_, mode, 1, {&t0, &t1}, {&r0, &r1});
  ASSERT_FALSE(HasFatalFailure());
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 0, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r2, spec).ok());
  grpc::Status s = Receive(c_, r2, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r2, 1), 0);
  Version(c_, mode, 2, {&t0, &t1}, {&r0, &r1, &r2});
}

// A source rollout whose memory changed after the version landed there (written since, torn, an
// engine that changed its weights in place) does not serve it: the catch-up checks the boxes it
// reads from the source against the digests the version landed with there (pb::CertifyBox) and
// fails naming the source, the box and the tensor; the restarted rollout is told why and gets the
// next version. Where the source's committed staging is what the catch-up reads (one-step-off,
// async: intact), the late rollout gets the version byte for byte. Never the changed bytes.
// Before: the catch-up only compared what landed with what the source read, so the late rollout
// got the changed byte, certified.
TEST_P(CatchUpTest, ASourceWhoseMemoryChangedDoesNotServeTheVersion) {
  const pb::Mode mode = GetParam();
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  static_cast<uint8_t*>(w.r0.seg.data())[w.r0.layout.pieces[0].offset_bytes + 6] ^= 0x10;
  ASSERT_EQ(CountBad(w.r0, 1), 1);
  TestWorker& r1b = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r1b, SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE)).ok());
  grpc::Status s = Receive(c_, r1b, mode, 1);
  if (s.ok()) {
    EXPECT_NE(mode, pb::MODE_SYNC) << "a sync source is read in its live weights, which changed";
    EXPECT_EQ(CountBad(r1b, 1), 0) << "the late rollout got the source's changed bytes";
  } else {
    // r0 was the only holder: it serves version 1 no more, and r1 is told why.
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    EXPECT_NE(s.error_message().find("no rollout holds version 1 (rollouts r0 held it, but a catch-up found their memory changed since)"),
              std::string::npos)
        << s.error_message();
    // What the catch-up found, in r0's status.
    std::string why;
    const pb::StatusResponse st = c_.Status(w.t0);
    for (const pb::WorkerStatus& ws : st.workers()) {
      if (ws.worker_id() == "r0") why = ws.catch_up_error();
    }
    EXPECT_NE(why.find("its memory no longer holds version 1"), std::string::npos) << why;
    EXPECT_NE(why.find("source rollout r0 on node n0 no longer holds the version it would serve: box [0:4, 0:16] of tensor " +
                       inv_.tensors[0].name),
              std::string::npos)
        << why;
    EXPECT_NE(why.find("as when the version landed there (op "), std::string::npos) << why;
  }
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&w.r0, &r1b});
  EXPECT_EQ(CountBad(w.r0, 2), 0) << "the next version did not rewrite r0";
}

// A rollout caught up is certified as a source by what its catch-up landed in it (that record
// replaces what the version's plan landed in its earlier incarnation; a late rollout new to the
// model has only it): r1 restarts and is caught up from r0; then a byte of r1's memory changes and
// r0 restarts, with r1 its only source: that catch-up fails naming r1 and the earlier catch-up.
TEST_P(CatchUpTest, ACaughtUpRolloutIsCertifiedByWhatItsCatchUpLanded) {
  const pb::Mode mode = GetParam();
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1});
  ASSERT_FALSE(HasFatalFailure());
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& r1b = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r1b, spec).ok());
  grpc::Status s = Receive(c_, r1b, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(CountBad(r1b, 1), 0);
  static_cast<uint8_t*>(r1b.seg.data())[r1b.layout.pieces[0].offset_bytes + 2] ^= 0x01;
  ASSERT_EQ(CountBad(r1b, 1), 1);
  TestWorker& r0b = c_.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv_, Whole(inv_, false));
  ASSERT_TRUE(c_.Register(r0b, spec).ok());
  s = Receive(c_, r0b, mode, 1);
  if (s.ok()) {
    EXPECT_NE(mode, pb::MODE_SYNC) << "a sync source is read in its live weights, which changed";
    EXPECT_EQ(CountBad(r0b, 1), 0) << "the late rollout got the source's changed bytes";
  } else {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    EXPECT_NE(s.error_message().find("(rollouts r1 held it, but a catch-up found their memory changed since)"), std::string::npos)
        << s.error_message();
    std::string why;
    const pb::StatusResponse st = c_.Status(w.t0);
    for (const pb::WorkerStatus& ws : st.workers()) {
      if (ws.worker_id() == "r1") why = ws.catch_up_error();
    }
    EXPECT_NE(why.find("source rollout r1 on node n1 no longer holds the version"), std::string::npos) << why;
    EXPECT_NE(why.find("as when an earlier catch-up landed there"), std::string::npos) << why;
  }
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&r0b, &r1b});
}

// A changed source among several holders: the catch-up that read it fails, the next attempt takes
// the version from the other holder, and the late rollout gets it byte for byte; the changed source
// is rewritten by the next version.
TEST_P(CatchUpTest, AChangedSourceIsLeftOutAndTheOtherHoldersServe) {
  const pb::Mode mode = GetParam();
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 0, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r2, spec).ok());
  Version(c_, mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1, &r2});
  ASSERT_FALSE(HasFatalFailure());
  // Both on n0 hold version 1; the planner reads r1's boxes from r0 (the first of them).
  static_cast<uint8_t*>(w.r0.seg.data())[w.r0.layout.pieces[0].offset_bytes + 6] ^= 0x10;
  TestWorker& r1b = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, Whole(inv_, true));
  ASSERT_TRUE(c_.Register(r1b, spec).ok());
  grpc::Status s = Receive(c_, r1b, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r1b, 1), 0) << "the late rollout got the changed source's bytes";
  std::string why;
  const pb::StatusResponse st = c_.Status(w.t0);
  for (const pb::WorkerStatus& ws : st.workers()) {
    if (ws.worker_id() == "r0") why = ws.catch_up_error();
  }
  EXPECT_NE(why.find("its memory no longer holds version 1"), std::string::npos)
      << "r0 was not read (the planner chose r2): the changed source was never put to the test; r0's status: " << why;
  Version(c_, mode, 2, {&w.t0, &w.t1}, {&w.r0, &r1b, &r2});
  EXPECT_EQ(CountBad(w.r0, 2), 0) << "the next version did not rewrite r0";
}

INSTANTIATE_TEST_SUITE_P(Modes, CatchUpTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                         [](const ::testing::TestParamInfo<pb::Mode>& p) { return pb::Mode_Name(p.param); });

}  // namespace
}  // namespace wb::daemon
