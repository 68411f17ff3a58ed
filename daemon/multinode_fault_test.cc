// Faults on a coordinator + two node daemons in one process (daemon/multinode_fixture.h): lost
// leases, coordinator and peer restarts, stale reports, dead worker processes, resource leaks.
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/convert.h"
#include "daemon/multinode_fixture.h"
#include "transport/factory.h"
#include "transport/transport.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// The lease tests freeze n1 inside version 2's executor: Hold (on the executor's thread, from the
// before-bucket hook) stops its heartbeats (`frozen` is the node's heartbeat gate) and blocks until
// Thaw (at most 20 s); `entered` tells the test it is frozen.
struct Freeze {
  absl::Notification entered, release;
  std::atomic<bool> frozen{false};
  void Hold() {
    frozen = true;
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  }
  void Thaw() {
    frozen = false;
    release.Notify();
  }
  // Thaw unless thawed (a StopAtExit's release; only the test's thread thaws).
  void ThawOnce() {
    if (!release.HasBeenNotified()) Thaw();
  }
};

// The lease tests' model: one-step-off, WeightBridge plans.
pb::ModelSpec LeaseTestSpec() { return SmallSpec(pb::MODE_ONE_STEP_OFF, pb::STRATEGY_WEIGHTBRIDGE); }

// The lease tests' start: all four workers registered, version 1 (one-step-off) published and
// applied by r0, byte for byte.
void RegisterAndApplyVersion1(Cluster& c, TestWorker& t0, TestWorker& t1, TestWorker& r0, TestWorker& r1) {
  const pb::ModelSpec spec = LeaseTestSpec();
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse resp;
  ASSERT_TRUE(c.Apply(r0, "m", 1, &resp).ok());
  ASSERT_EQ(CountBad(r0, 1), 0);
}

// After n1 lost its lease and thawed: it registers again within a heartbeat (until then the
// coordinator refuses JoinWorker, node not alive: wait for it on the coordinator's status push),
// its workers t1 and r1 register again (as clients do after NOT_FOUND), and version 3 reaches
// both rollouts byte for byte.
void ExpectN1RejoinsAndVersion3Lands(Cluster& c, TestWorker& t0, TestWorker& t1, TestWorker& r0, TestWorker& r1) {
  const pb::ModelSpec spec = LeaseTestSpec();
  auto back = c.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        for (const pb::NodeStatus& n : st.nodes()) {
          if (n.node_id() == "n1") return n.alive();
        }
        return false;
      },
      absl::Seconds(10));
  ASSERT_TRUE(back.ok()) << "n1 did not register again: " << back.status();
  for (TestWorker* w : {&t1, &r1}) {
    grpc::Status reg = c.Register(*w, spec);
    ASSERT_TRUE(reg.ok()) << w->id << ": " << reg.error_message();
  }
  for (auto& st : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(st.ok()) << st.error_message();
  pb::ApplyResponse resp;
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(c.Apply(*r, "m", 3, &resp).ok()) << r->id;
    EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  }
}

// Node n1 freezes while version 2 is mid-transfer (its executor hangs in bucket 0, its heartbeats
// stop): its lease expires, the version is aborted, the rollout on n0 still holds version 1 byte
// for byte and its waiter gets ABORTED. When n1 thaws it re-registers (new incarnation), its
// workers register again and version 3 goes through.
TEST(FaultTest, LeaseExpiresMidTransferAbortsAndKeepsPrevious) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator(absl::Milliseconds(600));
  Freeze n1;
  const StopAtExit stop(c, [&] { n1.ThawOnce(); });  // the nodes stop before the hooks' locals go
  c.StartNode(0);
  // The hook runs before every bucket and freezes only the first (bucket 0 of version 2). After
  // the thaw the executor may well reach bucket 1 of the aborted version: its bucket-0 posts go
  // out without error when n0 has not closed the data connection yet (n0's AbortVersion wakes the
  // waiters, which lets this test release n1, before it drops the version's channels). Before,
  // that second call notified `entered` again (absl::Notification: "Notify() called more than
  // once", a crash in CI) and would have frozen n1's heartbeats for good.
  c.StartNode(1, [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 2 || n1.entered.HasBeenNotified()) return;  // the executor's thread only: no race
    n1.Hold();
  }, [&] { return n1.frozen.load(); });
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  ASSERT_NO_FATAL_FAILURE(RegisterAndApplyVersion1(c, t0, t1, r0, r1));
  pb::ApplyResponse resp;

  // Version 2: publishes return (one-step-off), the transfer starts, n1 freezes in it.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(n1.entered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  grpc::Status s = c.Apply(r0, "m", 2, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("node n1 lost its lease"), std::string::npos) << s.error_message();
  EXPECT_EQ(CountBad(r0, 1), 0) << "rollout weights must still be exactly version 1";
  {
    pb::StatusResponse status = c.Status(r0);
    bool saw_aborted = false;
    for (const pb::VersionStatus& v : status.versions()) {
      if (v.version() == 2) saw_aborted = v.state() == "aborted";
    }
    EXPECT_TRUE(saw_aborted);
    for (const pb::NodeStatus& n : status.nodes()) {
      if (n.node_id() == "n1") {
        EXPECT_FALSE(n.alive()) << "n1 must have lost its lease";
      }
    }
  }
  // Thaw: n1's executor fails on the torn-down channel, its next heartbeat is refused and it
  // registers again; its workers re-register (as clients do after NOT_FOUND) and v3 succeeds.
  n1.Thaw();
  ExpectN1RejoinsAndVersion3Lands(c, t0, t1, r0, r1);
  c.Stop();
}

// host_tcp whose Disconnect waits, once armed, until `gate` is notified (at most 30 s): a node
// whose teardown of an aborted version's channels is slow (descheduled, as on a loaded machine).
class SlowDisconnectTransport final : public transport::Transport {
 public:
  SlowDisconnectTransport(transport::TransportSet inner, std::atomic<bool>* armed, absl::Notification* gate)
      : inner_(std::move(inner)), t_(inner_.Find("host_tcp")), armed_(armed), gate_(gate) {}

  transport::Capabilities capabilities() const override { return t_->capabilities(); }
  std::string instance_id() const override { return t_->instance_id(); }
  absl::StatusOr<std::string> ExportEndpoint(absl::string_view peer) override { return t_->ExportEndpoint(peer); }
  using transport::Transport::Connect;
  absl::StatusOr<transport::PeerId> Connect(absl::string_view endpoint, absl::string_view round, absl::Time deadline) override {
    return t_->Connect(endpoint, round, deadline);
  }
  absl::Status CancelRound(absl::string_view round) override { return t_->CancelRound(round); }
  absl::Status Disconnect(transport::PeerId peer) override {
    if (armed_->exchange(false)) gate_->WaitForNotificationWithTimeout(absl::Seconds(30));
    return t_->Disconnect(peer);
  }
  absl::StatusOr<transport::RegionHandle> RegisterMemory(const transport::MemorySpec& spec) override { return t_->RegisterMemory(spec); }
  absl::StatusOr<std::string> ExportDescriptor(transport::RegionHandle r) override { return t_->ExportDescriptor(r); }
  absl::StatusOr<transport::RegionHandle> ImportDescriptor(absl::string_view d) override { return t_->ImportDescriptor(d); }
  absl::StatusOr<transport::RegionInfo> Describe(transport::RegionHandle r) const override { return t_->Describe(r); }
  absl::Status Release(transport::RegionHandle r) override { return t_->Release(r); }
  absl::StatusOr<transport::BatchId> Post(const transport::Batch& batch) override { return t_->Post(batch); }
  absl::StatusOr<transport::BatchState> Poll(transport::BatchId b) override { return t_->Poll(b); }
  absl::Status Wait(transport::BatchId b, absl::Time deadline) override { return t_->Wait(b, deadline); }
  transport::TransportStats stats() const override { return t_->stats(); }

 private:
  transport::TransportSet inner_;
  transport::Transport* t_;
  std::atomic<bool>* armed_;
  absl::Notification* gate_;
};

// The interleaving behind LeaseExpiresMidTransferAbortsAndKeepsPrevious' CI crash, made certain:
// n0 wakes version 2's waiters (the Apply below returns ABORTED) before it drops the version's
// channels, and here that drop is held until n1, thawed, has run on into bucket 1 of the version
// the coordinator aborted (its bucket-0 posts went out on the still-open connection). n1's late
// bytes must not reach n0's rollout (still exactly version 1), n1 must come back, and version 3
// must land everywhere. The hook freezes only its first call; a hook that froze every call of
// version 2 (as that test's did) crashed here with "Notify() called more than once".
TEST(FaultTest, ThawedNodeRunsOnIntoItsAbortedVersionHarmlessly) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator(absl::Milliseconds(600));
  std::atomic<bool> disconnect_armed{false};
  absl::Notification gate;
  Freeze n1;
  absl::Notification later_bucket;
  const StopAtExit stop(c, [&] {  // the nodes stop before the locals of the hooks and the transport go
    NotifyOnce(gate);
    n1.ThawOnce();
  });
  c.StartNode(0, nullptr, nullptr, [&](ServerOptions& o) {
    o.make_transports = [&] {
      return HostTransportsWrappingTcp([&](transport::TransportSet tcp) -> std::unique_ptr<transport::Transport> {
        return std::make_unique<SlowDisconnectTransport>(std::move(tcp), &disconnect_armed, &gate);
      });
    };
  });
  c.StartNode(1, [&](const std::string&, uint64_t version, uint32_t bucket) {
    if (version != 2) return;
    if (n1.entered.HasBeenNotified()) {  // the executor's thread only: no race with the first call
      if (bucket > 0 && !later_bucket.HasBeenNotified()) later_bucket.Notify();
      return;
    }
    n1.Hold();
  }, [&] { return n1.frozen.load(); });
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  ASSERT_NO_FATAL_FAILURE(RegisterAndApplyVersion1(c, t0, t1, r0, r1));
  pb::ApplyResponse resp;

  // Armed before version 2 (nothing disconnects while it runs until the abort), not after n1
  // froze: a test thread descheduled past the 600 ms lease would arm it too late.
  disconnect_armed = true;  // n0's next Disconnect (its abort's drop of the n1 channel) waits for the gate
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(n1.entered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  grpc::Status s = c.Apply(r0, "m", 2, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("node n1 lost its lease"), std::string::npos) << s.error_message();
  n1.Thaw();
  const bool ran_on = later_bucket.WaitForNotificationWithTimeout(absl::Seconds(20));
  gate.Notify();
  ASSERT_TRUE(ran_on) << "n1 did not reach bucket 1 of version 2 while n0 kept the channel open";
  EXPECT_EQ(CountBad(r0, 1), 0) << "rollout weights must still be exactly version 1";

  ExpectN1RejoinsAndVersion3Lands(c, t0, t1, r0, r1);
  c.Stop();
}

// The coordinator restarts (new process state) while version 2 is in flight: nodes notice the new
// instance, abort the version locally (waiters: ABORTED naming the restart; rollouts keep version 1
// byte for byte), re-submit models, workers and layouts, and version 3 succeeds with the same
// worker processes and connections (no worker registers again).
TEST(FaultTest, CoordinatorRestartRebuildsStateFromNodes) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  absl::Notification entered, release;
  const StopAtExit stop(c, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go
  auto [t0, t1, r0, r1] = StartTwoNodeCluster(c, inv, {.n0_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 2 || entered.HasBeenNotified()) return;  // hold bucket 0 only (the hook runs per bucket)
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  }});
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse resp;
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(c.Apply(*r, "m", 1, &resp).ok()) << r->id;
    ASSERT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  // Version 2 is in flight (n0's executor holds it) when the coordinator goes away.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  grpc::Status apply_status, wait_status;
  std::thread applier([&] {
    pb::ApplyResponse r;
    apply_status = c.Apply(r1, "m", 2, &r);
  });
  std::thread waiter([&] {
    grpc::ClientContext ctx;
    pb::WaitVersionRequest req;
    req.set_model_id("m");
    req.set_version(2);
    req.set_timeout_ms(20000);
    pb::WaitVersionResponse r;
    wait_status = t1.stub->WaitVersion(&ctx, req, &r);
  });
  const int port = c.coord_->port();
  c.coord_->Shutdown();
  c.coord_.reset();
  c.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
  applier.join();
  waiter.join();
  release.Notify();
  for (const grpc::Status* s : {&apply_status, &wait_status}) {
    EXPECT_EQ(s->error_code(), grpc::StatusCode::ABORTED) << (s == &apply_status ? "Apply: " : "WaitVersion: ") << s->error_message();
    EXPECT_NE(s->error_message().find("coordinator restarted"), std::string::npos) << s->error_message();
  }
  for (TestWorker* r : {&r0, &r1}) EXPECT_EQ(CountBad(*r, 1), 0) << r->id << " must still hold exactly version 1";
  // Version 3 with the same workers: publishes wait for the re-plan, the transfer succeeds.
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 3, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  for (TestWorker* r : {&r0, &r1}) {
    ASSERT_TRUE(c.Apply(*r, "m", 3, &resp).ok()) << r->id;
    EXPECT_EQ(resp.applied_version(), 3u);
    EXPECT_EQ(CountBad(*r, 3), 0) << r->id;
  }
  ASSERT_TRUE(WaitCommitted(t0, "m", 3).ok());
  pb::StatusResponse status = c.Status(r0);
  ASSERT_EQ(status.models_size(), 1);
  EXPECT_EQ(status.models(0).committed_version(), 3u);
  EXPECT_EQ(status.workers_size(), 4) << "every worker re-joined through its node";
  // Version 1 (committed before the restart, reported by the nodes) cannot be published again.
  grpc::ClientContext ctx;
  pb::PublishRequest old;
  old.set_model_id("m");
  old.set_worker_id("t0");
  old.set_version(1);
  old.set_timeout_ms(5000);
  pb::PublishResponse presp;
  EXPECT_EQ(t0.stub->Publish(&ctx, old, &presp).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  c.Stop();
}

// An executor started by a previous coordinator process may report after the restart, possibly
// about a version number the new coordinator is running again. Such a ReportDone names the old
// coordinator instance and must not abort (or complete) the new coordinator's version.
TEST(FaultTest, StaleReportDoneFromBeforeRestartIsIgnored) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  absl::Notification entered, release;
  const StopAtExit stop(c, [&] { NotifyOnce(release); });  // the nodes stop before the hook's locals go
  auto [t0, t1, r0, r1] = StartTwoNodeCluster(c, inv, {.n0_before_bucket = [&](const std::string&, uint64_t version, uint32_t) {
    if (version != 1 || entered.HasBeenNotified()) return;  // hold the first batch of version 1
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(20));
  }});
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // Version 1 is held mid-transfer on n0. Failure reports about it from a stale executor (another
  // coordinator instance) arrive first.
  auto coord = pb::CoordinatorService::NewStub(grpc::CreateChannel(c.coord_->address(), grpc::InsecureChannelCredentials()));
  for (const char* node : {"n0", "n1"}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::ReportDoneRequest req;
    req.set_node_id(node);
    req.set_model_id("m");
    req.set_version(1);
    req.set_ok(false);
    req.set_error("transfer failed in an executor of the previous coordinator");
    req.set_coordinator_instance("previous-coordinator-instance");
    pb::ReportDoneResponse resp;
    EXPECT_TRUE(coord->ReportDone(&ctx, req, &resp).ok());
  }
  release.Notify();
  pb::ApplyResponse resp;
  for (TestWorker* r : {&r0, &r1}) {
    grpc::Status s = c.Apply(*r, "m", 1, &resp);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(resp.applied_version(), 1u);
    EXPECT_EQ(CountBad(*r, 1), 0) << r->id;
  }
  ASSERT_TRUE(WaitCommitted(t0, "m", 1).ok());
  c.Stop();
}

// The other direction (status.md items 20 / 24): an ExecuteVersion the previous coordinator sent
// just before it died and a node handles only after its re-join of the restarted one (a frozen
// node) names the old instance. The node refuses it, naming both instances, and runs nothing - the
// new session's plan has the same epoch number, so before, it ran version 2 from this call (its
// ReportDone ignored by instance) and the new coordinator's own ExecuteVersion(2) found it already
// started. The new coordinator's calls, stamped with the instance the node registered with, run
// version 2 to every rollout byte for byte.
TEST(FaultTest, StaleExecuteVersionFromBeforeRestartIsRefusedAfterTheReJoin) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  const StopAtExit stop(c);
  auto [t0, t1, r0, r1] = StartTwoNodeCluster(c, inv, {});
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 1, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitCommitted(t0, "m", 1).ok());
  const int port = c.coord_->port();
  c.coord_->Shutdown();
  c.coord_.reset();
  c.StartCoordinator(absl::Seconds(3), absl::StrCat("127.0.0.1:", port));
  auto back = c.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        int with_layout = 0;
        for (const pb::WorkerStatus& ws : st.workers()) with_layout += ws.has_layout();
        return with_layout == 4;
      },
      absl::Seconds(30));
  ASSERT_TRUE(back.ok()) << back.status();  // both nodes re-joined the new coordinator
  for (int n : {0, 1}) {
    auto node = pb::NodeService::NewStub(grpc::CreateChannel(c.nodes_[n]->address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::ExecuteVersionRequest req;
    req.set_model_id("m");
    req.set_version(2);
    req.set_plan_epoch(1);
    req.set_timeout_ms(5000);
    req.set_coordinator_instance("previous-coordinator-instance");
    pb::ExecuteVersionResponse resp;
    grpc::Status s = node->ExecuteVersion(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << "n" << n << ": " << s.error_message();
    EXPECT_NE(s.error_message().find("it comes from coordinator instance previous-coordinator-instance, but the node is registered with "
                                     "coordinator instance "),
              std::string::npos)
        << s.error_message();
  }
  for (auto& s : c.Publish("m", pb::MODE_ONE_STEP_OFF, 2, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse resp;
  for (TestWorker* r : {&r0, &r1}) {
    grpc::Status s = c.Apply(*r, "m", 2, &resp);
    ASSERT_TRUE(s.ok()) << r->id << ": " << s.error_message();
    EXPECT_EQ(CountBad(*r, 2), 0) << r->id;
  }
  c.Stop();
}

// A CUDA IPC buffer on a node without a cuda_ipc transport (no GPU here) is refused clearly at
// RegisterLayout and changes nothing (the worker can still register host memory).
TEST(FaultTest, CudaBufferWithoutGpuIsRefusedClearly) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  grpc::ClientContext c1;
  pb::RegisterWorkerRequest rw;
  rw.set_model_id("m");
  rw.set_worker_id("t0");
  rw.set_role(pb::ROLE_TRAINER);
  rw.set_gpu(0);
  rw.set_pid(::getpid());
  *rw.mutable_model() = spec;
  pb::RegisterWorkerResponse rwr;
  ASSERT_TRUE(t0.stub->RegisterWorker(&c1, rw, &rwr).ok());
  grpc::ClientContext c2;
  pb::RegisterLayoutRequest rl;
  rl.set_model_id("m");
  rl.set_worker_id("t0");
  pb::BufferSpec* b = rl.add_buffers();
  b->set_buffer_id(3);
  b->set_size_bytes(1024);
  b->set_cuda_ipc_handle(std::string(64, '\x01'));
  b->set_gpu(0);
  // Explicit pieces (a preset on this explicit-tensor model is refused before buffers are opened).
  for (const planner::Piece& p : t0.layout.pieces) {
    pb::Piece* pp = rl.mutable_layout()->mutable_pieces()->add_pieces();
    pp->set_tensor(inv.tensors[p.tensor].name);
    ToProto(p.box, pp->mutable_box());
    pp->set_buffer_id(3);
    pp->set_offset_bytes(static_cast<uint64_t>(p.offset_bytes));
    for (int64_t st : p.strides) pp->add_strides(st);
  }
  pb::RegisterLayoutResponse rlr;
  grpc::Status s = t0.stub->RegisterLayout(&c2, rl, &rlr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("buffer 3"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("no cuda_ipc transport"), std::string::npos) << s.error_message();
  c.Stop();
}

// A worker process that dies without Deregister (kill -9) is noticed through its pid: the model
// is re-planned without it.
TEST(FaultTest, DeadWorkerProcessIsDropped) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  spec.set_num_trainer_workers(1);
  spec.set_num_rollout_workers(2);
  TestWorker& t0 = c.AddWorker("t0", pb::ROLE_TRAINER, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  TestWorker& r0 = c.AddWorker("r0", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, false}, {1, {0, 0}, {4, 6}, false}}));
  ASSERT_TRUE(c.Register(t0, spec).ok());
  ASSERT_TRUE(c.Register(r0, spec).ok());
  // A second rollout "process": a child that only sleeps; we register it (layout included, so it
  // is in the plan) with the child's pid, then kill -9 it.
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  TestWorker& r1 = c.AddWorker("r1", pb::ROLE_ROLLOUT, 0, &inv, LayoutOf(inv, {{0, {0, 0}, {8, 16}, true}}));
  ASSERT_TRUE(c.Register(r1, spec, nullptr, child).ok());
  for (auto& s : c.Publish("m", pb::MODE_ASYNC, 1, {&t0}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << s.error_message();
  {
    pb::ApplyResponse resp;
    ASSERT_TRUE(c.Apply(r1, "m", 1, &resp).ok());
    EXPECT_EQ(CountBad(r1, 1), 0);
  }
  auto has_r1 = [&] {
    pb::StatusResponse st = c.Status(r0);
    for (const pb::WorkerStatus& w : st.workers()) if (w.worker_id() == "r1") return true;
    return false;
  };
  EXPECT_TRUE(has_r1());
  ::kill(child, SIGKILL);
  int wstatus = 0;
  ::waitpid(child, &wstatus, 0);
  // Heartbeats (100 ms) check worker processes; the node tells the coordinator (LeaveWorker).
  // Wait for the drop on the coordinator's status push (the status r0's node forwards).
  auto dropped = c.WaitForCoordinator(
      [](const pb::StatusResponse& st) {
        for (const pb::WorkerStatus& w : st.workers()) if (w.worker_id() == "r1") return false;
        return true;
      },
      absl::Seconds(10));
  EXPECT_TRUE(dropped.ok()) << "worker r1 (pid " << child << ") was not dropped: " << dropped.status();
  EXPECT_FALSE(has_r1());
  // Re-planned without it: the remaining pair still moves versions.
  for (auto& s : c.Publish("m", pb::MODE_ASYNC, 2, {&t0}, {&r0})) ASSERT_TRUE(s.ok()) << s.error_message();
  pb::ApplyResponse resp;
  ASSERT_TRUE(c.Apply(r0, "m", 2, &resp).ok());
  EXPECT_EQ(CountBad(r0, 2), 0);
  c.Stop();
}


int CountOpenFds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

// A peer node that restarts (new process = new transport instance) must not leave the surviving
// node holding the old incarnation's data channel: it was once replaced in the channel cache
// without being disconnected, leaking its sockets on every restart (found by the soak test).
TEST(FaultTest, PeerRestartsDoNotLeakChannels) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  // Trainers split `a` across the nodes, so every version has cross-node ops (a data channel).
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  auto run_version = [&](uint64_t v) {
    for (auto& s : c.Publish("m", pb::MODE_ASYNC, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << "version " << v << ": " << s.error_message();
    for (TestWorker* r : {&r0, &r1}) {
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "m", v, &resp);
      ASSERT_TRUE(s.ok()) << r->id << " version " << v << ": " << s.error_message();
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
  };
  run_version(1);
  run_version(2);  // channels cached and reused: the steady state
  const int fds0 = CountOpenFds();
  constexpr int kRestarts = 6;
  for (int k = 0; k < kRestarts; ++k) {
    c.nodes_[1]->Shutdown();
    c.nodes_[1].reset();
    c.StartNode(1);
    ASSERT_TRUE(c.nodes_[1]) << "restart " << k;
    // r1 first, then t1: the model cannot re-plan before both trainers are back, so the next
    // version's plan includes n1 again (cross-node channel needed).
    for (TestWorker* w : {&r1, &t1}) {
      c.Connect(*w);
      grpc::Status s = c.Register(*w, spec);
      ASSERT_TRUE(s.ok()) << w->id << " after restart " << k << ": " << s.error_message();
    }
    run_version(3 + k);
  }
  const int fds1 = CountOpenFds();
  // Every restart used to leave n0 with the old channel's streams open (>= 1 fd each).
  EXPECT_LE(fds1, fds0 + kRestarts / 2) << "open fds " << fds0 << " -> " << fds1 << " after " << kRestarts << " restarts of n1";
  c.Stop();
}

// Virtual memory of this process in KiB. A thread that has finished but was never joined is gone
// from /proc/self/task, yet its stack (8 MiB by default) stays mapped until it is joined.
int64_t VmSizeKiB() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoll(line.substr(7));
  }
  return -1;
}

// Every version runs on an executor thread per node. They used to be kept (unjoined) until
// shutdown, so a long-running daemon grew by one thread stack per version; finished ones are now
// joined as new versions start.
TEST(FaultTest, ExecutorThreadsDoNotAccumulate) {
  planner::Inventory inv = SmallInventory();
  Cluster c;
  c.StartCoordinator();
  c.StartNode(0);
  c.StartNode(1);
  pb::ModelSpec spec = SmallSpec(pb::MODE_ASYNC, pb::STRATEGY_WEIGHTBRIDGE);
  auto [t0, t1, r0, r1] = AddTwoNodeWorkers(c, inv);
  for (TestWorker* w : {&t0, &t1, &r0, &r1}) ASSERT_TRUE(c.Register(*w, spec).ok()) << w->id;
  int64_t vm_after_warmup = 0;
  constexpr uint64_t kWarmup = 5, kVersions = 35;
  for (uint64_t v = 1; v <= kVersions; ++v) {
    for (auto& s : c.Publish("m", pb::MODE_ASYNC, v, {&t0, &t1}, {&r0, &r1})) ASSERT_TRUE(s.ok()) << "version " << v << ": " << s.error_message();
    for (TestWorker* r : {&r0, &r1}) {
      pb::ApplyResponse resp;
      grpc::Status s = c.Apply(*r, "m", v, &resp);
      ASSERT_TRUE(s.ok()) << r->id << " version " << v << ": " << s.error_message();
      EXPECT_EQ(CountBad(*r, v), 0) << r->id << " version " << v;
    }
    if (v == kWarmup) vm_after_warmup = VmSizeKiB();
  }
  const int64_t vm_end = VmSizeKiB();
  ASSERT_GT(vm_after_warmup, 0);
  // Unjoined executors would pin 2 nodes x 30 versions x >= 8 MiB of stacks; allow 10 stacks.
  EXPECT_LE(vm_end, vm_after_warmup + 10 * 8 * 1024)
      << "VmSize " << vm_after_warmup << " KiB -> " << vm_end << " KiB over " << kVersions - kWarmup << " versions";
  c.Stop();
}

}  // namespace
}  // namespace wb::daemon
