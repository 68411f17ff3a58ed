#pragma once
// The node's session with the coordinator: registration, heartbeats (with the progress of the
// versions in flight), noticing a lost lease or a restarted coordinator, and re-registering.
//
// Threads: a heartbeat thread (beats at a fixed rate, never blocked by anything but the
// heartbeat RPC itself) and a control thread (re-registers when a heartbeat found the node
// unknown, and runs the owner's `tick` every heartbeat period). mu_ is a leaf lock: no callback
// runs and no RPC is made while holding it, so any thread may call the Await* methods.
// Every wait goes through the injected Clock (tests: FakeClock, simulated time); RPC timeouts
// are real time (CoordinatorClient).

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "daemon/node/coordinator_client.h"

namespace wb::daemon {

class CoordinatorSession {
 public:
  struct Options {
    std::string node_id;
    CoordinatorClient* client = nullptr;  // not owned; outlives the session
    Clock* clock = Clock::Real();
    absl::Duration heartbeat = absl::Milliseconds(500);
    // What every RegisterNode sends (address, data address, transports): fixed for the node's life.
    pb::RegisterNodeRequest registration;
    // Called on the control thread after a registration that found a restarted coordinator or a
    // lost lease, with why (no lock of the session held). Re-submits what the node holds; until it
    // returns, AwaitRegistered waits (calls would reach a coordinator that does not know them yet).
    std::function<void(const std::string& reason)> rejoin;
    // Called on the control thread once per heartbeat period (worker liveness, housekeeping).
    std::function<void()> tick;
    // TEST ONLY: when it returns true the heartbeat is skipped (a frozen node: its lease expires).
    std::function<bool()> test_skip_heartbeat;
  };

  explicit CoordinatorSession(Options options);
  ~CoordinatorSession();  // Stop()
  CoordinatorSession(const CoordinatorSession&) = delete;
  CoordinatorSession& operator=(const CoordinatorSession&) = delete;

  // Registers once (the coordinator's answer on error), then starts the heartbeat and control
  // threads.
  absl::Status Start();
  // Stops both threads (a heartbeat RPC in flight ends within its timeout); waiters return at once.
  // Idempotent.
  void Stop();

  // Waits (bounded by `deadline`, on the session's clock) until the node is registered and not in
  // the middle of a re-join; false when that did not happen in time or the session is stopping.
  bool AwaitRegistered(absl::Time deadline);
  // Bumps after each completed re-join (a forwarded call compares it before and after).
  uint64_t session();
  // After a forwarded call failed in a way a coordinator restart explains (UNAVAILABLE,
  // NOT_FOUND): heartbeats at once and waits (bounded by `deadline`) until either the node re-joined
  // a coordinator (returns why: the restart) or two heartbeats on the unchanged session succeeded
  // (nullopt); nullopt at the deadline.
  std::optional<std::string> AwaitCoordinatorChange(uint64_t session0, absl::Time deadline);
  // When the first heartbeat of the current outage was sent (the coordinator answered none since:
  // UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED); nullopt while heartbeats are answered. A held
  // worker call that gives up names it (WorkerCalls::CoordinatorDown).
  std::optional<absl::Time> UnreachableSince();
  // Heartbeats report `bytes_done` for (model, version) until it expires.
  void TrackProgress(const std::string& model_id, uint64_t version, std::weak_ptr<const std::atomic<uint64_t>> bytes_done);

  // Introspection (tests, status).
  std::string coordinator_instance();
  absl::Duration lease();

 private:
  absl::Status Register();
  void HeartbeatLoop();
  void ControlLoop();

  const Options options_;
  absl::Mutex mu_;
  uint64_t incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  std::string coordinator_instance_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::Seconds(3);
  bool registered_ ABSL_GUARDED_BY(mu_) = false;  // false: the control thread registers again
  bool rejoining_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t session_ ABSL_GUARDED_BY(mu_) = 0;     // bumps after each completed re-join
  uint64_t hb_ok_ ABSL_GUARDED_BY(mu_) = 0;       // heartbeats acknowledged
  std::optional<absl::Time> unreachable_since_ ABSL_GUARDED_BY(mu_);  // UnreachableSince
  bool kick_ ABSL_GUARDED_BY(mu_) = false;        // heartbeat now rather than at the next tick
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_change_ ABSL_GUARDED_BY(mu_);  // why the last re-join happened
  std::map<std::pair<std::string, uint64_t>, std::weak_ptr<const std::atomic<uint64_t>>> progress_ ABSL_GUARDED_BY(mu_);
  std::thread heartbeat_, control_;
};

}  // namespace wb::daemon
