#pragma once
// The node's local workers (issue 14): the table of workers registered on this node per (model,
// worker), their layouts, live buffers (shm mappings, CUDA imports), trainer snapshots, rollout
// committed staging and versions, the state of their live weights (whole / copying / TORN,
// daemon/node/live_copy.h), the model inventories they brought, and the node-local waits on them
// (Apply waiting for a version, a join waiting for the leave of the same id, one live copy per
// worker at a time).
//
// Threads and ownership: every field below is guarded by this class's own mutex (a leaf for
// everything but the clock: no method calls back into the node's other parts, the coordinator or
// a transport with it held). Callers: node::WorkerCalls (registration, layouts, Publish, Apply,
// WaitVersion), node::Versions' NodeService calls (commit / abort / drop) and its executor
// threads (GatherVersionMemory, AllocateStaging), which may call in while holding Versions' mutex
// (lock order: node::Versions::mu_ -> LocalWorkers::mu_). RunLiveCopies runs on the caller's
// thread (plus one copy thread per extra job) and must be called with no lock held.
//
// Waits go through the injected Clock (base/clock.h) and end at a deadline; Stop() ends them.
// The live copies themselves run on a transport, on real time (their deadline: now +
// live_copy_timeout).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "base/shm_segment.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/live_markers.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

// A worker process being watched: pidfd when the kernel has it (immune to pid reuse), else kill(pid, 0).
struct PidWatch {
  int pid = 0;
  int fd = -1;
  uint64_t start_time = 0;  // of the process when watched (/proc stat field 22; 0: unknown)
  ~PidWatch();
  bool Alive() const;
  // `pid` is the very process watched, still alive: same pid and start time (immune to pid reuse
  // also where the kernel has no pidfd).
  bool IsLive(int pid) const;
  // "<pid>@<start time>" (JoinWorkerRequest.process), empty when the start time is unknown.
  std::string Identity() const;
  // Watches `pid`; INVALID_ARGUMENT naming `who` when no such process exists.
  static absl::StatusOr<std::shared_ptr<PidWatch>> Open(int pid, const std::string& who);
};

class LocalWorkers {
 public:
  using Bytes = StagedBytes;
  // Worker ids are scoped per model (issue 16.5): two models may each have a trainer/0 on one
  // node, from one process or two. Local workers are keyed by (model, worker).
  using WorkerKey = std::pair<std::string, std::string>;
  // How LiveState (and its durable markers) know a worker: "<worker> of model <model>", which also
  // reads right in its TORN errors.
  static std::string LiveKey(const std::string& model, const std::string& worker) { return worker + " of model " + model; }

  struct Worker {
    std::string model_id;
    planner::Role role = planner::Role::kTrainer;
    int32_t gpu = 0;
    pb::Mode mode = pb::MODE_SYNC;
    bool has_layout = false;
    std::vector<std::shared_ptr<transport::ShmSegment>> buffers;  // live host memory, layout order (null: CUDA)
    std::vector<std::shared_ptr<CudaImport>> cuda;                 // same order: CUDA buffers (null: host)
    // Which files the host buffers are (name, device, inode; taken by name when the layout was
    // attached): a segment unlinked and created again under the same name is other memory
    // (SameLayout, NewMemory).
    std::vector<SegmentId> segments;
    std::map<uint64_t, std::shared_ptr<Bytes>> snapshots;          // trainer: version -> copy
    // Trainer, one-step-off / async: the newest version whose Publish the coordinator answered OK
    // (NotePublished). Re-joining says so (JoinInfo::published_version): the trainer never
    // publishes it again, so a restarted coordinator counts the number used.
    uint64_t published_version = 0;
    std::shared_ptr<Bytes> committed;                              // rollout: newest committed staging
    uint64_t committed_version = 0;
    uint64_t applied_version = 0;
    // Rollout: the newest version a catch-up committed into it (0: none). Its staging holds that
    // version at its pieces' places only (the sources' quantised bytes), never the canonical
    // shadows of receiver-quantised pieces: while it is the version the worker holds, re-joining
    // says so (JoinInfo::holds_without_shadows).
    uint64_t caught_up_version = 0;
    std::shared_ptr<PidWatch> pid;  // null: the worker gave no pid (not watched)
    // What the node re-submits when it re-joins a (restarted) coordinator.
    pb::ModelSpec spec;
    // Layouts are kept in wire form (serialized): a layout of 1e6 pieces is ~25 MB so and was
    // ~400 MB as each of these protos (docs/security.md, the thirty-eighth session's size probe);
    // they are parsed only when used (a re-join, a repeated RegisterLayout).
    std::string submitted;  // the SubmitLayoutRequest; valid when has_layout
    // RegisterWorker as it came (pid filled in): the same request again from the same live process
    // is a repeat (SameRegistration), not a new registration.
    pb::RegisterWorkerRequest registration;
    // RegisterLayout as it came and what it answered (serialized; empty until answered): the same
    // request again is answered the same (SameLayout). Its buffers parsed (SameMemory).
    std::string layout_request;
    std::string layout_response;
    std::vector<pb::BufferSpec> layout_buffers;
    // A repeated RegisterWorker was answered without a join (RepeatRegistration) and the
    // RegisterLayout that tells whether it was a replay has not come yet (TakeRepeat).
    bool repeat_pending = false;
    // Which registration this entry is (LocalWorkers::Add numbers them; a repeat of the same
    // registration keeps it). A worker call captures it when it begins, so that a call of a process
    // that was replaced meanwhile (killed while its WaitVersion waited, a new process registered
    // the same id) cannot write the new process's live weights (LiveJob::incarnation).
    uint64_t incarnation = 0;
    // Sync rollout: its engine is paused, so a commit may write its live weights. Cleared by
    // EndUpdate (the engine resumed: a commit makes the version its committed copy instead, which
    // the next BeginUpdate / Apply / WaitVersion copies), set again by BeginUpdate (Pause). True
    // from registration on: a client that never calls EndUpdate has its live weights written by
    // every commit, as before EndUpdate existed.
    bool paused = true;
    // Sync rollout: the cluster's committed version when its last BeginUpdate was recorded (0 =
    // none since registration or EndUpdate). That pause is for a newer version: a WaitVersion for
    // one at most this old answers without any commit taking the pause, and the engine resumes -
    // so it is taken as an EndUpdate (WorkerCalls::WaitVersion).
    uint64_t paused_at_committed = 0;
    // Sync rollout: its own committed_version when its last BeginUpdate paused it. A commit since
    // then (committed_version moved) took the coordinator's record of that pause, so a re-join
    // does not re-send it (PauseToResend).
    uint64_t pause_mark = 0;
    // The re-join (restarts_ count) that re-sent its pause to the new coordinator (0: none).
    uint64_t pause_resent_at = 0;
  };
  // A copy of one worker's entry (without `submitted`) and its live state, taken under the lock.
  struct View {
    Worker worker;     // `submitted` left empty
    bool copying = false;  // a copy into its live weights is running
    absl::Status torn;     // DATA_LOSS when its live weights are TORN
  };
  // What EndUpdate found once no copy into the worker's live weights runs.
  struct Ended {
    uint64_t applied_version = 0;    // what its live weights hold
    uint64_t committed_version = 0;  // its newest committed version on this node
  };
  // What Rejoin re-submits for one worker.
  struct JoinInfo {
    WorkerKey key;
    planner::Role role = planner::Role::kTrainer;
    int32_t gpu = 0;
    pb::ModelSpec spec;
    uint64_t applied_version = 0;
    uint64_t committed_version = 0;  // the worker's own (its committed copy), not the node's
    // Rollout: what it holds (max of the two above) came from a catch-up (Worker::caught_up_version):
    // no canonical shadows of it here (JoinWorkerRequest.holds_without_shadows).
    bool holds_without_shadows = false;
    uint64_t published_version = 0;  // trainer: Worker::published_version
    bool has_layout = false;
    pb::SubmitLayoutRequest submitted;
    std::string process;  // PidWatch::Identity of its process (empty: not watched / unknown)
  };
  // One copy of staging into a local rollout's live memory (sync commit or Apply).
  struct LiveJob {
    std::string model;
    std::string worker;
    uint64_t version = 0;  // being written
    std::shared_ptr<Bytes> staging;
    LiveBuffers live;
    planner::WorkerLayout layout;                       // the pieces copied from `staging`
    std::shared_ptr<const planner::Inventory> inventory;  // of the plan (kept alive by it)
    // Sync commit only: relays left to the commit, copied from other rollouts' incoming staging.
    const std::vector<RelayAtCommit>* relays = nullptr;
    const std::map<std::string, std::shared_ptr<Bytes>>* incoming = nullptr;
    std::string label;
    // Sync commit: written only while the worker is paused (Worker::paused, checked again when
    // the copy would start). A job with relays is never skipped for that: its staging lacks the
    // relayed pieces, so when the worker resumed RunLiveCopies copies the relays into its staging
    // instead (to_staging), which then becomes its committed copy; its live memory is not written.
    bool needs_pause = false;
    // Apply / BeginUpdate / WaitVersion: the worker's Worker::incarnation when the call began (0:
    // any - a commit's copy). Another one when the copy would start: the worker registered again
    // (a new process, new memory) while the call waited, and the job is refused (ABORTED, skipped)
    // - the call is the replaced process's, its copy would write the new process's live weights
    // while its engine reads them (sync chaos run: a killed rollout's WaitVersion answered once the
    // next version committed and copied it into its restarted successor, told the version before).
    uint64_t incarnation = 0;
    // Set by RunLiveCopies: the job was skipped, nothing copied into live memory (its status OK,
    // but for a refused incarnation) - the worker resumed (needs_pause; or relays: to_staging is
    // set too and the relayed pieces went into its staging), or its live weights hold `version` or
    // newer, whole (a copy of a newer version ran first). `holds`: the version its live weights
    // hold after the job.
    bool skipped = false;
    bool to_staging = false;
    uint64_t holds = 0;
  };
  // What Apply found after its wait: `staging` null = nothing newer to copy (live weights hold
  // `applied_version`); else copy `staging` (version `version`) into `live`.
  struct Applicable {
    uint64_t applied_version = 0;
    uint64_t version = 0;
    std::shared_ptr<Bytes> staging;
    LiveBuffers live;
    double copy_Bps = 0;  // observed staging -> live copy speed (bytes/s)
    // A catch-up of the (committed) version was aborted on this node and the rollout does not hold
    // it: only the coordinator knows whether that was final or another attempt follows (WorkerCalls
    // asks it, then waits again with ask_on_catch_up_abort = false). Nothing else is set.
    bool ask_coordinator = false;
    // With ask_coordinator: not a catch-up's end but a version this node knows nothing of since it
    // re-joined a coordinator (AwaitApplicable's ask_if_unknown_since_rejoin): a number the
    // coordinator before the re-join used, which no coordinator runs any more, or the next version.
    // Only the coordinator knows (its WaitVersion answers ABORTED for a used number, else once v is
    // decided); WorkerCalls asks it, then waits again without this question.
    bool unknown_since_rejoin = false;
  };

  struct Options {
    std::string node_id;
    Clock* clock = Clock::Real();
    // A live copy, once started, runs until done or this long (NodeDaemon::Options::live_copy_timeout).
    absl::Duration live_copy_timeout = absl::Minutes(2);
    LiveCopier* copier = nullptr;  // not owned; must outlive this
  };
  explicit LocalWorkers(Options options);
  ~LocalWorkers();

  // Durable live-copy markers (daemon/node/live_markers.h), before the first worker registers.
  void AttachMarkers(LiveMarkers* markers);
  // Ends every wait (Apply, joins, live copies waiting for another) with UNAVAILABLE.
  void Stop();

  // ---- registration
  // Before a join of `key`: waits (until `deadline`) while an exited earlier process of the same
  // id is still leaving, drops a dead entry not reaped yet, and marks the id joining (the liveness
  // check leaves it alone) until EndJoin. UNAVAILABLE when the leave does not finish in time.
  // `req` (the registration; null: a join without one) is checked against the id's holder: another
  // client of the same live process (both sent a RegisterWorkerRequest.client_instance, and they
  // differ) registered or registering it is ALREADY_EXISTS naming worker, node and process.
  absl::Status BeginJoin(const WorkerKey& key, absl::Time deadline, const pb::RegisterWorkerRequest* req = nullptr);
  static constexpr size_t kMaxClientInstanceBytes = 128;  // RegisterWorkerRequest.client_instance
  void EndJoin(const WorkerKey& key);
  // The coordinator accepted the join: `w` replaces any entry of `key` (its live state too: a new
  // process, its memory; and a leave owed for the id: the join replaced it there). `inventory`
  // (the model's tensors from the join) is kept when set.
  void Add(const WorkerKey& key, Worker w, std::optional<planner::Inventory> inventory);
  // The worker's buffers are mapped and its layout submitted: NOT_FOUND when it left meanwhile.
  // Adopts TORN markers an earlier process left on the same memory (LiveState::Adopt). Returns the
  // layout's bytes (what its pieces cover, from the model's inventory; 0 when unknown).
  absl::StatusOr<uint64_t> AttachLayout(const WorkerKey& key, std::vector<std::shared_ptr<transport::ShmSegment>> buffers,
                                        std::vector<std::shared_ptr<CudaImport>> cuda, pb::SubmitLayoutRequest submitted,
                                        const pb::ResolvedLayout& resolved);
  // A RegisterWorker of `key` that only repeats its registration (a client replaying it after its
  // channel to this node left READY - gRPC's idle timeout included - although the daemon did not
  // restart): the entry's process is alive and is the one `req` names (PidWatch::IsLive), `req` is
  // identical to the request it registered with (role, gpu, pid, model spec, client_instance:
  // another client of the process is no repeat - BeginJoin refuses it), and the id is not joining
  // or leaving. The node then keeps the entry as it is (applied version, snapshots, committed
  // staging, live state) and tells the coordinator nothing.
  // When the entry has a layout the repeat stays pending until the next RegisterLayout says what
  // it was (SameLayout, TakeRepeat).
  bool RepeatRegistration(const WorkerKey& key, const pb::RegisterWorkerRequest& req);
  // The answer to a RegisterLayout of `key` identical to the one it was answered for (shared
  // memory and CUDA buffers alike; not index probes, whose probe bytes in the worker's memory
  // may have changed); nullopt otherwise. The node answers it again and changes nothing (a
  // pending repeat was a replay: settled).
  // Not the same either when a shm name of the request now names another file (a segment unlinked
  // and created again under the same name) or the mapping faulted / shrank, nor when a CUDA VMM
  // buffer's allocations are not the ones it was imported from: `vmm_now[i]` holds the fd
  // channel's cache keys of buffer i's allocations now (CudaVmmFd::cache_key, in the buffer's
  // order; empty for other buffers, or when a key has no fd), compared with the import's
  // (CudaImport::allocation_keys) - a key offered again with another allocation is new memory.
  std::optional<pb::RegisterLayoutResponse> SameLayout(const WorkerKey& key, const pb::RegisterLayoutRequest& req,
                                                       const std::vector<std::vector<std::string>>& vmm_now = {});
  // A RegisterLayout of rollout `key` over NEW memory: the entry has a layout and `req` does not
  // name the very memory it mapped (another number of buffers, another shm name, the same name
  // naming another file now, a mapping that faulted or shrank, another CUDA IPC handle, any CUDA
  // VMM key: which allocation a key stands for is the worker's to say). Its live weights then hold
  // no version the node or the coordinator knows of, so the rollout registers anew: returns the
  // registration to join with (the coordinator drops and re-adds it - it holds nothing, is caught
  // up into the new memory and is no catch-up source meanwhile - and the node's entry, committed
  // copy included, is replaced). nullopt: the same memory (an index-probe replay), no layout yet,
  // or not a rollout (a trainer's new memory is simply mapped: it holds no version).
  std::optional<pb::RegisterWorkerRequest> NewMemory(const WorkerKey& key, const pb::RegisterLayoutRequest& req) const;
  // A RegisterLayout that is not the same after a repeated RegisterWorker: the repeat was no
  // replay (the process brings other memory or another layout), so it registers anew - returns
  // the registration to join with (and clears the mark); nullopt when no repeat is pending.
  std::optional<pb::RegisterWorkerRequest> TakeRepeat(const WorkerKey& key);
  // RegisterLayout of `key` answered `resp` for `req` (after AttachLayout).
  void RecordLayoutAnswer(const WorkerKey& key, const pb::RegisterLayoutRequest& req, const pb::RegisterLayoutResponse& resp);
  // Deregister / DropWorker / a refused re-join: the entry and its live state go.
  void Remove(const WorkerKey& key);
  // The liveness check: workers whose process exited (and that are not joining again) are removed
  // and marked leaving until LeaveDone (a join of the same id waits for it).
  std::vector<WorkerKey> ReapExited();
  void LeaveDone(const WorkerKey& key);
  // ---- owed leaves (daemon/node/local_workers_leaves.cc)
  // A LeaveWorker that could not reach the coordinator (it stalls: no answer, or refused
  // connections) is owed to it: re-sent once it answers again (WorkerCalls::SendOwedLeaves), so a
  // coordinator that comes back as the same process does not keep the departed worker as a member
  // (holding later versions that wait on it until their timeouts). A re-join drops them all
  // (NoteRejoin): the node re-submits only the workers it has, so the membership is rebuilt
  // without them. Bounded: at most kMaxOwedLeaves (4096, as the coordinator's owed aborts).
  static constexpr size_t kMaxOwedLeaves = 4096;
  enum class Owed {
    kKept,        // owed: re-sent when the coordinator answers again
    kSuperseded,  // the id is registered or joining here again: that join replaces it there
    kFull,        // kMaxOwedLeaves are owed already: not kept
  };
  struct OwedLeave {
    WorkerKey key;
    std::string reason;  // LeaveWorkerRequest.reason
  };
  // The leave of `key` (ReapExited's, Deregister's, or a re-send TakeOwedLeaves handed out) did
  // not reach the coordinator. Ends the id's leaving mark either way (a join of it no longer
  // waits: a join that reaches the coordinator replaces the old registration there, and a
  // successful one - Add - settles the debt).
  Owed OweLeave(const WorkerKey& key, const std::string& reason);
  // The owed leaves to send now, each marked leaving until LeaveDone / OweLeave (a join of the id
  // waits for its leave, as for ReapExited's). Ids joining here now stay owed (not handed out).
  std::vector<OwedLeave> TakeOwedLeaves();
  size_t OwedLeaves() const;
  // Re-join after a coordinator change: counts it (Apply waiters get ABORTED naming `reason`),
  // starts a new session (NoteSessionVersion) and drops the owed leaves (called before the re-join
  // takes its list of workers: a leave owed after that is of a worker it may have re-submitted).
  void NoteRejoin(const std::string& reason);
  // The coordinator session runs `version` of `model` on this node (an execution, not a catch-up):
  // the lowest such version since the last re-join bounds which Apply(v) ask the coordinator
  // (AwaitApplicable): every number a coordinator before the re-join used is below it, since a
  // used number is never published again.
  void NoteSessionVersion(const std::string& model, uint64_t version);
  // A trainer's Publish of `version` (one-step-off / async) was answered OK by the coordinator, on
  // behalf of registration `incarnation` (Worker::published_version; nothing when it registered
  // again meanwhile).
  void NotePublished(const WorkerKey& key, uint64_t version, uint64_t incarnation);
  std::string restart_reason() const;
  std::vector<JoinInfo> Joins() const;

  // ---- lookups
  bool Has(const WorkerKey& key) const;
  // The entry's Worker::incarnation (0: not registered here).
  uint64_t Incarnation(const WorkerKey& key) const;
  std::optional<View> Get(const WorkerKey& key) const;
  // The CUDA imports of a worker's buffers (empty when unknown).
  std::vector<std::shared_ptr<CudaImport>> Cuda(const WorkerKey& key) const;
  std::optional<planner::Inventory> Inventory(const std::string& model) const;
  // The model's spec as this node holds it: worker `worker`'s (and its role into *role when unset),
  // else any worker's of the model; nullopt when no worker of the model is registered here.
  std::optional<pb::ModelSpec> SpecOf(const std::string& model, const std::string& worker, std::optional<planner::Role>* role) const;
  // DATA_LOSS for the first TORN rollout of `model` on this node (WaitVersion), else OK.
  absl::Status TornRollout(const std::string& model) const;
  // Adds this node's view of its workers' live weights (LiveState) to a status answer.
  void AddLiveState(pb::StatusResponse* resp) const;

  // ---- versions
  // Node-local outcome of a version (AbortVersion, a commit that lost its staging, a re-join):
  // Apply waiters of it end with ABORTED naming `reason`.
  void NoteAborted(const std::string& model, uint64_t version, const std::string& reason);
  std::optional<std::string> AbortReason(const std::string& model, uint64_t version) const;
  // The version runs again (a re-joined coordinator runs a version whose execution the re-join
  // aborted here, its Publish re-sent): its abort is no longer its outcome here.
  void ForgetAborted(const std::string& model, uint64_t version);
  // A catch-up attempt of the committed `version` ended on this node (AbortVersion naming a plan
  // epoch, a re-join ending a catch-up execution): not an outcome for anyone here - the attempt
  // may be followed by another, and a rollout registering later has its own catch-up. Apply(v)
  // of a rollout not holding `version` then asks the coordinator (Applicable::ask_coordinator).
  void NoteCatchUpAborted(const std::string& model, uint64_t version, const std::string& reason);
  std::optional<std::string> CatchUpAbortReason(const std::string& model, uint64_t version) const;
  // False (nothing kept) when the worker left meanwhile.
  bool AddSnapshot(const WorkerKey& key, uint64_t version, std::shared_ptr<Bytes> snapshot);
  void DropSnapshot(const WorkerKey& key, uint64_t version);
  // Every worker of `model`: drops its snapshot of `version` / of every version before `version`.
  void DropSnapshots(const std::string& model, uint64_t version);
  void DropSnapshotsBefore(const std::string& model, uint64_t version);
  // CommitVersion: `incoming` (rollout -> staging) becomes each local rollout's committed copy
  // (none for a rollout in `relayed`: its staging lacks pieces relayed at commit, until the relays
  // are copied into it - RunLiveCopies, to_staging). Returns the live copies paused sync rollouts
  // need (model, worker, version, staging, live, needs_pause filled in); a sync rollout that
  // resumed (EndUpdate) gets none unless it is in `relayed` (then RunLiveCopies decides).
  // `catch_up`: the commit of a catch-up (Worker::caught_up_version = version for each rollout).
  std::vector<LiveJob> Commit(const std::string& model, uint64_t version, const std::map<std::string, std::shared_ptr<Bytes>>& incoming,
                              const std::set<std::string>& relayed, bool catch_up = false);
  // AbortVersion of `version` after this node committed it (a sync commit the coordinator declared
  // failed; node::Versions rolled its committed version back): a rollout whose live weights do not
  // hold it (resumed by EndUpdate when it committed: the version became its committed copy) drops
  // that copy, so no BeginUpdate / WaitVersion / Apply copies the aborted version into its live
  // weights; its committed version falls back to what its live weights hold. Rollouts whose live
  // weights hold it keep it (they do hold it; the next version rewrites them). Returns the rollouts
  // whose copy was dropped.
  std::vector<std::string> DropAbortedCommit(const std::string& model, uint64_t version);
  // A live copy of `version` from `staging` succeeded (RunLiveCopies recorded the version as
  // applied). `after_commit`: the commit's copy (the staging is released when it is the committed
  // one); else Apply's (released when nothing newer is committed). Nothing happens when the live
  // weights do not hold `version` (a sync commit's job skipped because the worker resumed: its
  // staging stays its committed copy).
  void MarkApplied(const WorkerKey& key, uint64_t version, const std::shared_ptr<Bytes>& staging, bool after_commit);
  // Apply: waits until `want` (0: whatever is newest) is committed or applied here, aborted, or
  // the node re-joined, and no copy into the worker runs; then says what to copy. NOT_FOUND (not a
  // rollout here), DEADLINE_EXCEEDED, ABORTED, UNAVAILABLE (stopped or left), DATA_LOSS (TORN with
  // nothing to restore it from). `ask_on_catch_up_abort`: also ends when a catch-up of `want` was
  // aborted here (before or during the wait) and the worker does not hold it, answering
  // ask_coordinator (NoteCatchUpAborted); false: such aborts are not waited for.
  // `ask_if_unknown_since_rejoin`: after a re-join (NoteRejoin), a `want` above what the rollout
  // holds that this node has no abort of and that is below every version the session ran here (or
  // none ran yet) is answered ask_coordinator + unknown_since_rejoin at once - this node cannot
  // tell a number the old coordinator used (its ExecuteVersion never came here) from the next
  // version, and waiting for it here lasted until the deadline (status.md item 24).
  absl::StatusOr<Applicable> AwaitApplicable(const WorkerKey& key, uint64_t want, absl::Time deadline, bool ask_on_catch_up_abort = false,
                                             bool ask_if_unknown_since_rejoin = false) const;
  // Runs `jobs` at once under the live-copy contract (daemon/node/live_copy.h): waits (bounded by
  // live_copy_timeout) until no copy into the same workers runs, then skips (LiveJob::skipped,
  // OK) a job whose worker's live weights hold its version or a newer one whole (two Apply calls
  // racing: the older version never lands over the newer one) and a needs_pause job of a worker
  // that resumed; marks the others copying, copies with live_copy_timeout as the deadline (not a
  // client's), then records each worker whole (applied_version = the job's version) or TORN.
  // Per job: OK, the copy's error when it wrote nothing, or DATA_LOSS naming the torn worker.
  // Call with no lock held.
  std::vector<absl::Status> RunLiveCopies(std::vector<LiveJob>& jobs);

  // ---- sync pause (BeginUpdate / EndUpdate)
  // BeginUpdate: the rollout paused; commits write its live weights again. False when `key` is
  // not a rollout here (nothing changes).
  bool Pause(const WorkerKey& key);
  // The committed version the coordinator answered that rollout's BeginUpdate with.
  void NotePausedAt(const WorkerKey& key, uint64_t committed);
  // Whether `key` is a sync rollout paused by a BeginUpdate recorded when `version` was committed
  // already (Worker::paused_at_committed >= version). `incarnation` != 0: and still the
  // registration a call began with (Worker::incarnation; false for a later one).
  bool PausedAfter(const WorkerKey& key, uint64_t version, uint64_t incarnation = 0);
  // EndUpdate: the rollout resumed; no live copy into it starts from now on (Commit, RunLiveCopies).
  // Waits (until `deadline`) for a copy into it that is running; NOT_FOUND (not a rollout here),
  // DEADLINE_EXCEEDED (the copy still runs; the worker stays resumed), UNAVAILABLE (stopped or
  // left), DATA_LOSS (its live weights are TORN). Errors name worker, model and node.
  // `incarnation` != 0 (WaitVersion's resume, on behalf of the registration its call began with):
  // ABORTED, nothing changed, when `key` is registered again meanwhile - another process's pause
  // is not the caller's to end.
  absl::StatusOr<Ended> EndUpdate(const WorkerKey& key, absl::Time deadline, uint64_t incarnation = 0);
  // ---- sync pause over a re-join (WorkerCalls::ResendPause, WaitAgainForRollout)
  // A sync rollout whose BeginUpdate the coordinator recorded (paused_at_committed set) and that
  // is still paused, with no commit since (committed_version == pause_mark): the pause the old
  // coordinator held. Returns its incarnation; nullopt otherwise.
  std::optional<uint64_t> PauseToResend(const WorkerKey& key) const;
  // That pause reached the coordinator of the current re-join: true and recorded
  // (pause_resent_at) when `key` is still that registration, paused; false when it resumed or
  // registered again meanwhile (the caller then reports it resumed).
  bool NotePauseResent(const WorkerKey& key, uint64_t incarnation);
  // A sync rollout's WaitVersion(`version`) lost to a re-join may be asked of the new coordinator:
  // still registration `incarnation`, and either paused with its pause re-sent by the latest
  // re-join (the version can start) or holding `version` already (committed into it: answered at
  // once, OK or the number's ABORTED).
  bool WaitResendable(const WorkerKey& key, uint64_t incarnation, uint64_t version) const;

 private:
  // RunLiveCopies, once no copy into the job's worker runs: skips it (LiveJob::skipped) or marks
  // the worker copying and records the copy durably (an error: not started).
  absl::Status StartLiveCopyLocked(LiveJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<WorkerKey, Worker> workers_ ABSL_GUARDED_BY(mu_);
  LiveState live_ ABSL_GUARDED_BY(mu_);  // whole / copying / TORN live weights per local worker
  std::map<std::string, planner::Inventory> inventories_ ABSL_GUARDED_BY(mu_);  // model -> inventory
  // Worker ids whose LeaveWorker (an exited process) is on its way to the coordinator, and ids being
  // registered again: a join waits for the leave of the same id, and the liveness check leaves a
  // joining id alone, so a late LeaveWorker never drops the NEW process's registration.
  std::set<WorkerKey> leaving_ ABSL_GUARDED_BY(mu_);
  std::set<WorkerKey> joining_ ABSL_GUARDED_BY(mu_);
  // The registration of a join in flight (BeginJoin with a request): a second client of the same
  // process joining the id at the same time is refused as if the first were registered already.
  std::map<WorkerKey, pb::RegisterWorkerRequest> joining_registration_ ABSL_GUARDED_BY(mu_);
  // ALREADY_EXISTS when `req` comes from another client of the process that holds `key` (BeginJoin).
  absl::Status CheckSameProcessClientLocked(const WorkerKey& key, const pb::RegisterWorkerRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Leaves the coordinator did not get (OweLeave): id -> LeaveWorkerRequest.reason.
  std::map<WorkerKey, std::string> owed_leaves_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, uint64_t>, std::string> aborted_ ABSL_GUARDED_BY(mu_);  // reason
  // (model, committed version) -> why a catch-up attempt of it ended here (NoteCatchUpAborted).
  std::map<std::pair<std::string, uint64_t>, std::string> catch_up_aborted_ ABSL_GUARDED_BY(mu_);
  uint64_t restarts_ ABSL_GUARDED_BY(mu_) = 0;  // re-joins so far (Apply waiters compare)
  // model -> the lowest version the coordinator session ran here since the last re-join
  // (NoteSessionVersion; cleared by NoteRejoin).
  std::map<std::string, uint64_t> session_first_ ABSL_GUARDED_BY(mu_);
  uint64_t next_incarnation_ ABSL_GUARDED_BY(mu_) = 1;  // Worker::incarnation of the next Add
  std::string restart_reason_ ABSL_GUARDED_BY(mu_);
  // Observed staging -> live copy speed (bytes/s; 10 GB/s, a multi-threaded memcpy, until
  // measured): Apply does not start a copy that would obviously outlast its caller's timeout. Not
  // pessimistic at first: a large model's first Apply with a modest timeout must still start.
  double live_copy_Bps_ ABSL_GUARDED_BY(mu_) = 1e10;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace wb::daemon
