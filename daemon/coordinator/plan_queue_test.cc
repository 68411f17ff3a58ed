// PlanQueue: per-model queues served round-robin, and a model's waiting job of a key replaced by
// a newer one (docs/daemon.md "Planning one model at a time, fairly").
#include "daemon/coordinator/plan_queue.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// Pops everything, running each job; returns what the jobs appended.
std::vector<std::string> RunAll(PlanQueue& q, std::vector<std::string>& log) {
  while (auto job = q.Pop()) (*job)();
  return log;
}

TEST(PlanQueueTest, ModelsAreServedRoundRobinNotFirstComeFirstServed) {
  PlanQueue q;
  std::vector<std::string> log;
  auto job = [&](const std::string& what) { return [&log, what] { log.push_back(what); }; };
  // "a" queued three jobs before "b" and "c" queued one each.
  q.Push("a", "1", job("a1"));
  q.Push("a", "2", job("a2"));
  q.Push("a", "3", job("a3"));
  q.Push("c", "1", job("c1"));
  q.Push("b", "1", job("b1"));
  EXPECT_EQ(q.size(), 5u);
  EXPECT_EQ(RunAll(q, log), (std::vector<std::string>{"a1", "b1", "c1", "a2", "a3"}));
  EXPECT_TRUE(q.empty());
}

// The model served last waits behind every other model with work, even when it queued its next
// job first (the planner thread was busy with its previous one).
TEST(PlanQueueTest, TheModelServedLastGoesBehindTheOthers) {
  PlanQueue q;
  std::vector<std::string> log;
  std::string model;
  q.Push("b", "plan", [&] { log.push_back("b1"); });
  ASSERT_TRUE(q.Pop(&model).has_value());
  EXPECT_EQ(model, "b");
  q.Push("b", "plan", [&] { log.push_back("b2"); });  // while b1 runs
  q.Push("a", "plan", [&] { log.push_back("a1"); });
  q.Push("c", "plan", [&] { log.push_back("c1"); });
  EXPECT_EQ(RunAll(q, log), (std::vector<std::string>{"c1", "a1", "b2"}));
}

TEST(PlanQueueTest, AWaitingJobOfTheSameKeyIsReplacedInItsPlace) {
  PlanQueue q;
  std::vector<std::string> log;
  EXPECT_FALSE(q.Push("a", "plan", [&] { log.push_back("a-old"); }));
  EXPECT_FALSE(q.Push("a", "catch-up", [&] { log.push_back("a-catch-up"); }));
  EXPECT_TRUE(q.Push("a", "plan", [&] { log.push_back("a-new"); }));
  EXPECT_TRUE(q.Waiting("a", "plan"));
  EXPECT_FALSE(q.Waiting("b", "plan"));
  EXPECT_EQ(q.size(), 2u);
  EXPECT_EQ(RunAll(q, log), (std::vector<std::string>{"a-new", "a-catch-up"}));
  EXPECT_FALSE(q.Waiting("a", "plan"));
  // Once started (popped), a job is not replaced: the same key queues anew.
  EXPECT_FALSE(q.Push("a", "plan", [] {}));
  EXPECT_EQ(q.size(), 1u);
}

}  // namespace
}  // namespace wb::daemon
