#pragma once
// Sync rollouts that do not pause (docs/daemon.md "Rollouts that never pause"): a sync version
// starts only once every rollout of its plan called BeginUpdate. One rollout that never does (a
// hung engine, or any process on the worker socket that joined the model with memory of its own)
// would hold every later version of the model until the trainers' publish deadline, and each of
// them would then abort. CoordinatorOptions::sync_pause_timeout bounds that wait: once a
// fully-published version waited that long since some rollout of the plan paused (timed from the
// first pause, so a fleet that all generated longer than the timeout is not cut at its first
// pause), the rollouts not paused are LEFT OUT - the model is planned again without them (the version never
// runs towards them, so nothing of it is ever written into their memory), and the version runs
// for the paused ones. A left-out rollout stays out of every later plan until its next
// BeginUpdate, which puts it back into the plan; it is then a late rollout like any other (its
// WaitVersion is answered only once a catch-up, or a newer version, reached it).
//
// This header is the PURE part (no I/O, no locks): the per-model record and the choice. The
// driver side (CoordinatorCore::SyncPauseLocked and friends) is in sync_pause.cc.

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace wb::daemon {

// A rollout left out of its model's plan for not pausing.
struct LeftOutRollout {
  uint64_t serial = 0;   // ModelRegistry::WorkerRec::serial: a registration again is a new worker, not left out
  uint64_t version = 0;  // the version it was left out of
  absl::Duration waited;  // how long that version had waited for it
  std::string reason;     // for the status (WorkerStatus.left_out_reason)
};

// Per model (CoordinatorCore::sync_pause_, under mu_).
struct SyncPauseBook {
  // The queued version whose wait for pauses is being timed (0: none), and since when: the first
  // driver pass that found it ready to start but for rollouts not paused, with at least one
  // rollout paused (a fleet all still generating is not timed).
  uint64_t waiting = 0;
  absl::Time since = absl::InfinitePast();
  std::map<std::string, LeftOutRollout> left_out;  // rollout id -> why
};

// Which rollouts of a plan to leave out once the wait is over: those not paused, but only when at
// least one rollout is paused. With none paused the answer is empty - a whole fleet still busy is
// a long generation step, not one rollout holding the others back, and a plan needs a rollout.
std::vector<std::string> RolloutsToLeaveOut(const std::set<std::string>& rollouts,
                                            const std::function<bool(const std::string&)>& paused);

}  // namespace wb::daemon
