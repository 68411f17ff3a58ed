#include "base/parallel_for.h"

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace wb {
namespace {

TEST(ParallelForTest, EveryIndexExactlyOnce) {
  for (size_t threads : {1u, 2u, 7u, 64u}) {
    std::vector<std::atomic<int>> seen(1000);
    ParallelFor(seen.size(), threads, [&](size_t i) { seen[i]++; });
    for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i].load(), 1) << "index " << i << ", " << threads << " threads";
  }
}

TEST(ParallelForTest, ZeroItemsCallsNothing) {
  int calls = 0;
  ParallelFor(0, 8, [&](size_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ParallelForTest, OneThreadRunsInOrderOnTheCaller) {
  std::vector<size_t> order;
  const std::thread::id caller = std::this_thread::get_id();
  ParallelFor(5, 1, [&](size_t i) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    order.push_back(i);
  });
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 3, 4}));
}

// The calls really overlap: 4 items on 4 threads each wait until all 4 started (a sequential
// implementation would time out here instead of hanging: the wait has a deadline).
TEST(ParallelForTest, CallsRunConcurrently) {
  absl::Mutex mu;
  int started = 0;
  std::atomic<int> all_met{0};
  ParallelFor(4, 4, [&](size_t) {
    absl::MutexLock l(&mu);
    ++started;
    if (mu.AwaitWithTimeout(absl::Condition(+[](int* s) { return *s == 4; }, &started), absl::Seconds(10))) all_met++;
  });
  EXPECT_EQ(all_met.load(), 4);
}

TEST(ParallelForTest, NeverMoreThreadsThanAsked) {
  absl::Mutex mu;
  std::set<std::thread::id> ids;
  ParallelFor(200, 3, [&](size_t) {
    absl::MutexLock l(&mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_LE(ids.size(), 3u);
  EXPECT_GE(HardwareThreads(16), 1u);
  EXPECT_LE(HardwareThreads(2), 2u);
}

}  // namespace
}  // namespace wb
