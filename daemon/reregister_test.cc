// A worker client that reconnects to a node daemon that did NOT restart replays RegisterWorker
// and RegisterLayout (both clients do whenever their channel left READY, gRPC's client idle
// timeout included). End to end with real daemons (coordinator + 2 nodes, shm workers), in every
// mode: the identical requests from the same live process change nothing - the worker keeps its
// applied version and layout on its node and at the coordinator, a version in flight is not
// aborted, no catch-up runs - while a different request from the same process still registers
// the worker anew (the coordinator drops it, it is caught up), as before.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/synchronization/notification.h"
#include "daemon/multinode_fixture.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// What a rollout does to get version v: sync, WaitVersion (the commit writes live weights);
// otherwise Apply(v).
grpc::Status Receive(Cluster& c, TestWorker& r, pb::Mode mode, uint64_t v) {
  if (mode == pb::MODE_SYNC) {
    pb::WaitVersionResponse resp;
    return WaitVersionAs(r, "m", v, 20000, &resp);
  }
  pb::ApplyResponse resp;
  grpc::Status s = c.Apply(r, "m", v, &resp);
  if (s.ok() && resp.applied_version() < v) return grpc::Status(grpc::StatusCode::INTERNAL, "applied an older version");
  return s;
}

// The coordinator's record of worker `id` (as w's node answers Status).
pb::WorkerStatus CoordinatorRecord(Cluster& c, TestWorker& via, const std::string& id) {
  const pb::StatusResponse status = c.Status(via);
  for (const pb::WorkerStatus& ws : status.workers()) {
    if (ws.worker_id() == id) return ws;
  }
  return pb::WorkerStatus();
}

// The version the node says r's live weights hold: Apply(0) answers at once with it.
uint64_t NodeApplied(Cluster& c, TestWorker& r) {
  pb::ApplyResponse resp;
  grpc::Status s = c.Apply(r, "m", 0, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.applied_version();
}

// w's memory is replaced by a new, zeroed segment of the same size (an engine that slept and
// discarded its weights): under the same name (a new file; `truncate_old`: the old one is cut to
// 0 bytes first, so the node's mapping of it is no longer intact) or under a new name.
void NewZeroedSegment(TestWorker& w, bool same_name, bool truncate_old = false) {
  const std::string name = w.seg.name();
  const int64_t size = w.seg.size();
  if (truncate_old) {
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, 0), 0);
    ::close(fd);
  }
  w.seg = transport::ShmSegment();  // unlinks the old name (the node may still map that file)
  auto seg = transport::ShmSegment::Create(same_name ? name : transport::ShmSegment::UniqueName("mn"), size);
  ASSERT_TRUE(seg.ok()) << seg.status();
  w.seg = std::move(*seg);
}

grpc::Status Deregister(TestWorker& w) {
  grpc::ClientContext ctx;
  pb::DeregisterRequest req;
  req.set_model_id("m");
  req.set_worker_id(w.id);
  pb::DeregisterResponse resp;
  return w.stub->Deregister(&ctx, req, &resp);
}

class ReregisterTest : public ::testing::TestWithParam<pb::Mode> {
 protected:
  void TearDown() override { c_.Stop(); }
  Cluster c_;
  planner::Inventory inv_ = SmallInventory();
};

TEST_P(ReregisterTest, TheSameRegistrationFromTheSameProcessChangesNothing) {
  const pb::Mode mode = GetParam();
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  std::atomic<bool> armed{false};
  absl::Notification entered, release;
  const StopAtExit stop(c_, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go, not in TearDown
  TwoNodeSetup setup{mode};
  setup.n1_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 2 || !armed.exchange(false)) return;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  };
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, setup);
  ASSERT_FALSE(HasFatalFailure());
  for (grpc::Status& s : c_.Publish("m", mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) {
    ASSERT_TRUE(Receive(c_, *r, mode, 1).ok()) << r->id;
    ASSERT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  ASSERT_EQ(NodeApplied(c_, w.r1), 1u);

  // Between versions: RegisterWorker again, alone first - before its RegisterLayout the worker
  // still has its layout at the coordinator and its applied version on its node (a new
  // registration would have neither).
  ASSERT_TRUE(c_.RegisterWorker(w.r1, spec).ok());
  const pb::WorkerStatus rec = CoordinatorRecord(c_, w.r1, "r1");
  EXPECT_TRUE(rec.has_layout()) << "the coordinator registered r1 anew";
  EXPECT_FALSE(rec.catching_up());
  EXPECT_EQ(NodeApplied(c_, w.r1), 1u) << "the node replaced r1's entry";
  ASSERT_TRUE(c_.RegisterLayout(w.r1, spec).ok());
  ASSERT_TRUE(c_.RegisterWorker(w.t1, spec).ok());
  ASSERT_TRUE(c_.RegisterLayout(w.t1, spec).ok());
  EXPECT_EQ(NodeApplied(c_, w.r1), 1u);
  EXPECT_FALSE(CoordinatorRecord(c_, w.r1, "r1").catching_up());

  // Mid-version: version 2 is held on n1 before a bucket while r1 and t1 (both on n1) replay
  // their registrations; it commits (not aborted: nobody "registered again").
  armed = true;
  std::vector<grpc::Status> published;
  std::thread publisher([&] { published = c_.Publish("m", mode, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1}); });
  const bool held = entered.WaitForNotificationWithTimeout(absl::Seconds(15));
  std::vector<grpc::Status> replays;
  if (held) {
    for (TestWorker* x : {&w.r1, &w.t1}) {
      replays.push_back(c_.RegisterWorker(*x, spec));
      replays.push_back(c_.RegisterLayout(*x, spec));
    }
  }
  release.Notify();
  publisher.join();
  ASSERT_TRUE(held) << "version 2 never ran on n1";
  for (grpc::Status& s : replays) EXPECT_TRUE(s.ok()) << s.error_message();
  for (grpc::Status& s : published) ASSERT_TRUE(s.ok()) << "publish v2: " << s.error_message();
  EXPECT_EQ(c_.FinalVersion(2).state(), "committed");
  for (TestWorker* r : {&w.r0, &w.r1}) {
    ASSERT_TRUE(Receive(c_, *r, mode, 2).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
}

// The same process registering r1 with a different request (another gpu) is a new registration,
// as before: the coordinator drops r1 and adds it afresh (no layout yet), the node forgets what it
// held, and once its layout is back r1 is caught up to the committed version from r0.
TEST_P(ReregisterTest, ADifferentRequestFromTheSameProcessRegistersAnew) {
  const pb::Mode mode = GetParam();
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  for (grpc::Status& s : c_.Publish("m", mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) ASSERT_TRUE(Receive(c_, *r, mode, 1).ok()) << r->id;
  ASSERT_TRUE(c_.RegisterWorker(w.r1, spec, ::getpid(), /*gpu=*/0).ok());
  EXPECT_FALSE(CoordinatorRecord(c_, w.r1, "r1").has_layout());
  EXPECT_EQ(NodeApplied(c_, w.r1), 0u);
  std::memset(w.r1.seg.data(), 0, w.r1.seg.size());
  ASSERT_TRUE(c_.RegisterLayout(w.r1, spec).ok());
  grpc::Status s = Receive(c_, w.r1, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(w.r1, 1), 0);
  for (grpc::Status& p : c_.Publish("m", mode, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(p.ok()) << p.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) {
    ASSERT_TRUE(Receive(c_, *r, mode, 2).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
}

// The same registration, then a layout with other memory (a process that rebuilt its buffers
// and registers them under the same request): the repeated RegisterWorker was no replay, so its
// RegisterLayout registers the worker anew - r1 is caught up into its new memory.
TEST_P(ReregisterTest, TheSameRegistrationWithOtherMemoryRegistersAnew) {
  const pb::Mode mode = GetParam();
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  for (grpc::Status& s : c_.Publish("m", mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) ASSERT_TRUE(Receive(c_, *r, mode, 1).ok()) << r->id;
  TestWorker& r1b = c_.AddWorker("r1", pb::ROLE_ROLLOUT, 1, &inv_, w.r1.layout);  // new, zeroed memory
  ASSERT_TRUE(c_.RegisterWorker(r1b, spec).ok());
  ASSERT_TRUE(c_.RegisterLayout(r1b, spec).ok());
  grpc::Status s = Receive(c_, r1b, mode, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(r1b, 1), 0) << "r1's new memory was not caught up";
}

// A segment that shrank (or faulted under a copy) is refused until the worker registers its layout
// again; that registration is checked and maps the memory anew even when its request is the same:
// the same layout over a segment that is still short is refused, not answered "unchanged".
TEST_P(ReregisterTest, TheSameLayoutOverABrokenSegmentIsCheckedAgain) {
  const pb::Mode mode = GetParam();
  if (mode != pb::MODE_ASYNC) GTEST_SKIP() << "the copy into live memory is r1's own Apply in async mode";
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  for (grpc::Status& s : c_.Publish("m", mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) ASSERT_TRUE(Receive(c_, *r, mode, 1).ok()) << r->id;
  for (grpc::Status& s : c_.Publish("m", mode, 2, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  // r1 truncates its segment: its Apply(2) is refused naming the segment.
  const int fd = ::shm_open(w.r1.seg.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  const off_t size = static_cast<off_t>(w.r1.seg.size());
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  pb::ApplyResponse resp;
  EXPECT_FALSE(c_.Apply(w.r1, "m", 2, &resp).ok()) << "a copy into a truncated segment must fail";
  // The same registration while the segment is still short: checked again, refused.
  ASSERT_TRUE(c_.RegisterWorker(w.r1, spec).ok());
  grpc::Status short_layout = c_.RegisterLayout(w.r1, spec);
  EXPECT_FALSE(short_layout.ok()) << "the same layout over a truncated segment was answered unchanged";
  // Restored: registered again, r1 gets version 2 whole.
  ASSERT_EQ(::ftruncate(fd, size), 0);
  ::close(fd);
  ASSERT_TRUE(c_.RegisterWorker(w.r1, spec).ok());
  ASSERT_TRUE(c_.RegisterLayout(w.r1, spec).ok());
  grpc::Status s = Receive(c_, w.r1, mode, 2);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountBad(w.r1, 2), 0);
}

// A rollout holding a version registers the same layout again, alone (no RegisterWorker), over new
// zeroed memory: under the same shm name (a new file), under a new name, and under the same name
// after the old file was cut short. Its live weights hold nothing: the node registers it anew, the
// coordinator counts it as holding nothing, and Receive answers only once the version is in the
// new memory (caught up from r0), byte for byte. Before: the same name was answered "unchanged"
// (the node kept writing the old, unlinked file; Receive OK over zeros), a new name was refused
// (another layout under the plan), a cut-short file was mapped anew but kept its applied version
// (Receive OK over zeros).
TEST_P(ReregisterTest, TheSameLayoutOverNewMemoryIsCaughtUpIntoIt) {
  const pb::Mode mode = GetParam();
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  struct Case { const char* what; bool same_name, truncate_old; };
  const Case cases[] = {{"same name, new file", true, false}, {"new name", false, false}, {"same name, old file cut short", true, true}};
  uint64_t v = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    ++v;
    for (grpc::Status& s : c_.Publish("m", mode, v, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
    for (TestWorker* r : {&w.r0, &w.r1}) {
      ASSERT_TRUE(Receive(c_, *r, mode, v).ok()) << r->id;
      ASSERT_EQ(CountBad(*r, v), 0) << r->id;
    }
    NewZeroedSegment(w.r1, k.same_name, k.truncate_old);
    ASSERT_FALSE(HasFatalFailure());
    grpc::Status reg = c_.RegisterLayout(w.r1, spec);
    ASSERT_TRUE(reg.ok()) << reg.error_message();
    grpc::Status s = Receive(c_, w.r1, mode, v);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(CountBad(w.r1, v), 0) << "version " << v << " reported to r1 while its new memory does not hold it";
  }
  ++v;
  for (grpc::Status& s : c_.Publish("m", mode, v, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) {
    ASSERT_TRUE(Receive(c_, *r, mode, v).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, v), 0) << r->id;
  }
}

// While a rollout registered over new memory holds nothing it is never a catch-up source: r0
// leaves, r1 (the only rollout holding version 1) registers its layout over new zeroed memory,
// and a late r2 registers. Nobody holds version 1 any more: both are told so (ABORTED naming why,
// never OK over zeros - before, r2 was "caught up" with r1's zeros and the catch-up's digests
// agreed, both read and landed zeros), and version 2 then reaches both whole.
TEST_P(ReregisterTest, ARolloutOverNewMemoryIsNoCatchUpSource) {
  const pb::Mode mode = GetParam();
  const pb::ModelSpec spec = SmallSpec(mode, pb::STRATEGY_WEIGHTBRIDGE);
  TwoNodeWorkers w = StartTwoNodeCluster(c_, inv_, {mode});
  ASSERT_FALSE(HasFatalFailure());
  for (grpc::Status& s : c_.Publish("m", mode, 1, {&w.t0, &w.t1}, {&w.r0, &w.r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r0, &w.r1}) ASSERT_TRUE(Receive(c_, *r, mode, 1).ok()) << r->id;
  ASSERT_TRUE(Deregister(w.r0).ok());
  NewZeroedSegment(w.r1, /*same_name=*/true, /*truncate_old=*/true);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(c_.RegisterLayout(w.r1, spec).ok());
  TestWorker& r2 = c_.AddWorker("r2", pb::ROLE_ROLLOUT, 0, &inv_, LayoutOf(inv_, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  ASSERT_TRUE(c_.Register(r2, spec).ok());
  for (TestWorker* r : {&w.r1, &r2}) {
    grpc::Status s = Receive(c_, *r, mode, 1);
    if (s.ok()) {
      ADD_FAILURE() << r->id << ": version 1 reported although no rollout holds it; wrong elements: " << CountBad(*r, 1);
      continue;
    }
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << r->id << ": " << s.error_message();
    EXPECT_NE(s.error_message().find("no rollout holds version 1"), std::string::npos) << r->id << ": " << s.error_message();
  }
  for (grpc::Status& s : c_.Publish("m", mode, 2, {&w.t0, &w.t1}, {&w.r1, &r2})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&w.r1, &r2}) {
    ASSERT_TRUE(Receive(c_, *r, mode, 2).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ReregisterTest, ::testing::Values(pb::MODE_SYNC, pb::MODE_ONE_STEP_OFF, pb::MODE_ASYNC),
                         [](const ::testing::TestParamInfo<pb::Mode>& p) { return pb::Mode_Name(p.param); });

}  // namespace
}  // namespace wb::daemon
