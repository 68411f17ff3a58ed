#include "tools/cc/clock.h"

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

}  // namespace
}  // namespace wb
