#pragma once
// node::WorkerCalls: what local workers ask of this node (the WorkerService calls; daemon/node/
// worker_service.cc only adapts gRPC to them). Each answers as the RPC of the same name; errors
// name the worker, model and node.
//
//   worker_calls.cc         RegisterWorker, Publish, BeginUpdate, EndUpdate, Apply, WaitVersion,
//                           ClusterStatus, and the restart rules (RestartAware,
//                           PublishAgainAfterRestart, ResendPause / WaitAgainForRollout).
//   worker_calls_layout.cc  RegisterLayout (buffers, CUDA imports, index probes), DescribeLayout.
//   worker_calls_held.cc    Deregister, leaves of exited workers and owed leaves (LeaveExited,
//                           SendOwedLeaves), and the holding of forwarded calls while the node
//                           re-joins or the coordinator is down (ForwardHeld, CoordinatorDown).
//
// Threads and locks: calls run on gRPC threads, any number at once; leaves of exited workers and
// owed leaves on the leave sender's thread (LeaveExited). WorkerCalls' only lock is the leave
// queue's (a leaf but for LocalWorkers::OweLeave under it): worker state is LocalWorkers' (own mutex), staging NodeStaging's (leaf locks), plans
// and committed versions node::Versions' (read through Plan / Committed, never held across a
// call), and coordinator calls and waits go through the CoordinatorAccess seam without any lock
// held. Every deadline and wait is on Options::clock.
//
// Dependencies (passed in, must outlive this): LocalWorkers, NodeStaging, Versions, NodeTransports
// (cuda_ipc for CUDA buffers), CoordinatorAccess, and the GpuImport seam.

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "base/shm_segment.h"
#include "daemon/fd_channel.h"
#include "daemon/layout_discovery.h"
#include "daemon/metrics.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/gpu_import.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/node_staging.h"
#include "daemon/node/node_transports.h"
#include "daemon/node/publish_record.h"
#include "daemon/node/versions.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon::node {

// How WorkerCalls::ForwardHeld holds a forwarded call (at namespace scope: a default argument
// there needs it complete).
struct ForwardHold {
  // The worker call's name. Non-empty: an UNAVAILABLE / CANCELLED answer (the coordinator is
  // down) is held too - only for calls the coordinator may record twice without harm (what the
  // client's own retry would send: BeginUpdate's ReportReady, RegisterWorker's JoinWorker,
  // RegisterLayout's SubmitLayout, Deregister's LeaveWorker).
  std::string call;
  // NOT_FOUND (the coordinator does not know the worker or model: a restarted one the node has
  // not re-joined yet) is held until a re-join too. False: it is the answer (JoinWorker never
  // answers it for that; a LeaveWorker's NOT_FOUND is Deregister's to judge).
  bool hold_not_found = true;
  // FAILED_PRECONDITION is held until a re-join too: JoinWorker's "node n is not registered", its
  // only one - a restarted coordinator the node has not noticed yet (up to a heartbeat period).
  bool hold_failed_precondition = false;
  // After a re-join the worker must be one the node re-joined (NOT_FOUND "register again"
  // otherwise). False for a worker that is not joined here (RegisterWorker) or no longer is
  // (Deregister removed it first).
  bool rejoined_worker = true;
  // What its error at the deadline ("<call> of worker <w> of model <m> on node <n>: the coordinator
  // at ... could not be reached ...") tells the worker to do; empty: "the call may not be recorded
  // there - call it again".
  std::string advice;
};

class WorkerCalls {
 public:
  struct Options {
    std::string node_id;
    // host:port of the coordinator (NodeDaemon::Options::coordinator): named by a held call that
    // gave up because the coordinator did not come back in time (ForwardHeld).
    std::string coordinator;
    Clock* clock = Clock::Real();
    DaemonMetrics* metrics = nullptr;  // required; must outlive this
    // CUDA VMM buffers: the fd a worker sent on the fd channel (NodeDaemon::Options::cuda_vmm_fd).
    std::function<absl::StatusOr<CudaVmmFd>(const std::string& model, const std::string& worker, const std::string& key)> cuda_vmm_fd;
    std::shared_ptr<GpuImport> gpu_import;  // required: opens workers' CUDA IPC / VMM buffers
    // The uid the worker socket bound `worker` of `model` to (the front's WorkerGuard::BoundCred).
    // RegisterLayout checks every shared-memory segment it maps is owned by it, on the node's own
    // descriptor: the front's ownership check opened the name separately, and the name may point
    // at another uid's segment by the time the node opens it. Unset: not checked here (only the
    // front's check).
    std::function<absl::StatusOr<uid_t>(const std::string& model, const std::string& worker)> worker_uid;
  };
  WorkerCalls(Options options, LocalWorkers& local, NodeStaging& staging, Versions& versions, const NodeTransports& transports,
              CoordinatorAccess& coordinator);
  ~WorkerCalls();  // StopLeaves
  WorkerCalls(const WorkerCalls&) = delete;
  WorkerCalls& operator=(const WorkerCalls&) = delete;

  // RegisterWorker, RegisterLayout and Deregister have no timeout_ms: `time_left` is what is left
  // of the worker's gRPC deadline (worker_service.cc; infinite: it gave none). Their calls to a
  // coordinator that is down are held within it (CallerDeadline, ForwardHeld).
  absl::Status RegisterWorker(const pb::RegisterWorkerRequest& req, pb::RegisterWorkerResponse* resp,
                              absl::Duration time_left = absl::InfiniteDuration());
  absl::Status RegisterLayout(const pb::RegisterLayoutRequest& req, pb::RegisterLayoutResponse* resp,
                              absl::Duration time_left = absl::InfiniteDuration());
  absl::Status Publish(const pb::PublishRequest& req, pb::PublishResponse* resp);
  // Sync pause (docs/daemon.md): BeginUpdate pauses the rollout on this node before it tells the
  // coordinator, then copies a version committed while it had resumed into its live weights;
  // EndUpdate resumes it (no commit writes its live weights until the next BeginUpdate), after a
  // copy into them that is running (LocalWorkers::EndUpdate).
  absl::Status BeginUpdate(const pb::BeginUpdateRequest& req, pb::BeginUpdateResponse* resp);
  absl::Status EndUpdate(const pb::EndUpdateRequest& req, pb::EndUpdateResponse* resp);
  absl::Status Apply(const pb::ApplyRequest& req, pb::ApplyResponse* resp);
  // `time_left`: what is left of the worker's gRPC deadline (worker_service.cc; infinite: none):
  // the node's answer is on its way before it (ReplyBy), also when the coordinator stalls.
  absl::Status WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp,
                           absl::Duration time_left = absl::InfiniteDuration());
  absl::Status Deregister(const pb::DeregisterRequest& req, absl::Duration time_left = absl::InfiniteDuration());
  absl::Status DescribeLayout(const pb::DescribeLayoutRequest& req, pb::DescribeLayoutResponse* resp);
  // Status on both services: the coordinator's cluster status plus this node's live states.
  absl::Status ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp);
  // The node's record of its trainers' publishes on disk (node::PublishRecord; null: none). Set
  // once, before the first call (NodeDaemon::Start, before the worker socket opens); must outlive this.
  void AttachPublishRecord(PublishRecord* record) { publish_record_ = record; }
  // The node's re-join, once the coordinator took worker `key` back (JoinWorker, before its
  // layout): a sync rollout paused by a BeginUpdate the old coordinator recorded, with no commit
  // since, is reported paused again (ReportReady), so the versions re-sent to the new coordinator
  // can start into it and its WaitVersion lost to the restart can be asked again there
  // (WaitAgainForRollout). The new coordinator keeps no pause of its own. A rollout that resumed
  // (EndUpdate) meanwhile is then reported resumed. Best effort: a failure is logged (its wait is
  // then answered ABORTED, as before).
  void ResendPause(const LocalWorkers::WorkerKey& key);
  // The node's liveness check (its control tick, NodeDaemon::CheckWorkers): each local worker whose
  // process exited is removed here and its LeaveWorker queued for the leave sender (a thread of
  // its own, so a coordinator that gives no answer never holds the control thread); a leave that
  // finds the coordinator unreachable (no answer, refused) is owed (LocalWorkers::OweLeave), and so
  // are the ones queued behind it, untried. Returns without waiting for the sends.
  void LeaveExited();
  // Queues the owed leaves for the sender once the coordinator answers again (registered, its
  // heartbeats answered: the same coordinator back from a stall - a re-join drops them instead);
  // the first that finds it unreachable again stays owed, and so do the rest, untried. Control
  // tick, after LeaveExited.
  void SendOwedLeaves();
  // Ends the leave sender: a leave in flight ends within its timeout; the ones queued behind it and
  // any queued later are owed, not sent (the node is stopping). Idempotent. NodeDaemon::Shutdown,
  // before the coordinator client goes.
  void StopLeaves();
  // TEST ONLY: waits (real time, up to `timeout`) until no leave is queued or being sent; whether so.
  bool AwaitLeavesSent(absl::Duration timeout);

 private:
  using Bytes = StagedBytes;
  DaemonMetrics& metrics() const { return *options_.metrics; }
  // Publish / Apply without their metrics (Publish and Apply count them before the reply).
  absl::Status PublishVersion(const pb::PublishRequest& req, pb::PublishResponse* resp);
  // A one-step-off / async publish the coordinator of instance `answered_by` answered OK: recorded
  // for the node's re-joins (LocalWorkers::NotePublished) and, with the trainer's `process`, on
  // disk for the node's own restart (PublishRecord). When the node registered with another
  // coordinator since the answer was sent, its re-join may have reported the trainer without it:
  // the publish is sent to the new coordinator too (within `deadline`; its answer is logged, the
  // trainer is answered OK as the first coordinator said). In worker_calls_publish.cc.
  void RecordPublished(const pb::PublishRequest& req, uint64_t incarnation, const std::string& process, const std::string& answered_by,
                       absl::Time deadline);
  // RegisterWorker's join: JoinWorker at the coordinator (held while it is down, within
  // `deadline`), then the node's entry (replacing any).
  absl::Status JoinWorker(const pb::RegisterWorkerRequest& req, pb::RegisterWorkerResponse* resp, absl::Time deadline);
  absl::Status ApplyVersion(const pb::ApplyRequest& req, pb::ApplyResponse* resp);
  // Copies what AwaitApplicable found (nothing when its staging is null) into the worker's live
  // weights and reports it applied; returns the version they hold (a copy skipped because a newer
  // one ran first answers that one). `fit_deadline`: a copy that would obviously outlast
  // `deadline` is not started (DEADLINE_EXCEEDED, nothing copied). `incarnation`: the worker's
  // entry when the call began (LocalWorkers::Incarnation): the copy is refused (ABORTED) when the
  // worker registered again since (LiveJob::incarnation).
  absl::StatusOr<uint64_t> CopyApplicable(const std::string& model, const std::string& wid, LocalWorkers::Applicable found,
                                          absl::Time deadline, bool fit_deadline, uint64_t incarnation);
  // BeginUpdate / WaitVersion of a sync rollout: copies its newest committed version when its
  // live weights hold an older one (after a copy that is running); `what` names the call in errors.
  // `key` is a local sync rollout whose committed copy is newer than its live weights (a commit
  // while it had resumed).
  bool NewerCommitted(const LocalWorkers::WorkerKey& key) const;
  absl::StatusOr<uint64_t> CopyNewest(const std::string& model, const std::string& wid, absl::Time deadline, bool fit_deadline,
                                      const std::string& what, uint64_t incarnation);
  // Sync: tells the coordinator that a rollout the node resumed on a WaitVersion answer (no commit
  // took its pause) is no longer paused, so the next version waits for its next BeginUpdate
  // (ReportReadyRequest.resumed). Best effort, bounded by `deadline` and 5 s; a failure is logged.
  void ReportResumed(const std::string& model, const std::string& worker, absl::Time deadline);
  // ABORTED when `key` registered again since a call of it began with `incarnation` (the call is
  // the replaced process's: it must not pause, resume or copy into the new one); else OK.
  absl::Status SameRegistration(const LocalWorkers::WorkerKey& key, uint64_t incarnation, const std::string& what) const;
  // Apply(v) of a rollout that does not hold v after a catch-up of v ended on this node: the
  // coordinator's WaitVersion(v, worker) decides - OK once another attempt caught it up (or it
  // holds v there), ABORTED naming why when its catch-up failed for good. With `worker` empty:
  // Apply(v) of a version this node knows nothing of since it re-joined
  // (Applicable::unknown_since_rejoin) - OK once v is committed there (the node's own commit then
  // ends the wait), ABORTED at once for a number the coordinator before the re-join used
  // (JoinWorkerRequest.published_version), or for v aborted.
  absl::Status AwaitCatchUp(const std::string& model, const std::string& worker, uint64_t version, absl::Time deadline);
  using Hold = ForwardHold;
  // One LeaveWorker of `key` for `reason`, answered within `timeout`.
  absl::Status SendLeave(const LocalWorkers::WorkerKey& key, const std::string& reason, absl::Duration timeout);
  // A leave for the sender: an exited worker's (LeaveExited) or an owed one re-sent (`owed`).
  struct QueuedLeave {
    LocalWorkers::WorkerKey key;
    std::string reason;  // LeaveWorkerRequest.reason
    absl::Duration timeout;
    bool owed = false;
  };
  // Appends to the sender's queue and starts the sender when none runs.
  void QueueLeaves(std::vector<QueuedLeave> leaves);
  // The sender thread: sends the queued leaves one by one until none is left, then ends.
  void SendQueuedLeaves();
  // Forwards a call about local worker `worker` to the coordinator (`call` gets the deadline),
  // held while the node (re-)registers and sent again once after a re-join that answered
  // NOT_FOUND (Hold). With Hold::call: an UNAVAILABLE / CANCELLED answer is held until the node
  // re-joined a coordinator (sent again there) or the same coordinator answers heartbeats again
  // (sent again once); at `deadline` UNAVAILABLE naming the coordinator and the wait
  // (CoordinatorDown). *sent_in = the session of the last attempt.
  absl::Status ForwardHeld(const std::string& model, const std::string& worker, absl::Time deadline, uint64_t* sent_in,
                           const std::function<absl::Status(absl::Time)>& call, const Hold& hold = {});
  // UNAVAILABLE for a call (`what`: "BeginUpdate of worker r0 of model m on node n0") that was held from `held_from` and gave up at
  // its deadline because the coordinator could not be reached (`last`: its last answer): names the
  // coordinator's address, since when it was unreachable (the node's heartbeats, else `held_from`),
  // how long the call waited, and `advice`.
  absl::Status CoordinatorDown(const std::string& what, const absl::Status& last, absl::Time held_from, const std::string& advice) const;
  // Publish whose call the coordinator could not answer (`lost`: UNAVAILABLE, CANCELLED): once the
  // node re-joined a changed coordinator (a restart, a lost lease), the same publish is sent to it
  // (ForwardHeld; *session = the session of that attempt) and its answer returned - it records
  // the version unless it knows of it as committed (FAILED_PRECONDITION "not newer", returned as
  // ABORTED; `sync`: OK when the new coordinator holds this very version committed, CommittedThere),
  // aborted or used (ABORTED). nullopt: no re-join before `deadline` (the answer stands). Sync:
  // before, the call was answered ABORTED and the version lost (trainer ranks whose calls went
  // different ways split, docs/soak.md seed 1002).
  std::optional<absl::Status> PublishAgainAfterRestart(const pb::PublishRequest& req, bool sync, const absl::Status& lost, absl::Time deadline,
                                                       uint64_t* session, const std::function<absl::Status(absl::Time)>& send);
  // Whether the coordinator now answers WaitVersion(`version`) of `model` OK with exactly that
  // version committed (asked once, for at most 2 s, within `deadline`).
  bool CommittedThere(const std::string& model, const std::string& worker, uint64_t version, absl::Time deadline);
  // A waiting call the coordinator could not answer (UNAVAILABLE, NOT_FOUND, CANCELLED): ABORTED
  // naming the restart once the node re-joined a restarted coordinator, else `s`.
  // WaitVersion of a trainer (not a rollout) answered ABORTED by RestartAware: asks the re-joined
  // coordinator once, for at most 2 s; its OK is the answer, else `aborted`.
  absl::Status WaitAgainAfterRestart(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Time deadline,
                                     absl::Time reply_by, const absl::Status& aborted);
  // WaitVersion of a sync rollout (registration `incarnation`) whose call the coordinator could not
  // answer (`lost`: UNAVAILABLE, NOT_FOUND, CANCELLED): once the node re-joined a changed
  // coordinator, asked again there within `deadline` (again after each further change) when the
  // re-join re-sent its pause (ResendPause) or the version is committed into it already
  // (LocalWorkers::WaitResendable); its answer is returned. Else ABORTED naming the change, as
  // before; `lost` itself when no re-join came.
  absl::Status WaitAgainForRollout(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Time deadline,
                                   absl::Time reply_by, uint64_t incarnation, uint64_t session0, const absl::Status& lost);
  // WaitVersion's first ask (timeout_ms: what is left of `deadline`), asked again while the coordinator
  // refuses it at once (UNAVAILABLE, CANCELLED) and then answers the node's heartbeats again - the
  // same coordinator, back before the deadline - after a backoff on the clock (kWaitAskAgainFirst,
  // doubling to kWaitAskAgainMax). Returns the last answer; a coordinator change (a re-join since
  // `session0`) or the deadline ends it with the refusal (the restart rules take it from there).
  // *answered = when the first answer came.
  absl::Status AskWait(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Time deadline, absl::Time reply_by,
                       uint64_t session0, absl::Time* answered);
  static constexpr absl::Duration kWaitAskAgainFirst = absl::Milliseconds(100);
  static constexpr absl::Duration kWaitAskAgainMax = absl::Seconds(1);
  // The timeout of a coordinator WaitVersion serving a wait until `until`: CallTimeout (the
  // coordinator's own answer at `until` gets through), but cut at `reply_by` (ReplyBy: the
  // worker's gRPC deadline less a margin); at least 1 ms.
  absl::Duration WaitCallTimeout(absl::Time until, absl::Time reply_by) const;
  absl::Status RestartAware(const absl::Status& s, uint64_t session0, absl::Time deadline, const std::string& what);
  // WaitVersion's answer `s` (its first coordinator answer came at `answered`): a coordinator that
  // stayed away to the call's deadline - refused connections, or no answer while the node's
  // heartbeats find it unreachable - becomes UNAVAILABLE naming it and since when (CoordinatorDown),
  // as a held call's; anything else is returned as it is.
  absl::Status WaitUnreached(const pb::WaitVersionRequest& req, const absl::Status& s, absl::Time answered, absl::Time deadline) const;
  // RestartAware's ABORTED for `what` after coordinator change `change`.
  absl::Status RestartAborted(const std::string& what, const std::string& change) const;
  // PERMISSION_DENIED naming worker, buffer and segment unless `seg` (as this node opened it) is
  // owned by the uid `worker` is bound to (Options::worker_uid; OK when unset).
  absl::Status CheckWorkerOwns(const std::string& model, const std::string& worker, uint32_t buffer_id, const transport::ShmSegment& seg) const;
  // Opens a worker's CUDA IPC buffer through the cuda_ipc transport. FAILED_PRECONDITION naming
  // the buffer when this node has no usable cuda_ipc transport (no GPU visible, or built without CUDA).
  absl::StatusOr<std::shared_ptr<CudaImport>> ImportCuda(const std::string& model, const std::string& worker, const pb::BufferSpec& b);
  // Per buffer of `req`, the fd channel's cache keys of its CUDA VMM allocations now (empty for
  // other buffers and when a key has no fd): what LocalWorkers::SameLayout compares with the import.
  std::vector<std::vector<std::string>> VmmAllocationsNow(const pb::RegisterLayoutRequest& req) const;
  // A registering rollout's incoming staging faulted in, in the sizes its versions will take
  // (planner::StagingLayout of `layout` over the registered buffers), before it is submitted;
  // `is_cuda` per buffer.
  void PrewarmIncomingStaging(const pb::ModelSpec& spec, const pb::RegisterLayoutRequest& req, const pb::LayoutSpec& layout,
                              const std::vector<bool>& is_cuda);

  const Options options_;
  LocalWorkers& local_;
  NodeStaging& staging_;
  Versions& versions_;
  PublishRecord* publish_record_ = nullptr;  // AttachPublishRecord (then const)
  const NodeTransports& transports_;
  CoordinatorAccess& coordinator_;
  LayoutDescriber describer_;  // RegisterLayout / DescribeLayout (thread-safe)
  // The leave sender (worker_calls_held.cc): a leaf lock - no call is made and no other lock
  // taken under it except LocalWorkers' (OweLeave, at stop).
  absl::Mutex leaves_mu_;
  std::deque<QueuedLeave> queued_leaves_ ABSL_GUARDED_BY(leaves_mu_);
  bool sending_ ABSL_GUARDED_BY(leaves_mu_) = false;  // sender_ runs (and takes what is queued)
  bool leaves_stopped_ ABSL_GUARDED_BY(leaves_mu_) = false;
  std::thread sender_ ABSL_GUARDED_BY(leaves_mu_);  // the last sender started; joined by the next start or StopLeaves
};

}  // namespace wb::daemon::node
