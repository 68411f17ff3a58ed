// Used numbers of a restarted coordinator and its re-join window (docs/daemon.md "Coordinator
// restart", "When that AbortVersion is lost"; status.md "Next steps" 11 and 24): a number a
// re-joined rollout holds above the restored committed version (or a trainer's recorded publish
// above it) is used (UsedUncommittedLocked), and WaitVersion / Publish of it are answered ABORTED -
// but the number may yet turn out committed. A sync commit is confirmed to some nodes only (the OK
// of a Publish, a WaitVersion or a ReportReady); the nodes not told roll it back at their re-join
// and report the version before it, while their rollouts' live weights still hold it (used). A
// node that was told reports it committed, and its re-join raises the committed version to it. The
// first plan after a restart waits for the spec's rollouts only (PlanReadyLocked), so a node
// outside it (rollouts beyond num_rollout_workers) may re-join after the model is planned: a call
// answered in between was ABORTED for a version that is committed. So within one lease of the
// coordinator's start - a node alive at the restart has registered again by then - such a call
// waits for that node (AwaitRejoinWindowLocked).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/core.h"

namespace wb::daemon {

std::optional<absl::Status> CoordinatorCore::UsedUncommittedLocked(const std::string& model_id, const Model& m, uint64_t v,
                                                                   const std::string& what) const {
  auto used = used_by_rejoin_.find(model_id);
  if (used == used_by_rejoin_.end() || v > used->second.version || v <= m.machine->committed() || m.machine->Find(v) != nullptr ||
      !m.planned_once) {
    return std::nullopt;
  }
  const UsedByRejoin& u = used->second;
  if (u.published) {
    return absl::AbortedError(absl::StrCat(what, ": version ", v, " of model ", model_id, " is not committed and its number is used: trainer ", u.worker,
                                           " on node ", u.node, " re-joined having published version ", u.version, " to the coordinator before the "
                                           "coordinator restarted, and never publishes it again; publish a version newer than ", u.version));
  }
  return absl::AbortedError(absl::StrCat(what, ": version ", v, " of model ", model_id, " is not committed and its number is used: rollout ",
                                         u.worker, " on node ", u.node, " re-joined holding version ", u.version,
                                         ", above the committed version ", m.machine->committed(),
                                         " (a sync commit that failed on another node, or was never confirmed before the coordinator"
                                         " restarted); publish a version newer than ", u.version));
}

bool CoordinatorCore::AwaitRejoinWindowLocked(const std::string& model_id, const Model& m, uint64_t v, absl::Time deadline) {
  const absl::Time until = std::min(deadline, rejoin_window_end_);
  if (options_.clock->Now() >= until) return false;
  auto settled = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || m.machine->Outcome(v).has_value() || !UsedUncommittedLocked(model_id, m, v, "").has_value();
  };
  options_.clock->WaitUntil(&mu_, absl::Condition(&settled), until);
  return true;
}

}  // namespace wb::daemon
