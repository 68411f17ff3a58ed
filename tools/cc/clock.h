#pragma once
// Injected time. Lease, heartbeat and timeout logic takes a Clock* so tests can drive time by hand.
// Contract: Now() is monotonic per Clock instance for RealClock; FakeClock moves only when told.
// Thread-safe.

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wb {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // The process-wide real clock.
  static Clock* Real();
};

class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

inline Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

// Hand-driven clock for tests.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock l(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock l(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb
