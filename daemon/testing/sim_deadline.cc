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
  t.join();
  return result;
}

}  // namespace wb::daemon::testing
