#pragma once
// node::Versions: what the coordinator and peer nodes ask of this node about versions (the
// NodeService calls; daemon/node/node_service.cc only adapts gRPC to them) and running each
// version here: plans, executions, commits, aborts, the data-plane exchange with peers.
//
//   versions.cc         the NodeService calls (InstallPlan, ExecuteVersion, CommitVersion,
//                       AbortVersion, ExchangeRegions, DropWorker, Drain), the exec table, re-join
//                       and shutdown.
//   versions_run.cc     one version on the executor thread: RunExec (ReportDone), RunExecInner
//                       (exec plan -> executor), ExecOptionsFor, the channel setup with peers
//                       (ExecChannels, SetupPeer) and the channels' ends (DropChannel,
//                       ReleaseChannels, AbortChannels).
//   versions_memory.cc  the memory of a version: AllocateStaging, GatherVersionMemory,
//                       HostLiveSyncRollouts, DigestVersion, StartQuantizing / FinishQuantizing.
//   versions_committed.cc  what is committed here: committed_, its history and confirmations
//                       (the re-join's rollback), the installed plans as WorkerCalls reads them
//                       (Plan, PlanWith) and the plan each committed staging landed with
//                       (PlanForApply).
//
// Executor (per version): every local memory of the version (trainer live buffers in sync mode or
// their Publish snapshot, rollout incoming staging, the rank-0 gather staging) is registered with
// the same-node transport and, when the slice has cross-node ops, with the cross-node transport.
// For each peer node, the node with the smaller id calls the other's ExchangeRegions (endpoint +
// region descriptors, per model); both connect (or keep a healthy channel) and import. Then the
// buckets run (daemon/node/exec_plan.h states the ordering and deadlock rules, daemon/node/
// executor.h runs them). AbortVersion disconnects the version's channels that no other execution
// shares or that carry its batches, so blocked waits end at once (daemon/node/channel_cache.h).
//
// Threads and locks:
//  - NodeService calls run on gRPC threads; each started version runs on its own executor thread
//    (ExecuteVersion starts it; the next ExecuteVersion and Stop join the finished ones).
//  - mu_ guards plans_, catch_up_plans_, execs_, committed_, the executor thread table, stopping_
//    and the fields of each Exec marked "under mu_". Lock order: mu_ -> LocalWorkers' own mutex
//    (LocalWorkers never calls back); ChannelCache, NodeStaging (pool, budget), the metrics and
//    the clock's own lock are leaves under mu_. mu_ is never held across a network call, a copy
//    or a wait for a peer except through Clock::WaitUntil on mu_ itself (ExchangeRegions, SetupPeer).
//  - Every wait goes through Options::clock (Clock::WaitUntil on mu_; deadlines are clock->Now()
//    + timeout). Transports and gRPC measure real time, so a FakeClock suits the control logic
//    (tests) but not a version whose bytes move.
//
// Dependencies are passed in and must outlive this object: LocalWorkers (worker table, snapshots,
// committed staging, live copies), node::ChannelCache (healthy cross-node channels per model),
// node::NodeStaging (host/GPU staging and the node's budget), node::NodeTransports, and the
// coordinator seam node::CoordinatorAccess (ReportDone, progress for heartbeats, Drain).

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "daemon/digest/op_digests.h"
#include "daemon/metrics.h"
#include "daemon/nic_meter.h"
#include "daemon/node/channel_cache.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/delta_node.h"
#include "daemon/node/exec_plan.h"
#include "daemon/node/executor.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/node_staging.h"
#include "daemon/node/node_transports.h"
#include "daemon/node/quantize_incoming.h"
#include "daemon/node/staging_budget.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"
#include "base/shm_segment.h"

namespace wb::digest {
class SourceCertification;
}  // namespace wb::digest

namespace wb::daemon::node {

class OutgoingQuantization;

namespace pb = ::weightbridge::v1;

// A model's installed plan slice, resolved.
struct ModelPlan {
  pb::PlanSlice slice;
  planner::Inventory inventory;
  // Per slice worker (empty when the slice has no layout for it). `layouts` is what transfers
  // address: a rollout's staging, where quantised pieces are replaced by their canonical-dtype
  // shadows (planner::StagingLayout); `live_layouts` is the worker's own layout (commit/Apply
  // copy into it; the quantiser writes its quantised pieces and scales in staging). The same
  // for everyone without quantised pieces.
  std::vector<planner::WorkerLayout> layouts;
  std::vector<planner::WorkerLayout> live_layouts;
  std::vector<bool> quantized;  // the worker holds quantised pieces (host staging)
  bool hosts_gather = false;    // rank0_broadcast: this node holds the gather staging
};

// One peer node's side of a version's data plane.
struct PeerState {
  bool have = false;  // its ExchangeRegions (request or response) arrived
  bool reuse = false;
  bool rounds = false;  // both nodes Connect in this attempt's round (ExchangeRegions negotiated it)
  std::string endpoint;
  std::map<std::string, std::string> regions;  // key -> descriptor
  // The receiver of ExchangeRegions (the node with the higher id): its look-up of its cached
  // channel to the caller, made once by the handler, which decides `reuse` against it; SetupPeer
  // then runs on what it found (held for the execution), never on a later look-up - the cache may
  // have changed in between (a sibling execution's new connection).
  bool looked_up = false;
  ChannelCache::Lookup lookup;
};

// A batch group no other execution of this process had (Exec::batch_group).
inline uint64_t NewBatchGroup() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// One execution of a version on this node.
struct Exec {
  using Bytes = StagedBytes;
  std::string model_id;
  uint64_t version = 0;
  uint64_t epoch = 0;
  std::string coordinator_instance;  // of the ExecuteVersion that started it (set under mu_ before the thread)
  std::shared_ptr<const ModelPlan> plan;
  std::map<std::string, std::shared_ptr<Bytes>> incoming;  // local rollout worker -> staging
  // (rollout, buffer) -> the committed version its incoming staging buffer still holds: the sync
  // commit's tagged buffer came back from the pool (NodeStaging::BaseTag), so delta ops decode in
  // place there instead of copying the base from live weights (NodeDeltas::For).
  std::map<std::pair<std::string, size_t>, uint64_t> staging_holds;
  // Local rollout -> (version, staging): its committed staging when this version's staging was
  // chosen, or its applied staging not yet back in the pool (NodeStaging::TakeBase): the base of
  // its deltas (NodeDeltas::For), held while the version runs.
  std::map<std::string, std::pair<uint64_t, std::shared_ptr<Bytes>>> bases_held;
  std::shared_ptr<Bytes> gather;                           // rank-0 gather staging (one buffer)
  std::atomic<uint64_t> bytes_done{0};  // read by the heartbeat thread without mu_
  int64_t staging_bytes = 0;            // incoming + gather, allocated by the executor (not under mu_)
  std::shared_ptr<StagingBudget::Charge> charge;  // staging_bytes of the node's budget; travels with the staging
  bool started = false, aborted = false, failed = false;  // under mu_
  // Under mu_: CommitVersion is copying this version into the sync rollouts' live weights (outside
  // mu_). The execution stays in execs_ meanwhile, so that an AbortVersion (or a re-join, Stop)
  // arriving during the copy marks it aborted and the commit sees it before committed_ advances.
  bool committing = false;
  // Catch-up (docs/daemon.md "Catch-up"): an execution of a catch-up slice (catch_up_plans_) for
  // the already committed `version`: its ROLE_TRAINER workers are rollouts holding it (sources).
  bool catch_up = false;
  // Every byte of the version landed in this node's staging (the executor finished OK, before
  // ReportDone): only then may CommitVersion make it the committed copy (FAILED_PRECONDITION before).
  bool transferred = false;
  std::string error;
  absl::Time deadline;  // on Options::clock
  // Data plane of this version (under mu_).
  bool regions_ready = false;
  // transport name (a kind, "host_tcp", or an nccl lane, "nccl/<device>") -> (key -> descriptor)
  std::map<std::string, std::map<std::string, std::string>> local_desc;
  std::map<std::string, PeerState> peers;              // channel (ChannelName) -> the peer's side
  // channel -> the connection this version uses (kept after it ended: a re-join drops them). While
  // it runs it also holds each in the ChannelCache (holder: this Exec), which says when one may be
  // disconnected; RunExec releases them before it reports.
  std::map<std::string, transport::PeerId> connected;
  // channel -> this version's batches on it posted and not yet waited for (ExecOptions::
  // channel_post / channel_waited); no post starts once `aborted` is set.
  std::map<std::string, int> in_flight;
  // Its batches' Batch::group (ExecOptions::batch_group): an abort cancels this group on a channel
  // it shares (Transport::CancelBatches) instead of disconnecting it. Unique in the process, never
  // reused (a transport refuses later posts of a cancelled group).
  const uint64_t batch_group = NewBatchGroup();
  // channel -> (transport, round) of a Connect in progress in a non-empty round: an abort cancels
  // these rounds (Transport::CancelRound) so that its Connects end now, not at the deadline.
  std::map<std::string, std::pair<transport::Transport*, std::string>> connecting;
  std::map<std::string, LinkStat> links;  // executor thread only: peer node (own id = same-node) -> totals
  // Sync mode: same-node relays into a rollout whose staging nothing else reads are not copied
  // staging to staging during the transfer; the commit copies them from the relay's source
  // staging straight into the rollout's live buffers (RunExecInner "Relays at commit"). Written
  // by the executor under mu_ before it reports done; read by CommitVersion.
  std::map<std::string, std::vector<daemon::RelayAtCommit>> relays_at_commit;  // destination rollout -> copies
  std::map<std::string, std::set<int32_t>> pieces_at_commit;                   // destination rollout -> its pieces they fill
  uint64_t relay_bytes_at_commit = 0;
  // Executor thread only: seconds spent allocating staging, registering memory and setting up
  // channels (ExchangeRegions, Connect), and in the buckets (logged with "version transferred").
  double staging_s = 0, setup_s = 0, buckets_s = 0;
  // The pure plan this node ran (set by the executor before its buckets): routes, ops with their
  // region keys, pieces and boxes, relays at commit. Kept for what runs after the buckets.
  std::shared_ptr<const ExecPlan> exec_plan;
  // Lossless deltas: ExecuteVersionRequest.base_versions (rollout worker id -> the version its
  // node holds) and, executor thread only, what travelled as deltas (the "version transferred" line).
  std::map<std::string, uint64_t> base_versions;
  std::set<std::string> bases_without_shadows;  // ExecuteVersionRequest.bases_without_shadows
  DeltaStats delta;
  // Executor thread only: the digests of this node's ops after the buckets (reported with
  // ReportDone; docs/daemon.md "End-to-end digests") and the seconds they took.
  digest::OpDigests digests;
  double digest_s = 0;
  // Executor thread only, catch-ups: this node's sources whose memory no longer holds the version
  // (pb::CertifyBox; reported with ReportDone, ReportDoneRequest.stale_sources).
  std::vector<std::string> stale_sources;
  // What the node's quantiser wrote into its rollouts' quantised pieces (IncomingOptions::digests;
  // reported with ReportDone, ReportDoneRequest.quantized_pieces).
  std::vector<node::QuantizedPieceDigest> quantized_pieces;
};

class Versions {
 public:
  using Bytes = StagedBytes;
  struct Options {
    std::string node_id;
    Clock* clock = Clock::Real();
    DaemonMetrics* metrics = nullptr;  // required; must outlive this
    bool checksums = true;             // per-batch xxh3 on cross-node batches
    bool digests = true;               // end-to-end digests (NodeDaemon::Options::digests)
    int digest_threads = 8;
    bool digest_overlap = true;
    bool digest_in_transport = true;  // NodeDaemon::Options::digest_in_transport
    uint64_t delta_cache_bytes = 0;  // NodeDaemon::Options::delta_cache_bytes (daemon/node/delta_node.h)
    int delta_threads = 2;           // encode / decode threads per version
    // Receiver-side quantising (daemon/node/quantize_incoming.h): threads that may run while the
    // buckets do (0: half the cores, at least one; -1: none).
    int quantize_early_threads = 0;
    bool delta_in_place = true;      // NodeDaemon::Options::delta_in_place
    // Connection rounds with peer nodes that have them (ExchangeRegions.connect_rounds); false
    // only in tests (NodeDaemon::Options::test_connect_rounds).
    bool connect_rounds = true;
    absl::Duration delta_apply_delay = absl::ZeroDuration();  // NodeDaemon::Options::delta_apply_delay
    // TEST ONLY hooks: see NodeDaemon::Options.
    std::function<void(const std::string& model_id, uint64_t version, const std::map<std::string, std::pair<uint8_t*, int64_t>>& regions)>
        test_after_buckets;
    std::function<void(const std::string& model_id, uint64_t version, uint32_t bucket)> test_before_bucket;
    // TEST ONLY: called once CommitVersion committed a version here (a catch-up: `catch_up`); a
    // non-OK status is answered instead of OK, as if the answer were lost on its way (the commit
    // stands here; the coordinator counts the node as not having acknowledged it). Runs under mu_:
    // it must not block or call into the node.
    std::function<absl::Status(const std::string& model_id, uint64_t version, bool catch_up)> test_commit_answer;
    // Seam: peer node `peer`'s ExchangeRegions at `address`, cut at `deadline` (PeerStubs).
    std::function<absl::Status(const std::string& peer, const std::string& address, const pb::ExchangeRegionsRequest& req,
                               pb::ExchangeRegionsResponse* resp, absl::Time deadline)>
        exchange_regions;
  };
  Versions(Options options, LocalWorkers& local, ChannelCache& channels, NodeStaging& staging, const NodeTransports& transports,
           CoordinatorAccess& coordinator);
  ~Versions();  // Stop + Join if not done
  Versions(const Versions&) = delete;
  Versions& operator=(const Versions&) = delete;

  // ---- NodeService calls (errors name the model, version and node).
  absl::Status InstallPlan(const pb::InstallPlanRequest& req);
  // Answers at once: staging is allocated and every copy runs on the version's executor thread.
  absl::Status ExecuteVersion(const pb::ExecuteVersionRequest& req);
  // FAILED_PRECONDITION while the version has not fully landed here (not transferred).
  absl::Status CommitVersion(const pb::CommitVersionRequest& req);
  absl::Status AbortVersion(const pb::AbortVersionRequest& req);
  // Waits (on the clock, up to the version's deadline) until our executor registered its regions.
  absl::Status ExchangeRegions(const pb::ExchangeRegionsRequest& req, pb::ExchangeRegionsResponse* resp);
  absl::Status DropWorker(const pb::DropWorkerRequest& req);
  absl::Status Drain(const pb::DrainRequest& req, pb::DrainResponse* resp);

  // ---- For NodeDaemon and WorkerCalls.
  // The model's committed version here (0: none).
  uint64_t Committed(const std::string& model_id);
  // The model's installed plan (not a catch-up slice), or null.
  std::shared_ptr<const ModelPlan> Plan(const std::string& model_id);
  // The plan whose slice lists `worker`: the model's, else its catch-up slice's (a rollout caught
  // up while the model's plan does not hold it: its trainers exited, so no plan was made with it);
  // null with neither. Apply's copy takes the worker's live layout from it.
  std::shared_ptr<const ModelPlan> PlanWith(const std::string& model_id, const std::string& worker);
  // The plan Apply copies `staging` (`worker`'s committed staging) into its live weights by: the
  // plan that staging landed with (its CommitVersion's execution: the worker's live layout as the
  // version was committed, whatever was installed since - a re-plan made without the worker, its
  // catch-up slice replaced by the next late rollout's), else PlanWith (a staging committed
  // outside CommitVersion, tests only); null when neither lists the worker.
  std::shared_ptr<const ModelPlan> PlanForApply(const std::string& model_id, const std::string& worker, const std::shared_ptr<Bytes>& staging);
  // A worker call's answer from the coordinator says `version` of `model` is committed cluster-wide
  // (a sync Publish answered OK; ReportReady's or WaitVersion's committed_version). Only such
  // versions are kept over a re-join (AbortAllForRejoin).
  void NoteClusterCommitted(const std::string& model, uint64_t version);
  // After (re-)registration: aborts every version in flight naming `reason` (LocalWorkers::
  // NoteAborted, NoteRejoin) and drops their channels. A sync model's versions committed here
  // that the coordinator never confirmed committed cluster-wide (NoteClusterCommitted, a catch-up
  // commit) are rolled back as their AbortVersion would have done: that commit may have failed on
  // another node, and the AbortVersion saying so been lost with the coordinator (docs/daemon.md
  // "Commit across nodes (sync)"). Returns the committed versions (model -> version) as they are
  // then, for the re-join of the node's workers.
  std::map<std::string, uint64_t> AbortAllForRejoin(const std::string& reason);
  // Shutdown, first half: aborts every version, stops LocalWorkers' waits; no new executor starts.
  // False when already stopped.
  bool Stop();
  // Shutdown, second half (after the coordinator session stopped): tears down every cached
  // channel (executors blocked on one end) and joins the executor threads.
  void Join();

 private:
  DaemonMetrics& metrics() const { return *options_.metrics; }
  // Drops an execution no ExecuteVersion started (made by a peer's ExchangeRegions), releasing its
  // staging reservation; nothing when it started or was already replaced.
  void ReapUnstartedLocked(const std::shared_ptr<Exec>& exec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `want_catch_up` (ExecuteVersionRequest.catch_up) decides which slice an execution runs; unset
  // (a peer's ExchangeRegions) the installed catch-up slice of `epoch` if there is one.
  absl::StatusOr<std::shared_ptr<Exec>> GetExecLocked(const std::string& model_id, uint64_t version, uint64_t epoch,
                                                      std::optional<bool> want_catch_up = std::nullopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rollout live copies a commit of `exec` asks for, with layouts and relays (under mu_).
  std::vector<LocalWorkers::LiveJob> CommitJobsLocked(const pb::CommitVersionRequest& req, Exec& exec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CommitVersion: each local rollout of `exec` (its incoming staging) landed with exec.plan
  // (landed_with_); entries whose staging is gone are dropped first.
  void NoteLandedWithLocked(const Exec& exec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // committed_ advances to `version` of `model` (and it joins committed_history_).
  void NoteCommittedLocked(const std::string& model, uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AbortVersion(version) of `model` (a version abort, no plan epoch) for a version this node had
  // committed: forgets it; committed_ becomes the newest version committed here before it that is
  // left (unchanged when a newer one was committed since). Returns the version committed_ held
  // before, or nullopt when `version` was not committed here.
  std::optional<uint64_t> RollBackCommittedLocked(const std::string& model, uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The model's mode as this node knows it: its installed plan's, else a local worker's spec.
  std::optional<pb::Mode> ModeLocked(const std::string& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A sync commit rolled back at a re-join (AbortAllForRejoin), for its log line.
  struct RolledBack {
    std::string model;
    uint64_t version = 0, committed_now = 0;
    std::vector<std::string> dropped_copies;
  };
  // AbortAllForRejoin's rollback of every sync version committed here above confirmed_.
  std::vector<RolledBack> RollBackUnconfirmedLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tags `worker`'s committed staging buffers with the version they hold (StagedBuffer::pool_tag;
  // not quantised, host memory), for the pool to hand back to the next version: a sync rollout's
  // after the commit copied them into live weights, another mode's at the commit (Apply copies it).
  void TagCommittedStaging(const Exec& exec, const std::string& model, const std::string& worker, uint64_t version,
                           const std::shared_ptr<Bytes>& staging) const;

  // A coordinator call (`call` of `model_id`, `what`: "version 3") stamped with another
  // coordinator instance than the one the node is registered with (CoordinatorAccess::
  // coordinator_instance): FAILED_PRECONDITION naming both; OK when either is empty (a
  // coordinator built before the field, no registration yet).
  absl::Status CheckCoordinatorInstanceLocked(absl::string_view call, const std::string& model_id, absl::string_view what,
                                              const std::string& from_instance) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CommitVersion of a version with no execution here: OK for one committed already, ABORTED for
  // one aborted here, FAILED_PRECONDITION when a restart lost its staging (noted for Apply).
  absl::Status CommitOfUnknownLocked(const pb::CommitVersionRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // versions_run.cc
  void RunExec(std::shared_ptr<Exec> exec);
  absl::Status RunExecInner(Exec& exec);
  void ReportDone(const Exec& exec, const absl::Status& s, absl::Time t0);
  // Exchanges regions with the peer of `channel` and returns the channel for this version
  // (connecting if needed) over our transport `mine`.
  absl::StatusOr<ChannelLink> SetupPeer(Exec& exec, const ChannelPlan& channel, transport::Transport* mine);
  // The executor's ChannelSetup: SetupPeer per channel, our descriptors into exec.local_desc.
  class ExecChannels;
  // Deadline, abort check, metrics and progress of the executor for `exec`.
  ExecOptions ExecOptionsFor(Exec& exec);
  // Transport::CancelRound of each (transport, round) (aborted executions' Connects in progress).
  static void CancelConnects(const std::vector<std::pair<transport::Transport*, std::string>>& rounds);
  // Channels shared by executions (daemon/node/channel_cache.h), all outside mu_:
  // DropChannel forgets `id` of `chan` (ChannelName) entirely and disconnects it, whoever holds it
  // (a re-join, shutdown); ReleaseChannels ends `exec`'s holds at its end (with `failed`, its
  // channels are not reused) and disconnects what nothing uses any more; AbortChannels is
  // AbortVersion's: `exec`'s channels leave the cache, and those no other execution holds, or with
  // batches of `exec` in flight (`in_flight`), are disconnected now so that its blocked waits end.
  void DropChannel(const std::string& model_id, const std::string& chan, transport::PeerId id);
  void ReleaseChannels(const Exec& exec, bool failed);
  void AbortChannels(const Exec& exec, const std::map<std::string, int>& in_flight);
  void Disconnect(const std::string& chan, transport::PeerId id);

  // versions_memory.cc
  // Which memory backs each region key of a version on this node ("w<i>.b<j>", "g"), and what
  // keeps it alive while the executor runs (GatherVersionMemory).
  struct VersionMemory {
    std::map<std::string, RegionMemory> regions;
    std::vector<std::shared_ptr<void>> holds;  // snapshots / segments / staging / CUDA imports
    // Live segments read in place (sync trainers, catch-up sources): checked again after the buckets.
    std::vector<std::pair<std::string, std::shared_ptr<transport::ShmSegment>>> live_sources;
  };
  // Allocates the version's incoming staging (per local rollout, on its GPU where it may) and the
  // gather staging, outside mu_.
  absl::Status AllocateStaging(Exec& exec, const LanePlan& lanes);
  // The memory of each local region key: rollout staging, trainer live buffers (sync) or snapshots,
  // a catch-up source's committed staging or live buffers, the gather staging.
  absl::Status GatherVersionMemory(Exec& exec, VersionMemory& out);
  // Local sync rollouts whose live buffers are all host memory and that are paused, not resumed by
  // EndUpdate (relays may be left to the commit: it writes their live memory).
  std::set<uint32_t> HostLiveSyncRollouts(const ModelPlan& plan);
  // After the buckets: end-to-end digests of the local ops (`digests`: started before the buckets;
  // null with digests off) and the TEST ONLY after-buckets hook.
  absl::Status DigestVersion(Exec& exec, const VersionMemory& memory, digest::OpDigestTracker* digests);
  // Receiver-side quantising of this node's quantised rollouts (their pieces from their shadows
  // into their places and scales in incoming host staging): started once the exec plan is made,
  // each piece as soon as every op into it landed (ExecOptions::on_op_landed); null when nothing
  // here is quantised. FinishQuantizing, after the buckets, quantises the rest, waits and logs.
  absl::StatusOr<std::unique_ptr<node::IncomingQuantization>> StartQuantizing(Exec& exec, const node::Slice& slice);
  absl::Status FinishQuantizing(Exec& exec, node::IncomingQuantization& q);
  // versions_run.cc, RunExecInner's parts: the host address of each region (device memory: none),
  // the end-to-end digest tracker wired into `exec_options`, a catch-up's source certification and
  // sender-side quantisation finished (each logs its line).
  static std::map<std::string, digest::RegionBytes> HostRegions(const VersionMemory& memory);
  absl::StatusOr<std::unique_ptr<digest::OpDigestTracker>> StartDigests(Exec& exec, const node::Slice& slice, const node::ExecPlan& xplan,
                                                                       const VersionMemory& memory, node::ExecOptions& exec_options);
  absl::Status FinishCertification(Exec& exec, digest::SourceCertification& certification);
  absl::Status FinishOutgoingQuantization(const Exec& exec, node::OutgoingQuantization& qout);
  // NVFP4 (node::MagnitudeExchange): this node's parts' magnitudes to the coordinator
  // (ExchangeMagnitudes) and, with `wait`, the tensors' magnitudes over every node's parts. A
  // coordinator that keeps none (a catch-up after its restart) or does not know the call: an empty
  // answer (the partial groups keep their own magnitude, counted in the log); other errors fail
  // the version when the answer is needed. A catch-up reports nothing and asks only with `wait`.
  absl::StatusOr<std::map<int32_t, node::TensorMagnitude>> ExchangeMagnitudes(const Exec& exec, const std::vector<node::MagnitudePart>& parts,
                                                                              bool wait);

  // Executor threads: a thread files its id in exec_done_ as its last step under mu_; the next
  // ExecuteVersion (and Join) joins those, so a daemon that runs for weeks at one version a
  // second keeps only the executors still running, not one per version.
  std::vector<std::thread> TakeFinishedExecThreadsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkExecThreadDone(uint64_t id);

  const Options options_;
  LocalWorkers& local_;
  ChannelCache& channels_;
  NodeStaging& staging_;
  const NodeTransports& transports_;
  CoordinatorAccess& coordinator_;
  NicMeter nic_meter_;  // wb_nic_bytes_total from the host channel's per-path counts (own lock)
  NodeDeltas deltas_{options_.delta_cache_bytes, options_.delta_threads, options_.clock, options_.delta_apply_delay};  // per model delta caches (own lock)

  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const ModelPlan>> plans_ ABSL_GUARDED_BY(mu_);
  // model -> its latest catch-up slice (PlanSlice.catch_up), apart from its plan. One per model:
  // the coordinator runs one catch-up of a model at a time, and an execution holds its own slice
  // (Exec::plan); what a rollout needs after its catch-up committed is in landed_with_.
  std::map<std::string, std::shared_ptr<const ModelPlan>> catch_up_plans_ ABSL_GUARDED_BY(mu_);
  // (model, local rollout) -> the plan its newest committed staging landed with (CommitVersion),
  // for Apply (PlanForApply): before, Apply looked the worker's layout up in the plans installed
  // when it ran, and a rollout no installed plan listed any more was refused (a one-step-off /
  // async rollout caught up while the trainers were gone, whose catch-up slice the next late
  // rollout's replaced; a sync rollout that resumed at a commit and was left out of the re-plan).
  // Bounded: one entry per local rollout, a shared reference to a plan (never a copy); an entry
  // whose staging is gone (applied and back in the pool, the worker left) is dropped at the next
  // commit here.
  struct LandedWith {
    std::weak_ptr<Bytes> staging;
    std::shared_ptr<const ModelPlan> plan;
  };
  std::map<std::pair<std::string, std::string>, LandedWith> landed_with_ ABSL_GUARDED_BY(mu_);
  // Versions whose execution a re-join aborted (AbortAllForRejoin): the new coordinator may run
  // them again (their Publish re-sent, WorkerCalls::PublishAgainAfterRestart), which their abort
  // record alone would refuse (GetExecLocked).
  std::set<std::pair<std::string, uint64_t>> rejoin_aborted_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<Exec>> execs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> committed_ ABSL_GUARDED_BY(mu_);  // model -> version
  // model -> the newest versions committed here (at most kCommittedHistory): an AbortVersion of a
  // version committed here (a sync commit the coordinator declared failed because another node did
  // not acknowledge it) removes it, and committed_ falls back to the newest one left, so the
  // node's re-join never reports it (RollBackCommittedLocked).
  static constexpr size_t kCommittedHistory = 8;
  std::map<std::string, std::set<uint64_t>> committed_history_ ABSL_GUARDED_BY(mu_);
  // model -> the newest version the coordinator is known to have committed cluster-wide
  // (NoteClusterCommitted, a catch-up commit here). In sync mode a node's own commit is no proof:
  // the version is committed only once every node acknowledged, and the AbortVersion of one that
  // was not is best effort.
  std::map<std::string, uint64_t> confirmed_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::thread> exec_threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> exec_done_ ABSL_GUARDED_BY(mu_);
  uint64_t next_exec_thread_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool joined_ ABSL_GUARDED_BY(mu_) = false;  // Join ran
};

}  // namespace wb::daemon::node
