#pragma once
// CoordinatorService: node membership with leases, models, layouts, planning (cached by
// fingerprint, re-planned on membership change), plan slices to nodes, and the version state
// machine (daemon/version_machine.h) driven by one driver thread. See docs/daemon.md.
//
// Threads: gRPC handlers mutate state under mu_ and wake the driver; the driver does every
// coordinator -> node RPC (install/execute/commit/abort) outside the lock. Waiting handlers
// (Publish, WaitVersion, Drain) block on mu_ with a real-time deadline from the request.
//
// Status push (WatchStatus): every change to what ClusterStatus reports bumps status_generation_
// under mu_; each watcher stream waits on that counter (docs/daemon.md "Status push").

#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/version_machine.h"
#include "planner/model_config.h"
#include "planner/types.h"
#include "proto/weightbridge.grpc.pb.h"
#include "tools/cc/clock.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

// The planner entry point (planner::MakePlan unless a test injects another).
using PlanFn = std::function<absl::StatusOr<planner::Plan>(const planner::Problem&, planner::Strategy)>;

class Coordinator final : public pb::CoordinatorService::Service {
 public:
  struct Options {
    Clock* clock = Clock::Real();
    absl::Duration lease = absl::Seconds(3);
    absl::Duration transfer_timeout = absl::Seconds(60);
    absl::Duration tick = absl::Milliseconds(20);  // driver wake-up cap
    PlanFn make_plan;                               // empty = planner::MakePlan
    // Bandwidths the planner assumes (node index = registered node daemon, gpu = the worker's gpu
    // or, for host workers (gpu < 0), a distinct slot per worker of the node).
    planner::Topology topology;
    int64_t bucket_bytes = int64_t{2} << 30;        // planner staging budget per GPU per bucket
    absl::Duration commit_retry = absl::Milliseconds(200);
    // Standalone role: the id of the node daemon in this same process. Its lease never expires
    // (a late heartbeat there means this process is starved, not that the node is gone).
    std::string local_node;
    // Channel to a node's NodeService (TLS + token: daemon/auth.h); empty = insecure.
    std::function<std::shared_ptr<grpc::Channel>(const std::string&)> make_channel;
    // WatchStatus: concurrent streams allowed (RESOURCE_EXHAUSTED over it; Limits sets it in a
    // daemon), and the safety-net period: a watcher rebuilds the status at least this often and
    // sends it when its bytes differ from the last message (catches any change not bumped).
    int max_status_watchers = 64;
    absl::Duration status_resend = absl::Seconds(1);
  };
  // WatchStatus timeouts: 0 in the request = the default; longer requests are capped.
  static constexpr absl::Duration kWatchDefaultTimeout = absl::Seconds(60);
  static constexpr absl::Duration kWatchMaxTimeout = absl::Minutes(10);
  // How often a waiting watcher checks whether its client went away.
  static constexpr absl::Duration kWatchCancelCheck = absl::Milliseconds(100);

  explicit Coordinator(Options options);
  ~Coordinator() override;
  // Starts the driver thread. Shutdown() stops it and fails every waiter (UNAVAILABLE).
  void Start();
  void Shutdown();

  grpc::Status RegisterNode(grpc::ServerContext*, const pb::RegisterNodeRequest*, pb::RegisterNodeResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const pb::HeartbeatRequest*, pb::HeartbeatResponse*) override;
  grpc::Status CreateModel(grpc::ServerContext*, const pb::CreateModelRequest*, pb::CreateModelResponse*) override;
  grpc::Status JoinWorker(grpc::ServerContext*, const pb::JoinWorkerRequest*, pb::JoinWorkerResponse*) override;
  grpc::Status SubmitLayout(grpc::ServerContext*, const pb::SubmitLayoutRequest*, pb::SubmitLayoutResponse*) override;
  grpc::Status LeaveWorker(grpc::ServerContext*, const pb::LeaveWorkerRequest*, pb::LeaveWorkerResponse*) override;
  // Publish / ReportReady: NOT_FOUND (unknown model, or a worker this coordinator does not know -
  // for Publish: or knows without its layout) means nothing was recorded; the node re-sends the
  // call once it has re-joined its workers (coordinator restart, lost lease). A trainer known with
  // its layout but not in a plan yet waits for the (re-)plan within the request's timeout.
  grpc::Status Publish(grpc::ServerContext*, const pb::CoordPublishRequest*, pb::PublishResponse*) override;
  grpc::Status ReportReady(grpc::ServerContext*, const pb::ReportReadyRequest*, pb::ReportReadyResponse*) override;
  grpc::Status ReportDone(grpc::ServerContext*, const pb::ReportDoneRequest*, pb::ReportDoneResponse*) override;
  grpc::Status ReportApplied(grpc::ServerContext*, const pb::ReportAppliedRequest*, pb::ReportAppliedResponse*) override;
  grpc::Status WaitVersion(grpc::ServerContext*, const pb::WaitVersionRequest*, pb::WaitVersionResponse*) override;
  grpc::Status ClusterStatus(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse*) override;
  // Streams ClusterStatus: the current status at once, then a message per change (generation
  // bump, or the status_resend safety net finding different bytes). Ends OK at the request's
  // timeout, CANCELLED when the client goes away (noticed within kWatchCancelCheck), UNAVAILABLE
  // as soon as Shutdown() runs (never holds it up), RESOURCE_EXHAUSTED over max_status_watchers.
  grpc::Status WatchStatus(grpc::ServerContext*, const pb::WatchStatusRequest*,
                           grpc::ServerWriter<pb::StatusResponse>*) override;
  // Waits until at most `n` WatchStatus streams are open (tests: a cancelled client frees its
  // slot); false if `deadline` passes first.
  bool AwaitStatusWatchersAtMost(int n, absl::Time deadline) const;
  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest*, pb::DrainResponse*) override;
  grpc::Status Plan(grpc::ServerContext*, const pb::PlanRequest*, pb::PlanResponse*) override;

 private:
  struct Node {
    std::string address, data_address;
    uint64_t incarnation = 0;
    absl::Time lease_expiry;
    bool alive = true;
    bool draining = false;
    std::map<std::string, std::string> transport_instances;
    std::vector<std::string> data_nics;  // RegisterNodeRequest.data_nics (status only)
    absl::Duration lease = absl::ZeroDuration();  // max(Options::lease, 3 heartbeats of the node)
    // shared: driver work captured a copy may still run while RegisterNode replaces it.
    std::shared_ptr<pb::NodeService::Stub> stub;
  };
  // A commit the coordinator decided that one node has not acknowledged yet (RPC failed). Retried
  // until the node acks, answers that its staging is gone (restart: its waiters see ABORTED), or
  // loses its lease / re-registers (its workers are dropped and get the next version).
  struct PendingCommit {
    std::string node, model_id;
    uint64_t version = 0;
    uint64_t incarnation = 0;
    absl::Time next_try;
  };
  struct WorkerRec {
    std::string node;
    planner::Role role = planner::Role::kTrainer;
    int32_t gpu = 0;
    bool has_layout = false;
    // Sync: BeginUpdate seen for the next version. Kept here too because the version machine only
    // knows rollouts of the current plan: a pause that arrives before the (re-)plan is re-applied.
    bool paused = false;
    pb::ResolvedLayout layout_proto;
    planner::WorkerLayout layout;
    uint64_t restored_applied = 0;  // rollout re-joined after a coordinator restart: its applied version
  };
  struct PlanState {
    uint64_t epoch = 0;
    planner::Plan plan;
    std::vector<std::string> worker_ids;  // Problem::workers order
    std::set<std::string> nodes;
    uint64_t total_bytes = 0;
    bool installed = false;
  };
  struct Model {
    pb::ModelSpec spec;
    std::optional<planner::ModelConfig> config;  // models created from hf_config_json (presets)
    planner::Inventory inventory;
    std::unique_ptr<VersionMachine> machine;
    std::map<std::string, WorkerRec> workers;
    PlanState plan;
    bool plan_dirty = false;
    bool planned_once = false;
    std::string plan_error;
    uint64_t committing = 0;  // version whose commit the driver is sending
    std::map<uint64_t, std::map<std::string, uint64_t>> progress;  // version -> node -> bytes
    double last_seconds = 0;
    uint64_t last_bytes = 0;
  };

  absl::StatusOr<Model*> GetModelLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CreateModelLocked(const pb::ModelSpec& spec, bool* created) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker left or its node was lost: abort an in-flight version it takes part in, re-plan.
  void DropWorkerLocked(Model& m, const std::string& worker, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(const std::string& model_id, Model& m, uint64_t version, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DriverLoop();
  // One driver pass: returns RPC work to run outside the lock.
  std::vector<std::function<void()>> CollectWorkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::map<std::string, pb::PlanSlice>> MakeSlicesLocked(const std::string& model_id, Model& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FillStatusLocked(pb::StatusResponse* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Something ClusterStatus reports changed: wakes WatchStatus streams.
  void StatusChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ++status_generation_; }

  Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Model> models_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, planner::Plan> plan_cache_ ABSL_GUARDED_BY(mu_);  // problem key -> plan
  std::vector<std::function<void()>> pending_rpcs_ ABSL_GUARDED_BY(mu_);   // aborts to send
  std::vector<PendingCommit> pending_commits_ ABSL_GUARDED_BY(mu_);
  uint64_t next_epoch_ ABSL_GUARDED_BY(mu_) = 1;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool cluster_draining_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t status_generation_ ABSL_GUARDED_BY(mu_) = 0;
  int status_watchers_ ABSL_GUARDED_BY(mu_) = 0;
  // Random per process: nodes that see a new one know the coordinator restarted (lost its state).
  const std::string instance_;
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // last lease check by the driver
  std::thread driver_;
};

}  // namespace wb::daemon
