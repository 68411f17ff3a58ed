// CoordinatorCore: aborting a version (AbortLocked), the AbortVersion calls it owes the nodes
// (QueueAbortRpcsLocked, SendAbort; retried while a node is unreachable: pending_aborts_), and the
// sync rollouts an abort or a commit leaves paused because they wait for a newer version
// (PausedPastLocked / PausePastLocked). Split from core.cc, whose handlers call them.
#include <algorithm>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/core.h"
#include "daemon/log.h"

namespace wb::daemon {

void CoordinatorCore::QueueAbortRpcsLocked(const std::set<std::string>& nodes, const std::string& model_id, uint64_t version,
                                           const std::string& reason, uint64_t plan_epoch, std::function<void()> sent) {
  std::vector<std::pair<PendingAbort, std::shared_ptr<NodeClient>>> targets;
  for (const std::string& n : nodes) {
    // A lost node has nothing to drop (and rolls back at its re-join what it committed).
    auto client = nodes_.AliveClient(n);
    if (!client) continue;
    PendingAbort p;
    p.node = n;
    p.model_id = model_id;
    p.reason = reason;
    p.version = version;
    p.plan_epoch = plan_epoch;
    p.incarnation = nodes_.Incarnation(n);
    targets.emplace_back(std::move(p), std::move(client));
  }
  if (targets.empty() && !sent) return;
  // In the model's lane: after the version calls posted before it (the ExecuteVersion of the
  // version it aborts), before those posted after.
  pending_rpcs_.emplace_back(ModelLane(model_id), [this, targets, sent = std::move(sent)] {
    for (const auto& [p, client] : targets) SendAbort(p, client);
    if (sent) sent();
  });
}

void CoordinatorCore::SendAbort(PendingAbort p, const std::shared_ptr<NodeClient>& client) {
  const absl::Status st = client->AbortVersion(p.model_id, p.version, p.plan_epoch, p.reason, absl::Seconds(2));
  // (RESOURCE_EXHAUSTED: a node past its call limits did not run the handler.)
  const bool owed = absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st) || absl::IsResourceExhausted(st);
  absl::MutexLock l(&mu_);
  auto same = [&](const PendingAbort& q) {
    return q.node == p.node && q.model_id == p.model_id && q.version == p.version && q.plan_epoch == p.plan_epoch;
  };
  auto it = std::find_if(pending_aborts_.begin(), pending_aborts_.end(), same);
  if (!owed) {
    if (it != pending_aborts_.end()) {
      pending_aborts_.erase(it);
      Log(st.ok() ? LogLevel::kInfo : LogLevel::kWarning, "owed abort delivered",
          {{"model", p.model_id}, {"version", p.version}, {"epoch", p.plan_epoch}, {"node", p.node}, {"tries", p.tries + 1},
           {"result", st.ok() ? "aborted" : st.message()}});
    } else if (!st.ok()) {
      Log(LogLevel::kWarning, "abort refused by node",
          {{"model", p.model_id}, {"version", p.version}, {"node", p.node}, {"error", st.message()}});
    }
    return;
  }
  if (!nodes_.HoldsIncarnation(p.node, p.incarnation)) {
    if (it != pending_aborts_.end()) pending_aborts_.erase(it);
    return;  // lost or restarted: its re-join rolls back what it was not told
  }
  p.tries += 1;
  p.next_try = options_.clock->Now() + options_.commit_retry;
  if (it != pending_aborts_.end()) {
    *it = std::move(p);
    return;
  }
  Log(LogLevel::kWarning, "abort not delivered, owed to the node",
      {{"model", p.model_id}, {"version", p.version}, {"epoch", p.plan_epoch}, {"node", p.node}, {"error", st.message()}});
  if (pending_aborts_.size() >= kMaxPendingAborts) {
    const PendingAbort& oldest = pending_aborts_.front();
    Log(LogLevel::kWarning, "owed abort given up (too many owed)",
        {{"model", oldest.model_id}, {"version", oldest.version}, {"node", oldest.node}, {"max", kMaxPendingAborts}});
    pending_aborts_.erase(pending_aborts_.begin());
  }
  pending_aborts_.push_back(std::move(p));
  wake_ = true;
}

void CoordinatorCore::AbortLocked(const std::string& model_id, Model& m, uint64_t version, const std::string& reason) {
  const VersionRecord* rec = m.machine->Find(version);
  if (rec && (rec->state == VState::kCommitted || rec->state == VState::kAborted)) return;
  if (m.committing == version) return;  // commit already decided
  // Deltas (docs/daemon.md "Deltas", "After an abort"): a node that decodes in place took each
  // rollout's base - the staging of the version the rollout holds, the only copy of its canonical
  // shadows - as this version's incoming staging, and what landed there is now neither version.
  // The rollout still holds its version (live weights, quantised pieces), but not those shadows: the
  // next version's deltas into them would be refused and resent in full. Marked as a catch-up's
  // rollout is (no base for the ops into its shadows; its other ops keep theirs) for every rollout
  // this version named a base for on such a node, whether or not the node got to take it: its
  // abort answer would come too late, as the next version may already be made (one waiting in
  // async, or started in the same driver pass as a timeout). Only when every node of the plan
  // reads the mark: otherwise it would cost the rollout every base (StartWorkLocked), more than
  // the one refusal it saves.
  if (rec && rec->state == VState::kTransferring) {
    const bool all_read_without_shadows = std::all_of(m.plan.nodes.begin(), m.plan.nodes.end(), [&](const std::string& n) {
      const NodeTable::Node* node = nodes_.Find(n);
      return node != nullptr && node->understands_bases_without_shadows;
    });
    for (const std::string& w : m.plan.worker_ids) {
      auto wr = m.workers.find(w);
      if (!all_read_without_shadows || wr == m.workers.end()) continue;
      WorkerRec& r = wr->second;
      const NodeTable::Node* node = nodes_.Find(r.node);
      if (r.role != planner::Role::kRollout || r.holds == 0 || r.serial != m.plan.serials[w] || r.holds_without_shadows ||
          node == nullptr || !node->delta_in_place) {
        continue;
      }
      r.holds_without_shadows = true;
      Log(LogLevel::kInfo, "delta base may be torn by the abort",
          {{"model", model_id}, {"version", version}, {"worker", w}, {"holds", r.holds}, {"node", r.node}});
    }
  }
  const std::vector<std::string> waiting = PausedPastLocked(m, version);
  m.machine->Abort(version, reason, options_.clock->Now());
  m.progress.erase(version);
  for (auto& [w, rec] : m.workers) rec.paused = false;  // released with the error; they pause again
  PausePastLocked(model_id, m, version, waiting);        // (but those still waiting, paused, for a newer one)
  Log(LogLevel::kWarning, "version aborted", {{"model", model_id}, {"version", version}, {"reason", reason}});
  QueueAbortRpcsLocked(m.plan.nodes, model_id, version, reason);
  wake_ = true;
  StatusChangedLocked();
}

std::vector<std::string> CoordinatorCore::PausedPastLocked(const Model& m, uint64_t v) const {
  std::vector<std::string> out;
  if (m.machine->mode() != ModeKind::kSync) return out;
  for (const auto& [w, rec] : m.workers) {
    if (rec.role == planner::Role::kRollout && rec.paused && !rec.waits.empty() && *rec.waits.rbegin() > v) out.push_back(w);
  }
  return out;
}

void CoordinatorCore::PausePastLocked(const std::string& model_id, Model& m, uint64_t v, const std::vector<std::string>& rollouts) {
  for (const std::string& w : rollouts) {
    auto rec = m.workers.find(w);
    if (rec == m.workers.end()) continue;
    rec->second.paused = true;
    m.machine->RecordReady(w);
    Log(LogLevel::kDebug, "rollout still paused, waiting for a newer version",
        {{"model", model_id}, {"worker", w}, {"version", v}, {"waits_for", *rec->second.waits.rbegin()}});
  }
}

}  // namespace wb::daemon
