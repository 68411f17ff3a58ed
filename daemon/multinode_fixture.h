// Test fixture shared by the multi-node end-to-end tests (multinode_test, multinode_fault_test,
// status_push_test, torn_test, hostile_worker_test): a coordinator and node daemons as objects in one
// process on 127.0.0.1:0, workers as gRPC clients on the nodes' Unix sockets with shared-memory
// weights, bytes moved by the real transports (host_shm same-node, host_tcp cross-node). Every
// rollout byte is checked against the canonical weights of its version (tests/common/weight_gen.h).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/server.h"
#include "planner/inventory.h"
#include "proto/weightbridge.grpc.pb.h"
#include "transport/factory.h"
#include "base/shm_segment.h"

namespace wb::daemon {

struct TestWorker {
  std::string id;
  pb::Role role;
  int node = 0;
  const planner::Inventory* inventory = nullptr;
  planner::WorkerLayout layout;  // buffer 0 = seg
  transport::ShmSegment seg;
  std::unique_ptr<pb::WorkerService::Stub> stub;
  // RegisterWorkerRequest.client_instance its registrations send (empty: none, as clients built
  // before the field; two TestWorkers of one id then pass for the same client).
  std::string client_instance;
};

// Writes version `version`'s canonical bytes into every piece of `w`.
void Fill(TestWorker& w, uint64_t version);
// Elements of `w` that differ from version `version`'s canonical bytes.
int64_t CountBad(const TestWorker& w, uint64_t version);
// The same for versions in which a share `fraction` of the elements changes from one version to
// the next (tests/common/weight_gen.h DeltaElementBits; lossless deltas).
void FillDelta(TestWorker& w, uint64_t version, double fraction);
int64_t CountBadDelta(const TestWorker& w, uint64_t version, double fraction);
// host_shm + host_tcp, as a node without GPUs has.
absl::StatusOr<transport::TransportSet> HostTransports();
// The same with host_tcp wrapped: `wrap` gets a set holding only the real host_tcp and returns the
// transport the node uses in its place (a test's fault-injecting transport over the real one).
absl::StatusOr<transport::TransportSet> HostTransportsWrappingTcp(
    const std::function<std::unique_ptr<transport::Transport>(transport::TransportSet tcp)>& wrap);

class Cluster {
 public:
  using BucketHook = std::function<void(const std::string&, uint64_t, uint32_t)>;

  void StartCoordinator(absl::Duration lease = absl::Seconds(3), const std::string& listen = "127.0.0.1:0",
                        const std::function<void(ServerOptions&)>& configure = nullptr);
  // Node "n<n>": `hook` is its test_before_bucket, `skip_heartbeat` its test_skip_heartbeat. Hooks
  // (these, and those `configure` installs) that capture a test's locals need a StopAtExit.
  void StartNode(int n, BucketHook hook = nullptr, std::function<bool()> skip_heartbeat = nullptr,
                 std::function<void(ServerOptions&)> configure = nullptr);
  void Stop();
  // The daemons' Shutdown alone (workers kept): calls still running end within Server::Shutdown's
  // 2 s (JoinAtExit). Stop may follow.
  void ShutDownDaemons();

  TestWorker& AddWorker(const std::string& id, pb::Role role, int node, const planner::Inventory* inv, planner::WorkerLayout layout);
  // (Re)connects w's stub to its node's worker socket.
  void Connect(TestWorker& w);

  // Registers the worker and its layout: explicit pieces (a quantised piece's scales in buffer 0
  // too), or `preset` when given.
  grpc::Status Register(TestWorker& w, const pb::ModelSpec& spec, const pb::ParallelConfig* preset = nullptr, int pid = ::getpid());
  // RegisterWorker alone (what Register sends first; `gpu` -1: host memory).
  grpc::Status RegisterWorker(TestWorker& w, const pb::ModelSpec& spec, int pid = ::getpid(), int gpu = -1);
  // RegisterLayout alone: explicit pieces of w.layout, or `preset` when given.
  grpc::Status RegisterLayout(TestWorker& w, const pb::ModelSpec& spec, const pb::ParallelConfig* preset = nullptr);

  // One version: (sync) pause rollouts, every trainer publishes, (non-sync) trainers scribble,
  // returns the trainers' publish statuses.
  std::vector<grpc::Status> Publish(const std::string& model, pb::Mode mode, uint64_t v, const std::vector<TestWorker*>& trainers,
                                    const std::vector<TestWorker*>& rollouts);
  grpc::Status Apply(TestWorker& r, const std::string& model, uint64_t v, pb::ApplyResponse* resp);

  // Waits (bounded) on the coordinator's status push until `pred` holds.
  absl::StatusOr<pb::StatusResponse> WaitForCoordinator(const std::function<bool(const pb::StatusResponse&)>& pred,
                                                        absl::Duration timeout);
  // The coordinator's record of version `v` once it is final (committed, aborted or superseded),
  // waited for on the status push; an empty record and a test failure when it is not in `timeout`.
  pb::VersionStatus FinalVersion(uint64_t v, absl::Duration timeout = absl::Seconds(30));
  // Status as w's node answers it.
  pb::StatusResponse Status(TestWorker& w);

  // > 0: Publish fills trainers with FillDelta(version, delta_fraction) instead of Fill (deltas).
  double delta_fraction = 0;
  // Set: Publish calls it for each trainer after filling it (a test's own change to the weights).
  std::function<void(TestWorker&, uint64_t)> after_fill;
  std::unique_ptr<Server> coord_;
  std::vector<std::unique_ptr<Server>> nodes_;
  // Node index -> worker socket of a node daemon running in another process (live_restart_test).
  std::map<int, std::string> external_sockets_;
  std::vector<std::unique_ptr<TestWorker>> workers_;
};

// Stops `c` when it goes out of scope, after `release` (when given) let go of what the test's
// hooks hold (so the stop need not wait for their own timeouts). Node hooks that capture a test's
// locals must not run once those are gone, also when an ASSERT returns early: TearDown (or a local
// Cluster declared before them) stops the nodes only after the locals died, and a hook still called
// by an execution then waited on a destroyed Notification and hung the test to its timeout.
// Declare it right after the last local a hook (or `release`) uses, before installing the hooks:
// it is destroyed first. Stop may run again afterwards (the test's own Stop, TearDown).
class StopAtExit {
 public:
  explicit StopAtExit(Cluster& c, std::function<void()> release = nullptr) : c_(c), release_(std::move(release)) {}
  ~StopAtExit() {
    if (release_) release_();
    c_.Stop();
  }
  StopAtExit(const StopAtExit&) = delete;
  StopAtExit& operator=(const StopAtExit&) = delete;

 private:
  Cluster& c_;
  std::function<void()> release_;
};

// Joins `t` on every way out of the scope it is declared in (right after `t` starts): a failed
// ASSERT between starting a thread and joining it returns early, and std::thread's destructor then
// calls std::terminate. On such an exit (`t` still joinable) it calls `release` (when given: let
// go of what the test's hooks hold), shuts the daemons down so the thread's calls end (within 2 s)
// and joins - before the workers the thread uses go (Cluster::Stop, the StopAtExit declared before
// it). A test that joins `t` itself leaves it nothing to do.
class JoinAtExit {
 public:
  JoinAtExit(Cluster& c, std::thread& t, std::function<void()> release = nullptr) : c_(c), t_(t), release_(std::move(release)) {}
  ~JoinAtExit() {
    if (!t_.joinable()) return;
    if (release_) release_();
    // The coordinator first: its waiting calls answer at once when it stops, so the nodes' calls
    // forwarded to it (a worker's WaitVersion, Publish) end before the nodes stop - a node's stop
    // waits for its running calls, which otherwise ran to their own timeouts (20 s).
    if (c_.coord_) c_.coord_->Shutdown();
    c_.ShutDownDaemons();
    t_.join();
  }
  JoinAtExit(const JoinAtExit&) = delete;
  JoinAtExit& operator=(const JoinAtExit&) = delete;

 private:
  Cluster& c_;
  std::thread& t_;
  std::function<void()> release_;
};

// Notifies `n` unless it was notified already (absl::Notification aborts on a second Notify): for a
// StopAtExit's release of a notification only the test's own thread notifies.
inline void NotifyOnce(absl::Notification& n) {
  if (!n.HasBeenNotified()) n.Notify();
}

// ------------------------------------------------------------------ explicit pieces, 2 tensors
struct PieceDef { int tensor; std::vector<int64_t> begin, end; bool transposed; };

// a [8, 16] f32, b [4, 6] bf16.
planner::Inventory SmallInventory();
// Pieces packed back to back in buffer 0 (row-major, or column-major when transposed).
planner::WorkerLayout LayoutOf(const planner::Inventory& inv, const std::vector<PieceDef>& defs);
// Model "m" of `inv`'s tensors (explicit, in their dtypes) with the given worker counts.
pb::ModelSpec SpecOf(const planner::Inventory& inv, pb::Mode mode, pb::Strategy strategy, int trainers = 2, int rollouts = 2);
// Model "m" of SmallInventory's tensors, 2 trainers, 2 rollouts.
pb::ModelSpec SmallSpec(pb::Mode mode, pb::Strategy strategy);

// The two-node cast most fault tests use: trainers t0 (n0, rows 0-3 of `a` and all of `b`) and t1
// (n1, rows 4-7), so every version has cross-node ops; rollouts r0 (n0) and r1 (n1, transposed)
// each hold the whole model.
struct TwoNodeWorkers {
  TestWorker &t0, &t1, &r0, &r1;
};
TwoNodeWorkers AddTwoNodeWorkers(Cluster& c, const planner::Inventory& inv);

// The whole setup of the torn-version and fault tests: coordinator, n0 (with `n0_live_copy_fault`
// as its NodeDaemon::Options::test_live_copy_fault and `n0_before_bucket` when given) and n1 (with
// `n1_before_bucket`), the
// TwoNodeWorkers cast registered for SmallSpec(mode, weightbridge). Check HasFatalFailure() after.
// Hooks that capture the test's locals need a StopAtExit.
struct TwoNodeSetup {
  pb::Mode mode = pb::MODE_ONE_STEP_OFF;
  std::function<absl::Status(const std::string& label)> n0_live_copy_fault;
  Cluster::BucketHook n1_before_bucket;
  Cluster::BucketHook n0_before_bucket;
};
TwoNodeWorkers StartTwoNodeCluster(Cluster& c, const planner::Inventory& inv, const TwoNodeSetup& setup);

// Waits (bounded) until the coordinator recorded version v of `model` as committed: a rollout's
// Apply returns once its node committed, the coordinator records the commit after every node
// acknowledged it.
grpc::Status WaitCommitted(TestWorker& w, const std::string& model, uint64_t v);
// The status of worker `w` as its own node reports it.
pb::WorkerStatus LocalStatus(Cluster& c, TestWorker& w);
// Apply of model "m" version v with the request's timeout_ms (the RPC's own deadline is 30 s).
grpc::Status ApplyWithin(TestWorker& r, uint64_t v, int64_t timeout_ms, pb::ApplyResponse* resp);
// WaitVersion(v) of `model` as the clients send it, with w's worker id (so a late rollout is
// answered once it holds v); the request's timeout_ms, the RPC's own deadline 10 s later.
grpc::Status WaitVersionAs(TestWorker& w, const std::string& model, uint64_t v, int64_t timeout_ms, pb::WaitVersionResponse* resp);
// BeginUpdate / EndUpdate of model "m" as rollout `r` with the request's timeout_ms, the RPC's own
// deadline 10 s later.
grpc::Status BeginUpdateAs(TestWorker& r, int64_t timeout_ms);
grpc::Status EndUpdateAs(TestWorker& r, int64_t timeout_ms, pb::EndUpdateResponse* resp);
// committed_version of `model` in a status (0 when absent).
uint64_t CommittedOf(const pb::StatusResponse& st, const std::string& model);

}  // namespace wb::daemon
