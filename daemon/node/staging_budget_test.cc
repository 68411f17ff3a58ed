#include "daemon/node/staging_budget.h"

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

TEST(StagingBudgetTest, OneTotalForEveryUserReleasedWithTheLastCharge) {
  auto b = StagingBudget::Create("n0", 100);
  auto snapshot = b->Reserve(40, "snapshot of t0 v1");
  ASSERT_TRUE(snapshot.ok());
  auto incoming = b->Reserve(50, "staging of m v1");
  ASSERT_TRUE(incoming.ok());
  EXPECT_EQ(b->in_use(), 90);
  // A second version's staging does not fit next to the first's: the budget is the node's total.
  auto second = b->Reserve(50, "staging of m v2");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  for (const char* want : {"node n0", "staging of m v2", "needs 50 bytes", "90 of the node's --staging_budget_bytes=100"}) {
    EXPECT_NE(second.status().message().find(want), std::string::npos) << want << " missing in: " << second.status().message();
  }
  // The memory outlives its first holder (committed staging held by a rollout): released with the last.
  std::shared_ptr<StagingBudget::Charge> held = *incoming;
  incoming->reset();
  EXPECT_EQ(b->in_use(), 90);
  held.reset();
  EXPECT_EQ(b->in_use(), 40);
  EXPECT_TRUE(b->Reserve(60, "staging of m v2").ok());
  EXPECT_EQ(b->in_use(), 40) << "the unkept charge was released at once";
  EXPECT_EQ(b->peak(), 100);
  EXPECT_EQ(b->Reserve(-1, "x").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StagingBudgetTest, ChargesOutliveTheBudgetObjectSafely) {
  std::shared_ptr<StagingBudget::Charge> c;
  {
    auto b = StagingBudget::Create("n0", 10);
    c = *b->Reserve(5, "x");
  }
  c.reset();  // the charge kept the budget alive
}

}  // namespace
}  // namespace wb::daemon
