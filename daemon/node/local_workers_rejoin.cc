// LocalWorkers across a coordinator change: the re-join's count and session (which Apply(v) the
// node must ask the coordinator about), what the re-join re-submits per worker (Joins), and the
// sync pauses it re-sends. Split from local_workers.cc by concern (the daemon/ size rule).
#include "daemon/node/local_workers.h"

#include <algorithm>

#include "daemon/log.h"

namespace wb::daemon {

void LocalWorkers::NoteRejoin(const std::string& reason) {
  absl::MutexLock l(&mu_);
  restarts_ += 1;
  restart_reason_ = reason;
  session_first_.clear();
  // The membership is rebuilt from the workers this node has (the re-join's list, taken after
  // this): a departed worker's owed leave has nothing left to undo there.
  if (!owed_leaves_.empty()) {
    Log(LogLevel::kInfo, "owed leaves dropped at re-join", {{"node", options_.node_id}, {"owed", owed_leaves_.size()}, {"reason", reason}});
  }
  owed_leaves_.clear();
}

std::string LocalWorkers::restart_reason() const {
  absl::MutexLock l(&mu_);
  return restart_reason_;
}

void LocalWorkers::NoteSessionVersion(const std::string& model, uint64_t version) {
  absl::MutexLock l(&mu_);
  uint64_t& first = session_first_.emplace(model, version).first->second;
  first = std::min(first, version);
}

void LocalWorkers::NotePublished(const WorkerKey& key, uint64_t version, uint64_t incarnation) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it != workers_.end() && it->second.incarnation == incarnation) it->second.published_version = std::max(it->second.published_version, version);
}

std::vector<LocalWorkers::JoinInfo> LocalWorkers::Joins() const {
  std::vector<JoinInfo> out;
  std::vector<std::string> layouts;  // serialized, parsed below without mu_
  {
    absl::MutexLock l(&mu_);
    for (const auto& [key, w] : workers_) {
      JoinInfo j;
      j.key = key;
      j.role = w.role;
      j.gpu = w.gpu;
      j.spec = w.spec;
      j.applied_version = w.applied_version;
      j.committed_version = w.committed_version;
      j.holds_without_shadows = w.role == planner::Role::kRollout && w.caught_up_version > 0 &&
                                w.caught_up_version == std::max(w.committed_version, w.applied_version);
      j.published_version = w.published_version;
      j.has_layout = w.has_layout;
      layouts.push_back(w.submitted);
      if (w.pid) j.process = w.pid->Identity();
      out.push_back(std::move(j));
  }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].submitted.ParseFromString(layouts[i])) out[i].submitted.Clear();  // (never: serialized here)
  }
  return out;
}

std::optional<uint64_t> LocalWorkers::PauseToResend(const WorkerKey& key) const {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end()) return std::nullopt;
  const Worker& w = it->second;
  const bool open = w.role == planner::Role::kRollout && w.mode == pb::MODE_SYNC && w.paused && w.paused_at_committed > 0 &&
                    w.committed_version == w.pause_mark;
  return open ? std::optional<uint64_t>(w.incarnation) : std::nullopt;
}

bool LocalWorkers::NotePauseResent(const WorkerKey& key, uint64_t incarnation) {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || it->second.incarnation != incarnation || !it->second.paused) return false;
  it->second.pause_resent_at = restarts_;
  return true;
}

bool LocalWorkers::WaitResendable(const WorkerKey& key, uint64_t incarnation, uint64_t version) const {
  absl::MutexLock l(&mu_);
  auto it = workers_.find(key);
  if (it == workers_.end() || it->second.incarnation != incarnation) return false;
  const Worker& w = it->second;
  if (w.role != planner::Role::kRollout || w.mode != pb::MODE_SYNC) return false;
  return (w.paused && w.pause_resent_at != 0 && w.pause_resent_at == restarts_) || std::max(w.committed_version, w.applied_version) >= version;
}

}  // namespace wb::daemon
