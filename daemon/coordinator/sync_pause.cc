// Sync rollouts that do not pause (sync_pause.h, docs/daemon.md "Rollouts that never pause"):
// the pure choice and the CoordinatorCore steps. Why leaving a rollout out of the PLAN (rather
// than starting the version with it in the plan but unpaused): a version's plan is what every node
// executes and commits, and a sync commit writes the live weights of every rollout of the plan.
// A rollout outside the plan is in no slice, so no op lands in its staging and no commit copies
// into its live memory - it can never hold part of the version. Back in the plan (its BeginUpdate),
// it is a late rollout: the catch-up (catch_up.cc) or the next version brings it to the committed
// version whole, and WaitVersion answers it only then (CaughtUpLocked).
// The race at the timeout is closed by mu_: the leave-out and ReportReady's RejoinLeftOutLocked
// are both under it, and each marks the plan dirty, which holds every start until the model is
// planned again. A rollout that pauses before the decision is paused and stays in; one that pauses
// after it is back in the next plan - if that plan is made before the version starts, the version
// includes it; if the version had started without it, it is re-planned once the version ended and
// caught up to it (or reached by the next version). Never both (a catch-up only serves rollouts
// holding less than the committed version), never neither (it is in the plan from then on).
#include "daemon/coordinator/sync_pause.h"

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/core.h"
#include "daemon/log.h"
#include "daemon/metrics.h"

namespace wb::daemon {

std::vector<std::string> RolloutsToLeaveOut(const std::set<std::string>& rollouts,
                                            const std::function<bool(const std::string&)>& paused) {
  std::vector<std::string> out;
  bool any_paused = false;
  for (const std::string& r : rollouts) {
    if (paused(r)) {
      any_paused = true;
    } else {
      out.push_back(r);
    }
  }
  if (!any_paused) out.clear();
  return out;
}

bool CoordinatorCore::SyncPauseLocked(const std::string& model_id, Model& m, absl::Time now) {
  if (m.machine->mode() != ModeKind::kSync || options_.sync_pause_timeout <= absl::ZeroDuration()) return false;
  auto it = sync_pause_.find(model_id);
  if (it != sync_pause_.end()) {
    // Registrations that are gone are forgotten: a worker registered again is a new process, planned
    // afresh (and left out again if it does not pause either).
    auto& left = it->second.left_out;
    for (auto lo = left.begin(); lo != left.end();) {
      auto w = m.workers.find(lo->first);
      lo = (w == m.workers.end() || w->second.serial != lo->second.serial) ? left.erase(lo) : std::next(lo);
    }
  }
  const std::optional<uint64_t> queued = m.machine->NewestQueued();
  // Nothing waits for a pause: no queued version, one that may start, or one behind a version in
  // flight (its rollouts pause again only after that commit: timed from then, not from now).
  if (!queued || m.machine->NextToStart() || m.machine->InFlight()) {
    if (it != sync_pause_.end()) {
      it->second.waiting = 0;
      if (it->second.left_out.empty()) sync_pause_.erase(it);
    }
    return false;
  }
  SyncPauseBook& book = it != sync_pause_.end() ? it->second : sync_pause_[model_id];
  // No rollout paused: keep waiting, until the trainers' publish deadline as before. Leaving every
  // rollout out would leave nobody to receive the version (and no plan: it needs a rollout), and a
  // whole fleet not paused is a long generation step, not one rollout holding the others back.
  const std::vector<std::string> out =
      RolloutsToLeaveOut(m.machine->rollouts(), [&](const std::string& r) { return m.machine->IsPaused(r); });
  // Timed from the first pass at which some rollout IS paused, not from the version's full
  // publication: after a generation step longer than the timeout, the first rollout to pause
  // would otherwise leave out at once its peers a moment behind it (e2e_quant_test's w4a16
  // rollouts, verifying 25 s per pass on a loaded machine, were left out one second late).
  if (book.waiting != *queued || out.empty()) {
    book.waiting = *queued;
    book.since = now;
    return false;
  }
  const absl::Duration waited = now - book.since;
  if (waited < options_.sync_pause_timeout) return false;
  const uint64_t v = *queued;
  const size_t paused = m.machine->rollouts().size() - out.size();
  DaemonMetrics& metrics = options_.metrics != nullptr ? *options_.metrics : Metrics();
  for (const std::string& r : out) {
    auto w = m.workers.find(r);
    if (w == m.workers.end()) continue;  // (gone: the plan is dirty already, it will not be in the next one)
    LeftOutRollout& lo = book.left_out[r];
    lo.serial = w->second.serial;
    lo.version = v;
    lo.waited = waited;
    lo.reason = absl::StrCat("did not pause (BeginUpdate) while version ", v, " waited for it ", absl::FormatDuration(waited),
                             " (sync pause timeout ", absl::FormatDuration(options_.sync_pause_timeout), "): left out of the plan, "
                             "versions run without it; its next BeginUpdate puts it back and it is caught up");
    Log(LogLevel::kWarning, "sync rollout left out",
        {{"model", model_id}, {"version", v}, {"worker", r}, {"node", w->second.node}, {"waited_s", absl::ToDoubleSeconds(waited)},
         {"timeout_s", absl::ToDoubleSeconds(options_.sync_pause_timeout)}, {"paused_rollouts", paused}});
    metrics.Version(options_.local_node.empty() ? std::string("coordinator") : options_.local_node, model_id, "rollout_left_out");
  }
  book.waiting = 0;  // the version waits for its new plan now; timed afresh if that one waits too
  MarkPlanDirtyLocked(m);
  StatusChangedLocked();
  wake_ = true;
  return true;
}

void CoordinatorCore::RejoinLeftOutLocked(const std::string& model_id, Model& m, const std::string& worker) {
  auto it = sync_pause_.find(model_id);
  if (it == sync_pause_.end()) return;
  auto lo = it->second.left_out.find(worker);
  if (lo == it->second.left_out.end()) return;
  Log(LogLevel::kInfo, "left-out rollout paused: back in the plan",
      {{"model", model_id}, {"worker", worker}, {"left_out_of", lo->second.version}, {"committed", m.machine->committed()}});
  it->second.left_out.erase(lo);
  MarkPlanDirtyLocked(m);
  StatusChangedLocked();
  wake_ = true;
}

const LeftOutRollout* CoordinatorCore::LeftOutLocked(const Model& m, const std::string& worker) const {
  auto it = sync_pause_.find(m.spec.model_id());
  if (it == sync_pause_.end()) return nullptr;
  auto lo = it->second.left_out.find(worker);
  auto w = m.workers.find(worker);
  if (lo == it->second.left_out.end() || w == m.workers.end() || w->second.serial != lo->second.serial) return nullptr;
  return &lo->second;
}

}  // namespace wb::daemon
