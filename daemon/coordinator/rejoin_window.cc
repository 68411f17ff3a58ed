// The re-join window of a restarted coordinator (docs/daemon.md "Coordinator restart", status.md
// "Next steps" 11): a number a re-joined rollout holds above the restored committed version is
// used (UsedUncommittedLocked), and WaitVersion of it is answered ABORTED - but the number may yet
// turn out committed. A sync commit is confirmed to some nodes only (the OK of a Publish, a
// WaitVersion or a ReportReady); the nodes not told roll it back at their re-join and report the
// version before it, while their rollouts' live weights still hold it (used). A node that was told
// reports it committed, and its re-join raises the committed version to it. The first plan after a
// restart waits for the spec's rollouts only (PlanReadyLocked), so a node outside it (rollouts
// beyond num_rollout_workers) may re-join after the model is planned: a wait answered in between
// was ABORTED for a version that is committed. So within one lease of the coordinator's start - a
// node alive at the restart has registered again by then - such a wait waits for that node.
#include <algorithm>

#include "daemon/coordinator/core.h"

namespace wb::daemon {

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
