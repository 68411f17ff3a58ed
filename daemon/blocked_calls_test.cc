// BlockedCalls (daemon/auth.h): the slots of calls that block, bounded in all and per caller, so
// that one caller (a worker, a node) cannot take every slot (hostile review H1 / H2).
#include <optional>
#include <deque>

#include "daemon/auth.h"
#include "daemon/limits.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

TEST(BlockedCallsTest, OneCallerHoldsAtMostItsShareAndOthersStillGetSlots) {
  BlockedCalls calls("node n0: waiting calls", 6, 4, "per worker, --max_blocked_calls_per_worker");
  std::deque<BlockedCalls::Slot> held;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<BlockedCalls::Slot> s = calls.Acquire("r0", "worker r0");
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(std::move(*s));
  }
  absl::StatusOr<BlockedCalls::Slot> fifth = calls.Acquire("r0", "worker r0");
  ASSERT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(fifth.status().message(),
            "node n0: waiting calls: worker r0 already holds 4 waiting calls (limit 4 per worker, --max_blocked_calls_per_worker); "
            "retry later");
  // Another caller still gets the slots left, up to the total.
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<BlockedCalls::Slot> s = calls.Acquire("r1");
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(std::move(*s));
  }
  absl::StatusOr<BlockedCalls::Slot> over = calls.Acquire("r2");
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.status().message(), "node n0: waiting calls: 6 calls are already waiting (limit 6, --max_blocked_calls); retry later");
  EXPECT_EQ(calls.in_use(), 6);
  EXPECT_EQ(calls.in_use("r0"), 4);
  // A finished call gives its slot back to its caller's share and to the total; refusals took none.
  held.pop_front();
  EXPECT_EQ(calls.in_use(), 5);
  EXPECT_EQ(calls.in_use("r0"), 3);
  EXPECT_TRUE(calls.Acquire("r0").ok());
  held.clear();
  EXPECT_EQ(calls.in_use(), 0);
  EXPECT_EQ(calls.in_use("r0"), 0);
}

TEST(BlockedCallsTest, WithoutAShareOnlyTheTotalCounts) {
  BlockedCalls calls("coordinator", 2);
  std::optional<BlockedCalls::Slot> a(*calls.Acquire()), b(*calls.Acquire());
  EXPECT_EQ(calls.Acquire().status().code(), absl::StatusCode::kResourceExhausted);
  b.reset();
  EXPECT_TRUE(calls.Acquire().ok());
}

TEST(BlockedCallsTest, ANodesShareOfTheCoordinatorsSlots) {
  Limits l;
  EXPECT_EQ(BlockedCallsPerNode(l, 512), 128);  // a quarter
  EXPECT_EQ(BlockedCallsPerNode(l, 40), 16);    // at least 16
  EXPECT_EQ(BlockedCallsPerNode(l, 4), 4);      // never more than all
  l.max_blocked_calls_per_node = 300;
  EXPECT_EQ(BlockedCallsPerNode(l, 512), 300);
  EXPECT_EQ(BlockedCallsPerNode(l, 128), 128);
}

}  // namespace
}  // namespace wb::daemon
