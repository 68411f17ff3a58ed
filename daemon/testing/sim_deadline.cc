#include "daemon/testing/sim_deadline.h"

#include <gtest/gtest.h>

#include <thread>

#include "absl/synchronization/notification.h"

namespace wb::daemon::testing {

absl::Status EndsAtSimulatedDeadline(FakeClock& clock, absl::Time deadline, const std::function<absl::Status()>& call) {
  absl::Notification done;
  absl::Status result;
  std::thread t([&] {
    result = call();
    done.Notify();
  });
  const bool waiting = clock.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30));
  EXPECT_TRUE(waiting) << "the call did not wait on the clock for its deadline";
  if (waiting) {
    clock.Advance(deadline - clock.Now() - absl::Seconds(1));
    EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(50))) << "returned with 1 s of simulated time left";
  }
  clock.Advance(deadline - clock.Now());
  // Answered in real time once the deadline passed. A call that waits on the clock for a later
  // deadline than `deadline` (or began its wait only after the advance, from a later Now()) would
  // otherwise hang the test to its timeout at the join, with nothing naming the call: it fails
  // here, and a far advance ends such a wait so the thread can be joined.
  const bool returned = done.WaitForNotificationWithTimeout(absl::Seconds(30));
  EXPECT_TRUE(returned) << "the call did not return once its deadline passed on the clock (30 s of real time)";
  if (!returned) clock.Advance(absl::Hours(24 * 365));
  t.join();
  return result;
}

}  // namespace wb::daemon::testing
