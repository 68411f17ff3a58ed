#pragma once
// The per-model version state machine of the coordinator (design.md "Versions and modes").
// Pure bookkeeping: no I/O, no threads; the caller serialises access (the coordinator's mutex) and
// passes time in, so tests drive it with a FakeClock.
//
// Life of a version v:
//   publishing  - some trainers called Publish(v)
//   queued      - every trainer published v; waits for the running transfer (and, in sync mode,
//                 for every rollout worker to be paused by BeginUpdate)
//   transferring- nodes execute the plan; finishes when every node reported done
//   committed   - every node committed; newest committed version is what rollouts may apply
//   aborted     - timeout, lost node, checksum mismatch, worker gone: staging dropped, error kept
//   superseded  - a newer version became queued before v started (v is never transferred; waiters
//                 on v are satisfied by the newer commit)
// Versions strictly increase; at most one transfers at a time.

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace wb::daemon {

enum class ModeKind { kSync, kOneStepOff, kAsync };

enum class VState { kPublishing, kQueued, kTransferring, kCommitted, kAborted, kSuperseded };
const char* VStateName(VState s);

struct VersionRecord {
  uint64_t version = 0;
  VState state = VState::kPublishing;
  std::set<std::string> published_by;
  // Sync: the process each trainer published from, as its node identified it (JoinWorkerRequest.
  // process; absent or empty: unknown). The version's source is that process's live memory.
  std::map<std::string, std::string> publisher_process;
  std::set<std::string> nodes_pending;  // transferring: nodes that have not reported done
  absl::Time started = absl::InfinitePast();
  absl::Time deadline = absl::InfiniteFuture();
  absl::Time finished = absl::InfinitePast();
  uint64_t bytes_total = 0;
  // Ops of the plan the version ran (set at Start): the model may be planned again while or after
  // it runs (a sync rollout left out and back), so its status must not read the model's plan.
  uint32_t num_ops = 0;
  std::string error;
};

class VersionMachine {
 public:
  // Version numbers accepted by RecordPublish: at most kMaxVersion (2^53 - 1: exact in JSON
  // numbers and doubles, which clients use), and at most kMaxVersionJump above the newest version
  // known (committed, started or published): one wild number (2^64 - 1, a corrupt step counter)
  // would otherwise make every later version "not newer" and block the model for good.
  static constexpr uint64_t kMaxVersion = (uint64_t{1} << 53) - 1;
  static constexpr uint64_t kMaxVersionJump = uint64_t{1} << 32;

  VersionMachine(ModeKind mode, uint32_t max_staleness) : mode_(mode), max_staleness_(max_staleness) {}

  ModeKind mode() const { return mode_; }
  uint32_t max_staleness() const { return max_staleness_; }

  // Membership (trainer and rollout worker ids). Removing a rollout forgets its applied version.
  void SetTrainers(std::set<std::string> trainers) { trainers_ = std::move(trainers); }
  void SetRollouts(std::set<std::string> rollouts);
  const std::set<std::string>& trainers() const { return trainers_; }
  const std::set<std::string>& rollouts() const { return rollouts_; }

  // Staleness bound (async, max_staleness k > 0): Publish(v) may proceed only while every rollout r
  // has v - applied(r) <= k. Always true in other modes or with k = 0 (unbounded).
  bool PublishAdmissible(uint64_t version) const;

  // Trainer `trainer` published `version`. FAILED_PRECONDITION for an unknown trainer, a version
  // not newer than the newest committed/started one, or one already aborted; UNAVAILABLE while
  // draining (unless the version was already being published). Idempotent per trainer.
  // `process`: the publishing process's identity (empty: unknown), kept per trainer while the
  // version is being published (VersionRecord::publisher_process).
  absl::Status RecordPublish(const std::string& trainer, uint64_t version, const std::string& process = "");
  // Versions not finished (publishing, queued, transferring) that `trainer` published from a known
  // process other than `process` (which must be known): a new process under its id does not hold
  // them in its memory.
  std::vector<uint64_t> PublishedFromAnotherProcess(const std::string& trainer, const std::string& process) const;
  // Versions not finished that `trainer` published.
  std::vector<uint64_t> UnfinishedPublishedBy(const std::string& trainer) const;
  // Versions older than `version` still being published (not every trainer yet) that `trainer`
  // has not published: a trainer publishes its versions in order, so once it published `version`
  // those can never be published by every trainer.
  std::vector<uint64_t> PublishingWithout(const std::string& trainer, uint64_t version) const;
  // The reverse order: another current trainer that already published a version newer than
  // `version` without publishing `version` (its first such, by name), so `version` - published
  // now by `trainer` - can never be published by every trainer. Empty if none.
  std::string PublishedPastWithout(const std::string& trainer, uint64_t version) const;

  // Sync mode: a rollout worker paused for the next version.
  void RecordReady(const std::string& rollout);
  // Sync mode: a paused rollout resumed with no commit taking its pause; the next version waits
  // for it to pause again. A version already started keeps running (its commit records no apply
  // for it: it was not paused when the commit came).
  void RecordResumed(const std::string& rollout) { ready_.erase(rollout); }
  bool IsPaused(const std::string& rollout) const { return ready_.count(rollout) > 0; }
  // A rollout applied `version` (used by the staleness bound).
  void RecordApplied(const std::string& rollout, uint64_t version);
  uint64_t Applied(const std::string& rollout) const;

  // The queued version that may start now (none in flight; sync: every rollout paused), if any.
  std::optional<uint64_t> NextToStart() const;
  // The newest queued version, whether or not it may start (sync: rollouts not paused yet).
  std::optional<uint64_t> NewestQueued() const;
  void Start(uint64_t version, std::set<std::string> nodes, absl::Time now, absl::Duration timeout,
             uint64_t bytes_total, uint32_t num_ops = 0);
  // A node finished its part. True when every node of the transfer is done (ready to commit).
  bool NodeDone(const std::string& node, uint64_t version);
  void Commit(uint64_t version, absl::Time now);
  // Sync mode: every node reported done but some did not acknowledge the commit (lost, or their
  // copy into live memory failed). The version is NOT committed: Outcome is ABORTED with `reason`
  // (which names the nodes and rollouts that do not hold it); rollouts in `holding` do hold it
  // (RecordApplied); paused rollouts are released. The number stays used (next must be newer).
  void CommitFailed(uint64_t version, const std::string& reason, const std::set<std::string>& holding, absl::Time now);
  void Abort(uint64_t version, const std::string& reason, absl::Time now);

  // The in-flight version whose deadline passed at `now`, if any.
  std::optional<uint64_t> TimedOut(absl::Time now) const;
  std::optional<uint64_t> InFlight() const;
  // True when the in-flight version involves `node`.
  bool InFlightInvolves(const std::string& node) const;

  // For waiters: OK once `version` or a newer one is committed (and `version` was not aborted);
  // ABORTED with the reason when it was aborted; nullopt while pending.
  std::optional<absl::Status> Outcome(uint64_t version) const;

  uint64_t committed() const { return committed_; }
  // The newest version known: committed, started, or with a record (published, aborted, ...).
  uint64_t newest_known() const;
  // Coordinator restart: a node reports `version` as committed on it. Later publishes must be
  // newer; waiters on versions <= it see them committed. Never lowers anything.
  void RestoreCommitted(uint64_t version) {
    committed_ = std::max(committed_, version);
    newest_started_ = std::max(newest_started_, version);
  }
  bool Idle() const;  // nothing queued or transferring
  void set_draining(bool draining) { draining_ = draining; }
  bool draining() const { return draining_; }

  const std::map<uint64_t, VersionRecord>& records() const { return records_; }
  const VersionRecord* Find(uint64_t version) const;
  // Drops finished records older than the newest `keep` (bounded memory).
  void Prune(size_t keep);

 private:
  ModeKind mode_;
  uint32_t max_staleness_;
  std::set<std::string> trainers_, rollouts_;
  std::set<std::string> ready_;
  std::map<std::string, uint64_t> applied_;
  std::map<uint64_t, VersionRecord> records_;
  uint64_t committed_ = 0;
  uint64_t newest_started_ = 0;
  bool draining_ = false;
};

}  // namespace wb::daemon
