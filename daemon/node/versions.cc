// node::Versions, part one: the NodeService calls, the exec table, re-join and shutdown (see
// versions.h for the split and the thread / lock rules).
#include "daemon/node/versions.h"

#include <algorithm>
#include <optional>
#include <set>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "daemon/convert.h"
#include "daemon/log.h"
#include "daemon/nccl_route.h"
#include "daemon/node/deadlines.h"
#include "planner/inventory.h"
#include "planner/quantized.h"

namespace wb::daemon::node {

Versions::Versions(Options options, LocalWorkers& local, ChannelCache& channels, NodeStaging& staging, const NodeTransports& transports,
                   CoordinatorAccess& coordinator)
    : options_(std::move(options)),
      local_(local),
      channels_(channels),
      staging_(staging),
      transports_(transports),
      coordinator_(coordinator) {}

Versions::~Versions() {
  Stop();
  Join();
  options_.clock->Forget(&mu_);
}

absl::Status Versions::InstallPlan(const pb::InstallPlanRequest& req) {
  auto plan = std::make_shared<ModelPlan>();
  plan->slice = req.slice();
  auto inv = InventoryFromProto(plan->slice.tensors());
  if (!inv.ok()) return inv.status();
  plan->inventory = std::move(*inv);
  for (const pb::PlanWorker& w : plan->slice.workers()) {
    planner::WorkerLayout layout;
    if (w.has_layout()) {
      auto l = LayoutFromProto(w.layout(), plan->inventory);
      if (!l.ok()) return Annotate(l.status(), absl::StrCat("worker ", w.worker_id()));
      layout = std::move(*l);
    }
    plan->quantized.push_back(planner::HasQuantizedPieces(layout));
    plan->layouts.push_back(planner::StagingLayout(plan->inventory, layout));
    plan->live_layouts.push_back(std::move(layout));
  }
  const std::string& me = options_.node_id;
  for (const pb::TransferOp& op : plan->slice.ops()) {
    if (op.src_worker() >= static_cast<uint32_t>(plan->slice.workers_size()) ||
        op.dst_worker() >= static_cast<uint32_t>(plan->slice.workers_size()) || op.bucket() >= plan->slice.num_buckets()) {
      return absl::InvalidArgumentError(absl::StrCat("op ", op.index(), " refers outside the slice"));
    }
    for (bool src : {true, false}) {
      const uint32_t w = src ? op.src_worker() : op.dst_worker();
      const int32_t piece = src ? op.src_piece() : op.dst_piece();
      if (piece >= 0 && piece >= static_cast<int32_t>(plan->layouts[w].pieces.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("op ", op.index(), ": piece ", piece, " of worker ", plan->slice.workers(w).worker_id(), " is not in the slice"));
      }
      if (piece < 0 && plan->slice.workers(w).node_id() == me) plan->hosts_gather = true;
    }
  }
  if (plan->slice.certify_size() > 0 && !plan->slice.catch_up()) {
    return absl::InvalidArgumentError("certified source boxes (PlanSlice.certify) belong to catch-up slices only");
  }
  for (const pb::CertifyBox& c : plan->slice.certify()) {
    if (c.worker() >= static_cast<uint32_t>(plan->slice.workers_size()) || plan->slice.workers(c.worker()).role() != pb::ROLE_TRAINER ||
        c.piece() < 0 || c.piece() >= static_cast<int32_t>(plan->layouts[c.worker()].pieces.size())) {
      return absl::InvalidArgumentError(absl::StrCat("certified box of op ", c.version_op(), ": worker ", c.worker(), " piece ", c.piece(),
                                                     " is not a source piece of the slice"));
    }
    if (c.quantized_here() && !c.quantized()) {
      return absl::InvalidArgumentError(absl::StrCat("certified box of op ", c.version_op(), ": quantized_here without quantized"));
    }
    // A quantised digest certifies a quantised piece, a canonical one an unquantised piece.
    if (plan->live_layouts[c.worker()].pieces[static_cast<size_t>(c.piece())].quant.has_value() != c.quantized()) {
      return absl::InvalidArgumentError(absl::StrCat("certified box of op ", c.version_op(), ": piece ", c.piece(), " of worker ",
                                                     plan->slice.workers(c.worker()).worker_id(), " is ",
                                                     c.quantized() ? "not quantised" : "quantised", ", the digest covers ",
                                                     c.quantized() ? "quantised" : "canonical", " bytes"));
    }
  }
  Log(LogLevel::kDebug, "plan installed",
      {{"node", me}, {"model", plan->slice.model_id()}, {"epoch", plan->slice.plan_epoch()}, {"ops", plan->slice.ops_size()}});
  absl::MutexLock l(&mu_);
  // Under mu_, as ExecuteVersion's: a re-join between the check and the install cannot let the
  // dead coordinator's slice replace the new session's plan.
  RETURN_IF_ERROR(CheckCoordinatorInstanceLocked(
      "InstallPlan", plan->slice.model_id(),
      absl::StrCat("plan epoch ", plan->slice.plan_epoch(), plan->slice.catch_up() ? " (catch-up)" : ""), req.coordinator_instance()));
  // A catch-up slice (docs/daemon.md "Catch-up") never replaces the model's plan.
  (plan->slice.catch_up() ? catch_up_plans_ : plans_)[plan->slice.model_id()] = std::move(plan);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Exec>> Versions::GetExecLocked(const std::string& model_id, uint64_t version, uint64_t epoch,
                                                              std::optional<bool> want_catch_up) {
  // Catch-up (docs/daemon.md "Catch-up"): the epoch of the installed catch-up slice; its version is
  // already committed (and may have been aborted by an earlier catch-up attempt).
  auto cu = catch_up_plans_.find(model_id);
  bool catch_up = cu != catch_up_plans_.end() && cu->second->slice.plan_epoch() == epoch;
  if (want_catch_up.has_value() && *want_catch_up != catch_up) {
    if (*want_catch_up) {
      return absl::FailedPreconditionError(
          absl::StrCat("catch-up slice of plan epoch ", epoch, " of model ", model_id, " is not installed on node ", options_.node_id));
    }
    catch_up = false;  // the coordinator runs a version of its plan: a catch-up slice is not it
  }
  auto it = execs_.find({model_id, version});
  if (it != execs_.end() && catch_up && (!it->second->catch_up || it->second->epoch != epoch)) {
    return absl::FailedPreconditionError(absl::StrCat("catch-up of model ", model_id, " version ", version, " on node ", options_.node_id,
                                                      ": another execution of that version is still held here"));
  }
  if (it != execs_.end()) return it->second;
  if (std::optional<std::string> aborted = local_.AbortReason(model_id, version); !catch_up && aborted) {
    // Aborted here by a re-join only (never by an AbortVersion since): the coordinator re-joined
    // runs it again from the same source (the trainers' Publish re-sent), once.
    if (rejoin_aborted_.erase({model_id, version}) == 0) {
      return absl::AbortedError(absl::StrCat("version ", version, " was aborted: ", *aborted));
    }
    local_.ForgetAborted(model_id, version);
  }
  if (!catch_up && version <= committed_[model_id]) return absl::FailedPreconditionError(absl::StrCat("version ", version, " is already committed"));
  auto p = catch_up ? cu : plans_.find(model_id);
  if (p == plans_.end() || p->second->slice.plan_epoch() != epoch) {
    return absl::FailedPreconditionError(absl::StrCat("plan epoch ", epoch, " of model ", model_id, " is not installed on node ", options_.node_id));
  }
  auto exec = std::make_shared<Exec>();
  exec->model_id = model_id;
  exec->version = version;
  exec->epoch = epoch;
  exec->catch_up = catch_up;
  exec->plan = p->second;
  exec->deadline = options_.clock->Now() + absl::Seconds(60);
  // Staging (incoming per local rollout + gather) is only sized here; the executor allocates it
  // outside mu_ (zero-filling a model-sized buffer under the lock stalled every handler).
  // With GPU staging, a rollout's CUDA buffers are staged on its GPU under the per-GPU budget and
  // are not counted here; the executor checks any that fall back to host memory.
  const bool gpu_staging = staging_.gpu_staging();
  int64_t staging = 0;
  for (int i = 0; i < exec->plan->slice.workers_size(); ++i) {
    const pb::PlanWorker& w = exec->plan->slice.workers(i);
    if (w.node_id() != options_.node_id || w.role() != pb::ROLE_ROLLOUT) continue;
    const std::vector<std::shared_ptr<CudaImport>> lw = local_.Cuda({exec->model_id, w.worker_id()});  // empty: unknown
    for (size_t j = 0; j < exec->plan->layouts[i].buffers.size(); ++j) {
      const bool cuda = j < lw.size() && lw[j] != nullptr;
      if (gpu_staging && cuda && !exec->plan->quantized[i]) continue;  // quantised: host staging (the quantiser runs there)
      staging += exec->plan->layouts[i].buffers[j].size_bytes;
    }
  }
  if (exec->plan->hosts_gather) staging += static_cast<int64_t>(exec->plan->slice.gather_staging_bytes());
  // The node's total (daemon/node/staging_budget.h), not this version's alone: other versions in
  // flight, snapshots and committed staging not applied yet count too.
  ASSIGN_OR_RETURN(exec->charge, staging_.budget().Reserve(staging, absl::StrCat("the staging of model ", model_id, " version ", version)));
  exec->staging_bytes = staging;
  execs_[{model_id, version}] = exec;
  // Heartbeats report the version's progress while it exists (without mu_).
  coordinator_.TrackProgress(model_id, version, std::shared_ptr<const std::atomic<uint64_t>>(exec, &exec->bytes_done));
  return exec;
}

absl::Status Versions::CheckCoordinatorInstanceLocked(absl::string_view call, const std::string& model_id, absl::string_view what,
                                                      const std::string& from_instance) {
  // An empty instance on either side: a coordinator built before the field, or no registration
  // yet - nothing to compare (as before).
  const std::string current = coordinator_.coordinator_instance();
  if (from_instance.empty() || current.empty() || from_instance == current) return absl::OkStatus();
  // The dead coordinator's call, late (a frozen node, or its handler scheduled after the
  // re-join). An ExecuteVersion would run, take staging, drop older snapshots, consume a re-join's
  // run-again mark and count as run by the new session (LocalWorkers::NoteSessionVersion); an
  // InstallPlan would replace the new session's plan, a CommitVersion commit a re-run the new
  // coordinator has not decided, an AbortVersion lose a re-run it may still commit.
  Log(LogLevel::kWarning, absl::StrCat("stale ", call, " refused"),
      {{"node", options_.node_id}, {"model", model_id}, {"what", what}, {"from_instance", from_instance}, {"instance", current}});
  return absl::FailedPreconditionError(absl::StrCat(
      call, " of model ", model_id, " ", what, " refused on node ", options_.node_id, ": it comes from coordinator instance ", from_instance,
      ", but the node is registered with coordinator instance ", current,
      " (the coordinator restarted and the node re-joined the new one; only its calls act here)"));
}

absl::Status Versions::ExecuteVersion(const pb::ExecuteVersionRequest& req) {
  // Declared before the lock so finished executors are joined after it is released.
  std::vector<std::thread> finished;
  absl::Cleanup join_finished = [&finished] {
    for (auto& t : finished) t.join();
  };
  absl::MutexLock l(&mu_);
  if (stopping_) return absl::UnavailableError(absl::StrCat("node ", options_.node_id, " is shutting down"));
  finished = TakeFinishedExecThreadsLocked();
  // First, before anything is dropped, created or recorded: a call of a coordinator this node has
  // left for a restarted one (read under mu_, so a re-join's AbortAllForRejoin either aborts what
  // this call starts or has already made this check see the new instance).
  RETURN_IF_ERROR(CheckCoordinatorInstanceLocked("ExecuteVersion", req.model_id(),
                                                 absl::StrCat("version ", req.version(), req.catch_up() ? " (catch-up)" : ""),
                                                 req.coordinator_instance()));
  // Snapshots older than this version can never be sent any more (superseded, or aborted with the
  // abort still on its way here): dropped before this version's staging is charged to the node's
  // budget, which they would otherwise still hold.
  local_.DropSnapshotsBefore(req.model_id(), req.version());
  auto exec = GetExecLocked(req.model_id(), req.version(), req.plan_epoch(), req.catch_up());
  if (!exec.ok()) return exec.status();
  if ((*exec)->catch_up != req.catch_up()) {
    return absl::FailedPreconditionError(absl::StrCat("version ", req.version(), " of model ", req.model_id(), " plan epoch ", req.plan_epoch(),
                                                      " is held on node ", options_.node_id, " as ", (*exec)->catch_up ? "a catch-up" : "a version",
                                                      ", asked to run as ", req.catch_up() ? "a catch-up" : "a version"));
  }
  if ((*exec)->started) return absl::OkStatus();
  (*exec)->started = true;
  // The session runs it here (a peer's ExchangeRegions may have created the exec first, but only
  // the coordinator's call says this session runs the version): Apply(v) at or above it needs no
  // question to the coordinator (LocalWorkers::AwaitApplicable).
  if (!req.catch_up()) local_.NoteSessionVersion(req.model_id(), req.version());
  (*exec)->coordinator_instance = req.coordinator_instance();
  (*exec)->base_versions = {req.base_versions().begin(), req.base_versions().end()};
  (*exec)->bases_without_shadows = {req.bases_without_shadows().begin(), req.bases_without_shadows().end()};
  (*exec)->deadline = options_.clock->Now() + absl::Milliseconds(req.timeout_ms() > 0 ? req.timeout_ms() : 60000);
  // Answers at once: staging is allocated and every copy runs on the executor thread.
  std::shared_ptr<Exec> e = *exec;
  const uint64_t tid = next_exec_thread_++;
  exec_threads_.emplace(tid, std::thread([this, e, tid] {
                          RunExec(e);
                          MarkExecThreadDone(tid);
                        }));
  return absl::OkStatus();
}

void Versions::TagCommittedStaging(const Exec& exec, const std::string& model, const std::string& worker, uint64_t version,
                                   const std::shared_ptr<Bytes>& staging) const {
  // Every piece of this staging holds the committed version (plans are complete) except pieces
  // relays at commit copied into live weights from another rollout's staging: no op of this
  // plan lands those here, and an op of another plan that would finds stale bytes, which its base
  // digest refuses (full copy), never a wrong byte. A quantised rollout's staging holds the
  // committed version twice: quantised at the pieces' places and canonical in their shadows
  // (planner::StagingLayout), which quantising only reads - the base of receiver-quantised deltas
  // (a shadow of a sender-quantised piece is never written: stale, so refused by its base digest
  // if a later plan landed a delta there). Nothing writes committed staging, so the tag stays true
  // until the pool hands the buffer out again.
  if (staging == nullptr || !options_.delta_in_place) return;
  for (const StagedBuffer& b : *staging) {
    if (b.device != nullptr) return;
  }
  for (size_t j = 0; j < staging->size(); ++j) (*staging)[j].pool_tag = NodeStaging::BaseTag(model, worker, j, version);
  staging_.Lend(staging);  // the next version finds it by tag also while someone still holds it
}

std::vector<LocalWorkers::LiveJob> Versions::CommitJobsLocked(const pb::CommitVersionRequest& req, Exec& exec) {
  std::set<std::string> relayed;  // rollouts with relays at commit
  for (const auto& [wid, pieces] : exec.pieces_at_commit) relayed.insert(wid);
  std::vector<LocalWorkers::LiveJob> jobs = local_.Commit(req.model_id(), req.version(), exec.incoming, relayed, exec.catch_up);
  for (LocalWorkers::LiveJob& t : jobs) {
    const std::string& wid = t.worker;
    t.inventory = std::shared_ptr<const planner::Inventory>(exec.plan, &exec.plan->inventory);
    t.label = absl::StrCat("commit ", wid, " v", req.version());
    for (int i = 0; i < exec.plan->slice.workers_size(); ++i) {
      if (exec.plan->slice.workers(i).worker_id() == wid) t.layout = exec.plan->live_layouts[i];
    }
    auto relayed_pieces = exec.pieces_at_commit.find(wid);
    if (relayed_pieces != exec.pieces_at_commit.end()) {
      std::vector<planner::Piece> own;
      for (size_t k = 0; k < t.layout.pieces.size(); ++k) {
        if (relayed_pieces->second.count(static_cast<int32_t>(k)) == 0) own.push_back(t.layout.pieces[k]);
      }
      t.layout.pieces = std::move(own);
      t.relays = &exec.relays_at_commit[wid];
      t.incoming = &exec.incoming;
    }
  }
  return jobs;
}

// CommitVersion of a version this node holds no execution of: a retry of one committed here, one
// aborted here, or one whose staging a restart lost (nothing is half-applied).
absl::Status Versions::CommitOfUnknownLocked(const pb::CommitVersionRequest& req) {
  const std::string& me = options_.node_id;
  // Idempotent for a retried commit (first: a version aborted here once - a re-join aborts the
  // version in flight - may have run again for a restarted coordinator and committed).
  if (req.version() <= committed_[req.model_id()]) return absl::OkStatus();
  // A version aborted here (AbortVersion before the commit, or after it: rolled back) is not
  // committed by a late or repeated CommitVersion.
  if (std::optional<std::string> aborted = local_.AbortReason(req.model_id(), req.version())) {
    return absl::AbortedError(absl::StrCat("commit of model ", req.model_id(), " version ", req.version(), " on node ", me,
                                           ": the version was aborted here: ", *aborted));
  }
  // A node that lost the version's staging (restart) cannot apply it; nothing is half-applied.
  std::string reason = absl::StrCat("node ", me, " no longer holds the staging of version ", req.version(), " (restarted before the commit)");
  // Sync: the coordinator fails the version (not every node acknowledged): its waiters here
  // see it aborted. One-step-off / async: the coordinator commits it anyway and counts this
  // node's rollouts as not holding it (they are caught up): Apply(v) here must not answer
  // ABORTED but ask the coordinator and wait for the catch-up (LocalWorkers::
  // NoteCatchUpAborted -> Applicable::ask_coordinator). The mode is the installed plan's, else
  // a local worker's model spec; unknown (neither here yet): the coordinator decides too.
  const std::optional<pb::Mode> mode = ModeLocked(req.model_id());
  if (mode.has_value() && (*mode == pb::MODE_SYNC || *mode == pb::MODE_UNSPECIFIED)) {
    local_.NoteAborted(req.model_id(), req.version(), reason);
  } else {
    local_.NoteCatchUpAborted(req.model_id(), req.version(), reason);
  }
  return absl::FailedPreconditionError(reason);
}

absl::Status Versions::CommitVersion(const pb::CommitVersionRequest& req) {
  // The commit is counted while mu_ is held, before anyone can see the version committed here
  // (Apply, then a metrics scrape, must find its counts): async rollouts see it once the first
  // block below releases mu_, sync ones once their live copies are done (second block).
  const absl::Time commit_start = options_.clock->Now();
  auto count_commit = [&] {
    DaemonMetrics& m = metrics();
    m.Phase(options_.node_id, "commit", absl::ToDoubleSeconds(options_.clock->Now() - commit_start));
    m.Version(options_.node_id, req.model_id(), "committed");
    m.Committed(options_.node_id, req.model_id(), req.version());
  };
  // What the sync live copy needs is captured under the lock by value (worker id, buffers,
  // layout): a concurrent Deregister may erase the LocalWorker meanwhile.
  std::vector<LocalWorkers::LiveJob> jobs;
  std::shared_ptr<Exec> exec;
  const std::string& me = options_.node_id;
  {
    absl::MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckCoordinatorInstanceLocked("CommitVersion", req.model_id(), absl::StrCat("version ", req.version()),
                                                   req.coordinator_instance()));
    auto it = execs_.find({req.model_id(), req.version()});
    if (it == execs_.end()) return CommitOfUnknownLocked(req);
    exec = it->second;
    if (exec->committing) {
      // Another CommitVersion of it is copying it into live weights right now: its outcome is that
      // call's (a retry after it finished is answered by what it left).
      return absl::UnavailableError(absl::StrCat("commit of model ", req.model_id(), " version ", req.version(), " on node ", me,
                                                 " is already running (live copies in progress); try again"));
    }
    if (!exec->transferred) {
      // Committing bytes that have not all arrived would hand rollouts a half-written version.
      const std::string missing = exec->failed     ? absl::StrCat("its transfer failed here (", exec->error, ")")
                                  : !exec->started ? std::string("its transfer has not started here (no ExecuteVersion)")
                                                   : absl::StrCat("its transfer is still running here (", exec->bytes_done.load(),
                                                                  " bytes received so far; not reported done)");
      return absl::FailedPreconditionError(absl::StrCat("cannot commit model ", req.model_id(), " version ", req.version(), " on node ", me,
                                                        ": the version has not fully landed: ", missing));
    }
    // Kept in execs_ (marked committing) until the live copies ended: an AbortVersion meanwhile
    // finds it, marks it aborted and erases it; the second block below then does not commit.
    exec->committing = true;
    jobs = CommitJobsLocked(req, *exec);
    // Under the same lock as the staging becomes committed (CommitJobsLocked): an Apply that finds
    // it finds the plan it landed with too.
    NoteLandedWithLocked(*exec);
    // One-step-off / async rollouts: their incoming staging is now the committed copy, which Apply
    // copies into live weights and then hands back to the pool - tagged, so that the next version
    // takes it back and decodes its deltas in place when the rollout applied this one before it
    // started (Exec::staging_holds). Sync rollouts are tagged after their copy below.
    std::set<std::string> sync;
    for (const LocalWorkers::LiveJob& j : jobs) sync.insert(j.worker);
    for (const auto& [wid, staging] : exec->incoming) {
      if (sync.count(wid) == 0 && exec->pieces_at_commit.count(wid) == 0) TagCommittedStaging(*exec, req.model_id(), wid, req.version(), staging);
    }
    local_.DropSnapshots(req.model_id(), req.version());
    // Nothing left that can fail, and rollouts (one-step-off / async) see the committed staging
    // as soon as mu_ is released: counted now. (The execution stays in execs_, committing, until
    // the second block, with or without live copies: an AbortVersion meanwhile marks it aborted.)
    if (jobs.empty()) count_commit();
  }
  // Sync: rollouts are paused; the commit writes their live weights before anyone is told.
  // All rollouts at once (their batches share the copy threads, so none waits for another's tail).
  const absl::Time copy_start = options_.clock->Now();
  std::vector<absl::Status> copied = local_.RunLiveCopies(jobs);
  absl::MutexLock l(&mu_);
  exec->committing = false;
  // Aborted during the copies (AbortVersion, a re-join, Stop): not committed here. Rollouts whose
  // copy finished hold the version whole in live memory (recorded as applied: true, and the next
  // version rewrites them), but their staging is not tagged as a delta base of it. Only this
  // execution's own mark counts: LocalWorkers' abort record of the version may be of an earlier
  // execution of it (a re-join aborted it; a restarted coordinator then ran it again).
  std::optional<std::string> abort_reason;
  if (exec->aborted) abort_reason = exec->error.empty() ? std::string("node ") + me + " is shutting down" : exec->error;
  const bool aborted = abort_reason.has_value();
  auto erase_exec = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto e = execs_.find({req.model_id(), req.version()});
    if (e != execs_.end() && e->second == exec) execs_.erase(e);
  };
  absl::Status failed;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!copied[i].ok()) {
      Log(LogLevel::kError, "sync commit copy failed", {{"node", me}, {"worker", jobs[i].worker}, {"error", copied[i].message()}});
      const std::string what = absl::StrCat("commit of model ", req.model_id(), " version ", req.version(), " on node ", me,
                                            ": live copy into rollout ", jobs[i].worker, " failed: ", copied[i].message());
      failed = failed.ok() ? absl::Status(copied[i].code(), what) : absl::Status(failed.code(), absl::StrCat(failed.message(), "; ", what));
      continue;
    }
    // Live weights hold it now and nothing reads this staging again (Apply finds nothing newer):
    // its memory goes back to the pool for the next version instead of sitting here - tagged with
    // what it holds, so that the next version takes it back and decodes its deltas in place.
    local_.MarkApplied({jobs[i].model, jobs[i].worker}, req.version(), jobs[i].staging, /*after_commit=*/true);
    if (!aborted) TagCommittedStaging(*exec, jobs[i].model, jobs[i].worker, req.version(), jobs[i].staging);
  }
  if (aborted) {
    erase_exec();  // (AbortVersion already did; Stop did not)
    const std::string& why = *abort_reason;
    Log(LogLevel::kWarning, "commit aborted during its live copy",
        {{"node", me}, {"model", req.model_id()}, {"version", req.version()}, {"reason", why}});
    const std::string what = absl::StrCat("commit of model ", req.model_id(), " version ", req.version(), " on node ", me,
                                          " was aborted during its live copy (", why, "): not committed here");
    return failed.ok() ? absl::AbortedError(what) : absl::Status(failed.code(), absl::StrCat(what, "; ", failed.message()));
  }
  if (!failed.ok()) {
    // Not committed on this node: the version stays here so that a retried CommitVersion copies
    // again (restoring whole weights); Apply of a torn rollout copies from its committed staging.
    return failed;
  }
  erase_exec();
  // Versions of this model whose commit failed here earlier are superseded now.
  for (auto it = execs_.begin(); it != execs_.end();) {
    const bool stale =
        it->first.first == req.model_id() && it->first.second < req.version() && it->second->transferred && !it->second->committing;
    it = stale ? execs_.erase(it) : std::next(it);
  }
  if (exec->relay_bytes_at_commit > 0) {
    transport::Transport* host_t = transports_.Local();
    if (host_t != nullptr) metrics().Bytes(me, req.model_id(), host_t->capabilities().kind, me, exec->relay_bytes_at_commit);
    metrics().RelayAtCommit(me, exec->relay_bytes_at_commit);
  }
  if (!jobs.empty()) count_commit();
  // Published last: node-local waiters (Apply) see the version only once live weights hold it.
  NoteCommittedLocked(req.model_id(), req.version());
  // A catch-up is of a version the coordinator had committed: proof that survives a re-join.
  if (exec->catch_up) confirmed_[req.model_id()] = std::max(confirmed_[req.model_id()], req.version());
  deltas_.Commit(req.model_id(), req.version());  // what this node sent is what destinations hold now
  Log(LogLevel::kInfo, "version committed on node",
      {{"node", me},
       {"model", req.model_id()},
       {"version", req.version()},
       {"live_copies", jobs.size()},
       {"copy_s", absl::ToDoubleSeconds(options_.clock->Now() - copy_start)}});
  if (options_.test_commit_answer) return options_.test_commit_answer(req.model_id(), req.version(), exec->catch_up);
  return absl::OkStatus();
}

// The Connects in progress of aborted executions end now (CANCELLED) instead of holding their
// threads until the version's deadline. Called without mu_ (a transport call).
void Versions::CancelConnects(const std::vector<std::pair<transport::Transport*, std::string>>& rounds) {
  for (const auto& [t, round] : rounds) (void)t->CancelRound(round);
}

absl::Status Versions::AbortVersion(const pb::AbortVersionRequest& req) {
  std::shared_ptr<Exec> aborted;       // the execution this abort ends (its channels, below)
  std::map<std::string, int> in_flight;  // its batches in flight per channel, when it was marked aborted
  std::vector<std::pair<transport::Transport*, std::string>> connecting;
  uint64_t other_epoch = 0;  // of an execution of the version this abort leaves running
  std::optional<uint64_t> rolled_back;  // committed_ before this abort rolled `version` back
  uint64_t committed_now = 0;
  std::vector<std::string> dropped_copies;  // resumed rollouts whose committed copy of it went
  {
    absl::MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckCoordinatorInstanceLocked("AbortVersion", req.model_id(), absl::StrCat("version ", req.version()),
                                                   req.coordinator_instance()));
    auto it = execs_.find({req.model_id(), req.version()});
    // Only a catch-up attempt's abort names a plan epoch (version aborts send 0): it ends that
    // attempt's execution, but it is no outcome of the version for this node's rollouts - the
    // version is committed, the attempt may be followed by another (a voided one always is), and
    // a rollout registering later has a catch-up of its own. Apply(v) of a rollout that does not
    // hold v asks the coordinator instead (LocalWorkers::NoteCatchUpAborted). Noting it as the
    // version's abort failed every Apply(v) on this node at once, the retry's and later ones too.
    // The abort of one execution (a voided catch-up attempt) arriving after the next attempt of
    // the same version started here on another epoch: that one is not what the coordinator ended.
    const bool other = req.plan_epoch() != 0 && it != execs_.end() && it->second->epoch != req.plan_epoch();
    const bool catch_up = other || (it != execs_.end() ? it->second->catch_up : req.plan_epoch() != 0);
    if (catch_up) local_.NoteCatchUpAborted(req.model_id(), req.version(), req.reason());
    if (!catch_up) rejoin_aborted_.erase({req.model_id(), req.version()});  // aborted since: not run again
    if (other) {
      other_epoch = it->second->epoch;
    } else {
      if (!catch_up) local_.NoteAborted(req.model_id(), req.version(), req.reason());
      if (it != execs_.end()) {
        // (A CommitVersion copying it into live weights - Exec::committing - sees this and does
        // not commit it.)
        it->second->aborted = true;
        it->second->error = req.reason();
        aborted = it->second;
        in_flight = it->second->in_flight;  // final: no batch is posted once `aborted` is set
        for (const auto& [chan, c] : it->second->connecting) connecting.push_back(c);
        execs_.erase(it);  // staging dropped with the last reference (the executor holds one until it stops)
      } else if (!catch_up) {
        // Already committed here: a sync commit the coordinator declared failed (another node did
        // not acknowledge it). The coordinator's committed version stays below it, so this node
        // must not report it as committed when it re-joins (RestoreCommitted takes the max).
        rolled_back = RollBackCommittedLocked(req.model_id(), req.version());
        committed_now = committed_[req.model_id()];
        // Rollouts that resumed (EndUpdate) before the commit hold it as their committed copy
        // only: dropped, or their next BeginUpdate would copy the aborted version into live weights.
        if (rolled_back) dropped_copies = local_.DropAbortedCommit(req.model_id(), req.version());
      }
      local_.DropSnapshots(req.model_id(), req.version());
    }
  }
  if (rolled_back) {
    metrics().Committed(options_.node_id, req.model_id(), committed_now);
    Log(LogLevel::kWarning, "committed version rolled back",
        {{"node", options_.node_id}, {"model", req.model_id()}, {"version", req.version()}, {"committed_before", *rolled_back},
         {"committed_now", committed_now}, {"committed_copies_dropped", absl::StrJoin(dropped_copies, ",")}, {"reason", req.reason()}});
  }
  if (other_epoch != 0) {
    Log(LogLevel::kInfo, "abort of another execution ignored",
        {{"node", options_.node_id}, {"model", req.model_id()}, {"version", req.version()}, {"epoch", req.plan_epoch()},
         {"running_epoch", other_epoch}});
    return absl::OkStatus();
  }
  metrics().Version(options_.node_id, req.model_id(), "aborted");
  metrics().Failure(options_.node_id, absl::AbortedError(req.reason()));
  deltas_.Drop(req.model_id(), req.version());
  // Blocked waits on the version's channels, and its Connects, end now instead of at the deadline.
  // A channel another execution of the model shares is kept for that one unless this version has
  // batches in flight on it (AbortChannels; daemon/node/channel_cache.h).
  CancelConnects(connecting);
  if (aborted != nullptr) AbortChannels(*aborted, in_flight);
  Log(LogLevel::kInfo, "version aborted on node",
      {{"node", options_.node_id}, {"model", req.model_id()}, {"version", req.version()}, {"reason", req.reason()}});
  return absl::OkStatus();
}

absl::Status Versions::ExchangeRegions(const pb::ExchangeRegionsRequest& req, pb::ExchangeRegionsResponse* resp) {
  const std::string& mine = req.transport_kind();
  const std::string& theirs = req.from_transport().empty() ? mine : req.from_transport();
  transport::Transport* cross = transports_.Cross(mine);
  if (cross == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("node ", options_.node_id, " has no '", mine, "' transport",
                                                      ParseNcclLaneName(mine) >= 0 ? " (nccl lane; needs --gpu_staging_bytes)" : ""));
  }
  absl::MutexLock l(&mu_);
  const bool existed = execs_.count({req.model_id(), req.version()}) > 0;
  auto e = GetExecLocked(req.model_id(), req.version(), req.plan_epoch());
  if (!e.ok()) return e.status();
  std::shared_ptr<Exec> exec = *e;
  // Only a node of the plan exchanges regions for it.
  bool peer_in_plan = false;
  for (const pb::PlanWorker& w : exec->plan->slice.workers()) peer_in_plan = peer_in_plan || w.node_id() == req.from_node();
  if (!peer_in_plan) {
    if (!existed) ReapUnstartedLocked(exec);
    return absl::PermissionDeniedError(absl::StrCat("node '", req.from_node().substr(0, 128), "' is not in plan epoch ", req.plan_epoch(),
                                                    " of model ", req.model_id(), " on node ", options_.node_id));
  }
  // Our regions exist once our executor registered them (ExecuteVersion may reach us later).
  auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return exec->regions_ready || exec->aborted || exec->failed || stopping_; };
  if (!options_.clock->WaitUntil(&mu_, absl::Condition(&ready), exec->deadline)) {
    // A peer's call made the execution and ExecuteVersion never came (a version this node was
    // never told of, or a peer that raced an abort): its staging goes back to the budget.
    ReapUnstartedLocked(exec);
    return absl::DeadlineExceededError(absl::StrCat("node ", options_.node_id, ": version ", req.version(), " did not start in time"));
  }
  if (!exec->regions_ready) return absl::AbortedError(absl::StrCat("version ", req.version(), " aborted: ", exec->error));
  std::string from_instance;
  for (const pb::PlanWorker& w : exec->plan->slice.workers()) {
    if (w.node_id() == req.from_node()) {
      auto it = w.transport_instances().find(theirs);
      if (it != w.transport_instances().end()) from_instance = it->second;
    }
  }
  const std::string chan = ChannelName(req.from_node(), mine, theirs);
  auto endpoint = cross->ExportEndpoint(from_instance);
  if (!endpoint.ok()) return endpoint.status();
  PeerState& ps = exec->peers[chan];
  if (!ps.looked_up) {
    // Once per execution and channel (a repeated call answers alike): the execution holds what it
    // found until it ends (its channels' release), and SetupPeer disconnects a stale one.
    ps.lookup = channels_.ForPeer(req.model_id(), chan, from_instance, exec.get());
    ps.looked_up = true;
  }
  // Reused only when the caller's cached channel is the other end of ours: connected in the same
  // round (ChannelCache::Entry::round). A sibling execution may have replaced either cached channel
  // by its own new connection since the caller looked its up: each end would then post on another
  // connection, and the batches wait for mirrors that never come.
  const bool reuse = req.reuse() && ps.lookup.reuse != transport::kNoPeer && ps.lookup.round == req.reuse_round();
  ps.have = true;
  ps.reuse = reuse;
  // Rounds when both have them (a caller built before them leaves the field unset).
  ps.rounds = req.connect_rounds() && options_.connect_rounds;
  ps.endpoint = req.endpoint();
  for (const pb::PeerRegion& r : req.regions()) ps.regions[r.key()] = r.region_descriptor();
  resp->set_reuse(reuse);
  resp->set_connect_rounds(ps.rounds);
  resp->set_endpoint(*endpoint);
  for (auto& [k, d] : exec->local_desc[mine]) {
    pb::PeerRegion* r = resp->add_regions();
    r->set_key(k);
    r->set_region_descriptor(d);
  }
  return absl::OkStatus();
}

void Versions::ReapUnstartedLocked(const std::shared_ptr<Exec>& exec) {
  if (exec->started) return;
  auto it = execs_.find({exec->model_id, exec->version});
  if (it != execs_.end() && it->second == exec) {
    execs_.erase(it);  // its staging charge goes back with the last reference (progress tracking is weak)
  }
}

absl::Status Versions::DropWorker(const pb::DropWorkerRequest& req) {
  local_.Remove({req.model_id(), req.worker_id()});
  return absl::OkStatus();
}

absl::Status Versions::Drain(const pb::DrainRequest& req, pb::DrainResponse* resp) {
  pb::DrainRequest r = req;
  if (r.node_id().empty()) r.set_node_id(options_.node_id);
  return coordinator_.client().Drain(r, resp, CallTimeout(options_.clock, Deadline(options_.clock, req.timeout_ms())));
}

std::map<std::string, uint64_t> Versions::AbortAllForRejoin(const std::string& reason) {
  std::vector<std::tuple<std::string, std::string, transport::PeerId>> drop;
  std::map<std::string, uint64_t> committed;
  std::vector<RolledBack> rolled_back;
  {
    absl::MutexLock l(&mu_);
    for (auto& [key, e] : execs_) {
      e->aborted = true;
      e->error = reason;
      // A catch-up execution's version is committed: the new session may catch its rollouts up.
      if (e->catch_up) {
        local_.NoteCatchUpAborted(key.first, key.second, reason);
      } else {
        local_.NoteAborted(key.first, key.second, reason);
        rejoin_aborted_.insert(key);
      }
      for (auto& [peer, id] : e->connected) drop.push_back({key.first, peer, id});
      // Its Connects in progress are not cancelled (CancelRound): the new session numbers plan
      // epochs from 1 again and may run the version again, in the very same round, which a
      // cancel would fail at once. They end at the version's deadline, as before cancels.
    }
    execs_.clear();
    // Catch-up slices belong to the coordinator session that installed them. A new session numbers
    // its plan epochs from 1 again: a slice left here under the same number as its plan made every
    // peer's ExchangeRegions of that epoch find the catch-up slice ("node n0 is not in plan epoch
    // 4") and every version of the new session fail until its membership changed (chaos run).
    catch_up_plans_.clear();
    rolled_back = RollBackUnconfirmedLocked(reason);
    local_.NoteRejoin(reason);
    committed = committed_;
  }
  for (const RolledBack& r : rolled_back) {
    metrics().Committed(options_.node_id, r.model, r.committed_now);
    Log(LogLevel::kWarning, "unconfirmed commit rolled back at re-join",
        {{"node", options_.node_id}, {"model", r.model}, {"version", r.version}, {"committed_now", r.committed_now},
         {"committed_copies_dropped", absl::StrJoin(r.dropped_copies, ",")}, {"reason", reason}});
  }
  for (auto& [model, peer, id] : drop) DropChannel(model, peer, id);
  return committed;
}

bool Versions::Stop() {
  std::vector<std::pair<transport::Transport*, std::string>> connecting;
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return false;
    stopping_ = true;
    for (auto& [k, e] : execs_) {
      e->aborted = true;
      for (const auto& [chan, c] : e->connecting) connecting.push_back(c);
    }
    local_.Stop();
  }
  CancelConnects(connecting);
  return true;
}

void Versions::Join() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock l(&mu_);
    if (joined_) return;
    joined_ = true;
    for (auto& [id, t] : exec_threads_) threads.push_back(std::move(t));
    exec_threads_.clear();
    exec_done_.clear();
  }
  // Executors blocked on a channel end when it is torn down.
  for (const ChannelCache::Keyed& c : channels_.All()) DropChannel(c.model_id, c.channel, c.id);
  for (auto& t : threads) t.join();
}

std::vector<std::thread> Versions::TakeFinishedExecThreadsLocked() {
  std::vector<std::thread> out;
  for (uint64_t id : exec_done_) {
    auto it = exec_threads_.find(id);
    if (it == exec_threads_.end()) continue;
    out.push_back(std::move(it->second));
    exec_threads_.erase(it);
  }
  exec_done_.clear();
  return out;
}

void Versions::MarkExecThreadDone(uint64_t id) {
  absl::MutexLock l(&mu_);
  exec_done_.push_back(id);
}

}  // namespace wb::daemon::node
