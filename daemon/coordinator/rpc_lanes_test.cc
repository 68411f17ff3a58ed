// RpcLanes: calls of one lane run in order, one at a time; a lane whose call blocks holds no other
// lane; Busy and AwaitIdle see queued and running calls; Shutdown drops what has not started.
// Blocking calls wait on notifications with a real-time bound, so a broken lane fails, never hangs.
#include "daemon/coordinator/rpc_lanes.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

constexpr absl::Duration kReal = absl::Seconds(20);

TEST(RpcLanesTest, ALanesCallsRunInTheOrderPostedOneAtATime) {
  absl::Mutex mu;
  std::vector<int> order;
  std::atomic<int> running{0}, overlap{0};
  RpcLanes lanes({.threads = 4});
  for (int i = 0; i < 50; ++i) {
    lanes.Post("model/a", [&, i] {
      if (running.fetch_add(1) != 0) overlap.fetch_add(1);
      {
        absl::MutexLock l(&mu);
        order.push_back(i);
      }
      running.fetch_sub(1);
    });
  }
  ASSERT_TRUE(lanes.AwaitIdle(absl::Now() + kReal));
  EXPECT_EQ(overlap.load(), 0) << "two calls of one lane ran at once";
  absl::MutexLock l(&mu);
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
}

TEST(RpcLanesTest, ABlockedLaneHoldsNoOtherLane) {
  absl::Notification release, other_ran;
  RpcLanes lanes({.threads = 2});
  lanes.Post("node/frozen", [&] { release.WaitForNotificationWithTimeout(kReal); });
  lanes.Post("node/frozen", [] {});  // behind the blocked call: the lane stays busy
  lanes.Post("model/b", [&] { other_ran.Notify(); });
  EXPECT_TRUE(other_ran.WaitForNotificationWithTimeout(absl::Seconds(10))) << "model/b waited for node/frozen";
  EXPECT_TRUE(lanes.Busy("node/frozen"));
  EXPECT_FALSE(lanes.AwaitIdle(absl::Now() + absl::Milliseconds(50)));
  release.Notify();
  EXPECT_TRUE(lanes.AwaitIdle(absl::Now() + kReal));
  EXPECT_FALSE(lanes.Busy("node/frozen"));
  EXPECT_FALSE(lanes.Busy("model/b"));
}

TEST(RpcLanesTest, OnIdleRunsAfterEveryCallWithNoLaneLockHeld) {
  std::atomic<int> idles{0};
  RpcLanes* self = nullptr;
  std::atomic<bool> busy_seen_free{true};
  RpcLanes lanes({.threads = 2, .on_idle = [&] {
                    // Calls back into the lanes: a lock held here would deadlock.
                    if (self != nullptr && self->Busy("never")) busy_seen_free = false;
                    idles.fetch_add(1);
                  }});
  self = &lanes;
  for (int i = 0; i < 5; ++i) lanes.Post(i % 2 ? "a" : "b", [] {});
  ASSERT_TRUE(lanes.AwaitIdle(absl::Now() + kReal));
  lanes.Shutdown();  // joins the workers: every on_idle has returned
  EXPECT_EQ(idles.load(), 5);
  EXPECT_TRUE(busy_seen_free.load());
}

// Notifies when the last copy of the call holding it is destroyed: Shutdown dropping the call.
struct OnDestroy {
  absl::Notification* n;
  ~OnDestroy() { n->Notify(); }
};

TEST(RpcLanesTest, ShutdownDropsCallsNotStartedAndWaitsForTheRunningOne) {
  absl::Notification started, release, a_dropped, b_dropped;
  std::atomic<int> ran{0};
  RpcLanes lanes({.threads = 1});
  lanes.Post("a", [&] {
    started.Notify();
    release.WaitForNotificationWithTimeout(kReal);
    ran.fetch_add(1);
  });
  lanes.Post("a", [&, g = std::shared_ptr<OnDestroy>(new OnDestroy{&a_dropped})] { ran.fetch_add(100); });
  lanes.Post("b", [&, g = std::shared_ptr<OnDestroy>(new OnDestroy{&b_dropped})] { ran.fetch_add(100); });
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(kReal));
  std::thread stopper([&] { lanes.Shutdown(); });
  // The running call is released only once Shutdown has dropped the others: released earlier, the
  // one worker could run them before Shutdown began (TSan's slower thread start showed that race).
  EXPECT_TRUE(a_dropped.WaitForNotificationWithTimeout(kReal)) << "Shutdown kept a's queued call";
  EXPECT_TRUE(b_dropped.WaitForNotificationWithTimeout(kReal)) << "Shutdown kept b's queued call";
  release.Notify();
  stopper.join();
  EXPECT_EQ(ran.load(), 1) << "a call not started ran after Shutdown, or the running one was not waited for";
  lanes.Post("c", [&] { ran.fetch_add(100); });  // after Shutdown: dropped
  EXPECT_FALSE(lanes.Busy("c"));
  EXPECT_EQ(ran.load(), 1);
}

}  // namespace
}  // namespace wb::daemon
