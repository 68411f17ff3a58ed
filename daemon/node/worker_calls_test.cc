// node::WorkerCalls on fakes (FakeClock, no coordinator): worker-call deadlines are on the
// injected clock - Apply's wait for a version ends in simulated time, and a forwarded call held
// while the node is not registered waits until the call's own deadline on that clock.
#include "daemon/node/worker_calls.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "daemon/metrics.h"
#include "daemon/node/channel_cache.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/fake_gpu_import.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/node_staging.h"
#include "daemon/node/node_transports.h"
#include "daemon/node/versions.h"
#include "daemon/testing/node_parts.h"
#include "daemon/testing/sim_deadline.h"
#include "transport/config.h"
#include "transport/factory.h"
#include "transport/host_shm/host_shm.h"

namespace wb::daemon::node {
namespace {

// Never registered: AwaitRegistered waits on the clock until its deadline (as CoordinatorSession's
// does) and records the deadlines it was given.
class UnregisteredCoordinator final : public CoordinatorAccess {
 public:
  explicit UnregisteredCoordinator(Clock* clock) : clock_(clock) {}
  ~UnregisteredCoordinator() override { clock_->Forget(&mu_); }
  CoordinatorClient& client() override { return client_; }
  bool AwaitRegistered(absl::Time deadline) override {
    absl::MutexLock l(&mu_);
    deadlines_.push_back(deadline);
    bool never = false;
    return clock_->WaitUntil(&mu_, absl::Condition(&never), deadline);
  }
  uint64_t session() override { return 0; }
  std::optional<std::string> AwaitCoordinatorChange(uint64_t, absl::Time) override { return std::nullopt; }
  void TrackProgress(const std::string&, uint64_t, std::weak_ptr<const std::atomic<uint64_t>>) override {}
  std::vector<absl::Time> deadlines() {
    absl::MutexLock l(&mu_);
    return deadlines_;
  }

 private:
  Clock* clock_;
  absl::Mutex mu_;
  std::vector<absl::Time> deadlines_ ABSL_GUARDED_BY(mu_);
  UnstartedCoordinatorClient client_{"n0"};
};

// The node's parts on a FakeClock (daemon/testing/node_parts.h) + WorkerCalls over them.
class WorkerCallsTest : public ::testing::Test, public daemon::testing::NodeParts {
 protected:
  WorkerCallsTest() : NodeParts({}), coordinator_(&clock_) {
    MakeVersions(coordinator_);
    WorkerCalls::Options wo;
    wo.node_id = "n0";
    wo.clock = &clock_;
    wo.metrics = &metrics_;
    wo.gpu_import = std::make_shared<FakeGpuImport>();
    wo.worker_uid = [this](const std::string& model, const std::string& worker) -> absl::StatusOr<uid_t> {
      if (model != "m" || worker != "t0") return absl::NotFoundError(absl::StrCat("worker ", worker, " is not bound"));
      return worker_uid_;
    };
    calls_ = std::make_unique<WorkerCalls>(wo, *local_, *staging_, *versions_, *transports_, coordinator_);
  }
  ~WorkerCallsTest() override {
    calls_.reset();
    versions_.reset();
    local_.reset();
  }

  UnregisteredCoordinator coordinator_;
  uid_t worker_uid_ = ::getuid();  // the uid the worker socket bound t0 of m to
  std::unique_ptr<WorkerCalls> calls_;
};

TEST_F(WorkerCallsTest, ApplyWaitsForTheVersionUntilItsDeadlineOnTheClock) {
  LocalWorkers::Worker w;
  w.model_id = "m";
  w.role = planner::Role::kRollout;
  local_->Add({"m", "rollout/0"}, std::move(w), std::nullopt);
  const absl::Time deadline = clock_.Now() + absl::Seconds(5);
  absl::Status applied = daemon::testing::EndsAtSimulatedDeadline(clock_, deadline, [&] {
    pb::ApplyRequest req;
    req.set_model_id("m");
    req.set_worker_id("rollout/0");
    req.set_version(2);
    req.set_timeout_ms(5000);
    pb::ApplyResponse resp;
    return calls_->Apply(req, &resp);
  });
  EXPECT_EQ(applied.code(), absl::StatusCode::kDeadlineExceeded) << applied;
  EXPECT_NE(applied.message().find("version 2 not committed on node n0 in time"), std::string::npos) << applied;
}

TEST_F(WorkerCallsTest, ForwardedCallIsHeldWhileUnregisteredUntilItsDeadlineOnTheClock) {
  const absl::Time deadline = clock_.Now() + absl::Seconds(3);
  absl::Status began = daemon::testing::EndsAtSimulatedDeadline(clock_, deadline, [&] {
    pb::BeginUpdateRequest req;
    req.set_model_id("m");
    req.set_worker_id("rollout/0");
    req.set_timeout_ms(3000);
    pb::BeginUpdateResponse resp;
    return calls_->BeginUpdate(req, &resp);
  });
  EXPECT_EQ(began.code(), absl::StatusCode::kUnavailable) << began;
  EXPECT_NE(began.message().find("node n0 is not registered with the coordinator"), std::string::npos) << began;
  EXPECT_NE(began.message().find("worker rollout/0 of model m"), std::string::npos) << began;
  ASSERT_EQ(coordinator_.deadlines().size(), 1u);
  EXPECT_EQ(coordinator_.deadlines()[0], deadline);
}

TEST_F(WorkerCallsTest, PublishByAWorkerWithoutLayoutNamesWorkerModelAndNode) {
  pb::PublishRequest req;
  req.set_model_id("m");
  req.set_worker_id("trainer/0");
  req.set_version(1);
  pb::PublishResponse resp;
  absl::Status s = calls_->Publish(req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("worker trainer/0 of model m has no layout on node n0"), std::string::npos) << s;
}

// Helper 122: a one-step-off rollout r0 holds committed version 1 in its staging, but the plan
// installed on its node does not list it (a re-plan made without it, a catch-up slice replaced by
// another rollout's): its live layout is unknown. Apply(1) copied nothing and answered OK over
// unchanged live weights; it is FAILED_PRECONDITION naming worker, model, version and why, and the
// staging stays: once a plan lists r0 (here with no pieces: OK is right then) Apply(1) lands.
TEST_F(WorkerCallsTest, ApplyForAWorkerNoInstalledPlanListsIsRefusedNotAnsweredOk) {
  auto install = [&](uint64_t epoch, const std::string& rollout) {
    pb::InstallPlanRequest req;
    pb::PlanSlice* s = req.mutable_slice();
    s->set_model_id("m");
    s->set_plan_epoch(epoch);
    s->set_mode(pb::MODE_ONE_STEP_OFF);
    s->set_num_buckets(1);
    pb::PlanWorker* r = s->add_workers();
    r->set_worker_id(rollout);
    r->set_node_id("n0");
    r->set_role(pb::ROLE_ROLLOUT);
    absl::Status installed = versions_->InstallPlan(req);
    EXPECT_TRUE(installed.ok()) << installed;
  };
  LocalWorkers::Worker w;
  w.model_id = "m";
  w.role = planner::Role::kRollout;
  w.mode = pb::MODE_ONE_STEP_OFF;
  local_->Add({"m", "r0"}, std::move(w), std::nullopt);
  auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("unplanned"), 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  auto live = std::make_shared<transport::ShmSegment>(std::move(*seg));
  std::memset(live->data(), 0x11, 4096);
  ASSERT_TRUE(local_->AttachLayout({"m", "r0"}, {live}, {nullptr}, pb::SubmitLayoutRequest(), pb::ResolvedLayout()).ok());
  auto staged = std::make_shared<StagedBytes>(1);
  (*staged)[0].host.assign(4096, 0xAB);
  EXPECT_TRUE(local_->Commit("m", 1, {{"r0", staged}}, {}).empty());  // one-step-off: no copy at commit
  install(1, "r1");                                                    // the model's plan, without r0
  auto apply = [&] {
    pb::ApplyRequest req;
    req.set_model_id("m");
    req.set_worker_id("r0");
    req.set_version(1);
    req.set_timeout_ms(10000);
    pb::ApplyResponse resp;
    absl::Status s = calls_->Apply(req, &resp);
    return s.ok() ? absl::StatusOr<uint64_t>(resp.applied_version()) : absl::StatusOr<uint64_t>(s);
  };
  absl::StatusOr<uint64_t> applied = apply();
  EXPECT_EQ(applied.status().code(), absl::StatusCode::kFailedPrecondition) << applied.status();
  for (const std::string& want : {std::string("version 1 of model m is committed on node n0 for worker r0"),
                                  std::string("no plan installed there lists the worker"), std::string("live weights still hold version 0")}) {
    EXPECT_NE(applied.status().message().find(want), std::string::npos) << want << " missing in: " << applied.status();
  }
  const uint8_t* p = static_cast<const uint8_t*>(live->data());
  EXPECT_EQ(std::count(p, p + 4096, 0x11), 4096) << "live weights written";
  std::optional<LocalWorkers::View> v = local_->Get({"m", "r0"});
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->worker.applied_version, 0u);
  EXPECT_EQ(v->worker.committed, staged) << "the staging is kept for a later Apply";
  // A plan listing r0 (no pieces in it): Apply(1) answers OK from the kept staging.
  install(2, "r0");
  applied = apply();
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(*applied, 1u);
}

// M3 of the hostile review: the front checks a segment's owner on a descriptor of its own and
// closes it; the node opened the name again and checked only mode and size, so a name replaced in
// between by another uid's segment was mapped. The node checks the owner on the descriptor it
// maps: a segment owned by another uid than the worker's is PERMISSION_DENIED naming worker,
// buffer, segment and both uids. (Root gives the segment to uid 65534, as a swap would.)
TEST_F(WorkerCallsTest, RegisterLayoutRefusesASegmentNotOwnedByTheWorkersUid) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a segment to another uid";
  LocalWorkers::Worker w;
  w.model_id = "m";
  w.role = planner::Role::kTrainer;
  local_->Add({"m", "t0"}, std::move(w), std::nullopt);
  auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("owner"), 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  const int fd = ::shm_open(seg->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchown(fd, 65534, 65534), 0);
  ::close(fd);
  pb::RegisterLayoutRequest req;
  req.set_model_id("m");
  req.set_worker_id("t0");
  pb::BufferSpec* b = req.add_buffers();
  b->set_buffer_id(3);
  b->set_shm_name(seg->name());
  b->set_size_bytes(4096);
  pb::RegisterLayoutResponse resp;
  absl::Status s = calls_->RegisterLayout(req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  for (const std::string& want : {std::string("worker t0 of model m buffer 3"), absl::StrCat("'", seg->name(), "'"),
                                  std::string("owned by uid 65534, not by the worker's uid "), absl::StrCat(::getuid())}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << " missing in: " << s;
  }
  // The same segment for a worker bound to its owner passes the check (and fails later: no
  // coordinator here - the node is never registered, and no time is left to wait for it), so the
  // refusal above is the owner's.
  worker_uid_ = 65534;
  s = calls_->RegisterLayout(req, &resp, absl::ZeroDuration());
  EXPECT_EQ(s.message().find("owned by uid"), std::string::npos) << s;
}

}  // namespace
}  // namespace wb::daemon::node
