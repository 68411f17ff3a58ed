#include "base/clock.h"

#include <thread>

#include "gtest/gtest.h"

namespace wb {
namespace {

TEST(Clock, FakeClockMovesOnlyWhenAdvanced) {
  FakeClock clock;
  absl::Time t0 = clock.Now();
  EXPECT_EQ(clock.Now(), t0);
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(clock.Now() - t0, absl::Seconds(5));
}

TEST(Clock, RealClockIsNotBehind) {
  absl::Time a = Clock::Real()->Now();
  absl::Time b = Clock::Real()->Now();
  EXPECT_GE(b, a);
}

// A wait on fake time ends when the test advances past its deadline, not before.
TEST(Clock, FakeWaitUntilTimesOutOnlyOnAdvance) {
  FakeClock clock;
  absl::Mutex mu;
  bool flag = false;
  bool done = false, result = true;
  const absl::Time deadline = clock.Now() + absl::Seconds(10);
  std::thread waiter([&] {
    absl::MutexLock l(&mu);
    result = clock.WaitUntil(&mu, absl::Condition(&flag), deadline);
    done = true;
  });
  // The waiter registers its mutex with the clock once it waits.
  {
    absl::MutexLock l(&mu);
    mu.AwaitWithTimeout(absl::Condition(+[](FakeClock* c) { return c->waiter_mutexes() == 1; }, &clock), absl::Seconds(10));
  }
  ASSERT_EQ(clock.waiter_mutexes(), 1);
  clock.Advance(absl::Seconds(5));
  {
    absl::MutexLock l(&mu);
    EXPECT_FALSE(done) << "returned before its (fake) deadline";
  }
  clock.Advance(absl::Seconds(5));
  waiter.join();
  EXPECT_TRUE(done);
  EXPECT_FALSE(result);
  clock.Forget(&mu);
  EXPECT_EQ(clock.waiter_mutexes(), 0);
}

TEST(Clock, FakeWaitUntilReturnsWhenTheConditionHolds) {
  FakeClock clock;
  absl::Mutex mu;
  bool flag = false, result = false;
  std::thread waiter([&] {
    absl::MutexLock l(&mu);
    result = clock.WaitUntil(&mu, absl::Condition(&flag), clock.Now() + absl::Hours(1));
  });
  {
    absl::MutexLock l(&mu);
    flag = true;
  }
  waiter.join();
  EXPECT_TRUE(result);
  clock.Forget(&mu);
}

TEST(Clock, FakeAwaitWaiterSeesSleepersAndWaitersByDeadline) {
  FakeClock clock;
  const absl::Time t = clock.Now() + absl::Seconds(3);
  EXPECT_FALSE(clock.AwaitWaiter(t, absl::Now() + absl::Milliseconds(20))) << "nobody sleeps yet";
  std::thread sleeper([&] { clock.SleepUntil(t); });
  ASSERT_TRUE(clock.AwaitWaiter(t, absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(clock.waiters(), 1);
  EXPECT_FALSE(clock.AwaitWaiter(t + absl::Seconds(1), absl::Now() + absl::Milliseconds(20))) << "another deadline";
  absl::Mutex mu;
  bool flag = false;
  const absl::Time t2 = clock.Now() + absl::Seconds(10);
  std::thread waiter([&] {
    absl::MutexLock l(&mu);
    clock.WaitUntil(&mu, absl::Condition(&flag), t2);
  });
  ASSERT_TRUE(clock.AwaitWaiter(t2, absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(clock.waiters(), 2);
  clock.Advance(absl::Seconds(3));
  sleeper.join();
  clock.Advance(absl::Seconds(7));
  waiter.join();
  EXPECT_EQ(clock.waiters(), 0);
  clock.Forget(&mu);
}

TEST(Clock, FakeSleepUntilWakesOnAdvance) {
  FakeClock clock;
  const absl::Time t = clock.Now() + absl::Seconds(3);
  std::thread sleeper([&] { clock.SleepUntil(t); });
  clock.Advance(absl::Seconds(3));
  sleeper.join();
  EXPECT_GE(clock.Now(), t);
}

TEST(Clock, RealWaitUntilHonoursTheDeadline) {
  absl::Mutex mu;
  bool flag = false;
  absl::MutexLock l(&mu);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(Clock::Real()->WaitUntil(&mu, absl::Condition(&flag), start + absl::Milliseconds(20)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(20));
}

}  // namespace
}  // namespace wb
