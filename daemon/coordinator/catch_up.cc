// Catch-up of late rollouts (docs/daemon.md "Catch-up"): the pure choice (catch_up.h) and the
// CoordinatorCore driver steps. A catch-up is the committed version `v` once more, planned with
// the rollouts that hold v as the sources (ROLE_TRAINER in the catch-up slice) and the late
// rollouts as the only destinations, run by the nodes' normal executor and commit on its own plan
// epoch (PlanSlice.catch_up, ExecuteVersionRequest.catch_up). Its commit changes nothing but the
// late rollouts' committed / live state. While it runs, normal versions of the model wait (the
// driver starts none), so it can never overtake a newer commit; a version that can start is
// started instead of a catch-up, and brings the late rollouts to that newer version itself.
#include "daemon/coordinator/catch_up.h"
#include "daemon/coordinator/certify_boxes.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "daemon/coordinator/checks.h"
#include "base/parallel_for.h"
#include "daemon/coordinator/core.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "planner/quantized.h"

namespace wb::daemon {

CatchUpChoice ChooseCatchUp(uint64_t committed, const std::vector<CatchUpCandidate>& workers) {
  CatchUpChoice out;
  std::vector<std::string> stale;
  if (committed == 0) return out;
  for (const CatchUpCandidate& w : workers) {
    if (!w.rollout || !w.has_layout) continue;
    if (w.holds < committed) {
      if (w.in_plan && w.catch_up_failed != committed) out.dests.push_back(w.id);
      continue;
    }
    if (w.holds == committed) (w.stale ? stale : out.sources).push_back(w.id);
  }
  if (!out.dests.empty() && out.sources.empty()) {
    out.no_source = stale.empty() ? absl::StrCat("no rollout holds version ", committed, " (no rollout holds it at all)")
                                  : absl::StrCat("no rollout holds version ", committed, " (rollouts ", absl::StrJoin(stale, ", "),
                                                 " held it, but a catch-up found their memory changed since)");
  }
  return out;
}

namespace {

// Per-node RPCs of one catch-up run at once, bounded (base/parallel_for.h).
constexpr size_t kRpcThreads = 32;

// A catch-up's digest outcome: wb_versions_total{event=...} (node label as for versions:
// `coordinator`, or the standalone node's id) and a log line.
void CatchUpDigestEvent(const CoordinatorOptions& o, const std::string& model_id, uint64_t version, const char* event,
                        absl::string_view detail) {
  DaemonMetrics& metrics = o.metrics != nullptr ? *o.metrics : Metrics();
  metrics.Version(o.local_node.empty() ? std::string("coordinator") : o.local_node, model_id, event);
  const bool bad = absl::string_view(event) == "catch_up_digest_mismatch" || absl::string_view(event) == "catch_up_stale_source";
  Log(bad ? LogLevel::kError : LogLevel::kInfo, absl::StrReplaceAll(event, {{"_", " "}}),
      {{"model", model_id}, {"version", version}, {bad ? "error" : "ops", detail}});
}

// Why model m's running catch-up is void (a source or late rollout left, registered again or lost
// its node), nullopt while every one of them is there. Under the core's mu_.
std::optional<std::string> CatchUpMemberGone(const ModelRegistry::Model& m, const NodeTable& nodes) {
  for (const auto* side : {&m.catch_up->sources, &m.catch_up->dests}) {
    for (const auto& [id, serial] : *side) {
      auto w = m.workers.find(id);
      if (w == m.workers.end() || w->second.serial != serial || !nodes.IsAlive(w->second.node)) {
        return absl::StrCat("worker ", id, " left or registered again during the catch-up");
      }
    }
  }
  return std::nullopt;
}

// A catch-up of several late rollouts that has no plan: the late rollouts that have none alone
// (each planned with every source), each with why. Before, one rollout the sources cannot serve (a
// tensor or a quantised form no source holds: a process that joined with such a layout) failed the
// catch-up of every late rollout planned with it - each then waited for the next version, which
// never comes while the trainers are gone. Empty when there is one late rollout, when each has a
// plan alone (the set's failure: all fail, as before), or when planning was cancelled or ran past
// its deadline (nothing known of any one rollout). One plan per late rollout, on the planner thread.
std::map<std::string, std::string> UnservableDests(PlanCache& cache, const PlanFn& make_plan, const SliceInput& in,
                                                   const PlanSettings& settings, const absl::Status& failed) {
  std::map<std::string, std::string> out;
  if (absl::IsCancelled(failed) || absl::IsDeadlineExceeded(failed)) return out;
  SliceInput solo = in;
  solo.workers.clear();
  size_t dests = 0;
  for (const SliceWorker& w : in.workers) {
    if (w.role == planner::Role::kRollout) {
      ++dests;
    } else {
      solo.workers.push_back(w);
    }
  }
  if (dests < 2) return out;
  for (const SliceWorker& w : in.workers) {
    if (w.role != planner::Role::kRollout) continue;
    solo.workers.push_back(w);  // problem order as in the joint plan: sources, then the late rollout
    absl::StatusOr<PlanOutcome> alone = cache.PlanAndSlice(solo, settings, make_plan);
    solo.workers.pop_back();
    if (alone.ok()) continue;
    if (absl::IsCancelled(alone.status()) || absl::IsDeadlineExceeded(alone.status())) return {};
    out[w.id] = std::string(alone.status().message());
  }
  if (out.size() == dests) out.clear();
  return out;
}

}  // namespace

void CoordinatorCore::StartCatchUpLocked(const std::string& model_id, Model& m, absl::Time now, bool without_plan) {
  const uint64_t v = m.machine->committed();
  if (v == 0 || m.catch_up || m.catch_up_aborts_unsent > 0) return;
  // An owed commit (async) still lands on its node: that node's version staging must not meet a
  // catch-up of the same version there.
  for (const PendingCommit& p : pending_commits_) {
    if (p.model_id == model_id) return;
  }
  const std::set<std::string> in_plan(m.plan.worker_ids.begin(), m.plan.worker_ids.end());
  std::vector<CatchUpCandidate> candidates;
  for (auto& [id, rec] : m.workers) {
    CatchUpCandidate c;
    c.id = id;
    c.node = rec.node;
    c.rollout = rec.role == planner::Role::kRollout;
    c.has_layout = rec.has_layout && rec.layout != nullptr;
    // Without a plan (trainers gone), a rollout that is not left out is one the next plan would
    // hold; a left-out one has not paused, so no commit may write its live memory.
    c.in_plan = without_plan ? LeftOutLocked(m, id) == nullptr : in_plan.count(id) > 0;
    c.holds = rec.holds;
    c.catch_up_failed = rec.catch_up_failed;
    c.stale = rec.stale_version == v;
    if (!nodes_.IsAlive(rec.node)) c.has_layout = false;  // neither source nor destination now
    candidates.push_back(std::move(c));
  }
  CatchUpChoice choice = ChooseCatchUp(v, candidates);
  if (choice.dests.empty()) return;
  if (!choice.no_source.empty()) {
    const std::string reason = absl::StrCat("rollout(s) ", absl::StrJoin(choice.dests, ", "), " of model ", model_id,
                                            " cannot catch up to version ", v, ": ", choice.no_source,
                                            "; they get the next version");
    std::set<std::string> nodes;
    for (const std::string& d : choice.dests) {
      WorkerRec& rec = m.workers.at(d);
      rec.catch_up_failed = v;
      rec.catch_up_error = reason;
      nodes.insert(rec.node);
    }
    Log(LogLevel::kWarning, "catch-up not possible", {{"model", model_id}, {"version", v}, {"reason", reason}});
    // Apply(v) of those rollouts, waiting on their nodes, learns why (from WaitVersion here: the
    // node asks once a catch-up of v ended there). A catch-up's abort names a plan epoch - this
    // one's own, which no execution has: nothing runs to be ended, and the node records no abort
    // of the version itself (that would fail rollouts registering there later, which may get a
    // catch-up of their own).
    QueueAbortRpcsLocked(nodes, model_id, v, reason, next_epoch_++);
    StatusChangedLocked();
    return;
  }
  CatchUpRun run;
  run.version = v;
  run.epoch = next_epoch_++;
  run.started = now;
  run.deadline = now + options_.transfer_timeout;
  SliceInput in;
  in.model_id = model_id;
  in.epoch = run.epoch;
  in.mode = m.spec.mode();
  in.inventory = m.inventory;
  // Problem order: sources (as trainers), then the late rollouts; ids sorted (map order).
  for (const auto& [ids, role] : {std::pair{&choice.sources, planner::Role::kTrainer}, std::pair{&choice.dests, planner::Role::kRollout}}) {
    for (const std::string& id : *ids) {
      const WorkerRec& w = m.workers.at(id);
      in.workers.push_back({id, w.node, role, w.gpu, w.layout, w.layout_proto, w.layout_pieces});
      if (const Node* n = nodes_.Find(w.node)) in.nodes[w.node] = {n->data_address, n->transport_instances};
      (role == planner::Role::kTrainer ? run.sources : run.dests)[id] = w.serial;
    }
  }
  Log(LogLevel::kInfo, "catch-up started", {{"model", model_id}, {"version", v}, {"epoch", run.epoch},
                                             {"late", absl::StrJoin(choice.dests, ",")}, {"sources", absl::StrJoin(choice.sources, ",")}});
  m.catch_up = std::move(run);
  StatusChangedLocked();
  Model* mp = &m;  // no hold: a catch-up needs a committed version, never evicted (model_registry.h)
  plan_queue_.Push(model_id, kCatchUpJob, [this, model_id, mp, in = std::move(in)] { RunCatchUpPlan(model_id, mp, in); });
}

// Planner thread: plan the catch-up and post its installs and starts to the model's lane
// (InstallCatchUp; no lock held while planning or calling nodes).
void CoordinatorCore::RunCatchUpPlan(const std::string& model_id, Model* m, const SliceInput& in) {
  PlanSettings settings;  // the weightbridge planner whatever the model's strategy: a catch-up is ours alone
  settings.strategy = planner::Strategy::kWeightBridge;
  settings.strategy_proto = pb::STRATEGY_WEIGHTBRIDGE;
  settings.topology = options_.topology;
  settings.bucket_bytes = options_.bucket_bytes;
  // Quantised rollouts serve late rollouts quantised in their format, as copies of their
  // quantised bytes (planner::PlanOptions::quantized_sources); nothing is quantised on send.
  settings.sender_quantization = false;
  settings.quantized_sources = true;
  absl::StatusOr<PlanOutcome> outcome = plan_cache_.PlanAndSlice(in, settings, options_.make_plan);
  const std::map<std::string, std::string> unservable =
      outcome.ok() ? std::map<std::string, std::string>() : UnservableDests(plan_cache_, options_.make_plan, in, settings, outcome.status());
  std::vector<std::pair<std::string, std::shared_ptr<NodeClient>>> clients;
  uint64_t version = 0;
  std::shared_ptr<const LandedRecord> landed;  // what the version landed in each rollout
  {
    absl::MutexLock l(&mu_);
    if (stopping_ || !m->catch_up || m->catch_up->epoch != in.epoch) return;
    version = m->catch_up->version;
    if (!outcome.ok() && !unservable.empty()) {
      // Only these late rollouts cannot be served: each fails alone, told its own reason (its node
      // gets the attempt's abort, so a waiting Apply(v) asks and learns it), and the attempt is
      // void, not final: the next one, chosen at once, brings the others (catch_up_failed leaves
      // these out of it).
      for (const auto& [id, why] : unservable) {
        auto d = m->catch_up->dests.find(id);
        auto w = m->workers.find(id);
        if (d == m->catch_up->dests.end() || w == m->workers.end() || w->second.serial != d->second) continue;
        w->second.catch_up_failed = version;
        w->second.catch_up_error =
            absl::StrCat("catch-up of model ", model_id, " version ", version, " failed: no plan from the rollouts holding it: ", why,
                         "; it gets the next version");
        m->catch_up->nodes.insert(w->second.node);
      }
      FailCatchUpLocked(model_id, *m,
                        absl::StrCat("late rollout(s) ", absl::StrJoin(unservable, ", ", [](std::string* o, const auto& u) { o->append(u.first); }),
                                     " cannot be served (", outcome.status().message(), "); the others are tried again without them"),
                        false);
      return;
    }
    if (!outcome.ok()) {
      FailCatchUpLocked(model_id, *m, absl::StrCat("no plan from the rollouts holding it: ", outcome.status().message()), true);
      return;
    }
    for (auto& [n, slice] : outcome->slices.by_node) {
      clients.push_back({n, nodes_.AliveClient(n)});
      m->catch_up->nodes.insert(n);
    }
    // What the nodes will report is checked against this plan (end-to-end digests, as for a
    // version: docs/daemon.md "End-to-end digests"). Made before any node can run it.
    std::vector<std::string> ids;
    std::map<std::string, std::string> node_of;
    for (const SliceWorker& w : in.workers) {
      ids.push_back(w.id);
      node_of[w.id] = w.node;
    }
    m->catch_up->digests.emplace(model_id, version, outcome->plan, std::move(ids), in.inventory, std::move(node_of),
                                 DigestBook::Kind::kCatchUp);
    auto record = m->landed.find(version);
    if (record != m->landed.end()) landed = record->second;
  }
  // The sources still hold the version: what it landed with in them, checked where the catch-up
  // reads it (pb::CertifyBox; without digests, no record and nothing to check). Outside the lock.
  if (landed != nullptr) {
    const CertifyCount certify = AddCertifyBoxes(*outcome->plan, in, *landed, &outcome->slices.by_node);
    Log(LogLevel::kInfo, "catch-up sources to certify",
        {{"model", model_id}, {"version", version}, {"boxes", certify.boxes}, {"sources", certify.sources},
         {"sources_without_record", certify.uncovered_sources}});
  }
  // Installs and starts run in the model's lane, not on the planner thread: a node slow to answer
  // holds this catch-up, never the other models' plans.
  auto job = std::make_shared<CatchUpInstallJob>(CatchUpInstallJob{in, std::move(*outcome), std::move(clients), version});
  lanes_.Post(ModelLane(model_id), [this, model_id, m, job] { InstallCatchUp(model_id, m, job.get()); });
}

void CoordinatorCore::InstallCatchUp(const std::string& model_id, Model* m, CatchUpInstallJob* job) {
  const SliceInput& in = job->in;
  PlanOutcome* outcome = &job->outcome;
  const auto& clients = job->clients;
  const uint64_t version = job->version;
  {
    absl::MutexLock l(&mu_);  // (no hold: as in StartCatchUpLocked)
    if (stopping_ || !m->catch_up || m->catch_up->epoch != in.epoch) return;
  }
  std::vector<absl::Status> results(clients.size());
  ParallelFor(clients.size(), kRpcThreads, [&](size_t i) {
    if (!clients[i].second) {
      results[i] = absl::UnavailableError(absl::StrCat("node ", clients[i].first, " is not registered"));
      return;
    }
    pb::PlanSlice slice = std::move(outcome->slices.by_node.at(clients[i].first));
    FillSliceHeader(*outcome->plan, in, outcome->slices, clients[i].first, &slice);
    slice.set_catch_up(true);
    results[i] = clients[i].second->InstallPlan(slice, absl::Seconds(30));
    if (!results[i].ok()) results[i] = absl::Status(results[i].code(), absl::StrCat("install on node ", clients[i].first, ": ", results[i].message()));
  });
  pb::ExecuteVersionRequest req;
  req.set_model_id(model_id);
  req.set_version(version);
  req.set_plan_epoch(in.epoch);
  req.set_timeout_ms(absl::ToInt64Milliseconds(options_.transfer_timeout));
  req.set_coordinator_instance(instance_);
  req.set_catch_up(true);
  const absl::Duration timeout = std::max(options_.transfer_timeout, absl::Seconds(5));
  bool installed = true;
  for (const absl::Status& s : results) installed &= s.ok();
  if (installed) {
    {
      absl::MutexLock l(&mu_);
      if (stopping_ || !m->catch_up || m->catch_up->epoch != in.epoch) return;
    }
    ParallelFor(clients.size(), kRpcThreads, [&](size_t i) {
      results[i] = clients[i].second->ExecuteVersion(req, timeout);
      if (!results[i].ok()) results[i] = absl::Status(results[i].code(), absl::StrCat("start on node ", clients[i].first, ": ", results[i].message()));
    });
  }
  for (const absl::Status& s : results) {
    if (s.ok()) continue;
    absl::MutexLock l(&mu_);
    if (m->catch_up && m->catch_up->epoch == in.epoch) FailCatchUpLocked(model_id, *m, std::string(s.message()), true);
    return;
  }
}

absl::Status CoordinatorCore::CatchUpDoneLocked(const pb::ReportDoneRequest& req, Model& m) {
  // The plan epoch tells attempts of one version apart: an attempt made void (a late rollout or
  // source registered again) is followed by another of the same version on the same nodes, and
  // the first one's executors may still report. Counted for the new attempt, such a report would
  // commit it before its own executions finished. (0: a node that does not send the epoch.)
  if (req.plan_epoch() != 0 && (!m.catch_up || m.catch_up->epoch != req.plan_epoch())) {
    const std::string running = m.catch_up ? absl::StrCat("catch-up epoch ", m.catch_up->epoch, " is running") : "no catch-up is running";
    Log(LogLevel::kInfo, "stale catch-up report refused",
        {{"model", req.model_id()}, {"version", req.version()}, {"node", req.node_id()}, {"epoch", req.plan_epoch()},
         {"running_epoch", m.catch_up ? m.catch_up->epoch : 0}});
    return absl::FailedPreconditionError(absl::StrCat("catch-up report of model ", req.model_id(), " version ", req.version(),
                                                      " from node ", req.node_id(), " is for plan epoch ", req.plan_epoch(),
                                                      " while ", running, " (a late report of an earlier attempt): ignored"));
  }
  if (!m.catch_up || m.catch_up->version != req.version() || m.catch_up->nodes.count(req.node_id()) == 0 ||
      m.catch_up->phase != CatchUpRun::Phase::kRunning) {
    Log(LogLevel::kInfo, "stale catch-up report ignored", {{"model", req.model_id()}, {"version", req.version()}, {"node", req.node_id()}});
    return absl::OkStatus();
  }
  if (!req.ok()) {
    // A source or late rollout already gone here (its leave handled, the driver's pass that voids
    // the attempt not yet run): the failure is most likely that departure seen by a node - a
    // source's node no longer finds it -, so the attempt is void, not final, as the driver would
    // have made it a moment later. Counted as final, the late rollouts were told the catch-up
    // failed and waited for the next version (daemon catch_up_test, AVoidedAttempt..., under load).
    if (std::optional<std::string> gone = CatchUpMemberGone(m, nodes_)) {
      FailCatchUpLocked(req.model_id(), m, absl::StrCat(*gone, " (node ", req.node_id(), ": ", req.error(), ")"), false);
      return absl::OkStatus();
    }
    const std::string reason = absl::StrCat("node ", req.node_id(), ": ", req.error());
    // Sources of that node whose memory no longer holds the version (PlanSlice.certify): they serve
    // it no more; the next attempt, chosen again at once, takes it from the other holders (or tells
    // the late rollouts that none is left). The next version rewrites them. A node names only its
    // own sources of this attempt.
    std::vector<std::string> stale;
    for (const std::string& id : req.stale_sources()) {
      auto src = m.catch_up->sources.find(id);
      auto w = m.workers.find(id);
      if (src == m.catch_up->sources.end() || w == m.workers.end() || w->second.serial != src->second ||
          w->second.node != req.node_id() || w->second.holds != m.catch_up->version) {
        continue;
      }
      w->second.stale_version = m.catch_up->version;
      w->second.stale_error = absl::StrCat("its memory no longer holds version ", m.catch_up->version,
                                           " (found by a catch-up it was to serve; the next version rewrites it): ", req.error());
      stale.push_back(id);
    }
    if (!stale.empty()) {
      CatchUpDigestEvent(options_, req.model_id(), m.catch_up->version, "catch_up_stale_source",
                         absl::StrCat("rollouts ", absl::StrJoin(stale, ","), " serve it no more: ", reason));
      FailCatchUpLocked(req.model_id(), m, reason, false);
      return absl::OkStatus();
    }
    FailCatchUpLocked(req.model_id(), m, reason, true);
    return absl::OkStatus();
  }
  // What landed in the late rollouts' staging must be what the sources read: a mismatch ends the
  // catch-up before its commit (nothing of it reaches the late rollouts' committed or live state),
  // finally, as a node error does - a corrupting source or path would only repeat it; the late
  // rollouts are told why (tensor, box, both workers) and get the next version.
  if (m.catch_up->digests) {
    if (absl::Status d = m.catch_up->digests->Add(req); !d.ok()) {
      CatchUpDigestEvent(options_, req.model_id(), m.catch_up->version, "catch_up_digest_mismatch", d.message());
      FailCatchUpLocked(req.model_id(), m, std::string(d.message()), true);
      return absl::OkStatus();
    }
  }
  m.catch_up->done.insert(req.node_id());
  if (m.catch_up->done.size() == m.catch_up->nodes.size()) {
    m.catch_up->phase = CatchUpRun::Phase::kDone;
    if (m.catch_up->digests) {
      const DigestVerdict verdict = m.catch_up->digests->Verdict();
      CatchUpDigestEvent(options_, req.model_id(), m.catch_up->version, verdict.verified ? "catch_up_verified" : "catch_up_not_verified",
                         absl::StrCat(verdict.ops_verified, " of ", verdict.ops_total, " ops verified"));
    }
    wake_ = true;
  }
  return absl::OkStatus();
}

std::function<void()> CoordinatorCore::CatchUpWorkLocked(const std::string& model_id, Model& m, absl::Time now) {
  CatchUpRun& c = *m.catch_up;
  if (c.phase == CatchUpRun::Phase::kCommitting) return nullptr;  // its commit is on its way
  if (c.phase == CatchUpRun::Phase::kRunning) {
    if (now > c.deadline) {
      FailCatchUpLocked(model_id, m, absl::StrCat("timed out after ", absl::FormatDuration(options_.transfer_timeout)), true);
      return nullptr;
    }
    // A source or late rollout that left, registered again or lost its node: this attempt is
    // void (not final: the next pass chooses again from who is there).
    if (std::optional<std::string> gone = CatchUpMemberGone(m, nodes_)) FailCatchUpLocked(model_id, m, *gone, false);
    return nullptr;
  }
  // Every node reported done: commit on all of them at once (sync: the late rollouts' nodes copy
  // it into their live weights before answering).
  c.phase = CatchUpRun::Phase::kCommitting;
  std::vector<std::string> nodes(c.nodes.begin(), c.nodes.end());
  std::vector<std::shared_ptr<NodeClient>> clients;
  for (const std::string& n : nodes) clients.push_back(nodes_.Client(n));
  const uint64_t v = c.version, epoch = c.epoch;
  const absl::Duration timeout = std::max(absl::Seconds(5), options_.transfer_timeout);
  Model* mp = &m;  // no hold: as in StartCatchUpLocked
  return [this, mp, model_id, v, epoch, nodes, clients, timeout] {
    std::vector<absl::Status> acks(clients.size());
    ParallelFor(clients.size(), kRpcThreads, [&](size_t i) {
      acks[i] = clients[i] ? clients[i]->CommitVersion(model_id, v, timeout)
                           : absl::UnavailableError(absl::StrCat("node ", nodes[i], " is not registered"));
    });
    absl::MutexLock l(&mu_);
    if (!mp->catch_up || mp->catch_up->epoch != epoch) return;
    std::map<std::string, std::string> refused;  // node -> why
    for (size_t i = 0; i < acks.size(); ++i) {
      if (!acks[i].ok()) refused[nodes[i]] = std::string(acks[i].message());
    }
    std::vector<std::string> caught, failed;
    LandedRecord caught_landed;
    if (mp->catch_up->digests) caught_landed = mp->catch_up->digests->LandedByWorker();
    auto record = mp->landed.find(v);
    // What landed in a caught-up rollout certifies it as a source of v later (AddCertifyBoxes),
    // replacing what v's plan landed in an earlier incarnation of the same worker id. A new
    // record: the catch-up planner may be reading the old one outside the lock.
    std::shared_ptr<LandedRecord> updated;
    if (record != mp->landed.end() && record->second != nullptr) updated = std::make_shared<LandedRecord>(*record->second);
    for (const auto& [id, serial] : mp->catch_up->dests) {
      auto w = mp->workers.find(id);
      if (w == mp->workers.end() || w->second.serial != serial) continue;
      auto r = refused.find(w->second.node);
      if (r == refused.end()) {
        if (v > w->second.holds) w->second.holds_without_shadows = true;  // sources' quantised bytes, never shadows
        w->second.holds = std::max(w->second.holds, v);
        w->second.catch_up_error.clear();
        caught.push_back(id);
        if (updated != nullptr) {
          auto it = caught_landed.find(id);
          if (it != caught_landed.end()) {
            (*updated)[id] = std::move(it->second);
          } else {
            updated->erase(id);
          }
        }
      } else {
        w->second.catch_up_failed = v;
        w->second.catch_up_error = absl::StrCat("catch-up of version ", v, " not committed on node ", r->first, ": ", r->second,
                                                "; it gets the next version");
        failed.push_back(id);
      }
    }
    if (updated != nullptr) record->second = std::move(updated);
    mp->last_catch_up_seconds = absl::ToDoubleSeconds(options_.clock->Now() - mp->catch_up->started);
    Log(failed.empty() ? LogLevel::kInfo : LogLevel::kWarning, "catch-up committed",
        {{"model", model_id}, {"version", v}, {"caught_up", absl::StrJoin(caught, ",")}, {"failed", absl::StrJoin(failed, ",")},
         {"seconds", mp->last_catch_up_seconds}});
    mp->catch_up.reset();
    wake_ = true;
    StatusChangedLocked();
  };
}

void CoordinatorCore::FailCatchUpLocked(const std::string& model_id, Model& m, const std::string& reason, bool final) {
  if (!m.catch_up) return;
  CatchUpRun& c = *m.catch_up;
  const std::string what = absl::StrCat("catch-up of model ", model_id, " version ", c.version, " failed: ", reason);
  std::set<std::string> nodes = c.nodes;
  for (const auto& [id, serial] : c.dests) {
    auto w = m.workers.find(id);
    if (w == m.workers.end() || w->second.serial != serial) continue;
    if (final) {
      w->second.catch_up_failed = c.version;
      w->second.catch_up_error = absl::StrCat(what, "; it gets the next version");
      nodes.insert(w->second.node);  // Apply(v) waiting there learns why
    }
  }
  Log(LogLevel::kWarning, "catch-up failed", {{"model", model_id}, {"version", c.version}, {"final", final ? "yes" : "no (tried again)"},
                                              {"reason", reason}});
  // Of this attempt only: the next attempt of the same version may be running on these nodes by
  // the time the abort arrives. Final or not, the nodes only end the attempt's execution; a
  // waiting Apply(v) of a late rollout then asks WaitVersion here, which answers ABORTED with
  // catch_up_error when this was final and otherwise waits for the next attempt.
  ++m.catch_up_aborts_unsent;
  Model* mp = &m;  // no hold: a model with a committed version is never evicted (model_registry.h)
  QueueAbortRpcsLocked(nodes, model_id, c.version, what, c.epoch, [this, mp] {
    absl::MutexLock l(&mu_);
    --mp->catch_up_aborts_unsent;
    wake_ = true;
  });
  // A plan still being made for this attempt is void: cancel it (nothing else would, the model's
  // next plan job has another key), so it holds neither the planner thread nor other models' plans.
  plan_queue_.CancelRunning(what, model_id, kCatchUpJob);
  m.catch_up.reset();
  wake_ = true;
  StatusChangedLocked();
}

std::optional<absl::Status> CoordinatorCore::CaughtUpLocked(const Model& m, const std::string& worker, uint64_t v) const {
  if (worker.empty()) return absl::OkStatus();
  auto w = m.workers.find(worker);
  if (w == m.workers.end() || w->second.role != planner::Role::kRollout) return absl::OkStatus();
  if (w->second.holds >= v) return absl::OkStatus();
  if (w->second.catch_up_failed != 0 && w->second.catch_up_failed >= m.machine->committed()) {
    return absl::AbortedError(absl::StrCat("rollout ", worker, " does not hold version ", v, " of model ", m.spec.model_id(), ": ",
                                           w->second.catch_up_error));
  }
  return std::nullopt;
}

}  // namespace wb::daemon
