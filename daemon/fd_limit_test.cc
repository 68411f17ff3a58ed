#include "daemon/fd_limit.h"

#include <sys/resource.h>

#include <algorithm>

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// Lowers this test process's soft limit first, so that the raise has something to do whatever
// limit the test runner started with.
TEST(FdLimitTest, RaisesTheSoftLimitToTheHardOne) {
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max <= 256) GTEST_SKIP() << "hard limit " << rl.rlim_max << " leaves nothing to raise";
  rlimit low = rl;
  low.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  auto r = RaiseFdLimit(/*cap=*/1 << 16);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->before, 256u);
  const rlim_t want = rl.rlim_max == RLIM_INFINITY ? rlim_t{1} << 16 : std::min<rlim_t>(rl.rlim_max, 1 << 16);
  EXPECT_EQ(r->now, want);
  rlimit after{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &after), 0);
  EXPECT_EQ(after.rlim_cur, want);
  // Already there: nothing changes.
  auto again = RaiseFdLimit(1 << 16);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->before, want);
  EXPECT_EQ(again->now, want);
}

}  // namespace
}  // namespace wb::daemon
