#pragma once
// The coordinator's business logic (docs/daemon.md, docs/architecture.md "Coordinator"): node
// membership with leases, models, layouts, planning (outside the lock, cached), plan slices to
// nodes, and the per-model version state machine (daemon/version_machine.h) driven by one driver
// thread over the NodeClient seam. Handlers take and return protobuf messages and absl::Status;
// daemon/coordinator.h adapts them to gRPC (the one place statuses are converted).
//
// Threads and what they own:
//   - RPC handler threads: mutate the tables under mu_, wake the driver, and wait (Publish,
//     WaitVersion, Drain) on mu_ through Clock::WaitUntil with the request's deadline.
//     SubmitLayout resolves and validates its layout OUTSIDE mu_ (a snapshot under it, the result
//     applied under it if the worker did not change meanwhile: ModelRegistry::SnapshotLayout).
//   - the driver thread (DriverLoop): under mu_ it decides (leases, timeouts, what to plan,
//     start, commit) and posts the resulting node RPCs to lanes_ (rpc_lanes.h); it never waits
//     for a node, so a frozen node holds neither lease sweeps nor other models' versions.
//   - the lanes' worker threads (lanes_): run those RPCs OUTSIDE mu_, serially per lane - a
//     model's version calls (start, commit, catch-up, aborts) in the order the driver posted them,
//     a node's owed retries - each fanning out to up to 32 helper threads per version; results
//     are applied under mu_ again.
//   - the planner thread (PlannerLoop): takes queued plan jobs round-robin over models (PlanQueue),
//     snapshots the model under mu_, plans and slices OUTSIDE mu_, applies the result under mu_ if
//     membership did not change meanwhile, and posts the installs to the model's lane.
//   Nothing slow ever runs under mu_.
// Locking: mu_ is the one lock of the membership state. The node table (node_table.h) and the
// model registry (model_registry.h) are plain data, not thread-safe, guarded by mu_ and only
// touched with it held; they take no lock of their own. PlanCache has its own lock, taken only
// on the planner thread with mu_ NOT held (plan_outside_lock_test), so there is no lock order
// to keep between the two.
//   - WatchStatus streams: build the status under mu_, write outside it (real time: client streams);
//     each has a watchdog thread that cancels the call if a write outlives the stream's deadline.
// Every lease, heartbeat, staleness, timeout and eviction decision reads options.clock and every
// wait goes through it, so tests run the coordinator on a FakeClock.
// Model pointers: a Model* / Model& is used under mu_; one kept across a release of mu_ (a wait,
// work outside the lock) needs a hold (ModelRegistry::Held, Hold / Release) or a model with a
// version, or an idle-model eviction could free it (model_registry.h, "Why eviction never ...").

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/coordinator/model_registry.h"
#include "daemon/coordinator/node_client.h"
#include "daemon/coordinator/node_table.h"
#include "daemon/coordinator/plan_cache.h"
#include "daemon/coordinator/plan_queue.h"
#include "daemon/coordinator/rpc_lanes.h"
#include "daemon/coordinator/sync_pause.h"
#include "daemon/version_machine.h"
#include "planner/model_config.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"
#include "base/clock.h"

namespace grpc {
class Channel;
}

namespace wb::daemon {

class DaemonMetrics;  // daemon/metrics.h

struct CoordinatorOptions {
  Clock* clock = Clock::Real();
  absl::Duration lease = absl::Seconds(3);
  // After a restart, how long from its start the coordinator waits for nodes still re-joining
  // before it answers a used number ABORTED (AwaitRejoinWindowLocked); unset: one lease, within
  // which every node alive at the restart has heard of it. Tests set it apart from other timers.
  std::optional<absl::Duration> rejoin_window;
  absl::Duration transfer_timeout = absl::Seconds(60);
  absl::Duration tick = absl::Milliseconds(20);  // driver wake-up cap
  PlanFn make_plan;  // empty = planner::MakePlanWithOptions, cancellable (plan_cache.h); tests inject one
  // A plan (coverage check + planner) still running this long is abandoned (DEADLINE_EXCEEDED
  // naming the model and the time; PlanCache::Options::plan_deadline; flag --plan_deadline_s).
  // <= 0: none.
  absl::Duration plan_deadline = kDefaultPlanDeadline;
  // Sync: the longest a fully-published version waits, counted from the first pass at which one
  // rollout of its plan is paused (BeginUpdate), for the others. Past it they are left out of the plan
  // and the version runs without them (sync_pause.h; flag --sync_pause_timeout_ms). Default 30 s:
  // half the clients' default publish timeout (60 s), so that the version still has time to run
  // before its trainers give up. <= 0: wait as long as the trainers do.
  absl::Duration sync_pause_timeout = absl::Seconds(30);
  // Bandwidths the planner assumes (node index = registered node daemon, gpu = the worker's gpu
  // or, for host workers (gpu < 0), a distinct slot per worker of the node).
  planner::Topology topology;
  int64_t bucket_bytes = int64_t{2} << 30;        // planner staging budget per GPU per bucket
  // Owed commits (async / one-step-off: a node that did not answer CommitVersion) and owed
  // aborts (an AbortVersion a node may have missed) are retried this often while the node keeps
  // its incarnation.
  absl::Duration commit_retry = absl::Milliseconds(200);
  // Standalone role: the id of the node daemon in this same process. Its lease never expires
  // (a late heartbeat there means this process is starved, not that the node is gone).
  std::string local_node;
  // Channel to a node's NodeService (TLS + token: daemon/auth.h); empty = insecure.
  std::function<std::shared_ptr<grpc::Channel>(const std::string&)> make_channel;
  // The client the driver uses for a node; empty = GrpcNodeClient over make_channel. Tests and
  // the control-plane bench inject FakeNodeClients here.
  NodeClientFactory make_node_client;
  // WatchStatus: concurrent streams allowed (RESOURCE_EXHAUSTED over it; Limits sets it in a
  // daemon), and the safety-net period: a watcher rebuilds the status at least this often and
  // sends it when its bytes differ from the last message (catches any change not bumped).
  int max_status_watchers = 64;
  absl::Duration status_resend = absl::Seconds(1);
  // ClusterStatus / WatchStatus byte budget: a larger status is trimmed, least important details
  // first (status_budget.h; docs/daemon.md "Status byte budget"), to stay under the 4 MiB a gRPC
  // client receives by default (wbctl; a node daemon forwarding ClusterStatus to its workers adds
  // their live state). <= 0: no budget.
  int64_t max_status_bytes = int64_t{3} << 20;
  // Input bounds (RESOURCE_EXHAUSTED / INVALID_ARGUMENT naming the limit; docs/daemon.md "Limits").
  int max_models = 256;                  // models held at once (CreateModel / JoinWorker with a spec)
  // At max_models a new model evicts the model idle longest among those with no workers, no
  // version ever, nothing waiting on or planning it, and no call touching it for this long
  // (ModelRegistry, docs/daemon.md "Idle models are evicted").
  absl::Duration model_idle_grace = absl::Seconds(60);
  int max_name_bytes = 1024;             // node, worker and model ids, addresses
  // Node ids in the node table. A new id at the cap takes the place of the lost node (lease ran
  // out) that nothing refers to any more - no worker, plan, version, catch-up or owed commit -
  // and whose lease ran out first; with none, RegisterNode is RESOURCE_EXHAUSTED. (Each id used to
  // stay for good: 100 made-up ids added 322 MiB.) Re-registering a known id is never refused.
  int max_nodes = 4096;
  int max_heartbeat_progress = 1024;     // VersionProgress entries in one heartbeat
  // Largest CreateModel / JoinWorker reply (the inventory): over it the call fails and the model
  // it created is removed. 4 MiB = gRPC's default receive limit of the nodes' coordinator channel.
  int64_t max_reply_bytes = int64_t{4} << 20;
  // Encoded bytes of all models' inventories together (CreateModel / JoinWorker with a spec over it:
  // RESOURCE_EXHAUSTED naming it); each costs several times its size in memory. <= 0: no bound.
  int64_t max_inventory_bytes_total = int64_t{2} << 30;
  // The longest any request waits (Publish, WaitVersion, Drain, ExchangeMagnitudes): a longer
  // timeout_ms is cut to it (the gate already clamps remote calls to Limits::max_wait_ms; this
  // bounds every caller of the core). Past it the call ends DEADLINE_EXCEEDED as at its own timeout.
  absl::Duration max_wait = absl::Hours(1);
  // Where the coordinator's events are counted (daemon/metrics.h; the daemon's instance, made in
  // main.cc); null = the process default, Metrics(). Must outlive the coordinator.
  DaemonMetrics* metrics = nullptr;
  // Tests: SubmitLayout calls it with mu_ NOT held, between its snapshot and resolving the layout
  // (submit_layout_test holds it there while other calls are answered).
  std::function<void()> test_before_layout_resolve;
};

class CoordinatorCore {
 public:
  // WatchStatus timeouts: 0 in the request = the default; longer requests are capped.
  static constexpr absl::Duration kWatchDefaultTimeout = absl::Seconds(60);
  static constexpr absl::Duration kWatchMaxTimeout = absl::Minutes(10);
  // How often a waiting watcher checks whether its client went away.
  static constexpr absl::Duration kWatchCancelCheck = absl::Milliseconds(100);
  // How long past its timeout (or Shutdown) a stream may still be writing before it is cancelled:
  // a write that flow control holds (the client stopped reading) never returns by itself.
  static constexpr absl::Duration kWatchWriteGrace = absl::Seconds(2);

  explicit CoordinatorCore(CoordinatorOptions options);
  ~CoordinatorCore();
  // Starts the driver thread. Shutdown() stops it and fails every waiter (UNAVAILABLE).
  void Start();
  void Shutdown();

  absl::Status RegisterNode(const pb::RegisterNodeRequest& req, pb::RegisterNodeResponse* resp);
  absl::Status Heartbeat(const pb::HeartbeatRequest& req, pb::HeartbeatResponse* resp);
  absl::Status CreateModel(const pb::CreateModelRequest& req, pb::CreateModelResponse* resp);
  absl::Status JoinWorker(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse* resp);
  absl::Status SubmitLayout(const pb::SubmitLayoutRequest& req, pb::SubmitLayoutResponse* resp);
  absl::Status LeaveWorker(const pb::LeaveWorkerRequest& req, pb::LeaveWorkerResponse* resp);
  // Publish / ReportReady: NOT_FOUND (unknown model, or a worker this coordinator does not know -
  // for Publish: or knows without its layout) means nothing was recorded; the node re-sends the
  // call once it has re-joined its workers (coordinator restart, lost lease). A trainer known with
  // its layout but not in a plan yet waits for the (re-)plan within the request's timeout.
  // Sync mode: OK only once every node of the plan acknowledged CommitVersion, i.e. every
  // rollout holds the version whole in live memory; otherwise ABORTED naming the nodes and
  // rollouts that do not hold it.
  absl::Status Publish(const pb::CoordPublishRequest& req, pb::PublishResponse* resp);
  absl::Status ReportReady(const pb::ReportReadyRequest& req, pb::ReportReadyResponse* resp);
  absl::Status ReportDone(const pb::ReportDoneRequest& req, pb::ReportDoneResponse* resp);
  absl::Status ReportApplied(const pb::ReportAppliedRequest& req, pb::ReportAppliedResponse* resp);
  // NVFP4 global scales across nodes (magnitudes.cc, magnitude_book.h). A node of the version's
  // book adds its parts; with wait, the answer comes once every node of the book reported (the
  // request's timeout: DEADLINE_EXCEEDED naming the missing nodes; ABORTED when the version ends
  // first, or had ended). FAILED_PRECONDITION for a version not transferring, one without NVFP4 rollout pieces,
  // a node not in the book, or a call of an execution an earlier coordinator started; a catch-up
  // is answered from the committed version's book (NOT_FOUND when none is kept).
  absl::Status ExchangeMagnitudes(const pb::ExchangeMagnitudesRequest& req, pb::ExchangeMagnitudesResponse* resp);
  absl::Status WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp);
  absl::Status ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp);
  // Streams ClusterStatus through `write` (false = the client is gone): the current status at
  // once, then a message per change. Ends OK at the request's timeout, CANCELLED when `cancelled`
  // says so (checked every kWatchCancelCheck), UNAVAILABLE as soon as Shutdown() runs,
  // RESOURCE_EXHAUSTED over max_status_watchers. `cancel` (may be empty) must make a `write`
  // blocked on a client that does not read return false; it is called, from another thread, when
  // the stream is still running kWatchWriteGrace past its timeout or past Shutdown(), and never
  // after WatchStatus returns.
  absl::Status WatchStatus(const pb::WatchStatusRequest& req, const std::function<bool(const pb::StatusResponse&)>& write,
                           const std::function<bool()>& cancelled, const std::function<void()>& cancel = nullptr);
  bool AwaitStatusWatchersAtMost(int n, absl::Time deadline) const;
  // Drain a node (node_id) or the whole cluster (all = true; an empty request is refused); undo =
  // true lifts that drain again. docs/daemon.md "Drain".
  absl::Status Drain(const pb::DrainRequest& req, pb::DrainResponse* resp);
  absl::Status Plan(const pb::PlanRequest& req, pb::PlanResponse* resp);

  // Tests and the bench: waits until the model has an installed plan (false at `deadline`).
  bool AwaitPlanInstalled(const std::string& model_id, absl::Time deadline) const;
  // Tests: waits until `n` jobs wait for the planner thread (not counting the one it runs).
  bool AwaitPlansWaiting(size_t n, absl::Time deadline) const;
  // Tests: waits until nothing is left to plan for the model (no change unplanned, no plan job
  // waiting or running): its last plan was made, or failed (ModelStatus.plan_error).
  bool AwaitPlanSettled(const std::string& model_id, absl::Time deadline) const;
  // Tests: waits until `n` threads keep the model across a release of mu_ (ModelRegistry holds:
  // waiting Publish / WaitVersion calls, a queued or running plan job), e.g. until calls wait.
  bool AwaitModelHolds(const std::string& model_id, int n, absl::Time deadline) const;
  int num_models() const;
  // Tests in simulated time: waits (real time) until the driver has made a pass (lease sweep,
  // timeouts, starts, commits) at clock time `t` or later. The pass's node RPCs are posted by
  // then, not necessarily sent: AwaitNodeRpcsIdle waits for them.
  bool AwaitDriverPassAt(absl::Time t, absl::Time real_deadline) const;
  // Tests: waits (real time) until no node RPC the driver posted is queued or running.
  bool AwaitNodeRpcsIdle(absl::Time real_deadline) const;

 private:
  // The tables (node_table.h, model_registry.h): plain data guarded by mu_, not thread-safe.
  // The aliases keep the names the driver, catch-up and digest code use.
  using Node = NodeTable::Node;
  using Model = ModelRegistry::Model;
  using WorkerRec = ModelRegistry::WorkerRec;
  using CatchUpRun = ModelRegistry::CatchUpRun;
  using PlanState = ModelRegistry::PlanState;

  // A commit the coordinator decided that one node has not acknowledged yet (async / one-step-off:
  // RPC failed). Retried until the node acks, answers that its staging is gone, or loses its
  // lease / re-registers (its workers are dropped and get the next version).
  struct PendingCommit {
    std::string node, model_id;
    uint64_t version = 0;
    uint64_t incarnation = 0;
    absl::Time next_try;
  };
  // An AbortVersion that may not have reached a node (UNAVAILABLE / DEADLINE_EXCEEDED /
  // RESOURCE_EXHAUSTED). Sent again every commit_retry while the node keeps its incarnation: a
  // node that acknowledged a failed sync commit and missed its abort would otherwise keep the
  // version as committed until the next commit - a rollout that resumed before it (EndUpdate)
  // would copy the aborted version into its live weights at its next BeginUpdate. Safe to repeat:
  // an aborted version number is never executed again (Publish of it is refused), and an abort
  // naming a plan epoch ends only that execution. A restarted node rolls back what it was not
  // told at its re-join instead.
  struct PendingAbort {
    std::string node, model_id, reason;
    uint64_t version = 0, plan_epoch = 0, incarnation = 0;
    absl::Time next_try;
    int tries = 0;
  };
  // At most this many owed aborts are kept (each version or catch-up abort adds one per node that
  // missed it; a node keeping its lease while refusing every abort would otherwise grow the list).
  static constexpr size_t kMaxPendingAborts = 4096;

  absl::Status JoinWorkerLocked(const pb::JoinWorkerRequest& req, pb::JoinWorkerResponse* resp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A version number a re-joined rollout holds above the committed version (JoinWorkerRequest:
  // holds_version / applied_version): its node committed it, but it was never committed
  // cluster-wide - a sync commit that failed on another node while this one acknowledged it,
  // rolled back on the node when the coordinator's AbortVersion came or, lost, at its re-join.
  // The number is used: publishing it again is refused (the rollout's live weights hold its bytes),
  // and WaitVersion of it answers ABORTED. Per model, the newest such number and who held it.
  // Also a number a re-joined trainer published to the coordinator before (one-step-off / async:
  // JoinWorkerRequest.published_version) above the committed version: that coordinator recorded
  // it and is gone, the trainer never publishes it again, so no coordinator runs it - a rollout's
  // Apply / WaitVersion of it would otherwise wait until its deadline (status.md item 24).
  struct UsedByRejoin {
    uint64_t version = 0;
    std::string worker, node;
    bool published = false;  // a trainer's published_version (else a rollout's held version)
  };
  // ABORTED naming the rollout when `v` of `m` is such a number (not committed, no record of this
  // coordinator, at most the newest held) and the model was planned since (every worker of its
  // first plan re-joined, so a node that reports `v` committed would have raised the committed
  // version first); nullopt otherwise.
  std::optional<absl::Status> UsedUncommittedLocked(const std::string& model_id, const Model& m, uint64_t v, const std::string& what) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Such a number may still turn out committed: the first plan after a restart needs only the
  // spec's rollouts, so a node outside it (a rollout beyond num_rollout_workers) that was told `v`
  // committed may re-join after it and restore the commit. Until rejoin_window_end_ (and at most
  // `deadline`) this waits for that: returns false at once when that time has passed, else true
  // once `v` has an outcome or is used no more, the coordinator stops, or that time comes
  // (rejoin_window.cc; docs/daemon.md "Coordinator restart").
  bool AwaitRejoinWindowLocked(const std::string& model_id, const Model& m, uint64_t v, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The model's membership changed (a layout, a worker gone): re-plan. A plan of it being made now
  // is stale: cancelled at once, and the newer plan queued (see core.cc).
  void MarkPlanDirtyLocked(Model& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker left or its node was lost: abort an in-flight version it takes part in, re-plan.
  // Sync: aborts the unfinished versions `worker` published from another known process than
  // `process` (it registers again from a new one).
  void WithdrawPublishesOfOtherProcessLocked(const std::string& model_id, Model& m, const std::string& worker, const std::string& process)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropWorkerLocked(Model& m, const std::string& worker, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(const std::string& model_id, Model& m, uint64_t version, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sync: the rollouts counted paused whose pending WaitVersion asks for a version newer than `v`
  // (WorkerRec::waits). A commit or abort of `v` releases the paused rollouts, but these wait on,
  // paused: PausePastLocked counts them paused again afterwards, so the next version does not wait
  // for a BeginUpdate they send only once their wait has failed.
  std::vector<std::string> PausedPastLocked(const Model& m, uint64_t v) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void PausePastLocked(const std::string& model_id, Model& m, uint64_t v, const std::vector<std::string>& rollouts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // End-to-end digests (digests.cc, docs/daemon.md "End-to-end digests"): a book for version v on
  // the model's current plan; a node's report into it (DATA_LOSS naming the op on a mismatch: the
  // caller aborts v); the verdict once every node reported.
  void StartDigestsLocked(const std::string& model_id, Model& m, uint64_t v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AddDigestsLocked(const std::string& model_id, Model& m, const pb::ReportDoneRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishDigestsLocked(const std::string& model_id, Model& m, uint64_t v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NVFP4 magnitudes (magnitudes.cc): version v's book, for the nodes holding NVFP4 rollout pieces
  // of the current plan (none: no book); older books go, but the committed version's.
  void StartMagnitudesLocked(const std::string& model_id, Model& m, uint64_t v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A node reported v done: it counts as having reported its magnitudes (none, if it did not),
  // so no node waits for it any longer.
  void MagnitudesDoneLocked(Model& m, const std::string& node, uint64_t v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends AbortVersion to `nodes` (from the driver, outside the lock; one a node may have missed is
  // owed and sent again: PendingAbort); `plan_epoch` > 0 ends only that execution of `version` (a
  // catch-up attempt), 0 whatever runs for it.
  // `sent` (optional) runs after every node got its first try (without mu_).
  void QueueAbortRpcsLocked(const std::set<std::string>& nodes, const std::string& model_id, uint64_t version,
                            const std::string& reason, uint64_t plan_epoch = 0, std::function<void()> sent = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RegisterNode of a new id at max_nodes: removes the lost node nothing refers to whose lease ran
  // out first, or RESOURCE_EXHAUSTED naming max_nodes.
  absl::Status MakeRoomForNodeLocked(const std::string& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // now + timeout_ms (60 s when <= 0), at most max_wait from now.
  absl::Time Deadline(int64_t timeout_ms) const;

  // Driver (driver.cc). Each *WorkLocked decides under mu_ and returns RPC work to run outside
  // it; the driver posts each call to its lane (lanes_).
  using LaneWork = std::vector<std::pair<std::string, std::function<void()>>>;
  void DriverLoop();
  LaneWork CollectWorkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepLeasesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::function<void()> CommitWorkLocked(const std::string& model_id, Model& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishCommitLocked(const std::string& model_id, Model& m, uint64_t v, const std::vector<std::string>& nodes,
                          const std::vector<absl::Status>& acks, const std::vector<uint64_t>& incarnations)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Planning (driver.cc): the driver queues one plan job per model (plan_queued); the job takes
  // the model's snapshot when the planner thread starts it (PlanSnapshotLocked), plans outside
  // mu_, applies the result if membership did not change meanwhile, and installs.
  bool PlanReadyLocked(const Model& m) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Fewer trainers with a layout than the spec names (they exited): no plan can be made.
  bool TrainersMissingLocked(const Model& m) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool PlanWorkLocked(const std::string& model_id, Model& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PlanSnapshotLocked(const std::string& model_id, Model& m, SliceInput* in, PlanSettings* settings)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PlannerLoop();
  void RunPlan(const std::string& model_id, Model* m);
  // A plan's installs, posted by RunPlan to the model's lane: every node's slice, then (under mu_)
  // the plan installed if its epoch is still the model's, else re-planned; ends RunPlan's hold.
  struct InstallJob {
    SliceInput in;
    PlanOutcome outcome;
    std::vector<std::pair<std::shared_ptr<NodeClient>, std::string>> installs;  // client, node
  };
  void InstallPlanSlices(const std::string& model_id, Model* m, InstallJob* job);
  std::function<void()> StartWorkLocked(const std::string& model_id, Model& m, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OwedCommitWorkLocked(LaneWork* work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Owed aborts (PendingAbort) due now: dropped for a node lost or restarted, else sent again.
  void OwedAbortWorkLocked(LaneWork* work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends `p`'s AbortVersion (without mu_, from the driver's work): an answer settles it (owed
  // entry removed); UNAVAILABLE / DEADLINE_EXCEEDED owes it (again) while the node keeps
  // p.incarnation.
  void SendAbort(PendingAbort p, const std::shared_ptr<NodeClient>& client) ABSL_LOCKS_EXCLUDED(mu_);

  // Catch-up of late rollouts (catch_up.cc, docs/daemon.md "Catch-up"). StartCatchUpLocked: when
  // nothing else runs for the model and a rollout of its plan holds less than the committed
  // version, queues the catch-up plan (planner thread: plan, install, ExecuteVersion) or, with no
  // source, records why for those rollouts. `without_plan`: the model cannot be planned (its
  // trainers are gone): late are the rollouts with a layout that are not left out (sync_pause.h),
  // as a plan made now would hold them. CatchUpWorkLocked: while one runs: its timeout, a
  // source or late rollout that went away, and the commit once every node reported done.
  void StartCatchUpLocked(const std::string& model_id, Model& m, absl::Time now, bool without_plan = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::function<void()> CatchUpWorkLocked(const std::string& model_id, Model& m, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunCatchUpPlan(const std::string& model_id, Model* m, const SliceInput& in);
  // A catch-up's installs and starts, posted by RunCatchUpPlan to the model's lane.
  struct CatchUpInstallJob {
    SliceInput in;
    PlanOutcome outcome;
    std::vector<std::pair<std::string, std::shared_ptr<NodeClient>>> clients;  // node, client
    uint64_t version = 0;
  };
  void InstallCatchUp(const std::string& model_id, Model* m, CatchUpInstallJob* job);
  // A node's report of a catch-up execution. FAILED_PRECONDITION for a report of another plan
  // epoch than the catch-up running (a late report of an earlier attempt of the same version).
  absl::Status CatchUpDoneLocked(const pb::ReportDoneRequest& req, Model& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the catch-up: AbortVersion to its nodes; with `final`, its late rollouts are not tried
  // again for this version (they get the next one) and `reason` is what they are told.
  void FailCatchUpLocked(const std::string& model_id, Model& m, const std::string& reason, bool final) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sync rollouts that do not pause (sync_pause.cc, sync_pause.h). SyncPauseLocked: at the point
  // where the driver would start a version; once the newest queued version waited
  // sync_pause_timeout for rollouts to pause, leaves out the ones not paused (log, metric, status)
  // and marks the plan dirty: true when it did (the driver re-plans before anything starts).
  // RejoinLeftOutLocked: the rollout paused (BeginUpdate): back into the next plan. LeftOutLocked:
  // the record of a rollout left out (this registration), or null.
  bool SyncPauseLocked(const std::string& model_id, Model& m, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RejoinLeftOutLocked(const std::string& model_id, Model& m, const std::string& worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const LeftOutRollout* LeftOutLocked(const Model& m, const std::string& worker) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // WaitVersion for `worker`: a late rollout is not told `v` until it holds it (nullopt: keep
  // waiting; OK: it holds it or is not a late rollout; ABORTED: its catch-up failed).
  std::optional<absl::Status> CaughtUpLocked(const Model& m, const std::string& worker, uint64_t v) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Status (status.cc). WatchDog: one per WatchStatus stream; calls `cancel` once the stream
  // overruns its deadline (or Shutdown) by kWatchWriteGrace; the destructor stops and joins it.
  class WatchDog {
   public:
    WatchDog(CoordinatorCore* core, absl::Time deadline, const std::function<void()>& cancel);
    ~WatchDog();
    WatchDog(const WatchDog&) = delete;
    WatchDog& operator=(const WatchDog&) = delete;

   private:
    CoordinatorCore* const core_;
    bool done_ ABSL_GUARDED_BY(core_->mu_) = false;  // the stream ended
    std::thread thread_;
  };
  // StatusRequest's filter: ids checked (INVALID_ARGUMENT) and known (NOT_FOUND).
  absl::Status CheckStatusFilterLocked(const pb::StatusRequest& req) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The status, narrowed to the filter (checked already).
  void FillStatusLocked(const pb::StatusRequest& filter, pb::StatusResponse* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Trims a built status to options.max_status_bytes (status_budget.h), keeping what `filter`
  // asked for longest; called without mu_.
  void FitStatus(pb::StatusResponse* status, const pb::StatusRequest& filter) const;
  // Something ClusterStatus reports changed: wakes WatchStatus streams.
  void StatusChangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ++status_generation_; }

  CoordinatorOptions options_;
  mutable absl::Mutex mu_;
  NodeTable nodes_ ABSL_GUARDED_BY(mu_);
  ModelRegistry models_ ABSL_GUARDED_BY(mu_);
  PlanCache plan_cache_;                                                 // own lock
  LaneWork pending_rpcs_ ABSL_GUARDED_BY(mu_);  // aborts to send: posted by the next driver pass
  // Clients of nodes lost in this driver pass: their calls in flight are cancelled after it.
  std::vector<std::shared_ptr<NodeClient>> lost_clients_ ABSL_GUARDED_BY(mu_);
  std::vector<PendingCommit> pending_commits_ ABSL_GUARDED_BY(mu_);
  std::vector<PendingAbort> pending_aborts_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, UsedByRejoin> used_by_rejoin_ ABSL_GUARDED_BY(mu_);  // model -> (see UsedByRejoin)
  std::map<std::string, SyncPauseBook> sync_pause_ ABSL_GUARDED_BY(mu_);   // model -> rollouts left out (sync_pause.h)
  uint64_t next_epoch_ ABSL_GUARDED_BY(mu_) = 1;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool cluster_draining_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t status_generation_ ABSL_GUARDED_BY(mu_) = 0;
  int status_watchers_ ABSL_GUARDED_BY(mu_) = 0;
  mutable std::atomic<int64_t> status_warned_at_s_{0};  // FitStatus's last warning (unix seconds)
  // Random per process: nodes that see a new one know the coordinator restarted (lost its state).
  const std::string instance_;
  const absl::Time rejoin_window_end_;  // AwaitRejoinWindowLocked: start + options_.rejoin_window
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // last lease check by the driver
  // The planner thread's work: per model, round-robin; a model's plan job and its catch-up job
  // are keyed (PlanQueue coalesces a key's waiting job).
  static constexpr const char* kPlanJob = "plan";
  static constexpr const char* kCatchUpJob = "catch-up";
  PlanQueue plan_queue_ ABSL_GUARDED_BY(mu_);
  // The driver's node RPCs (see Threads above). Lanes: ModelLane(model), NodeLane(node). Declared
  // after everything its calls touch; Shutdown stops it after the driver, before the members go.
  RpcLanes lanes_;
  static std::string ModelLane(const std::string& model_id) { return "model/" + model_id; }
  static std::string NodeLane(const std::string& node_id) { return "node/" + node_id; }
  std::thread driver_, planner_;
};

}  // namespace wb::daemon
