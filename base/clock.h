#pragma once
// Injected time. Lease, heartbeat and timeout logic takes a Clock* so tests can drive time by hand.
// Contract: Now() is monotonic per Clock instance for RealClock; FakeClock moves only when told.
// Thread-safe.
//
// The clock also WAITS: code that sleeps or waits on a condition with a deadline goes through
// SleepUntil / WaitUntil, so the same code runs on real time in a daemon and on simulated time
// in a test (FakeClock: a deadline passes when the test Advance()s past it, never on its own).

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace wb {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // Blocks until Now() >= deadline. (Defaults run on real time, for clocks that only override Now.)
  virtual void SleepUntil(absl::Time deadline) { absl::SleepFor(deadline - Now()); }
  // `mu` is held by the caller (and held again on return). Waits until `cond` holds or Now()
  // reaches `deadline`; returns whether `cond` holds (like absl::Mutex::AwaitWithDeadline, whose
  // rules it follows: `cond` is evaluated with `mu` held, and re-evaluated when `mu` is released).
  virtual bool WaitUntil(absl::Mutex* mu, const absl::Condition& cond, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return mu->AwaitWithDeadline(cond, deadline);
  }
  // Owners of a mutex used with WaitUntil call Forget(mu) before destroying it (FakeClock keeps
  // the mutexes it must wake on Advance; a no-op on real time). Must not be called with `mu` held.
  virtual void Forget(absl::Mutex* mu) { (void)mu; }
  // The process-wide real clock.
  static Clock* Real();
};

class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  void SleepUntil(absl::Time deadline) override { absl::SleepFor(deadline - absl::Now()); }
  bool WaitUntil(absl::Mutex* mu, const absl::Condition& cond, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return mu->AwaitWithDeadline(cond, deadline);
  }
};

inline Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

// Hand-driven clock for tests. Advance() wakes every SleepUntil and WaitUntil whose deadline it
// passes. Lock order: Advance()/Forget() take the waiters' mutexes, so they must not be called
// while holding one of them.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock l(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock a(&advance_mu_);
    {
      absl::MutexLock l(&mu_);
      now_ += d;
    }
    // A waiter's condition is re-evaluated when its mutex is released: lock and release each
    // mutex a WaitUntil ever used so it notices the new time.
    std::map<absl::Mutex*, int> mutexes;
    {
      absl::MutexLock l(&list_mu_);
      mutexes = mutexes_;
    }
    for (auto& [m, n] : mutexes) {
      m->Lock();
      m->Unlock();
    }
  }
  void SleepUntil(absl::Time deadline) override {
    Waiting w(this, deadline);
    absl::MutexLock l(&mu_);
    auto reached = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return now_ >= deadline; };
    mu_.Await(absl::Condition(&reached));
  }
  bool WaitUntil(absl::Mutex* waiter_mu, const absl::Condition& cond, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(waiter_mu) {
    {
      absl::MutexLock l(&list_mu_);
      mutexes_[waiter_mu] += 0;
    }
    // Registered with waiter_mu held, so once AwaitWaiter sees it an Advance past `deadline`
    // cannot be missed (Advance takes waiter_mu after moving the time).
    Waiting w(this, deadline);
    struct Args {
      const absl::Condition* cond;
      const FakeClock* clock;
      absl::Time deadline;
    } args{&cond, this, deadline};
    auto either = [](Args* a) { return a->cond->Eval() || a->clock->Now() >= a->deadline; };
    waiter_mu->Await(absl::Condition(+either, &args));
    return cond.Eval();
  }
  void Forget(absl::Mutex* m) override {
    absl::MutexLock a(&advance_mu_);
    absl::MutexLock l(&list_mu_);
    mutexes_.erase(m);
  }
  // Tests: blocks (in real time, up to real_deadline) until some thread is inside SleepUntil or
  // WaitUntil with exactly this simulated deadline. A test that starts a thread which computes
  // its own deadline from Now() waits here before advancing, else the thread may start after the
  // advance and wait from a later time. True when such a waiter exists.
  bool AwaitWaiter(absl::Time deadline, absl::Time real_deadline) const {
    absl::MutexLock l(&list_mu_);
    auto has = [&]() ABSL_SHARED_LOCKS_REQUIRED(list_mu_) { return waiting_.count(deadline) > 0; };
    return list_mu_.AwaitWithDeadline(absl::Condition(&has), real_deadline);
  }
  // Tests: how many threads are inside SleepUntil or WaitUntil now.
  int waiters() const {
    absl::MutexLock l(&list_mu_);
    return static_cast<int>(waiting_.size());
  }
  // Tests: how many distinct mutexes WaitUntil has been used with (not forgotten).
  int waiter_mutexes() const {
    absl::MutexLock l(&list_mu_);
    return static_cast<int>(mutexes_.size());
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  // Order: advance_mu_ -> a waiter's mutex -> list_mu_ (WaitUntil registers with its mutex held).
  absl::Mutex advance_mu_;
  mutable absl::Mutex list_mu_;
  std::map<absl::Mutex*, int> mutexes_ ABSL_GUARDED_BY(list_mu_);
  mutable std::multiset<absl::Time> waiting_ ABSL_GUARDED_BY(list_mu_);  // deadlines of current waiters

  // Scoped registration of one waiter's deadline (AwaitWaiter, waiters()).
  class Waiting {
   public:
    Waiting(const FakeClock* c, absl::Time deadline) : c_(c), deadline_(deadline) {
      absl::MutexLock l(&c_->list_mu_);
      c_->waiting_.insert(deadline_);
    }
    ~Waiting() {
      absl::MutexLock l(&c_->list_mu_);
      c_->waiting_.erase(c_->waiting_.find(deadline_));
    }
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;

   private:
    const FakeClock* c_;
    absl::Time deadline_;
  };
};

}  // namespace wb
