#include "transport/host_tcp/send_pacer.h"

#include <thread>

#include "base/clock.h"
#include "gtest/gtest.h"

namespace wb::transport {
namespace {

constexpr double kRate = 1e9;  // 1 GB/s: 1 MB takes 1 ms

TEST(SendPacerTest, BookingsFollowEachOtherAtTheLineRate) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  SendPacer p(kRate, &clock);
  EXPECT_EQ(p.Reserve(1'000'000), t0);  // idle link: at once
  EXPECT_EQ(p.Reserve(2'000'000), t0 + absl::Milliseconds(1));
  EXPECT_EQ(p.Reserve(0), t0 + absl::Milliseconds(3));
  EXPECT_EQ(p.Reserve(500'000), t0 + absl::Milliseconds(3));
  // Halfway through the bookings, the next one still queues behind them.
  clock.Advance(absl::Milliseconds(2));
  EXPECT_EQ(p.Reserve(1'000'000), t0 + absl::Microseconds(3500));
}

TEST(SendPacerTest, IdleTimeIsNotBanked) {
  FakeClock clock;
  SendPacer p(kRate, &clock);
  p.Reserve(1'000'000);
  clock.Advance(absl::Seconds(10));  // a long pause: no burst credit afterwards
  const absl::Time now = clock.Now();
  EXPECT_EQ(p.Reserve(4'000'000), now);
  EXPECT_EQ(p.Reserve(1'000'000), now + absl::Milliseconds(4));
}

TEST(SendPacerTest, AcquireWaitsOnTheInjectedClock) {
  FakeClock clock;
  SendPacer p(kRate, &clock);
  EXPECT_EQ(p.Acquire(5'000'000), absl::ZeroDuration());  // first booking starts now
  absl::Duration waited = absl::InfiniteDuration();
  std::thread writer([&] { waited = p.Acquire(1'000'000); });
  // The writer is asleep until the first 5 MB have had their 5 ms of link time.
  ASSERT_TRUE(clock.AwaitWaiter(clock.Now() + absl::Milliseconds(5), absl::Now() + absl::Seconds(30)));
  clock.Advance(absl::Milliseconds(5));
  writer.join();
  EXPECT_EQ(waited, absl::Milliseconds(5));
}

TEST(SendPacerTest, ManyWritersNeverExceedTheRate) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  SendPacer p(kRate, &clock);
  constexpr int kWriters = 4, kChunks = 250;
  std::vector<std::thread> ts;
  std::vector<absl::Time> last(kWriters);
  for (int w = 0; w < kWriters; ++w) {
    ts.emplace_back([&, w] {
      for (int i = 0; i < kChunks; ++i) last[w] = std::max(last[w], p.Reserve(1'000'000));
    });
  }
  for (auto& t : ts) t.join();
  // 1000 chunks of 1 MB at 1 GB/s: the last one starts at 999 ms, whatever the interleaving.
  EXPECT_EQ(*std::max_element(last.begin(), last.end()), t0 + absl::Milliseconds(999));
}

}  // namespace
}  // namespace wb::transport
