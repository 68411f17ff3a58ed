// CoordinatorCore's version driver: one thread decides under mu_ (leases, timeouts, what to plan,
// start, commit) and runs the resulting node RPCs outside it; plans run on their own thread,
// also outside mu_. Results are applied under mu_ again, checked against what changed meanwhile
// (membership counter for plans, plan epoch for installs, node incarnation for owed commits).
#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/convert.h"
#include "base/parallel_for.h"
#include "daemon/coordinator/core.h"
#include "daemon/log.h"

namespace wb::daemon {
namespace {

// Per-node RPCs of one version (or catch-up) run at once: every node on a small cluster,
// bounded threads on a large one (base/parallel_for.h).
constexpr size_t kRpcThreads = 32;

// "a, b, c and 7 more": names in messages stay short on a large cluster.
std::string ShortList(const std::vector<std::string>& names, size_t max = 8) {
  if (names.size() <= max) return absl::StrJoin(names, ", ");
  std::vector<std::string> head(names.begin(), names.begin() + static_cast<long>(max));
  return absl::StrCat(absl::StrJoin(head, ", "), " and ", names.size() - max, " more");
}

// Ends the planner's hold on a model (PlanWorkLocked) at scope exit unless disarmed. Declared
// after a MutexLock of mu_, so it releases with mu_ still held.
struct ReleaseHold {
  ModelRegistry& registry;
  ModelRegistry::Model* m;
  bool armed = true;
  ~ReleaseHold() {
    if (armed) registry.Release(*m);
  }
};

}  // namespace

void CoordinatorCore::DriverLoop() {
  while (true) {
    std::vector<std::shared_ptr<NodeClient>> lost;
    {
      absl::MutexLock l(&mu_);
      auto woken = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return wake_ || stopping_; };
      // A pass at least every tick, counted from the last pass: time that moved while the driver
      // ran RPCs (or a fake clock advanced meanwhile) is seen at once.
      const absl::Time since = last_sweep_ == absl::InfinitePast() ? options_.clock->Now() : last_sweep_;
      options_.clock->WaitUntil(&mu_, absl::Condition(&woken), since + options_.tick);
      if (stopping_) return;
      wake_ = false;
      // Posted under mu_ (Post never waits for a call), so a pass seen by AwaitDriverPassAt has
      // posted its calls. The driver never waits for a node: a lane's worker does.
      for (auto& [lane, call] : CollectWorkLocked()) lanes_.Post(lane, std::move(call));
      lost.swap(lost_clients_);
    }
    // Nodes whose lease ran out in this pass: their calls still in flight (a frozen node's held
    // ExecuteVersion / CommitVersion / InstallPlan) end now instead of holding their lanes - and
    // the models' next plans and versions behind them - until their deadlines (up to 60 s).
    for (const std::shared_ptr<NodeClient>& client : lost) client->CancelCalls();
  }
}

void CoordinatorCore::SweepLeasesLocked(absl::Time now) {
  // Leases (gap extension for a driver that did not run, the local node) are the node table's;
  // a lost node's versions and workers are the models'.
  const absl::Time last = last_sweep_;
  last_sweep_ = now;
  nodes_.Sweep(now, last, [&](const std::string& nid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StatusChangedLocked();
    const std::string reason = absl::StrCat("node ", nid, " lost its lease");
    Log(LogLevel::kWarning, "node lost", {{"node", nid}, {"reason", reason}});
    if (std::shared_ptr<NodeClient> client = nodes_.Client(nid)) lost_clients_.push_back(std::move(client));
    for (auto& [mid, m] : models_) {
      if (m.machine->InFlightInvolves(nid)) AbortLocked(mid, m, *m.machine->InFlight(), reason);
      std::vector<std::string> gone;
      for (auto& [w, rec] : m.workers) if (rec.node == nid) gone.push_back(w);
      for (const std::string& w : gone) DropWorkerLocked(m, w, reason);
    }
  });
}

CoordinatorCore::LaneWork CoordinatorCore::CollectWorkLocked() {
  LaneWork work;
  const absl::Time now = options_.clock->Now();
  SweepLeasesLocked(now);
  for (auto& [mid, m] : models_) {
    if (auto v = m.machine->TimedOut(now); v && m.committing != *v) {
      AbortLocked(mid, m, *v, absl::StrCat("transfer timed out after ", absl::FormatDuration(options_.transfer_timeout)));
    }
    const std::string lane = ModelLane(mid);
    // Commit: every node reported done, so the decision is made. Posted once: `committing` stays
    // set until the posted call finished (FinishCommitLocked), and a lane with a call queued or
    // running is busy until then.
    if (m.committing != 0) {
      if (!lanes_.Busy(lane)) work.emplace_back(lane, CommitWorkLocked(mid, m));
      continue;
    }
    // A catch-up in progress (catch_up.cc): normal versions wait for it (it is one update long).
    if (m.catch_up) {
      if (auto f = CatchUpWorkLocked(mid, m, now)) work.emplace_back(lane, std::move(f));
      continue;
    }
    if (m.machine->InFlight()) continue;
    if (m.plan_dirty) {
      // One queued plan per model (plan_queued): it takes its snapshot when the planner thread
      // gets to it, so it plans the newest membership however often the model changed meanwhile.
      // Queued also while an older plan of the model is being made (that one will be discarded):
      // the model then waits its turn behind the other models' plans (PlanQueue: round-robin).
      if (m.plan_queued || PlanWorkLocked(mid, m) || m.planning) continue;
      // No plan can be made while trainers are missing (they exited after the last publish), yet
      // the committed version is in rollouts: a late rollout is caught up from them, which needs
      // no trainer. Trainers coming back make the model plannable again, and a plan queued (or a
      // version) wins over this; one coming back while this catch-up runs waits for it.
      if (TrainersMissingLocked(m)) StartCatchUpLocked(mid, m, now, /*without_plan=*/true);
      continue;
    }
    if (m.planning) continue;
    if (!m.plan.installed) continue;
    // Sync: rollouts that did not pause in time are left out, and the model planned again first.
    if (SyncPauseLocked(mid, m, now)) continue;
    if (auto f = StartWorkLocked(mid, m, now)) {
      work.emplace_back(lane, std::move(f));
      continue;
    }
    // Nothing to start: a late rollout is brought to the committed version (a version that
    // starts instead brings it to that newer one: a catch-up never overtakes a commit).
    StartCatchUpLocked(mid, m, now);
  }
  OwedCommitWorkLocked(&work);
  OwedAbortWorkLocked(&work);
  for (auto& item : pending_rpcs_) work.push_back(std::move(item));
  pending_rpcs_.clear();
  return work;
}

// Sends CommitVersion to every node of the plan at once (sync: nodes copy staging into the paused
// rollouts' live buffers before answering, so one node after another would add up those copies).
std::function<void()> CoordinatorCore::CommitWorkLocked(const std::string& model_id, Model& m) {
  const uint64_t v = m.committing;
  std::vector<std::string> nodes;
  std::vector<std::shared_ptr<NodeClient>> clients;
  std::vector<uint64_t> incarnations;
  for (const std::string& n : m.plan.nodes) {
    nodes.push_back(n);
    clients.push_back(nodes_.Client(n));
    incarnations.push_back(nodes_.Incarnation(n));
  }
  // Sync commits copy staging into live weights before answering: as long as a transfer may take.
  const absl::Duration timeout = std::max(absl::Seconds(5), options_.transfer_timeout);
  Model* mp = &m;  // no hold: a model committing has a version, never evicted (model_registry.h)
  return [this, mp, model_id, v, nodes, clients, incarnations, timeout] {
    std::vector<absl::Status> acks(clients.size());
    ParallelFor(clients.size(), kRpcThreads, [&](size_t i) {
      acks[i] = clients[i] ? clients[i]->CommitVersion(model_id, v, timeout)
                           : absl::UnavailableError(absl::StrCat("node ", nodes[i], " is not registered"));
    });
    absl::MutexLock l(&mu_);
    FinishCommitLocked(model_id, *mp, v, nodes, acks, incarnations);
  };
}

// The commit contract (docs/daemon.md "Commit"):
//  - sync: the version is committed only if EVERY node acknowledged CommitVersion (every rollout
//    holds it whole in live memory). Otherwise it is not committed: Publish and WaitVersion get
//    ABORTED naming the nodes (and their rollouts) that do not hold it and why; every node of the
//    commit is told it was aborted (AbortVersion, best effort): the ones that failed drop it, the
//    ones that acknowledged roll their committed version back (a re-join never restores v as
//    committed); rollouts on nodes that acknowledged count as having applied it. The next version
//    rewrites every rollout.
//  - one-step-off / async: CommitVersion only marks the landed staging committed (rollouts copy
//    at Apply), so the version is committed; a node that did not answer (UNAVAILABLE /
//    DEADLINE_EXCEEDED) is owed the commit and retried every commit_retry while it keeps its
//    incarnation; a node that answered an error is logged (its rollouts get the next version).
void CoordinatorCore::FinishCommitLocked(const std::string& model_id, Model& m, uint64_t v, const std::vector<std::string>& nodes,
                                         const std::vector<absl::Status>& acks, const std::vector<uint64_t>& incarnations) {
  const absl::Time now = options_.clock->Now();
  std::vector<size_t> failed;
  for (size_t i = 0; i < acks.size(); ++i) {
    if (acks[i].ok()) continue;
    failed.push_back(i);
    Log(LogLevel::kWarning, "commit not acknowledged", {{"model", model_id}, {"version", v}, {"node", nodes[i]}, {"error", acks[i].message()}});
  }
  // Paused rollouts waiting for a newer version than v wait on, paused, after its commit (which
  // wrote v into their live weights) or its failure.
  const std::vector<std::string> waiting = PausedPastLocked(m, v);
  auto finish = [&] {
    for (auto& [w, rec] : m.workers) rec.paused = false;  // the commit (or its failure) resumed them
    PausePastLocked(model_id, m, v, waiting);            // but those still waiting for a newer one
    m.progress.erase(v);
    m.machine->Prune(64);
    m.committing = 0;
    wake_ = true;
    StatusChangedLocked();
  };
  if (m.machine->mode() == ModeKind::kSync && !failed.empty()) {
    std::set<std::string> bad_nodes;
    std::vector<std::string> parts, good_nodes;
    for (size_t i : failed) bad_nodes.insert(nodes[i]);
    for (const std::string& n : nodes) if (!bad_nodes.count(n)) good_nodes.push_back(n);
    std::set<std::string> holding;
    for (size_t i : failed) {
      std::vector<std::string> rollouts;
      for (const std::string& w : m.plan.worker_ids) {
        auto rec = m.workers.find(w);
        if (rec != m.workers.end() && rec->second.role == planner::Role::kRollout && rec->second.node == nodes[i]) rollouts.push_back(w);
      }
      parts.push_back(absl::StrCat("node ", nodes[i], " (rollouts ", rollouts.empty() ? "none known" : ShortList(rollouts), "): ",
                                   acks[i].message()));
    }
    for (const std::string& w : m.plan.worker_ids) {
      auto rec = m.workers.find(w);
      if (rec != m.workers.end() && rec->second.role == planner::Role::kRollout && !bad_nodes.count(rec->second.node)) holding.insert(w);
    }
    const std::string reason =
        absl::StrCat("commit not acknowledged by every node, so the version is not committed: ", absl::StrJoin(parts, "; "),
                     good_nodes.empty() ? std::string(" (no node holds it)") : absl::StrCat(" (nodes ", ShortList(good_nodes), " hold it)"));
    m.machine->CommitFailed(v, reason, holding, now);
    // Not a catch-up source for the committed version (they hold v or a torn copy) and not caught
    // up to it either: the next version rewrites them.
    for (const std::string& w : m.plan.worker_ids) {
      auto rec = m.workers.find(w);
      if (rec == m.workers.end() || rec->second.role != planner::Role::kRollout || rec->second.serial != m.plan.serials[w]) continue;
      rec->second.holds = 0;
      rec->second.catch_up_failed = m.machine->committed();
      rec->second.catch_up_error = absl::StrCat("version ", v, " was not committed (", reason, "); the next version rewrites it");
    }
    Log(LogLevel::kWarning, "version commit failed", {{"model", model_id}, {"version", v}, {"reason", reason}});
    // Every node of the commit is told (best effort), the ones that acknowledged too: those roll
    // their committed version back (node::Versions::AbortVersion), so that a node re-joining a
    // restarted coordinator never reports v as committed (RestoreCommitted takes the max over the
    // nodes: v would come back committed and be caught up to other rollouts). Their rollouts keep
    // v whole in live memory and still count as having applied it (`holding` above).
    QueueAbortRpcsLocked(std::set<std::string>(nodes.begin(), nodes.end()), model_id, v, reason);
    finish();
    return;
  }
  for (size_t i : failed) {
    if (absl::IsUnavailable(acks[i]) || absl::IsDeadlineExceeded(acks[i])) {
      pending_commits_.push_back({nodes[i], model_id, v, incarnations[i], now + options_.commit_retry});
    }
  }
  m.machine->Commit(v, now);
  // Catch-up sources and late rollouts: every rollout of the plan holds v now, except on nodes
  // that answered the commit with an error (an owed commit is assumed to land).
  std::set<std::string> refused;
  for (size_t i : failed) {
    if (!absl::IsUnavailable(acks[i]) && !absl::IsDeadlineExceeded(acks[i])) refused.insert(nodes[i]);
  }
  for (const std::string& w : m.plan.worker_ids) {
    auto rec = m.workers.find(w);
    // (A rollout registered again since the plan was made is a new process: it does not hold v.)
    if (rec != m.workers.end() && rec->second.role == planner::Role::kRollout && rec->second.serial == m.plan.serials[w] &&
        !refused.count(rec->second.node)) {
      rec->second.holds = v;
      rec->second.holds_without_shadows = false;  // the plan wrote every shadow of v
    }
  }
  if (const VersionRecord* rec = m.machine->Find(v)) {
    m.last_seconds = absl::ToDoubleSeconds(rec->finished - rec->started);
    m.last_bytes = rec->bytes_total;
  }
  Log(LogLevel::kInfo, "version committed", {{"model", model_id}, {"version", v}, {"bytes", m.last_bytes},
                                              {"seconds", m.last_seconds}, {"unacked_nodes", failed.size()}});
  finish();
}

// (Re-)plan: trainers complete; rollouts complete the first time, any non-empty set later.
// Rollouts left out for not pausing (sync_pause.h) are in no plan until they pause.
bool CoordinatorCore::PlanReadyLocked(const Model& m) const {
  uint32_t nt = 0, nr = 0;
  for (auto& [w, rec] : m.workers) {
    if (!rec.has_layout || LeftOutLocked(m, w) != nullptr) continue;
    (rec.role == planner::Role::kTrainer ? nt : nr) += 1;
  }
  return nt >= m.spec.num_trainer_workers() && nr > 0 && (m.planned_once || nr >= m.spec.num_rollout_workers());
}

bool CoordinatorCore::TrainersMissingLocked(const Model& m) const {
  uint32_t nt = 0;
  for (auto& [w, rec] : m.workers) nt += rec.has_layout && rec.role == planner::Role::kTrainer ? 1 : 0;
  return nt < m.spec.num_trainer_workers();
}

// Queues a plan of the model for the planner thread (PlanQueue, round-robin over models). The job
// takes its snapshot when it starts (PlanSnapshotLocked), not now: however often the model changes
// while it waits, it plans the newest membership once. False when the model is not ready to plan.
bool CoordinatorCore::PlanWorkLocked(const std::string& model_id, Model& m) {
  if (!PlanReadyLocked(m)) return false;
  m.plan_queued = true;
  Model* mp = &m;
  // RunPlan keeps mp until its last locked step, and the model may have no version: held till then.
  models_.Hold(m);
  plan_queue_.Push(model_id, kPlanJob, [this, model_id, mp] { RunPlan(model_id, mp); });
  return true;
}

// The planner thread's first step of a plan job, under mu_: the model's current membership (layouts
// are shared, not copied). False when it is not ready any more (a worker left while it waited).
bool CoordinatorCore::PlanSnapshotLocked(const std::string& model_id, Model& m, SliceInput* in, PlanSettings* settings) {
  m.plan_queued = false;
  if (!PlanReadyLocked(m)) return false;
  m.plan_dirty = false;
  m.planning = true;
  in->model_id = model_id;
  in->epoch = next_epoch_++;
  in->mode = m.spec.mode();
  in->inventory = m.inventory;
  // Problem order: trainers then rollouts (ids sorted: std::map order), only workers with a layout.
  for (planner::Role role : {planner::Role::kTrainer, planner::Role::kRollout}) {
    for (auto& [id, w] : m.workers) {
      if (!w.has_layout || w.role != role || LeftOutLocked(m, id) != nullptr) continue;
      in->workers.push_back({id, w.node, w.role, w.gpu, w.layout, w.layout_proto, w.layout_pieces});
      if (const Node* n = nodes_.Find(w.node)) in->nodes[w.node] = {n->data_address, n->transport_instances, n->delta_cache_bytes > 0, n->delta_in_place};
    }
  }
  settings->strategy = FromProto(m.spec.strategy());
  settings->strategy_proto = m.spec.strategy();
  settings->topology = options_.topology;
  settings->bucket_bytes = options_.bucket_bytes;
  return true;
}

// The planner thread: runs queued jobs one at a time, round-robin over models, never under mu_.
void CoordinatorCore::PlannerLoop() {
  while (true) {
    std::optional<PlanQueue::Job> job;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !plan_queue_.empty(); };
      if (!options_.clock->WaitUntil(&mu_, absl::Condition(&ready), options_.clock->Now() + absl::Seconds(1))) continue;
      if (stopping_) return;
      job = plan_queue_.Pop();
    }
    if (job) (*job)();
  }
}

void CoordinatorCore::RunPlan(const std::string& model_id, Model* m) {
  SliceInput in;
  PlanSettings settings;
  uint64_t membership = 0;
  {
    absl::MutexLock l(&mu_);
    if (stopping_ || !PlanSnapshotLocked(model_id, *m, &in, &settings)) {
      m->plan_queued = false;
      models_.Release(*m);  // plan_dirty stays: the driver queues it again once it is ready
      wake_ = true;
      return;
    }
    membership = m->membership;
  }
  absl::StatusOr<PlanOutcome> outcome = plan_cache_.PlanAndSlice(in, settings, options_.make_plan);
  std::shared_ptr<const MagnitudePlan> magnitudes;  // NVFP4: made here, outside the lock
  if (outcome.ok()) {
    std::vector<MagnitudeWorker> mw;
    for (const SliceWorker& w : in.workers) mw.push_back({w.node, w.role == planner::Role::kRollout, w.layout.get()});
    magnitudes = MakeMagnitudePlan(mw, *in.inventory);
  }
  std::vector<std::pair<std::shared_ptr<NodeClient>, std::string>> installs;  // client, node
  {
    absl::MutexLock l(&mu_);
    ReleaseHold release{models_, m};  // disarmed below when the installs (and m) follow (InstallPlanSlices)
    m->planning = false;
    wake_ = true;
    if (stopping_) return;
    if (m->membership != membership) {
      // Workers changed while planning: plan_dirty is set again, the driver re-plans.
      Log(LogLevel::kInfo, "plan discarded: membership changed while planning", {{"model", model_id}, {"epoch", in.epoch}});
      return;
    }
    StatusChangedLocked();  // a new plan (fingerprint, stats) or the planner's error
    if (!outcome.ok()) {
      m->plan_error = std::string(outcome.status().message());
      Log(LogLevel::kWarning, "plan failed", {{"model", model_id}, {"error", outcome.status().message()}});
      return;
    }
    m->plan_error.clear();
    m->planned_once = true;
    m->plan.epoch = in.epoch;
    m->plan.plan = outcome->plan;
    m->plan.worker_ids.clear();
    m->plan.nodes.clear();
    std::set<std::string> trainers, rollouts;
    m->plan.serials.clear();
    for (const SliceWorker& w : in.workers) {
      m->plan.worker_ids.push_back(w.id);
      auto rec = m->workers.find(w.id);  // there: membership did not change since the snapshot
      m->plan.serials[w.id] = rec != m->workers.end() ? rec->second.serial : 0;
      m->plan.nodes.insert(w.node);
      (w.role == planner::Role::kTrainer ? trainers : rollouts).insert(w.id);
    }
    m->plan.total_bytes = outcome->slices.total_bytes;
    m->plan.magnitudes = std::move(magnitudes);
    m->plan.installed = false;
    m->machine->SetTrainers(trainers);
    m->machine->SetRollouts(rollouts);
    for (const std::string& r : rollouts) {
      const WorkerRec& rec = m->workers.at(r);
      if (rec.paused) m->machine->RecordReady(r);
      if (rec.restored_applied > 0) m->machine->RecordApplied(r, rec.restored_applied);
    }
    const planner::Plan& plan = *outcome->plan;
    Log(LogLevel::kInfo, "plan made", {{"model", model_id}, {"epoch", in.epoch}, {"strategy", planner::StrategyName(plan.strategy)},
                                       {"fingerprint", plan.fingerprint}, {"ops", plan.stats.num_ops}, {"buckets", plan.buckets.size()},
                                       {"bytes", m->plan.total_bytes}, {"bytes_inter_node", plan.stats.bytes_inter_node},
                                       {"plan_ms", plan.stats.plan_ms}, {"cached", outcome->cached ? "yes" : "no"}});
    for (auto& [n, slice] : outcome->slices.by_node) installs.push_back({nodes_.Client(n), n});
    release.armed = false;  // still held across the installs
    // The installs run in the model's lane (after its calls posted before, e.g. the aborts of the
    // old epoch), not on the planner thread: a node slow to answer InstallPlan (30 s each) holds
    // this model, never the other models' plans.
    auto job = std::make_shared<InstallJob>(InstallJob{std::move(in), std::move(*outcome), std::move(installs)});
    lanes_.Post(ModelLane(model_id), [this, model_id, m, job] { InstallPlanSlices(model_id, m, job.get()); });
  }
}

void CoordinatorCore::InstallPlanSlices(const std::string& model_id, Model* m, InstallJob* job) {
  const SliceInput& in = job->in;
  PlanOutcome* outcome = &job->outcome;
  const auto& installs = job->installs;
  // Each slice gets its header (inventory, workers: the bulk of it) just before it is sent, so at
  // most the 32 slices in flight are held whole.
  std::vector<absl::Status> results(installs.size());
  ParallelFor(installs.size(), kRpcThreads, [&](size_t i) {
    if (!installs[i].first) {
      results[i] = absl::UnavailableError(absl::StrCat("node ", installs[i].second, " not registered"));
      return;
    }
    pb::PlanSlice slice = std::move(outcome->slices.by_node.at(installs[i].second));
    FillSliceHeader(*outcome->plan, in, outcome->slices, installs[i].second, &slice);
    results[i] = installs[i].first->InstallPlan(slice, absl::Seconds(30));
  });
  absl::Status status;
  for (const absl::Status& s : results) if (!s.ok()) status = s;
  absl::MutexLock l(&mu_);
  ReleaseHold release{models_, m};
  if (m->plan.epoch != in.epoch) return;
  if (status.ok()) {
    m->plan.installed = true;
  } else {
    Log(LogLevel::kWarning, "plan install failed", {{"model", model_id}, {"epoch", in.epoch}, {"error", status.message()}});
    m->plan_error = std::string(status.message());
    MarkPlanDirtyLocked(*m);  // retry on the next pass
  }
  wake_ = true;
}

std::function<void()> CoordinatorCore::StartWorkLocked(const std::string& model_id, Model& m, absl::Time now) {
  auto next = m.machine->NextToStart();
  if (!next) return nullptr;
  const uint64_t v = *next;
  m.machine->Start(v, m.plan.nodes, now, options_.transfer_timeout, m.plan.total_bytes,
                   static_cast<uint32_t>(m.plan.plan->stats.num_ops));
  StartDigestsLocked(model_id, m, v);
  StartMagnitudesLocked(model_id, m, v);
  StatusChangedLocked();
  Log(LogLevel::kInfo, "version started", {{"model", model_id}, {"version", v}, {"epoch", m.plan.epoch}, {"nodes", m.plan.nodes.size()},
                                           {"bytes", m.plan.total_bytes}});
  std::vector<std::pair<std::string, std::shared_ptr<NodeClient>>> clients;
  for (const std::string& n : m.plan.nodes) clients.push_back({n, nodes_.Client(n)});
  pb::ExecuteVersionRequest req;
  req.set_model_id(model_id);
  req.set_version(v);
  req.set_plan_epoch(m.plan.epoch);
  req.set_timeout_ms(absl::ToInt64Milliseconds(options_.transfer_timeout));
  req.set_coordinator_instance(instance_);
  // Lossless deltas: the version each rollout's node holds for it is the base of the delta ops into
  // it (TransferOp.delta); a rollout registered again since the plan holds nothing (full). A rollout
  // held without shadows (a catch-up's quantised bytes) is named in bases_without_shadows, which a
  // node built before that field ignores - it would take the ops into the shadows as deltas while
  // the newer nodes send them full (or the reverse). So such a rollout has a base only when every
  // node of the plan reads the field; otherwise none at all: every op into it in full this version.
  const bool all_read_without_shadows = std::all_of(m.plan.nodes.begin(), m.plan.nodes.end(), [&](const std::string& n) {
    const NodeTable::Node* node = nodes_.Find(n);
    return node != nullptr && node->understands_bases_without_shadows;
  });
  for (const std::string& w : m.plan.worker_ids) {
    auto rec = m.workers.find(w);
    if (rec != m.workers.end() && rec->second.role == planner::Role::kRollout && rec->second.holds > 0 &&
        rec->second.serial == m.plan.serials[w]) {
      if (rec->second.holds_without_shadows && !all_read_without_shadows) continue;
      (*req.mutable_base_versions())[w] = rec->second.holds;
      if (rec->second.holds_without_shadows) req.add_bases_without_shadows(w);
    }
  }
  // The node answers at once (the executor runs on its own thread); the deadline is the transfer
  // timeout anyway so that a slow, loaded node is not declared unable to start.
  const absl::Duration timeout = std::max(options_.transfer_timeout, absl::Seconds(5));
  Model* mp = &m;  // no hold: a model starting a version has one, never evicted (model_registry.h)
  return [this, mp, model_id, v, clients, req, timeout] {
    // Every node at once (each answers at once; one after another the last node would start a
    // round trip per node later, and the first nodes' executors would wait for it).
    std::vector<absl::Status> started(clients.size());
    ParallelFor(clients.size(), kRpcThreads, [&](size_t i) {
      started[i] = clients[i].second ? clients[i].second->ExecuteVersion(req, timeout)
                                     : absl::UnavailableError("node not registered");
    });
    for (size_t i = 0; i < clients.size(); ++i) {
      if (started[i].ok()) continue;
      absl::MutexLock l(&mu_);
      AbortLocked(model_id, *mp, v, absl::StrCat("node ", clients[i].first, " could not start: ", started[i].message()));
      return;
    }
  };
}

// Owed commits (async / one-step-off): retry while the node keeps the incarnation that executed
// the version.
void CoordinatorCore::OwedCommitWorkLocked(LaneWork* work) {
  const absl::Time now = options_.clock->Now();
  for (auto it = pending_commits_.begin(); it != pending_commits_.end();) {
    if (!nodes_.HoldsIncarnation(it->node, it->incarnation)) {
      Log(LogLevel::kWarning, "owed commit dropped: node lost or restarted", {{"model", it->model_id}, {"version", it->version}, {"node", it->node}});
      it = pending_commits_.erase(it);
      continue;
    }
    // One try at a time per node: its lane is busy while one is queued or running.
    if (now >= it->next_try && !lanes_.Busy(NodeLane(it->node))) {
      it->next_try = now + options_.commit_retry;
      PendingCommit p = *it;
      std::shared_ptr<NodeClient> client = nodes_.AliveClient(p.node);  // held at p.incarnation: alive
      work->emplace_back(NodeLane(p.node), [this, p, client] {
        absl::Status st = client->CommitVersion(p.model_id, p.version, absl::Seconds(2));
        if (absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st)) return;  // try again later
        Log(st.ok() ? LogLevel::kInfo : LogLevel::kWarning, "owed commit delivered",
            {{"model", p.model_id}, {"version", p.version}, {"node", p.node}, {"result", st.ok() ? "committed" : st.message()}});
        absl::MutexLock l(&mu_);
        pending_commits_.erase(std::remove_if(pending_commits_.begin(), pending_commits_.end(),
                                              [&](const PendingCommit& q) {
                                                return q.node == p.node && q.model_id == p.model_id && q.version == p.version;
                                              }),
                               pending_commits_.end());
      });
    }
    ++it;
  }
}

void CoordinatorCore::OwedAbortWorkLocked(LaneWork* work) {
  const absl::Time now = options_.clock->Now();
  for (auto it = pending_aborts_.begin(); it != pending_aborts_.end();) {
    if (!nodes_.HoldsIncarnation(it->node, it->incarnation)) {
      Log(LogLevel::kWarning, "owed abort dropped: node lost or restarted (it rolls back at its re-join)",
          {{"model", it->model_id}, {"version", it->version}, {"node", it->node}});
      it = pending_aborts_.erase(it);
      continue;
    }
    if (now >= it->next_try) {
      // Not due again until this try answered (SendAbort sets the next time).
      it->next_try = absl::InfiniteFuture();
      PendingAbort p = *it;
      std::shared_ptr<NodeClient> client = nodes_.AliveClient(p.node);  // held at p.incarnation: alive
      work->emplace_back(NodeLane(p.node), [this, p, client] { SendAbort(p, client); });
    }
    ++it;
  }
}

}  // namespace wb::daemon
