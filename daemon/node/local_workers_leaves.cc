// LocalWorkers' owed leaves: LeaveWorker calls the coordinator did not get while it stalled (see
// local_workers.h, "owed leaves"). Split from local_workers.cc by concern (the daemon/ size rule).
#include "daemon/log.h"
#include "daemon/node/local_workers.h"

namespace wb::daemon {

LocalWorkers::Owed LocalWorkers::OweLeave(const WorkerKey& key, const std::string& reason) {
  absl::MutexLock l(&mu_);
  leaving_.erase(key);
  // Registered or joining again here: that join drops the old registration at the coordinator
  // ("registered again"); a leave sent after it would drop the new one.
  if (workers_.count(key) > 0 || joining_.count(key) > 0) {
    owed_leaves_.erase(key);
    return Owed::kSuperseded;
  }
  if (owed_leaves_.count(key) == 0 && owed_leaves_.size() >= kMaxOwedLeaves) {
    Log(LogLevel::kWarning, "owed leave not kept: too many owed",
        {{"node", options_.node_id}, {"model", key.first}, {"worker", key.second}, {"owed", owed_leaves_.size()}});
    return Owed::kFull;
  }
  owed_leaves_[key] = reason;
  return Owed::kKept;
}

std::vector<LocalWorkers::OwedLeave> LocalWorkers::TakeOwedLeaves() {
  std::vector<OwedLeave> out;
  absl::MutexLock l(&mu_);
  for (auto it = owed_leaves_.begin(); it != owed_leaves_.end();) {
    // A join in progress: left owed - it replaces the old registration if it gets through, and
    // settles the debt (Add); if it fails, the leave is still owed.
    if (joining_.count(it->first) > 0) {
      ++it;
      continue;
    }
    leaving_.insert(it->first);
    out.push_back({it->first, std::move(it->second)});
    it = owed_leaves_.erase(it);
  }
  return out;
}

size_t LocalWorkers::OwedLeaves() const {
  absl::MutexLock l(&mu_);
  return owed_leaves_.size();
}

}  // namespace wb::daemon
