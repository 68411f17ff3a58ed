#include "daemon/version_machine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace wb::daemon {

const char* VStateName(VState s) {
  switch (s) {
    case VState::kPublishing: return "publishing";
    case VState::kQueued: return "queued";
    case VState::kTransferring: return "transferring";
    case VState::kCommitted: return "committed";
    case VState::kAborted: return "aborted";
    case VState::kSuperseded: return "superseded";
  }
  return "?";
}

void VersionMachine::SetRollouts(std::set<std::string> rollouts) {
  rollouts_ = std::move(rollouts);
  for (auto it = applied_.begin(); it != applied_.end();) {
    it = rollouts_.count(it->first) ? std::next(it) : applied_.erase(it);
  }
  for (auto it = ready_.begin(); it != ready_.end();) {
    it = rollouts_.count(*it) ? std::next(it) : ready_.erase(it);
  }
}

bool VersionMachine::PublishAdmissible(uint64_t version) const {
  if (mode_ != ModeKind::kAsync || max_staleness_ == 0) return true;
  for (const std::string& r : rollouts_) {
    uint64_t applied = Applied(r);
    if (version > applied && version - applied > max_staleness_) return false;
  }
  return true;
}

absl::Status VersionMachine::RecordPublish(const std::string& trainer, uint64_t version, const std::string& process) {
  if (!trainers_.count(trainer)) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", trainer, " is not a registered trainer of this model"));
  }
  if (version == 0) return absl::InvalidArgumentError("version must be > 0");
  auto it = records_.find(version);
  if (it == records_.end()) {
    if (draining_) return absl::UnavailableError(absl::StrCat("draining: version ", version, " refused"));
    if (version > kMaxVersion) {
      return absl::InvalidArgumentError(absl::StrCat("version ", version, " is above the largest version ", kMaxVersion,
                                                     " (2^53 - 1): no later version could ever follow it"));
    }
    const uint64_t newest = newest_known();
    if (version - std::min(version, newest) > kMaxVersionJump) {
      return absl::InvalidArgumentError(absl::StrCat("version ", version, " is more than ", kMaxVersionJump, " (2^32) above the newest version ",
                                                     newest, " of this model (a corrupt step counter?): refused, it would block every later version"));
    }
    if (version <= committed_ || version <= newest_started_) {
      return absl::FailedPreconditionError(absl::StrCat("version ", version, " is not newer than version ",
                                                        std::max(committed_, newest_started_)));
    }
    VersionRecord rec;
    rec.version = version;
    it = records_.emplace(version, std::move(rec)).first;
  }
  VersionRecord& rec = it->second;
  if (rec.state == VState::kAborted) {
    return absl::AbortedError(absl::StrCat("version ", version, " was aborted: ", rec.error));
  }
  if (rec.state != VState::kPublishing) return absl::OkStatus();  // idempotent
  rec.published_by.insert(trainer);
  if (!process.empty()) rec.publisher_process[trainer] = process;
  // Only trainers are recorded, so fewer entries than trainers means someone is missing (keeps a
  // version of T trainers at O(T log T) in all, not O(T^2)).
  if (rec.published_by.size() < trainers_.size()) return absl::OkStatus();
  for (const std::string& t : trainers_) {
    if (!rec.published_by.count(t)) return absl::OkStatus();
  }
  // Fully published: it supersedes any older version that has not started.
  for (auto& [v, other] : records_) {
    if (v < version && (other.state == VState::kQueued || other.state == VState::kPublishing)) {
      other.state = VState::kSuperseded;
    }
  }
  rec.state = VState::kQueued;
  return absl::OkStatus();
}

void VersionMachine::RecordReady(const std::string& rollout) {
  if (rollouts_.count(rollout)) ready_.insert(rollout);
}

void VersionMachine::RecordApplied(const std::string& rollout, uint64_t version) {
  if (!rollouts_.count(rollout)) return;
  uint64_t& a = applied_[rollout];
  if (version > a) a = version;
}

uint64_t VersionMachine::Applied(const std::string& rollout) const {
  auto it = applied_.find(rollout);
  return it == applied_.end() ? 0 : it->second;
}

std::optional<uint64_t> VersionMachine::NextToStart() const {
  if (InFlight()) return std::nullopt;
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (it->second.state != VState::kQueued) continue;
    if (mode_ == ModeKind::kSync) {
      for (const std::string& r : rollouts_) {
        if (!ready_.count(r)) return std::nullopt;
      }
    }
    return it->first;
  }
  return std::nullopt;
}

std::optional<uint64_t> VersionMachine::NewestQueued() const {
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (it->second.state == VState::kQueued) return it->first;
  }
  return std::nullopt;
}

void VersionMachine::Start(uint64_t version, std::set<std::string> nodes, absl::Time now,
                           absl::Duration timeout, uint64_t bytes_total, uint32_t num_ops) {
  VersionRecord& rec = records_[version];
  rec.version = version;
  rec.state = VState::kTransferring;
  rec.nodes_pending = std::move(nodes);
  rec.started = now;
  rec.deadline = now + timeout;
  rec.bytes_total = bytes_total;
  rec.num_ops = num_ops;
  newest_started_ = std::max(newest_started_, version);
}

bool VersionMachine::NodeDone(const std::string& node, uint64_t version) {
  auto it = records_.find(version);
  if (it == records_.end() || it->second.state != VState::kTransferring) return false;
  it->second.nodes_pending.erase(node);
  return it->second.nodes_pending.empty();
}

void VersionMachine::Commit(uint64_t version, absl::Time now) {
  VersionRecord& rec = records_[version];
  rec.state = VState::kCommitted;
  rec.finished = now;
  rec.nodes_pending.clear();
  committed_ = std::max(committed_, version);
  if (mode_ == ModeKind::kSync) {
    // Commit wrote the live weights of every paused rollout: they applied it and resume.
    for (const std::string& r : ready_) RecordApplied(r, version);
    ready_.clear();
  }
}

void VersionMachine::CommitFailed(uint64_t version, const std::string& reason, const std::set<std::string>& holding,
                                  absl::Time now) {
  for (const std::string& r : holding) RecordApplied(r, version);
  Abort(version, reason, now);
  ready_.clear();
}

void VersionMachine::Abort(uint64_t version, const std::string& reason, absl::Time now) {
  VersionRecord& rec = records_[version];
  rec.version = version;
  if (rec.state == VState::kCommitted) return;
  rec.state = VState::kAborted;
  rec.error = reason;
  rec.finished = now;
  rec.nodes_pending.clear();
  // Paused rollouts are released with the error; they pause again for the next version.
  if (mode_ == ModeKind::kSync) ready_.clear();
}

std::optional<uint64_t> VersionMachine::TimedOut(absl::Time now) const {
  auto v = InFlight();
  if (v && now >= records_.at(*v).deadline) return v;
  return std::nullopt;
}

std::optional<uint64_t> VersionMachine::InFlight() const {
  for (const auto& [v, rec] : records_) {
    if (rec.state == VState::kTransferring) return v;
  }
  return std::nullopt;
}

bool VersionMachine::InFlightInvolves(const std::string& node) const {
  auto v = InFlight();
  return v && records_.at(*v).nodes_pending.count(node) > 0;
}

std::optional<absl::Status> VersionMachine::Outcome(uint64_t version) const {
  auto it = records_.find(version);
  if (it != records_.end() && it->second.state == VState::kAborted) {
    return absl::AbortedError(absl::StrCat("version ", version, " aborted: ", it->second.error));
  }
  if (committed_ >= version) return absl::OkStatus();
  return std::nullopt;
}

bool VersionMachine::Idle() const {
  for (const auto& [v, rec] : records_) {
    if (rec.state == VState::kQueued || rec.state == VState::kTransferring) return false;
  }
  return true;
}

uint64_t VersionMachine::newest_known() const {
  uint64_t newest = std::max(committed_, newest_started_);
  if (!records_.empty()) newest = std::max(newest, records_.rbegin()->first);
  return newest;
}

const VersionRecord* VersionMachine::Find(uint64_t version) const {
  auto it = records_.find(version);
  return it == records_.end() ? nullptr : &it->second;
}

void VersionMachine::Prune(size_t keep) {
  while (records_.size() > keep) {
    auto it = records_.begin();
    VState s = it->second.state;
    if (s == VState::kQueued || s == VState::kTransferring || s == VState::kPublishing) return;
    records_.erase(it);
  }
}

namespace {
bool Unfinished(VState s) { return s == VState::kPublishing || s == VState::kQueued || s == VState::kTransferring; }
}  // namespace

std::vector<uint64_t> VersionMachine::PublishedFromAnotherProcess(const std::string& trainer, const std::string& process) const {
  std::vector<uint64_t> out;
  if (process.empty()) return out;
  for (const auto& [v, rec] : records_) {
    if (!Unfinished(rec.state)) continue;
    auto p = rec.publisher_process.find(trainer);
    if (p != rec.publisher_process.end() && p->second != process) out.push_back(v);
  }
  return out;
}

std::vector<uint64_t> VersionMachine::PublishingWithout(const std::string& trainer, uint64_t version) const {
  std::vector<uint64_t> out;
  for (const auto& [v, rec] : records_) {
    if (v >= version) break;
    if (rec.state == VState::kPublishing && rec.published_by.count(trainer) == 0) out.push_back(v);
  }
  return out;
}

std::string VersionMachine::PublishedPastWithout(const std::string& trainer, uint64_t version) const {
  auto mine = records_.find(version);
  for (const std::string& other : trainers_) {
    if (other == trainer) continue;
    if (mine != records_.end() && mine->second.published_by.count(other) > 0) continue;
    for (auto it = records_.upper_bound(version); it != records_.end(); ++it) {
      if (it->second.published_by.count(other) > 0) return other;
    }
  }
  return "";
}

std::vector<uint64_t> VersionMachine::UnfinishedPublishedBy(const std::string& trainer) const {
  std::vector<uint64_t> out;
  for (const auto& [v, rec] : records_) {
    if (Unfinished(rec.state) && rec.published_by.count(trainer) > 0) out.push_back(v);
  }
  return out;
}

}  // namespace wb::daemon
