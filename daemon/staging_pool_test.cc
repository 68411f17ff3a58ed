#include "daemon/staging_pool.h"

#include <cstring>
#include <memory>
#include <thread>

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

StagingPool::Options Opts(FakeClock* clock, int64_t max_idle_bytes = int64_t{1} << 30) {
  StagingPool::Options o;
  o.max_idle_bytes = max_idle_bytes;
  o.max_idle_time = absl::Seconds(60);
  o.clock = clock;
  return o;
}

TEST(StagingPoolTest, GivenBackBufferIsTheOneTakenNextForTheSameSize) {
  FakeClock clock;
  StagingPool pool(Opts(&clock));
  std::vector<uint8_t> a = pool.Take(4096);
  ASSERT_EQ(a.size(), 4096u);
  EXPECT_EQ(a[0], 0);  // new buffers are zero-filled
  a[0] = 7;
  const uint8_t* where = a.data();
  pool.Give(std::move(a));
  EXPECT_EQ(pool.stats().idle_bytes, 4096);
  bool reused = false;
  std::vector<uint8_t> b = pool.Take(4096, &reused);
  EXPECT_TRUE(reused);
  EXPECT_EQ(b.data(), where);  // the same memory, not a new allocation
  EXPECT_EQ(b[0], 7);          // stale bytes are not cleared (callers overwrite what they read)
  EXPECT_EQ(pool.stats().reused, 1u);
  EXPECT_EQ(pool.stats().allocated, 1u);
  EXPECT_EQ(pool.stats().idle_bytes, 0);
}

// A tagged buffer goes back to whoever asks for its tag (a sync rollout's committed staging to
// that rollout's next version), even when others of its size are newer; untagged takers get
// untagged buffers first.
TEST(StagingPoolTest, ATaggedBufferGoesToItsTag) {
  FakeClock clock;
  StagingPool pool(Opts(&clock));
  std::vector<uint8_t> a = pool.Take(4096), b = pool.Take(4096), c = pool.Take(4096);
  a[0] = 1;
  b[0] = 2;
  c[0] = 3;
  const uint8_t* at_a = a.data();
  const uint8_t* at_b = b.data();
  pool.Give(std::move(a), "r0 v1");
  pool.Give(std::move(b), "r1 v1");
  pool.Give(std::move(c));
  bool reused = false, matched = false;
  std::vector<uint8_t> x = pool.Take(4096, &reused, "r0 v1", &matched);
  EXPECT_TRUE(reused);
  EXPECT_TRUE(matched);
  EXPECT_EQ(x.data(), at_a);
  EXPECT_EQ(x[0], 1) << "the bytes its last user left";
  std::vector<uint8_t> y = pool.Take(4096, &reused, "r0 v2", &matched);
  EXPECT_FALSE(matched) << "another tag: any buffer, untagged first";
  EXPECT_EQ(y[0], 3);
  std::vector<uint8_t> z = pool.Take(4096, &reused);
  EXPECT_TRUE(reused) << "a tagged buffer still serves when nothing else is idle";
  EXPECT_EQ(z.data(), at_b);
  matched = true;
  std::vector<uint8_t> w = pool.Take(4096, &reused, "r1 v1", &matched);
  EXPECT_FALSE(matched) << "taken by someone else: the tag went with it";
  EXPECT_FALSE(reused);
}

TEST(StagingPoolTest, OtherSizesAreNotHandedOut) {
  FakeClock clock;
  StagingPool pool(Opts(&clock));
  pool.Give(std::vector<uint8_t>(1000));
  bool reused = true;
  std::vector<uint8_t> b = pool.Take(999, &reused);
  EXPECT_FALSE(reused);
  EXPECT_EQ(b.size(), 999u);
  EXPECT_EQ(pool.stats().reused, 0u);
  EXPECT_EQ(pool.stats().idle_buffers, 1u);
  EXPECT_TRUE(pool.Take(0).empty());
  pool.Give({});  // ignored
  EXPECT_EQ(pool.stats().idle_buffers, 1u);
}

TEST(StagingPoolTest, IdleBytesStayUnderTheCapOldestFreedFirst) {
  FakeClock clock;
  StagingPool pool(Opts(&clock, 3000));
  pool.Give(std::vector<uint8_t>(1000, 1));
  clock.Advance(absl::Seconds(1));
  pool.Give(std::vector<uint8_t>(1500, 2));
  clock.Advance(absl::Seconds(1));
  pool.Give(std::vector<uint8_t>(1000, 3));  // 3500 > 3000: the oldest (1000 of 1s) goes
  EXPECT_EQ(pool.stats().idle_bytes, 2500);
  EXPECT_EQ(pool.stats().idle_buffers, 2u);
  EXPECT_EQ(pool.Take(1000)[0], 3);
  pool.Give(std::vector<uint8_t>(4000));  // larger than the cap on its own: freed at once
  EXPECT_EQ(pool.stats().idle_bytes, 1500);
}

TEST(StagingPoolTest, TrimFreesBuffersIdleTooLong) {
  FakeClock clock;
  StagingPool pool(Opts(&clock));
  pool.Give(std::vector<uint8_t>(100));
  clock.Advance(absl::Seconds(40));
  pool.Give(std::vector<uint8_t>(200));
  clock.Advance(absl::Seconds(30));  // the first idle 70 s, the second 30 s
  pool.Trim();
  EXPECT_EQ(pool.stats().idle_bytes, 200);
  clock.Advance(absl::Seconds(31));
  pool.Trim();
  EXPECT_EQ(pool.stats().idle_bytes, 0);
  pool.Give(std::vector<uint8_t>(300));
  pool.Clear();
  EXPECT_EQ(pool.stats().idle_buffers, 0u);
}

TEST(StagingPoolTest, TrimToKeepsAtMostThatManyIdleBytesOldestFirst) {
  StagingPool pool(StagingPool::Options{});
  pool.Give(std::vector<uint8_t>(100));
  pool.Give(std::vector<uint8_t>(200));
  pool.Give(std::vector<uint8_t>(300));
  pool.TrimTo(500);
  EXPECT_EQ(pool.stats().idle_bytes, 500);  // the 100-byte buffer (oldest) went
  pool.TrimTo(0);
  EXPECT_EQ(pool.stats().idle_bytes, 0);
}

}  // namespace
TEST(StagingPoolTest, PrewarmLeavesOneIdleBufferOfThatSizeWithinRoom) {
  StagingPool pool(StagingPool::Options{});
  EXPECT_TRUE(pool.Prewarm(1000, 10000));
  EXPECT_FALSE(pool.Prewarm(1000, 10000));  // one of that size is idle already
  EXPECT_FALSE(pool.Prewarm(9500, 10000));  // would exceed the room
  EXPECT_EQ(pool.stats().idle_bytes, 1000);
  bool reused = false;
  std::vector<uint8_t> b = pool.Take(1000, &reused);
  EXPECT_TRUE(reused);
  EXPECT_EQ(b.size(), 1000u);
  EXPECT_EQ(pool.stats().allocated, 0u);  // the version's Take allocated nothing
}

// A tagged idle buffer of that size (another rollout's committed staging, its next delta base)
// does not count: Prewarm adds an untagged one, which an untagged Take (a late rollout's catch-up)
// takes, and the tagged buffer stays for its tag. Before, the catch-up took the tagged buffer and
// that rollout's next deltas into its receiver-quantised shadows had no base.
TEST(StagingPoolTest, PrewarmDoesNotCountATaggedBufferAndTheUntaggedTakeLeavesIt) {
  StagingPool pool(StagingPool::Options{});
  std::vector<uint8_t> base(1000, 7);
  pool.Give(std::move(base), "m/r1/b0/v2");
  EXPECT_TRUE(pool.Prewarm(1000, 10000));
  EXPECT_FALSE(pool.Prewarm(1000, 10000));  // an untagged one is idle now
  bool reused = false;
  std::vector<uint8_t> late = pool.Take(1000, &reused);
  EXPECT_TRUE(reused);
  EXPECT_EQ(late[0], 0) << "the catch-up got the prewarmed buffer";
  bool matched = false;
  std::vector<uint8_t> kept = pool.Take(1000, &reused, "m/r1/b0/v2", &matched);
  EXPECT_TRUE(matched) << "the tagged base is still there for its rollout";
  EXPECT_EQ(kept[0], 7);
}

// A rollout's committed staging goes back to the pool, tagged, when its last reference drops -
// which may be after the next version chose its staging (an Apply that still holds it while it
// reports to the coordinator). TakeTagged then names the holder (the base, out of place) and never
// hands out a buffer of another tag; once the buffer is back, the buffer itself.
TEST(StagingPoolTest, TakeTaggedNamesTheHolderUntilTheBufferIsBack) {
  FakeClock clock;
  StagingPool pool(Opts(&clock));
  std::vector<uint8_t> base = pool.Take(4096);
  const uint8_t* at = base.data();
  auto holder = std::make_shared<int>(1);
  pool.Lend("r0 v1", holder);
  std::vector<uint8_t> untagged = pool.Take(4096), older = pool.Take(4096);
  pool.Give(std::move(untagged));        // an untagged buffer of the size: not it
  pool.Give(std::move(older), "r0 v0");  // another tag: not it either
  const absl::Time deadline = clock.Now() + absl::Seconds(1);
  StagingPool::Tagged t = pool.TakeTagged(4096, "r0 v1", deadline);
  EXPECT_TRUE(t.buffer.empty());
  EXPECT_EQ(t.holder, holder) << "alive: the base is where it is";
  // Its last reference goes, its buffer comes back (as NodeStaging::NewBytes' deleter does).
  t.holder.reset();
  holder.reset();
  pool.Give(std::move(base), "r0 v1");
  t = pool.TakeTagged(4096, "r0 v1", deadline);
  EXPECT_EQ(t.buffer.data(), at);
  EXPECT_EQ(t.holder, nullptr);
  // Neither idle nor lent: nothing, at once (a wait here would never end on the fake clock).
  t = pool.TakeTagged(4096, "r0 v1", deadline);
  EXPECT_TRUE(t.buffer.empty());
  EXPECT_EQ(t.holder, nullptr);
  EXPECT_EQ(pool.stats().idle_buffers, 2u);
}

// The holder's last reference has dropped but its deleter has not given the buffer back yet (the
// two are not one step): TakeTagged waits for it, on the pool's clock, instead of missing it.
TEST(StagingPoolTest, TakeTaggedWaitsForAHolderThatLetGoUntilTheBufferIsBack) {
  FakeClock clock;
  StagingPool pool(Opts(&clock));
  std::vector<uint8_t> base = pool.Take(4096);
  const uint8_t* at = base.data();
  auto holder = std::make_shared<int>(1);
  pool.Lend("r0 v1", holder);
  holder.reset();  // let go, not given back yet
  const absl::Time deadline = clock.Now() + absl::Seconds(1);
  StagingPool::Tagged t;
  std::thread taker([&] { t = pool.TakeTagged(4096, "r0 v1", deadline); });
  ASSERT_TRUE(clock.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30))) << "TakeTagged did not wait for the buffer";
  pool.Give(std::move(base), "r0 v1");
  taker.join();
  EXPECT_EQ(t.buffer.data(), at);

  // A buffer that never comes back: the wait ends after a second at most, with nothing.
  auto gone = std::make_shared<int>(2);
  pool.Lend("r0 v2", gone);
  gone.reset();
  std::thread late([&] { t = pool.TakeTagged(4096, "r0 v2", deadline + absl::Minutes(1)); });
  ASSERT_TRUE(clock.AwaitWaiter(deadline, absl::Now() + absl::Seconds(30)));
  clock.Advance(absl::Seconds(1));
  late.join();
  EXPECT_TRUE(t.buffer.empty());
  EXPECT_EQ(t.holder, nullptr);
}

// Diagnostics: a tagged buffer handed to a taker of another tag, or freed idle, is counted.
TEST(StagingPoolTest, TaggedBuffersGivenAwayOrFreedAreCounted) {
  FakeClock clock;
  StagingPool pool(Opts(&clock));
  pool.Give(pool.Take(4096), "r0 v1");
  pool.Give(pool.Take(8192), "r0 v1 b1");
  std::vector<uint8_t> other = pool.Take(4096, nullptr, "r1 v1");  // no untagged one: r0's
  EXPECT_EQ(other.size(), 4096u);
  EXPECT_EQ(pool.stats().tagged_given_away, 1u);
  pool.Clear();
  EXPECT_EQ(pool.stats().tagged_freed, 1u);
}

}  // namespace wb::daemon
