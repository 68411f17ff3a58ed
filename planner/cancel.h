#pragma once
// Cancelling a plan (docs/planner.md "Cancelling a plan"). The planner stays pure - no clock, no
// thread, no I/O -: the caller hands MakePlanWithOptions a check (PlanOptions::cancel) that says
// whether to go on, and the planner polls it where it meters its work (building fragments, the
// sender-side quantisation decision, the sender reserve, building ops: the load balancer and the
// bucketing), about once every kCancelPollUnits units of work. The caller decides what stopping
// means: a cancel flag (CANCELLED), a deadline read from its own clock (DEADLINE_EXCEEDED), ...;
// the plan then fails with the check's code and message plus where the planner stopped (the phase
// and its progress), e.g. `model m: plan cancelled: a newer plan of the model is queued (planner
// stopped building the weightbridge ops: fragment 8192 of 65536, 16384 ops built)`.

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace wb::planner {

// OK: go on. Anything else stops the plan with that status's code and message.
using CancelCheck = std::function<absl::Status()>;

// Work units between two calls of the check. A unit is about what the fragments' work budget
// counts (a grid cell walked or merged, a holder/needer ref read or written, a few ns); an op built
// counts kCancelUnitsPerOp. So the check runs about every 0.1-2 ms of planning and costs nothing
// measurable (a poll is one call of the check: an atomic load and a clock read in the coordinator).
inline constexpr int64_t kCancelPollUnits = int64_t{1} << 16;
inline constexpr int64_t kCancelUnitsPerOp = 8;

// The planner's side of a CancelCheck: counts work, calls the check every kCancelPollUnits units.
// Not thread-safe (one plan, one thread). With no check (null or empty) Tick is a compare.
class CancelPoll {
 public:
  explicit CancelPoll(const CancelCheck* check) : check_(check != nullptr && *check ? check : nullptr) {}
  // Counts `units` of work; calls the check when kCancelPollUnits have been counted since the last
  // call. False once the check said stop (then Stopped() is the error).
  bool Tick(int64_t units) {
    if (check_ == nullptr) return true;
    left_ -= units;
    return left_ > 0 || Poll();
  }
  // Calls the check now (the start of a plan); false when it said stop.
  bool Poll() {
    if (check_ == nullptr) return true;
    left_ = kCancelPollUnits;
    ++polls_;
    stop_ = (*check_)();
    return stop_.ok();
  }
  // The error once Tick / Poll returned false: the check's code and message, then
  // " (planner stopped WHERE)"; `where` names the phase and its progress.
  absl::Status Stopped(absl::string_view where) const {
    return absl::Status(stop_.code(), absl::StrCat(stop_.message(), " (planner stopped ", where, ")"));
  }
  int64_t polls() const { return polls_; }

 private:
  const CancelCheck* check_;
  int64_t left_ = kCancelPollUnits;
  int64_t polls_ = 0;
  absl::Status stop_;
};

}  // namespace wb::planner
