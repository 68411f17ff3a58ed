#pragma once
// TEST ONLY: a call that must end exactly at its deadline in simulated time (base/clock.h
// FakeClock). The pattern several node tests share: run the call on its own thread, wait until it
// waits on the clock for `deadline`, advance to 1 s before it and check the call is still waiting,
// then advance to the deadline and collect what it returned.

#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/clock.h"

namespace wb::daemon::testing {

// Runs `call` on a thread and drives `clock` as above. Adds a gtest failure (and still ends the
// call by advancing to the deadline) when the call does not wait on the clock for `deadline`
// within 30 s of real time, or has returned with 1 s of simulated time left (checked for 50 ms
// of real time), or has not returned within 30 s of real time once the deadline passed (then
// the clock is moved a year on, so that a wait for a later deadline ends and the thread joins,
// instead of hanging the test to its timeout). Returns the call's status.
absl::Status EndsAtSimulatedDeadline(FakeClock& clock, absl::Time deadline, const std::function<absl::Status()>& call);

}  // namespace wb::daemon::testing
