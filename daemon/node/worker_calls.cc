// node::WorkerCalls, part one: the WorkerService calls that forward to the coordinator and move
// versions into and out of live memory (see worker_calls.h).
#include "daemon/node/worker_calls.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/convert.h"
#include "daemon/log.h"
#include "daemon/node/deadlines.h"
#include "planner/inventory.h"

namespace wb::daemon::node {

WorkerCalls::WorkerCalls(Options options, LocalWorkers& local, NodeStaging& staging, Versions& versions, const NodeTransports& transports,
                         CoordinatorAccess& coordinator)
    : options_(std::move(options)),
      local_(local),
      staging_(staging),
      versions_(versions),
      transports_(transports),
      coordinator_(coordinator) {}

// ------------------------------------------------------------------------------- WorkerService calls
absl::Status WorkerCalls::RegisterWorker(const pb::RegisterWorkerRequest& req, pb::RegisterWorkerResponse* resp, absl::Duration time_left) {
  const absl::Time deadline = CallerDeadline(options_.clock, time_left);
  // Enums are checked before anything is forwarded or stored (role 99 was counted as a trainer).
  // Ids were checked by the front (daemon/limits.h: length, control characters).
  if (req.role() != pb::ROLE_TRAINER && req.role() != pb::ROLE_ROLLOUT) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterWorker.role is ", static_cast<int>(req.role()), ": must be ROLE_TRAINER (1) or ROLE_ROLLOUT (2)"));
  }
  if (req.has_model() && !pb::Mode_IsValid(req.model().mode())) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterWorker.model.mode is ", static_cast<int>(req.model().mode()),
                                                   ": must be MODE_SYNC (1), MODE_ONE_STEP_OFF (2), MODE_ASYNC (3) or unset"));
  }
  if (req.has_model() && !pb::Strategy_IsValid(req.model().strategy())) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterWorker.model.strategy is ", static_cast<int>(req.model().strategy()),
                     ": must be STRATEGY_WEIGHTBRIDGE (1), STRATEGY_RANK0_BROADCAST (2), STRATEGY_P2P_NO_DEDUP (3) or unset"));
  }
  const LocalWorkers::WorkerKey key{req.model_id(), req.worker_id()};  // worker ids are scoped per model (issue 16.5)
  // The same registration again from the same live process: a client replaying it after its
  // channel to this node left READY (gRPC's client idle timeout, 30 min without calls, included),
  // although this daemon did not restart. Answered as the first time, changing nothing here or at
  // the coordinator. (Before, the node replaced the worker's entry - applied version, snapshots,
  // live state - and the coordinator dropped the worker as "registered again", aborting the
  // version in flight.) The RegisterLayout that follows tells a replay (the same layout) from a
  // process that brings other memory (RegisterLayout: TakeRepeat).
  if (req.pid() > 0 && local_.RepeatRegistration(key, req)) {
    Log(LogLevel::kInfo, "worker registration repeated by its process: unchanged",
        {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"pid", req.pid()}});
    resp->set_session(absl::StrCat(options_.node_id, "/", req.worker_id()));
    return absl::OkStatus();
  }
  return JoinWorker(req, resp, deadline);
}

absl::Status WorkerCalls::JoinWorker(const pb::RegisterWorkerRequest& req, pb::RegisterWorkerResponse* resp, absl::Time deadline) {
  // A join sent before this node's (re-)registration and re-join have finished could reach the
  // coordinator first and then be dropped by that registration (a restarted node's workers are
  // dropped there) while this node keeps the worker: it would be left out of every plan.
  if (!coordinator_.AwaitRegistered(std::min(deadline, options_.clock->Now() + absl::Seconds(10)))) {
    return absl::UnavailableError(absl::StrCat("node ", options_.node_id, " is not registered with the coordinator yet (retry)"));
  }
  const LocalWorkers::WorkerKey key{req.model_id(), req.worker_id()};
  // An earlier process of this worker id that exited: its LeaveWorker reaches the coordinator
  // before this join; another client of the same process holding the id refuses it
  // (LocalWorkers::BeginJoin).
  if (absl::Status joining = local_.BeginJoin(key, std::min(deadline, options_.clock->Now() + absl::Seconds(10)), &req); !joining.ok()) return joining;
  struct Joined {
    LocalWorkers* workers;
    LocalWorkers::WorkerKey key;
    ~Joined() { workers->EndJoin(key); }
  } joined{&local_, key};
  // The process is watched from before the join, so the coordinator learns which process this is
  // (JoinWorkerRequest.process) and a pid with no process is refused before anything is recorded.
  std::shared_ptr<PidWatch> watch;
  if (req.pid() > 0) {
    auto opened = PidWatch::Open(req.pid(), absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id()));
    if (!opened.ok()) return opened.status();
    watch = std::move(*opened);
  }
  // A trainer process registering again with this node after the node restarted: the newest
  // publish a coordinator answered it, as the node kept it on disk (PublishRecord). Told to a
  // coordinator other than the one that answered it (that one has its own record), which then
  // counts the number used, as a re-join's (JoinWorkerRequest.published_version).
  std::optional<PublishEntry> inherited;
  if (publish_record_ != nullptr && req.role() == pb::ROLE_TRAINER && watch && !watch->Identity().empty()) {
    inherited = publish_record_->Find(req.model_id(), req.worker_id());
    if (inherited && inherited->process != watch->Identity()) inherited.reset();  // another process numbers its own versions
  }
  pb::JoinWorkerRequest j;
  if (watch) j.set_process(watch->Identity());
  j.set_node_id(options_.node_id);
  j.set_worker_id(req.worker_id());
  j.set_model_id(req.model_id());
  j.set_role(req.role());
  j.set_gpu(req.gpu());
  if (req.has_model()) *j.mutable_model() = req.model();
  pb::JoinWorkerResponse jr;
  // Held while the coordinator is down (a worker restarting during a coordinator restart): sent
  // once the node re-joined the restarted coordinator - after the re-join, which re-sent only the
  // workers this node had then (this one is added below, after its join), so it is joined once,
  // by this call - or once more to the same coordinator when it answers again (a join recorded
  // before its answer was lost is then recorded again: a fresh registration, as the client's own
  // retry would make). A restarted coordinator the node has not noticed yet refuses the join
  // ("node n is not registered"): held the same way, until the node's re-join.
  uint64_t sent_in = 0;
  absl::Status s = ForwardHeld(
      req.model_id(), req.worker_id(), deadline, &sent_in,
      [&](absl::Time dl) {
        jr.Clear();
        j.set_published_version(inherited && inherited->instance != coordinator_.coordinator_instance() ? inherited->version : 0);
        return coordinator_.client().JoinWorker(j, &jr, std::min(absl::Seconds(10), CallTimeout(options_.clock, dl)));
      },
      Hold{.call = "RegisterWorker", .hold_not_found = false, .hold_failed_precondition = true, .rejoined_worker = false});
  if (!s.ok()) return s;
  LocalWorkers::Worker w;
  w.model_id = req.model_id();
  w.role = FromProto(req.role());
  w.gpu = req.gpu();
  w.mode = jr.mode();
  w.spec = jr.has_model() ? jr.model() : req.model();
  if (w.spec.model_id().empty()) w.spec.set_model_id(req.model_id());
  w.registration = req;
  w.pid = std::move(watch);
  auto inv = InventoryFromProto(jr.tensors());
  local_.Add(key, std::move(w), inv.ok() ? std::optional<planner::Inventory>(std::move(*inv)) : std::nullopt);
  if (inherited) {
    local_.NotePublished(key, inherited->version, local_.Incarnation(key));  // this node's later re-joins report it too
  } else if (publish_record_ != nullptr) {
    publish_record_->Forget(req.model_id(), req.worker_id());  // an earlier process's record: no one inherits it
  }
  Log(LogLevel::kInfo, "worker registered",
      {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"role", pb::Role_Name(req.role())}, {"pid", req.pid()}});
  resp->set_session(absl::StrCat(options_.node_id, "/", req.worker_id()));
  return absl::OkStatus();
}

// Publish and Apply are counted here, before their reply is sent.
absl::Status WorkerCalls::Publish(const pb::PublishRequest& req, pb::PublishResponse* resp) {
  absl::Status s = PublishVersion(req, resp);
  const std::string& me = options_.node_id;
  if (s.ok()) {
    metrics().Version(me, req.model_id(), "published");
    metrics().Phase(me, "publish_stall", resp->stall_seconds());
  } else {
    metrics().Failure(me, s);
  }
  return s;
}

absl::Status WorkerCalls::PublishVersion(const pb::PublishRequest& req, pb::PublishResponse* resp) {
  const absl::Time start = options_.clock->Now();
  const absl::Time deadline = Deadline(options_.clock, req.timeout_ms());
  std::vector<std::shared_ptr<transport::ShmSegment>> to_snapshot;
  std::vector<std::shared_ptr<CudaImport>> cuda_snapshot;
  std::shared_ptr<StagingBudget::Charge> snap_charge;
  bool snapshot = false;
  bool sync = false;
  std::string process;  // the trainer's process (PublishRecord)
  // The registration this publish is for (NotePublished).
  const uint64_t incarnation = local_.Incarnation({req.model_id(), req.worker_id()});
  {
    std::optional<LocalWorkers::View> it = local_.Get({req.model_id(), req.worker_id()});
    if (!it || !it->worker.has_layout) {
      return absl::NotFoundError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " has no layout on node ", options_.node_id));
    }
    const LocalWorkers::Worker& w = it->worker;
    if (w.role != planner::Role::kTrainer) {
      return absl::FailedPreconditionError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " is not a trainer"));
    }
    sync = w.mode == pb::MODE_SYNC;
    if (w.pid) process = w.pid->Identity();
    if (!sync) {
      // Snapshot: the trainer's only stall. Budget bounds snapshot + staging memory.
      // With GPU staging, CUDA buffers are snapshotted on their GPU (under its own budget); if
      // one falls back to host memory it is checked against this budget after the copy.
      const bool gpu_staging = staging_.gpu_staging();
      int64_t need = 0;
      for (size_t j = 0; j < w.buffers.size(); ++j) {
        if (w.buffers[j]) {
          need += w.buffers[j]->size();
        } else if (!gpu_staging) {
          need += w.cuda[j]->size;
        }
      }
      // One node total (daemon/node/staging_budget.h): with every other snapshot, version in
      // flight and committed staging not applied yet. Reserved before the copy, which runs
      // outside any lock; the charge goes with the snapshot's memory.
      auto charge = staging_.budget().Reserve(need, absl::StrCat("the snapshot of worker ", req.worker_id(), " version ", req.version()));
      if (!charge.ok()) return charge.status();
      snap_charge = std::move(*charge);
      snapshot = true;
      to_snapshot = w.buffers;
      cuda_snapshot = w.cuda;
    }
  }
  if (snapshot) {
    std::shared_ptr<Bytes> snap = staging_.NewBytes(0, {snap_charge});
    absl::Status copied = staging_.ReadLive(to_snapshot, cuda_snapshot, *snap, absl::StrCat("snapshot ", req.worker_id(), " v", req.version()), deadline,
                                   /*on_gpu=*/true);
    if (!copied.ok()) return Annotate(copied, absl::StrCat("snapshot of version ", req.version()));
    int64_t fell_back = 0;  // CUDA buffers that did not fit GPU staging: host memory after all
    for (size_t j = 0; j < snap->size(); ++j) {
      if (!(*snap)[j].device && j < cuda_snapshot.size() && cuda_snapshot[j] && staging_.gpu_staging()) {
        fell_back += (*snap)[j].size();
      }
    }
    if (fell_back > 0) {
      auto extra = staging_.budget().Reserve(fell_back, absl::StrCat("the snapshot of worker ", req.worker_id(), " version ", req.version(),
                                                            " (CUDA buffers that did not fit the GPU staging budget)"));
      if (!extra.ok()) return extra.status();
      snap = NodeStaging::KeepWith(std::move(snap), std::move(*extra));
    }
    if (!local_.AddSnapshot({req.model_id(), req.worker_id()}, req.version(), std::move(snap))) {
      return absl::NotFoundError(absl::StrCat("worker ", req.worker_id(), " of model ", req.model_id(), " left during Publish"));
    }
  }
  pb::CoordPublishRequest c;
  c.set_node_id(options_.node_id);
  c.set_model_id(req.model_id());
  c.set_worker_id(req.worker_id());
  c.set_version(req.version());
  uint64_t session0 = 0;
  std::string sent_to;  // the coordinator instance the node was registered with when it sent the call
  const std::function<absl::Status(absl::Time)> send = [&](absl::Time dl) {
    sent_to = coordinator_.coordinator_instance();
    c.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(dl - options_.clock->Now())));  // 0 would mean 60 s
    return coordinator_.client().Publish(c, resp, CallTimeout(options_.clock, dl));
  };
  absl::Status s = ForwardHeld(req.model_id(), req.worker_id(), deadline, &session0, send);
  const absl::Time held_from = options_.clock->Now();
  // The coordinator went away while the call was in flight: sent again to the coordinator the node
  // re-joined (PublishAgainAfterRestart), so the version is published there instead of lost.
  while (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kCancelled) {
    std::optional<absl::Status> again = PublishAgainAfterRestart(req, sync, s, deadline, &session0, send);
    if (!again) break;
    s = *std::move(again);
  }
  if ((absl::IsUnavailable(s) || absl::IsCancelled(s)) && options_.clock->Now() >= deadline) {
    // The coordinator was not back (no re-join, no answer) by the deadline: say what the call
    // waited for, as a held BeginUpdate does, not the transport's last words.
    s = CoordinatorDown(absl::StrCat("Publish of version ", req.version(), " by worker ", req.worker_id(), " of model ", req.model_id(),
                                     " on node ", options_.node_id),
                        s, held_from, "the version may not be recorded there: publish it again");
  }
  if (!s.ok()) {
    local_.DropSnapshot({req.model_id(), req.worker_id()}, req.version());
    // NOT_FOUND: ForwardHeld already waited for a re-join; nothing was recorded anywhere.
    // UNAVAILABLE / CANCELLED: PublishAgainAfterRestart found no re-join (the same coordinator's
    // answer, or the deadline).
    return s;
  }
  // Sync: OK means every node committed it. Recorded before the trainer hears it: this node keeps
  // its own commit of the version over a re-join only when the coordinator said so.
  if (sync) versions_.NoteClusterCommitted(req.model_id(), req.version());
  // Not sync: recorded there, never sent again - a re-join tells a restarted coordinator, which
  // has no record of it, that the number is used (JoinWorkerRequest.published_version).
  if (!sync) RecordPublished(req, incarnation, process, sent_to, deadline);
  if (resp->version() == 0) resp->set_version(req.version());  // (an OK found by CommittedThere)
  resp->set_stall_seconds(absl::ToDoubleSeconds(options_.clock->Now() - start));
  return absl::OkStatus();
}

absl::Status WorkerCalls::BeginUpdate(const pb::BeginUpdateRequest& req, pb::BeginUpdateResponse* resp) {
  const LocalWorkers::WorkerKey key{req.model_id(), req.worker_id()};
  const absl::Time deadline = Deadline(options_.clock, req.timeout_ms());
  // Paused on this node before the coordinator hears of it: a commit the report lets start writes
  // its live weights (LocalWorkers::Commit).
  const bool rollout_here = local_.Pause(key);
  const uint64_t incarnation = local_.Incarnation(key);
  pb::ReportReadyRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(req.model_id());
  r.set_worker_id(req.worker_id());
  pb::ReportReadyResponse rr;
  uint64_t session0 = 0;
  // Held over a coordinator that is down too ("BeginUpdate"): ReportReady may be recorded twice
  // (it only marks the rollout paused), and a pause re-sent by the re-join meanwhile is the same.
  absl::Status s = ForwardHeld(
      req.model_id(), req.worker_id(), deadline, &session0,
      [&](absl::Time dl) { return coordinator_.client().ReportReady(r, &rr, CallTimeout(options_.clock, dl)); }, Hold{.call = "BeginUpdate"});
  resp->set_committed_version(rr.committed_version());
  if (s.ok()) versions_.NoteClusterCommitted(req.model_id(), rr.committed_version());
  if (s.ok() && rollout_here) s = SameRegistration(key, incarnation, "BeginUpdate");
  if (s.ok() && rollout_here) local_.NotePausedAt(key, rr.committed_version());
  if (!s.ok() || !rollout_here || !NewerCommitted(key)) return s;
  // A version committed while it had resumed (EndUpdate) is its committed copy, newer than its
  // live weights: copied now that it is paused, so that BeginUpdate + WaitVersion(v) OK means its
  // live weights hold v. The copy is not cut to the call's timeout (live_copy.h). (Nothing newer:
  // answered as before, also for TORN live weights, which the next commit restores.)
  absl::StatusOr<uint64_t> holds = CopyNewest(req.model_id(), req.worker_id(), deadline, /*fit_deadline=*/false, "BeginUpdate", incarnation);
  return holds.ok() ? absl::OkStatus() : holds.status();
}

absl::Status WorkerCalls::SameRegistration(const LocalWorkers::WorkerKey& key, uint64_t incarnation, const std::string& what) const {
  if (local_.Incarnation(key) == incarnation) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(what, " of worker ", key.second, " of model ", key.first, " on node ", options_.node_id,
                                         ": the worker registered again (another process or new memory) while the call waited; the call "
                                         "is the earlier registration's and changes nothing of the new one"));
}

absl::Status WorkerCalls::EndUpdate(const pb::EndUpdateRequest& req, pb::EndUpdateResponse* resp) {
  absl::StatusOr<LocalWorkers::Ended> ended =
      local_.EndUpdate({req.model_id(), req.worker_id()}, Deadline(options_.clock, req.timeout_ms()));
  if (!ended.ok()) return ended.status();
  resp->set_applied_version(ended->applied_version);
  resp->set_committed_version(ended->committed_version);
  Log(LogLevel::kDebug, "rollout resumed (EndUpdate)",
      {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"applied", ended->applied_version}});
  return absl::OkStatus();
}

absl::Status WorkerCalls::Apply(const pb::ApplyRequest& req, pb::ApplyResponse* resp) {
  absl::Status s = ApplyVersion(req, resp);
  if (s.ok()) {
    const uint64_t committed = versions_.Committed(req.model_id());
    const std::string& me = options_.node_id;
    metrics().Version(me, req.model_id(), "applied");
    metrics().Phase(me, "apply", resp->stall_seconds());
    metrics().Applied(me, req.model_id(), req.worker_id(), resp->applied_version(), committed);
  }
  return s;
}

absl::Status WorkerCalls::ApplyVersion(const pb::ApplyRequest& req, pb::ApplyResponse* resp) {
  const absl::Time start = options_.clock->Now();
  // The client's deadline bounds the wait for the version (and for a copy into this worker that
  // is already running); a copy that started runs to live_copy_timeout (RunLiveCopies).
  const absl::Time deadline = Deadline(options_.clock, req.timeout_ms());
  const std::string& model = req.model_id();
  const std::string& wid = req.worker_id();
  const uint64_t incarnation = local_.Incarnation({model, wid});  // a copy is for this registration only
  absl::StatusOr<LocalWorkers::Applicable> found =
      local_.AwaitApplicable({model, wid}, req.version(), deadline, /*ask_on_catch_up_abort=*/true, /*ask_if_unknown_since_rejoin=*/true);
  if (found.ok() && found->unknown_since_rejoin) {
    // A version unknown here since a re-join (status.md item 24): asked once, for the model - not
    // for the worker: whether the number is used or the version committed is the model's, and a
    // sync rollout's wait must not be recorded as its pause there (CoordinatorCore::WaitVersion).
    // Its ABORTED (a used number) is the answer; after OK the node's own commit decides.
    Log(LogLevel::kInfo, "Apply of a version unknown here since the re-join: asking the coordinator",
        {{"node", options_.node_id}, {"model", model}, {"worker", wid}, {"version", req.version()}});
    if (absl::Status s = AwaitCatchUp(model, /*worker=*/"", req.version(), deadline); !s.ok()) return s;
    found = local_.AwaitApplicable({model, wid}, req.version(), deadline, /*ask_on_catch_up_abort=*/true);
  }
  if (found.ok() && found->ask_coordinator) {
    // Once per call: after the coordinator's answer only the node's own commit (or an abort of
    // the version itself, a re-join, the deadline) ends the wait.
    if (absl::Status s = AwaitCatchUp(model, wid, req.version(), deadline); !s.ok()) return s;
    found = local_.AwaitApplicable({model, wid}, req.version(), deadline, /*ask_on_catch_up_abort=*/false);
  }
  if (!found.ok()) return found.status();
  absl::StatusOr<uint64_t> holds = CopyApplicable(model, wid, *std::move(found), deadline, /*fit_deadline=*/true, incarnation);
  if (!holds.ok()) return holds.status();
  resp->set_applied_version(*holds);
  resp->set_stall_seconds(absl::ToDoubleSeconds(options_.clock->Now() - start));
  return absl::OkStatus();
}

bool WorkerCalls::NewerCommitted(const LocalWorkers::WorkerKey& key) const {
  std::optional<LocalWorkers::View> w = local_.Get(key);
  return w && w->worker.role == planner::Role::kRollout && w->worker.mode == pb::MODE_SYNC && w->worker.committed != nullptr &&
         w->worker.committed_version > w->worker.applied_version;
}

absl::StatusOr<uint64_t> WorkerCalls::CopyNewest(const std::string& model, const std::string& wid, absl::Time deadline, bool fit_deadline,
                                                 const std::string& what, uint64_t incarnation) {
  // Version 0: no wait for a version, only for a copy into the worker that is running.
  absl::StatusOr<LocalWorkers::Applicable> found = local_.AwaitApplicable({model, wid}, 0, deadline);
  if (!found.ok()) {
    return absl::Status(found.status().code(), absl::StrCat(what, " of worker ", wid, " of model ", model, " on node ", options_.node_id,
                                                            ": ", found.status().message()));
  }
  return CopyApplicable(model, wid, *std::move(found), deadline, fit_deadline, incarnation);
}

absl::StatusOr<uint64_t> WorkerCalls::CopyApplicable(const std::string& model, const std::string& wid, LocalWorkers::Applicable found,
                                                     absl::Time deadline, bool fit_deadline, uint64_t incarnation) {
  if (found.staging == nullptr) return found.applied_version;
  std::vector<LocalWorkers::LiveJob> jobs(1);
  LocalWorkers::LiveJob& job = jobs[0];
  job.model = model;
  job.worker = wid;
  job.incarnation = incarnation;
  job.version = found.version;
  job.staging = found.staging;
  job.live = std::move(found.live);
  // The worker's live layout: from the plan this staging landed with (its commit's), whatever
  // is installed now - a re-plan made without the worker, or the next late rollout's catch-up
  // slice replacing the one that brought it the version, left it in no installed plan, and its
  // Apply was refused (status.md item 25). Before that refusal, such a worker got an empty
  // layout: nothing copied, and Apply answered OK over unchanged live weights (a silent
  // non-landing). A staging whose layout is truly unknown (no commit plan, no installed plan
  // lists the worker) is still refused, naming why; it stays for a later Apply.
  // (Listed with an empty layout is different: the worker holds no pieces, and OK is right.)
  std::shared_ptr<const ModelPlan> plan = versions_.PlanForApply(model, wid, job.staging);
  if (plan == nullptr) {
    const bool any = versions_.Plan(model) != nullptr;
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", job.version, " of model ", model, " is committed on node ", options_.node_id, " for worker ", wid,
        " but no plan installed there lists the worker (", any ? "the model's plan was made without it" : "no plan of the model is installed",
        ", and no catch-up slice lists it), so its live layout is unknown; nothing was copied: live weights still hold version ",
        found.applied_version, " (the version stays staged: Apply again once the worker is planned)"));
  }
  job.inventory = std::shared_ptr<const planner::Inventory>(plan, &plan->inventory);
  for (int i = 0; i < plan->slice.workers_size(); ++i) {
    if (plan->slice.workers(i).worker_id() == wid) job.layout = plan->live_layouts[i];
  }
  job.label = absl::StrCat("apply ", wid, " v", job.version);
  // A copy that starts runs to its end; one that would obviously outlast the caller's timeout
  // (the wait for the version took it) is not started: the caller learns that nothing changed
  // instead of giving up while its live weights are being rewritten.
  int64_t bytes = 0;
  for (const StagedBuffer& b : *job.staging) bytes += b.size();
  const absl::Duration estimate = absl::Seconds(static_cast<double>(bytes) / found.copy_Bps);
  if (fit_deadline && options_.clock->Now() + estimate > deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("version ", job.version, " is committed on node ", options_.node_id, " but copying it into the live weights of worker ", wid,
                     " (", bytes, " bytes, about ", absl::FormatDuration(estimate), ") does not fit in what is left of the call's timeout (",
                     absl::FormatDuration(std::max(absl::ZeroDuration(), deadline - options_.clock->Now())),
                     "); nothing was copied: live weights still hold version ", found.applied_version, " (call Apply with a longer timeout)"));
  }
  // The rollout's only stall: copy its pieces from committed staging into live weights (on the
  // same-node transport's copy threads).
  const uint64_t version = job.version;
  absl::Status copied = local_.RunLiveCopies(jobs)[0];
  if (!copied.ok()) return Annotate(copied, absl::StrCat("applying version ", version, " to ", wid));
  // Skipped: a copy of this version or a newer one ran first (a concurrent Apply); its caller
  // reports it. Answered with what the live weights hold.
  if (job.skipped) return job.holds;
  // Applied: the staging is not read again (a later Apply finds nothing newer); back to the pool.
  local_.MarkApplied({model, wid}, version, job.staging, /*after_commit=*/false);
  // Let go before the report: the next version may start meanwhile (the coordinator answers it),
  // and it decodes in place only if the tagged staging is back in the pool (NodeStaging::TakeBase).
  found.staging.reset();
  jobs.clear();  // `job` is not used below
  pb::ReportAppliedRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(model);
  r.set_worker_id(wid);
  r.set_version(version);
  pb::ReportAppliedResponse rr;
  // Best effort: the coordinator learns the applied version from the next ReportApplied or re-join.
  coordinator_.client().ReportApplied(r, &rr, CallTimeout(options_.clock, options_.clock->Now() + absl::Seconds(5))).IgnoreError();
  return version;
}

absl::Status WorkerCalls::AwaitCatchUp(const std::string& model, const std::string& worker, uint64_t version, absl::Time deadline) {
  pb::WaitVersionRequest w;
  w.set_model_id(model);
  w.set_version(version);
  w.set_worker_id(worker);
  w.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - options_.clock->Now())));
  pb::WaitVersionResponse resp;
  const uint64_t session0 = coordinator_.session();
  absl::Status s = coordinator_.client().WaitVersion(w, &resp, CallTimeout(options_.clock, deadline));
  if (s.ok()) versions_.NoteClusterCommitted(model, resp.committed_version());
  return RestartAware(s, session0, deadline, absl::StrCat("version ", version));
}

absl::Duration WorkerCalls::WaitCallTimeout(absl::Time until, absl::Time reply_by) const {
  return std::max(absl::Milliseconds(1), std::min(CallTimeout(options_.clock, until), reply_by - options_.clock->Now()));
}

absl::Status WorkerCalls::AskWait(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Time deadline, absl::Time reply_by,
                                  uint64_t session0, absl::Time* answered) {
  absl::Duration backoff = kWaitAskAgainFirst;
  for (bool first = true;; first = false) {
    pb::WaitVersionRequest ask = req;
    ask.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - options_.clock->Now())));
    resp->Clear();
    absl::Status s = coordinator_.client().WaitVersion(ask, resp, WaitCallTimeout(deadline, reply_by));
    if (first) *answered = options_.clock->Now();
    // Refused at once: the coordinator is down (refused connections) or shutting down. A wait is
    // a read, so asking again is harmless - but only of the SAME coordinator once it answers the
    // node's heartbeats again: a restarted one is the restart rules' (RestartAware,
    // WaitAgainForRollout: a rollout's pause must be re-sent there first). Before, the refusal was
    // the answer although the coordinator was back long before the wait's deadline.
    if (!absl::IsUnavailable(s) && !absl::IsCancelled(s)) return s;
    if (coordinator_.AwaitCoordinatorChange(session0, deadline).has_value()) return s;
    // Bounded: a coordinator that answers heartbeats but keeps refusing is asked at most once per
    // backoff (doubling to kWaitAskAgainMax), never past the deadline.
    const absl::Time again = options_.clock->Now() + backoff;
    if (again >= deadline) return s;
    options_.clock->SleepUntil(again);
    backoff = std::min(2 * backoff, kWaitAskAgainMax);
    Log(LogLevel::kInfo, "WaitVersion refused by a coordinator that answers again: asked again",
        {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"version", req.version()},
         {"first_answer", s.message()}});
  }
}

absl::Status WorkerCalls::WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Duration time_left) {
  const uint64_t session0 = coordinator_.session();
  const absl::Time deadline = Deadline(options_.clock, req.timeout_ms());
  // The coordinator calls below are cut before the worker's own gRPC deadline (ReplyBy): a
  // stalled coordinator (no answer at all) otherwise held them to 2 s past the wait's deadline -
  // the clients' own grace - and the worker saw its transport's DEADLINE_EXCEEDED instead of the
  // node's UNAVAILABLE naming the coordinator (WaitUnreached).
  const absl::Time reply_by = ReplyBy(options_.clock, time_left);
  const LocalWorkers::WorkerKey key{req.model_id(), req.worker_id()};
  // The registration the caller is (a process killed while this waits may be replaced meanwhile:
  // the answer is not the new process's, which must be neither copied into nor resumed by it).
  const uint64_t incarnation = req.worker_id().empty() ? 0 : local_.Incarnation(key);
  absl::Time answered;  // the coordinator's first answer (WaitUnreached: how long the call was held)
  absl::Status s = AskWait(req, resp, deadline, reply_by, session0, &answered);
  // A rollout's wait lost to a coordinator change: asked again of the new coordinator when its
  // re-join re-sent the rollout's pause (the re-sent version can start into it), else ABORTED
  // naming the change. Its OK then goes through the steps below like a first answer's.
  std::optional<planner::Role> role;
  const bool rollout = !req.worker_id().empty() && local_.SpecOf(req.model_id(), req.worker_id(), &role) && role == planner::Role::kRollout;
  const bool lost = s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kNotFound || s.code() == absl::StatusCode::kCancelled;
  if (rollout && lost) s = WaitAgainForRollout(req, resp, deadline, reply_by, incarnation, session0, s);
  if (s.ok() && !req.worker_id().empty()) s = SameRegistration(key, incarnation, "WaitVersion");
  if (s.ok()) {
    versions_.NoteClusterCommitted(req.model_id(), resp->committed_version());
    // Committed cluster-wide, but a local rollout of the model whose live copy failed does not
    // hold it (sync: "committed" includes live weights): say so instead of OK.
    if (absl::Status torn = local_.TornRollout(req.model_id()); !torn.ok()) return torn;
    // A sync rollout that resumed (EndUpdate) when the version committed holds it as its
    // committed copy, not in its live weights: copied first, as Apply does, so that OK means its
    // live weights hold it.
    if (!req.worker_id().empty() && NewerCommitted({req.model_id(), req.worker_id()})) {
      absl::StatusOr<uint64_t> holds = CopyNewest(req.model_id(), req.worker_id(), deadline, /*fit_deadline=*/true, "WaitVersion", incarnation);
      if (!holds.ok()) return holds.status();
    }
    // Sync: a rollout paused by BeginUpdate when version v was committed already, waiting for v or
    // older (a late or restarted rollout a catch-up served, a framework re-asking for the version it
    // holds), is answered without any commit taking its pause, and its engine resumes on OK. The
    // coordinator still counts it paused, so the next version would start at once and its commit
    // would write the live weights the engine reads (chaos run: rollouts saw v + 1's bytes while
    // checking v). Taken as an EndUpdate: later commits become its committed copy, copied at its
    // next BeginUpdate / WaitVersion.
    // Both steps check the registration again under the workers' lock: a process registered under
    // the same id after the check above is not this caller's to resume.
    if (!req.worker_id().empty() && local_.PausedAfter({req.model_id(), req.worker_id()}, req.version(), incarnation)) {
      absl::StatusOr<LocalWorkers::Ended> ended = local_.EndUpdate({req.model_id(), req.worker_id()}, deadline, incarnation);
      if (!ended.ok()) return ended.status();
      // The coordinator answered before this resume and still counted the rollout paused: a newer
      // version may have committed into its live weights in between (chaos run: told v104, held
      // v105). EndUpdate waited for any such copy; the answer is what the weights hold now.
      if (ended->applied_version > resp->committed_version()) resp->set_committed_version(ended->applied_version);
      Log(LogLevel::kDebug, "rollout resumed (WaitVersion for a version committed before its pause)",
          {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"version", req.version()},
           {"holds", ended->applied_version}});
      ReportResumed(req.model_id(), req.worker_id(), deadline);
    }
  }
  if (rollout && lost) return WaitUnreached(req, s, answered, deadline);  // WaitAgainForRollout applied the restart rules
  absl::Status out = RestartAware(s, session0, deadline, absl::StrCat("version ", req.version()));
  if (absl::IsAborted(out) && !absl::IsAborted(s)) out = WaitAgainAfterRestart(req, resp, deadline, reply_by, out);
  return WaitUnreached(req, out, answered, deadline);
}

absl::Status WorkerCalls::WaitUnreached(const pb::WaitVersionRequest& req, const absl::Status& s, absl::Time answered,
                                        absl::Time deadline) const {
  // No answer by the deadline from a coordinator the node's heartbeats cannot reach either (it
  // stalls), or refused connections (it is down) until then. Before, the transport's words
  // ("failed to connect to all addresses") were the whole answer; now it says so as the held calls
  // do - UNAVAILABLE (the version did not time out: the coordinator was away), naming it and since
  // when. A wait the coordinator itself timed out (it answers: DEADLINE_EXCEEDED) is left alone.
  const bool away = absl::IsUnavailable(s) || absl::IsCancelled(s) || (absl::IsDeadlineExceeded(s) && coordinator_.UnreachableSince().has_value());
  if (!away || options_.clock->Now() < deadline) return s;
  const std::string what = absl::StrCat("WaitVersion of version ", req.version(), req.worker_id().empty() ? "" : " by worker ", req.worker_id(),
                                        " of model ", req.model_id(), " on node ", options_.node_id);
  return CoordinatorDown(what, s, answered, "the version may still be committed there: wait for it again");
}

// Why asking again is right for a rollout whose pause was re-sent: the old coordinator counted it
// paused and the node's re-join told the new one the same before the worker's layout (so before
// any re-plan could let a re-sent version start), so the version it waits for - re-published by
// its trainers (PublishAgainAfterRestart) - starts and commits into its live weights as it would
// have there, and the answer is the version's real outcome. Before, the wait was answered
// ABORTED; the client resumed, the re-sent version became its committed copy and was never
// verified by it (chaos seed 1002, coordinator kills only: 26 such answers in 40 rounds). A
// rollout whose pause was not re-sent (a commit took it, it resumed, the report failed) would wait
// for a version that waits for its next BeginUpdate: ABORTED as before, unless the version is
// committed into it already (then the new coordinator answers at once).
absl::Status WorkerCalls::WaitAgainForRollout(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Time deadline,
                                              absl::Time reply_by, uint64_t incarnation, uint64_t session0, const absl::Status& lost) {
  const LocalWorkers::WorkerKey key{req.model_id(), req.worker_id()};
  const std::string what = absl::StrCat("version ", req.version());
  absl::Status s = lost;
  uint64_t session = session0;
  while (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kNotFound || s.code() == absl::StatusCode::kCancelled) {
    std::optional<std::string> change = coordinator_.AwaitCoordinatorChange(session, deadline);
    if (!change) return s;  // the same coordinator answered that (or the deadline): it stands
    session = coordinator_.session();
    if (!local_.WaitResendable(key, incarnation, req.version())) return RestartAborted(what, *change);
    Log(LogLevel::kInfo, "rollout's wait in flight at a coordinator change sent again",
        {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"version", req.version()},
         {"change", *change}, {"first_answer", s.message()}});
    pb::WaitVersionRequest again = req;
    again.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - options_.clock->Now())));
    resp->Clear();
    s = coordinator_.client().WaitVersion(again, resp, WaitCallTimeout(deadline, reply_by));
  }
  return s;
}

void WorkerCalls::ResendPause(const LocalWorkers::WorkerKey& key) {
  const std::optional<uint64_t> incarnation = local_.PauseToResend(key);
  if (!incarnation) return;
  pb::ReportReadyRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(key.first);
  r.set_worker_id(key.second);
  pb::ReportReadyResponse rr;
  // Bounded like the re-join's other calls; the node's worker calls are held meanwhile.
  absl::Status s = coordinator_.client().ReportReady(r, &rr, CallTimeout(options_.clock, options_.clock->Now() + absl::Seconds(5)));
  if (!s.ok()) {
    Log(LogLevel::kWarning, "could not re-send a paused rollout's pause at re-join",
        {{"node", options_.node_id}, {"model", key.first}, {"worker", key.second}, {"error", s.message()}});
    return;
  }
  if (local_.NotePauseResent(key, *incarnation)) {
    Log(LogLevel::kInfo, "paused rollout's pause re-sent at re-join", {{"node", options_.node_id}, {"model", key.first}, {"worker", key.second}});
    return;
  }
  // EndUpdate (or a new registration) while the report was on its way: the new coordinator must
  // not count a resumed rollout paused (a version would start and commit without its BeginUpdate).
  ReportResumed(key.first, key.second, options_.clock->Now() + absl::Seconds(5));
}

absl::Status WorkerCalls::WaitAgainAfterRestart(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp, absl::Time deadline,
                                                absl::Time reply_by, const absl::Status& aborted) {
  // Rollouts are WaitAgainForRollout's (their pause must be re-sent first).
  std::optional<planner::Role> role;
  if (!req.worker_id().empty() && (!local_.SpecOf(req.model_id(), req.worker_id(), &role) || role != planner::Role::kTrainer)) {
    return aborted;
  }
  // A trainer's wait (or a watcher's): the version may have committed before the restart - the new
  // coordinator restores the committed version from the nodes and answers a version at or below
  // it at once. Asked once, briefly; otherwise ABORTED as before. (Chaos, seed 1002 with only
  // coordinator kills: v33 and v75 committed on every node, yet both trainer ranks were told
  // ABORTED; for v54 one rank was told committed and the other ABORTED.)
  const absl::Time until = std::min(deadline, options_.clock->Now() + absl::Seconds(2));
  pb::WaitVersionRequest again = req;
  again.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(until - options_.clock->Now())));
  pb::WaitVersionResponse answer;
  if (!coordinator_.client().WaitVersion(again, &answer, WaitCallTimeout(until, reply_by)).ok()) return aborted;
  versions_.NoteClusterCommitted(req.model_id(), answer.committed_version());
  *resp = std::move(answer);
  return absl::OkStatus();
}

void WorkerCalls::ReportResumed(const std::string& model, const std::string& worker, absl::Time deadline) {
  pb::ReportReadyRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(model);
  r.set_worker_id(worker);
  r.set_resumed(true);
  pb::ReportReadyResponse rr;
  // Bounded by the worker's call, at most 5 s: its answer does not depend on this report.
  const absl::Time until = std::min(deadline, options_.clock->Now() + absl::Seconds(5));
  absl::Status s = coordinator_.client().ReportReady(r, &rr, CallTimeout(options_.clock, until));
  if (!s.ok()) {
    // The coordinator still counts the rollout paused: the next version may start without it and
    // become its committed copy (copied at its next BeginUpdate), as before this report existed.
    Log(LogLevel::kWarning, "could not tell the coordinator that a rollout resumed",
        {{"node", options_.node_id}, {"model", model}, {"worker", worker}, {"error", s.message()}});
  }
}

absl::Status WorkerCalls::ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp) {
  absl::Status s = coordinator_.client().ClusterStatus(req, resp, CallTimeout(options_.clock, options_.clock->Now() + absl::Seconds(5)));
  resp->set_role("node");
  resp->set_node_id(options_.node_id);
  local_.AddLiveState(resp);
  return s;
}

// Why re-sending is safe: the version's source did not change - a sync trainer's live weights
// (the trainer is still blocked in this Publish) or its one-step-off / async snapshot (kept over
// the re-join: AbortAllForRejoin drops executions, not snapshots) - so whatever the new
// coordinator runs under this number holds the bytes the old one would have. And what the old
// coordinator decided about the version is seen by the new one: a commit some node was told of
// restores `committed` >= v (the re-send is refused "not newer"), a commit or failed commit that
// reached some rollout's live weights makes the number used (ABORTED), and the node re-sends only
// after its own re-join, which rolled back its unconfirmed commits first. The new coordinator
// records the publish only after its re-plan, i.e. once every worker, with its node's committed
// version, is back. What it does not know is a version the old one aborted before any rollout
// held it (a failed transfer, another rank's deadline) whose answer this call lost: if it runs
// now, it delivers the same bytes, whole, under its own number; the other ranks were told and
// publish newer versions, so it is aborted when one of them does (PublishingWithout) or, if theirs
// came first, at this call's deadline. A trainer that gave up (its deadline) is not re-sent for,
// and the coordinator withdraws a re-sent publish at that same deadline.
std::optional<absl::Status> WorkerCalls::PublishAgainAfterRestart(const pb::PublishRequest& req, bool sync, const absl::Status& lost,
                                                                  absl::Time deadline, uint64_t* session,
                                                                  const std::function<absl::Status(absl::Time)>& send) {
  std::optional<std::string> change = coordinator_.AwaitCoordinatorChange(*session, deadline);
  if (!change) return std::nullopt;  // the same coordinator answered that (or the deadline): it stands
  const std::string what = absl::StrCat("publish of version ", req.version(), " by worker ", req.worker_id(), " of model ", req.model_id(),
                                        " on node ", options_.node_id);
  if (!local_.Has({req.model_id(), req.worker_id()})) {
    return absl::AbortedError(absl::StrCat(what, " aborted: ", *change, ", and the worker was not re-joined: register again"));
  }
  Log(LogLevel::kInfo, "publish in flight at a coordinator change sent again",
      {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"version", req.version()},
       {"change", *change}, {"first_answer", lost.message()}});
  absl::Status s = ForwardHeld(req.model_id(), req.worker_id(), deadline, session, send);
  if (s.code() == absl::StatusCode::kFailedPrecondition) {
    // "Not newer": the new coordinator restored a committed version >= v from the nodes (the old
    // one committed it and some node was told, this one was not). Sync: this rank is still
    // blocked in Publish(v), so no newer version can have committed without it - committed = v is
    // this very version, committed cluster-wide: OK (chaos seed 1002, coordinator kills only: v99,
    // v50 committed and verified by every rollout, both ranks told ABORTED). Otherwise not re-run
    // under the number; the trainer goes on with a newer version, as before re-sending existed.
    if (sync && CommittedThere(req.model_id(), req.worker_id(), req.version(), deadline)) {
      Log(LogLevel::kInfo, "publish in flight at a coordinator change: committed before it",
          {{"node", options_.node_id}, {"model", req.model_id()}, {"worker", req.worker_id()}, {"version", req.version()}});
      return absl::OkStatus();
    }
    return absl::AbortedError(absl::StrCat(what, ": the call was in flight at ", *change, "; the new coordinator refuses it (", s.message(),
                                           "): publish a newer version"));
  }
  return s;
}

bool WorkerCalls::CommittedThere(const std::string& model, const std::string& worker, uint64_t version, absl::Time deadline) {
  const absl::Time until = std::min(deadline, options_.clock->Now() + absl::Seconds(2));
  pb::WaitVersionRequest w;
  w.set_model_id(model);
  w.set_worker_id(worker);
  w.set_version(version);
  w.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(until - options_.clock->Now())));
  pb::WaitVersionResponse answer;
  return coordinator_.client().WaitVersion(w, &answer, CallTimeout(options_.clock, until)).ok() && answer.committed_version() == version;
}

// A waiting call the coordinator could not answer because it went away (UNAVAILABLE, CANCELLED) or does
// not know us any more (NOT_FOUND): once the node re-joined a restarted coordinator the caller
// gets ABORTED naming the restart (what it waited for will never happen there); otherwise the
// original error.
absl::Status WorkerCalls::RestartAware(const absl::Status& s, uint64_t session0, absl::Time deadline, const std::string& what) {
  // CANCELLED: the coordinator's server shut down under the call.
  if (s.ok() || (s.code() != absl::StatusCode::kUnavailable && s.code() != absl::StatusCode::kNotFound && s.code() != absl::StatusCode::kCancelled)) {
    return s;
  }
  std::optional<std::string> change = coordinator_.AwaitCoordinatorChange(session0, deadline);
  if (!change) return s;
  return RestartAborted(what, *change);
}

absl::Status WorkerCalls::RestartAborted(const std::string& what, const std::string& change) const {
  return absl::AbortedError(
      absl::StrCat(what, " aborted: ", change, " (node ", options_.node_id, " re-submitted its workers; publish a newer version)"));
}

}  // namespace wb::daemon::node
