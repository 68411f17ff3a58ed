// node::Versions, what is committed here: the committed version per model, its history and what
// the coordinator confirmed (rolled back at a re-join when unconfirmed), the installed plans as
// WorkerCalls reads them, and the plan each local rollout's committed staging landed with, which
// Apply copies it by (see versions.h for the split and the thread / lock rules).
#include <algorithm>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/node/versions.h"

namespace wb::daemon::node {

void Versions::NoteCommittedLocked(const std::string& model, uint64_t version) {
  committed_[model] = std::max(committed_[model], version);
  std::set<uint64_t>& history = committed_history_[model];
  history.insert(version);
  while (history.size() > kCommittedHistory) history.erase(history.begin());
}

std::optional<uint64_t> Versions::RollBackCommittedLocked(const std::string& model, uint64_t version) {
  auto h = committed_history_.find(model);
  if (h == committed_history_.end() || h->second.erase(version) == 0) return std::nullopt;
  uint64_t& committed = committed_[model];
  const uint64_t before = committed;
  // The newest version committed here that is left (0: none known). One level back is what sync
  // needs (one version at a time); a version rolled back under a newer one changes nothing.
  if (committed == version) committed = h->second.empty() ? 0 : *h->second.rbegin();
  return before;
}

std::optional<pb::Mode> Versions::ModeLocked(const std::string& model) {
  if (auto p = plans_.find(model); p != plans_.end()) return p->second->slice.mode();
  std::optional<planner::Role> role;
  if (std::optional<pb::ModelSpec> spec = local_.SpecOf(model, "", &role)) return spec->mode();
  return std::nullopt;
}

void Versions::NoteClusterCommitted(const std::string& model, uint64_t version) {
  if (version == 0) return;
  absl::MutexLock l(&mu_);
  uint64_t& confirmed = confirmed_[model];
  confirmed = std::max(confirmed, version);
}

std::vector<Versions::RolledBack> Versions::RollBackUnconfirmedLocked(const std::string& reason) {
  std::vector<RolledBack> out;
  for (auto& [model, history] : committed_history_) {
    const uint64_t confirmed = confirmed_[model];
    if (history.empty() || *history.rbegin() <= confirmed) continue;
    // Only sync: in the other modes the coordinator decides the commit before it sends
    // CommitVersion, so a version committed here is committed (owed to nodes that missed it).
    const std::optional<pb::Mode> mode = ModeLocked(model);
    if (!mode.has_value() || (*mode != pb::MODE_SYNC && *mode != pb::MODE_UNSPECIFIED)) continue;
    std::vector<uint64_t> unconfirmed(history.upper_bound(confirmed), history.end());
    for (auto v = unconfirmed.rbegin(); v != unconfirmed.rend(); ++v) {
      // As the AbortVersion of a failed sync commit would have: committed_ falls back, the
      // version is recorded aborted here (a CommitVersion or ExecuteVersion of it, or the number
      // published again, is refused ABORTED), resumed rollouts' committed copy of it goes.
      // Rollouts whose live weights hold it still say so (holds_version): above the restored
      // committed version they are neither catch-up sources nor destinations.
      if (!RollBackCommittedLocked(model, *v)) continue;
      local_.NoteAborted(model, *v, absl::StrCat("version ", *v, " was committed on node ", options_.node_id,
                                                  " but never confirmed committed cluster-wide before ", reason,
                                                  " (not every node may have committed it; its AbortVersion may have been lost): "
                                                  "rolled back at the re-join"));
      // Like an execution the re-join aborted (AbortAllForRejoin), it may run again for the new
      // coordinator, once: its trainers' Publish is sent again there (WorkerCalls::
      // PublishAgainAfterRestart), from the same source. A number a rollout's live weights
      // hold is never run again: the coordinator refuses it as used (UsedUncommittedLocked).
      // Before, this record refused the new ExecuteVersion (chaos seed 1002, v34).
      rejoin_aborted_.insert({model, *v});
      out.push_back({model, *v, committed_[model], local_.DropAbortedCommit(model, *v)});
    }
  }
  return out;
}

uint64_t Versions::Committed(const std::string& model_id) {
  absl::MutexLock l(&mu_);
  auto it = committed_.find(model_id);
  return it == committed_.end() ? 0 : it->second;
}

std::shared_ptr<const ModelPlan> Versions::Plan(const std::string& model_id) {
  absl::MutexLock l(&mu_);
  auto it = plans_.find(model_id);
  return it == plans_.end() ? nullptr : it->second;
}

std::shared_ptr<const ModelPlan> Versions::PlanWith(const std::string& model_id, const std::string& worker) {
  absl::MutexLock l(&mu_);
  for (const auto* plans : {&plans_, &catch_up_plans_}) {
    auto it = plans->find(model_id);
    if (it == plans->end()) continue;
    for (const auto& w : it->second->slice.workers()) {
      if (w.worker_id() == worker) return it->second;
    }
  }
  return nullptr;
}

void Versions::NoteLandedWithLocked(const Exec& exec) {
  // Entries whose staging is gone (applied and back in the pool, the worker left or registered
  // again) first: the table stays one entry per local rollout with a committed staging alive.
  for (auto it = landed_with_.begin(); it != landed_with_.end();) it = it->second.staging.expired() ? landed_with_.erase(it) : std::next(it);
  for (const auto& [wid, staging] : exec.incoming) landed_with_[{exec.model_id, wid}] = {staging, exec.plan};
}

std::shared_ptr<const ModelPlan> Versions::PlanForApply(const std::string& model_id, const std::string& worker,
                                                        const std::shared_ptr<Bytes>& staging) {
  {
    absl::MutexLock l(&mu_);
    auto it = landed_with_.find({model_id, worker});
    // lock(), not the address: a staging freed since and another allocated at the same address
    // is not the one the entry's plan landed.
    if (it != landed_with_.end() && staging != nullptr && it->second.staging.lock() == staging) return it->second.plan;
  }
  return PlanWith(model_id, worker);
}

}  // namespace wb::daemon::node
