// node::Versions + node::WorkerCalls on a FakeClock, host_shm, no coordinator (status.md item 25):
// Apply copies a rollout's committed staging into its live weights with the layout that staging
// landed with (the plan of the execution CommitVersion committed), whatever plans are installed
// by the time Apply runs. Before, Apply looked the worker up in the installed plans only, and a
// rollout a re-plan was made without (here) was refused FAILED_PRECONDITION with its version staged
// until some plan listed it again - nothing re-plans or catches it up for that reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/clock.h"
#include "base/shm_segment.h"
#include "daemon/convert.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/fake_gpu_import.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/versions.h"
#include "daemon/node/worker_calls.h"
#include "daemon/testing/node_parts.h"

namespace wb::daemon::node {
namespace {

// Every call UNAVAILABLE (no coordinator), except that ReportDone - the node's executor saying the
// version landed here - is counted and wakes the test (the version may be committed from then on).
class DoneClient final : public CoordinatorClient {
 public:
#define WB_ABSENT_(Name, Req, Resp) \
  absl::Status Name(const pb::Req& r, pb::Resp* p, absl::Duration t) override { return absent_.Name(r, p, t); }
  WB_ABSENT_(RegisterNode, RegisterNodeRequest, RegisterNodeResponse)
  WB_ABSENT_(Heartbeat, HeartbeatRequest, HeartbeatResponse)
  WB_ABSENT_(JoinWorker, JoinWorkerRequest, JoinWorkerResponse)
  WB_ABSENT_(SubmitLayout, SubmitLayoutRequest, SubmitLayoutResponse)
  WB_ABSENT_(LeaveWorker, LeaveWorkerRequest, LeaveWorkerResponse)
  WB_ABSENT_(Publish, CoordPublishRequest, PublishResponse)
  WB_ABSENT_(ReportReady, ReportReadyRequest, ReportReadyResponse)
  WB_ABSENT_(ReportApplied, ReportAppliedRequest, ReportAppliedResponse)
  WB_ABSENT_(WaitVersion, WaitVersionRequest, WaitVersionResponse)
  WB_ABSENT_(ExchangeMagnitudes, ExchangeMagnitudesRequest, ExchangeMagnitudesResponse)
  WB_ABSENT_(ClusterStatus, StatusRequest, StatusResponse)
  WB_ABSENT_(Drain, DrainRequest, DrainResponse)
#undef WB_ABSENT_
  absl::Status ReportDone(const pb::ReportDoneRequest& req, pb::ReportDoneResponse*, absl::Duration) override {
    absl::MutexLock l(&mu_);
    done_[req.version()] = req.ok() ? "" : req.error();
    return absl::OkStatus();
  }
  // Until version `v` was reported done (bounded in real time: the executor runs on its own
  // thread); its error ("" when it landed), or "not reported" at the timeout.
  std::string AwaitDone(uint64_t v, absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto reported = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return done_.count(v) > 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&reported), timeout)) return "not reported";
    return done_[v];
  }

 private:
  UnstartedCoordinatorClient absent_{"n0"};
  absl::Mutex mu_;
  std::map<uint64_t, std::string> done_ ABSL_GUARDED_BY(mu_);
};

class NoSession final : public CoordinatorAccess {
 public:
  CoordinatorClient& client() override { return client_; }
  bool AwaitRegistered(absl::Time) override { return false; }
  uint64_t session() override { return 0; }
  std::optional<std::string> AwaitCoordinatorChange(uint64_t, absl::Time) override { return std::nullopt; }
  void TrackProgress(const std::string&, uint64_t, std::weak_ptr<const std::atomic<uint64_t>>) override {}
  DoneClient client_;
};

constexpr int64_t kBytes = 8 * 16 * 4;  // tensor "a", f32 [8, 16], whole in r0's one buffer

class LandedWithTest : public ::testing::Test, public daemon::testing::NodeParts {
 protected:
  LandedWithTest() : NodeParts({}) {
    inv_.tensors = {{"a", {8, 16}, planner::DType::kF32}};
    Versions::Options vo;
    vo.node_id = "n0";
    vo.clock = &clock_;
    vo.metrics = &metrics_;
    // What "landed" in r0's staging: a byte per version (the slices here have no ops).
    vo.test_after_buckets = [](const std::string&, uint64_t v, const std::map<std::string, std::pair<uint8_t*, int64_t>>& regions) {
      auto r = regions.find("r0.b0");
      if (r != regions.end()) std::memset(r->second.first, static_cast<int>(0x40 + v), static_cast<size_t>(r->second.second));
    };
    versions_ = std::make_unique<Versions>(vo, *local_, channels_, *staging_, *transports_, coordinator_);
    WorkerCalls::Options wo;
    wo.node_id = "n0";
    wo.clock = &clock_;
    wo.metrics = &metrics_;
    wo.gpu_import = std::make_shared<FakeGpuImport>();
    calls_ = std::make_unique<WorkerCalls>(wo, *local_, *staging_, *versions_, *transports_, coordinator_);
  }
  ~LandedWithTest() override {
    calls_.reset();
    versions_.reset();
    local_.reset();
  }

  // One-step-off rollout r0 on n0 with one host buffer, its live memory filled with 0x11.
  void AddRollout() {
    LocalWorkers::Worker w;
    w.model_id = "m";
    w.role = planner::Role::kRollout;
    w.mode = pb::MODE_ONE_STEP_OFF;
    local_->Add({"m", "r0"}, std::move(w), inv_);
    auto seg = transport::ShmSegment::Create(transport::ShmSegment::UniqueName("landed"), kBytes);
    ASSERT_TRUE(seg.ok()) << seg.status();
    live_ = std::make_shared<transport::ShmSegment>(std::move(*seg));
    std::memset(live_->data(), 0x11, kBytes);
    pb::ResolvedLayout resolved;
    LayoutToProto(Layout(), inv_, Buffers(), &resolved);
    absl::StatusOr<uint64_t> attached = local_->AttachLayout({"m", "r0"}, {live_}, {nullptr}, pb::SubmitLayoutRequest(), resolved);
    ASSERT_TRUE(attached.ok()) << attached.status();
  }
  planner::WorkerLayout Layout() const {
    planner::WorkerLayout l;
    l.buffers = {{kBytes}};
    planner::Piece p;
    p.tensor = 0;
    p.box = {{0, 0}, {8, 16}};
    p.strides = {16, 1};
    l.pieces = {p};
    return l;
  }
  static convert::BufferSpecs Buffers() {
    convert::BufferSpecs b;
    pb::BufferSpec* s = b.Add();
    s->set_buffer_id(0);
    s->set_size_bytes(kBytes);
    return b;
  }
  // Plan epoch `epoch` of model m (one-step-off, no ops): rollout `rollout` on n0 with its layout
  // (r0's), and a trainer on n1.
  void Install(uint64_t epoch, const std::string& rollout) {
    pb::InstallPlanRequest req;
    pb::PlanSlice* s = req.mutable_slice();
    s->set_model_id("m");
    s->set_plan_epoch(epoch);
    s->set_mode(pb::MODE_ONE_STEP_OFF);
    s->set_num_buckets(1);
    InventoryToProto(inv_, s->mutable_tensors());
    pb::PlanWorker* t = s->add_workers();
    t->set_worker_id("t0");
    t->set_node_id("n1");
    t->set_role(pb::ROLE_TRAINER);
    pb::PlanWorker* r = s->add_workers();
    r->set_worker_id(rollout);
    r->set_node_id("n0");
    r->set_role(pb::ROLE_ROLLOUT);
    LayoutToProto(Layout(), inv_, Buffers(), r->mutable_layout());
    absl::Status installed = versions_->InstallPlan(req);
    ASSERT_TRUE(installed.ok()) << installed;
  }
  // Version v runs on plan epoch `epoch` and is committed here.
  void RunAndCommit(uint64_t v, uint64_t epoch) {
    pb::ExecuteVersionRequest e;
    e.set_model_id("m");
    e.set_version(v);
    e.set_plan_epoch(epoch);
    e.set_timeout_ms(60000);
    absl::Status started = versions_->ExecuteVersion(e);
    ASSERT_TRUE(started.ok()) << started;
    const std::string error = coordinator_.client_.AwaitDone(v, absl::Seconds(30));
    ASSERT_EQ(error, "") << "version " << v;
    pb::CommitVersionRequest c;
    c.set_model_id("m");
    c.set_version(v);
    absl::Status committed = versions_->CommitVersion(c);
    ASSERT_TRUE(committed.ok()) << committed;
  }
  absl::StatusOr<uint64_t> Apply(uint64_t v) {
    pb::ApplyRequest req;
    req.set_model_id("m");
    req.set_worker_id("r0");
    req.set_version(v);
    req.set_timeout_ms(10000);
    pb::ApplyResponse resp;
    absl::Status s = calls_->Apply(req, &resp);
    if (!s.ok()) return s;
    return resp.applied_version();
  }
  int64_t LiveBytesOf(uint8_t value) const {
    const uint8_t* p = static_cast<const uint8_t*>(live_->data());
    return std::count(p, p + kBytes, value);
  }

  planner::Inventory inv_;
  NoSession coordinator_;
  std::unique_ptr<WorkerCalls> calls_;
  std::shared_ptr<transport::ShmSegment> live_;
};

// Version 1 is committed for r0 under plan epoch 1; before r0 applies it, a re-plan without r0
// (epoch 2, another rollout in its place) is installed. Apply(1) copies version 1 with r0's layout
// from epoch 1: every live byte is version 1's. Before: FAILED_PRECONDITION ("no plan installed
// there lists the worker"), live weights unchanged and version 1 staged for good.
TEST_F(LandedWithTest, ApplyAfterAReplanWithoutTheRolloutCopiesWithTheLayoutItLandedWith) {
  AddRollout();
  ASSERT_FALSE(HasFatalFailure());
  Install(1, "r0");
  ASSERT_FALSE(HasFatalFailure());
  RunAndCommit(1, 1);
  ASSERT_FALSE(HasFatalFailure());
  Install(2, "r1");  // the re-plan, made without r0
  ASSERT_FALSE(HasFatalFailure());
  absl::StatusOr<uint64_t> applied = Apply(1);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(*applied, 1u);
  EXPECT_EQ(LiveBytesOf(0x41), kBytes) << "live weights do not hold version 1";
  std::optional<LocalWorkers::View> view = local_->Get({"m", "r0"});
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->worker.applied_version, 1u);
}

// The plan a staging landed with is that staging's, not the worker's newest: version 2 committed
// under a plan listing r0 again is applied with it, and a staging committed outside any execution
// whose worker no installed plan lists (its layout truly unknown) is still refused, live weights
// untouched.
TEST_F(LandedWithTest, OnlyTheStagingCommittedWithAPlanIsAppliedByIt) {
  AddRollout();
  ASSERT_FALSE(HasFatalFailure());
  Install(1, "r0");
  ASSERT_FALSE(HasFatalFailure());
  RunAndCommit(1, 1);
  ASSERT_FALSE(HasFatalFailure());
  Install(2, "r0");
  ASSERT_FALSE(HasFatalFailure());
  RunAndCommit(2, 2);
  ASSERT_FALSE(HasFatalFailure());
  Install(3, "r1");
  ASSERT_FALSE(HasFatalFailure());
  absl::StatusOr<uint64_t> applied = Apply(2);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(LiveBytesOf(0x42), kBytes) << "live weights do not hold version 2";
  // A staging the node never committed through an execution (no plan it landed with).
  auto other = std::make_shared<StagedBytes>(1);
  (*other)[0].host.assign(kBytes, 0x77);
  EXPECT_TRUE(local_->Commit("m", 3, {{"r0", other}}, {}).empty());
  applied = Apply(3);
  EXPECT_EQ(applied.status().code(), absl::StatusCode::kFailedPrecondition) << applied.status();
  EXPECT_NE(applied.status().message().find("no plan installed there lists the worker"), std::string::npos) << applied.status();
  EXPECT_EQ(LiveBytesOf(0x42), kBytes) << "live weights written from a staging of unknown layout";
}

}  // namespace
}  // namespace wb::daemon::node
