// PlanQueue: per-model queues served round-robin, and a model's waiting job of a key replaced by
// a newer one (docs/daemon.md "Planning one model at a time, fairly"); the running job cancelled by
// a newer one of its key or by CancelRunning.
#include "daemon/coordinator/plan_queue.h"

#include <optional>
#include <string>
#include <thread>
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

// Cancellation: a job of a model and key pushed while the model's job of that key runs cancels the
// running one (its plan would be discarded); other keys and models do not; the job reads it on its
// own thread through CurrentJobCancelled, and the next job starts uncancelled.
TEST(PlanQueueTest, ARunningJobIsCancelledByANewerJobOfItsKey) {
  PlanQueue q;
  std::vector<std::string> log;
  auto note = [&](const std::string& who) {
    std::optional<std::string> why = PlanQueue::CurrentJobCancelled();
    log.push_back(who + ": " + (why ? *why : "go on"));
  };
  q.Push("a", "plan", [&] {
    note("a1");
    q.Push("a", "catch-up", [&] { note("a-catch-up"); });  // another key: not this job's successor
    q.Push("b", "plan", [&] { note("b1"); });              // another model
    note("a1");
    q.Push("a", "plan", [&] { note("a2"); });  // the model changed: a newer plan is queued
    note("a1");
    EXPECT_TRUE(q.Running());
  });
  EXPECT_FALSE(PlanQueue::CurrentJobCancelled().has_value()) << "no job runs on this thread";
  while (auto job = q.Pop()) (*job)();
  EXPECT_EQ(log, (std::vector<std::string>{"a1: go on", "a1: go on", "a1: a newer plan job of the model is queued",
                                           "b1: go on", "a-catch-up: go on", "a2: go on"}));
  EXPECT_FALSE(q.Running()) << "the last job returned";
  EXPECT_FALSE(PlanQueue::CurrentJobCancelled().has_value());
}

// CancelRunning (coordinator shutdown, a removed model): the running job, optionally only the given
// model's; the first reason stays; nothing when no job runs.
TEST(PlanQueueTest, CancelRunningCancelsTheJobThatRuns) {
  PlanQueue q;
  EXPECT_FALSE(q.CancelRunning("coordinator shutting down"));
  std::vector<std::string> log;
  q.Push("a", "plan", [&] {
    std::string model, key;
    ASSERT_TRUE(q.Running(&model, &key));
    EXPECT_EQ(model + "/" + key, "a/plan");
    EXPECT_FALSE(q.CancelRunning("model b removed", "b")) << "not b's job";
    EXPECT_FALSE(PlanQueue::CurrentJobCancelled().has_value());
    EXPECT_TRUE(q.CancelRunning("coordinator shutting down"));
    EXPECT_TRUE(q.CancelRunning("model a removed", "a"));
    log.push_back(PlanQueue::CurrentJobCancelled().value_or("go on"));
  });
  while (auto job = q.Pop()) (*job)();
  EXPECT_EQ(log, (std::vector<std::string>{"coordinator shutting down"}));
  EXPECT_FALSE(q.CancelRunning("late")) << "nothing runs";
}

// A job popped but run on another thread reads its own state there (the planner thread), not the
// popping thread's.
TEST(PlanQueueTest, TheCancellationIsReadOnTheThreadRunningTheJob) {
  PlanQueue q;
  std::optional<std::string> seen;
  q.Push("a", "plan", [&] { seen = PlanQueue::CurrentJobCancelled(); });
  std::optional<PlanQueue::Job> job = q.Pop();
  ASSERT_TRUE(job.has_value());
  EXPECT_TRUE(q.CancelRunning("stop"));
  EXPECT_FALSE(PlanQueue::CurrentJobCancelled().has_value()) << "the popping thread runs no job";
  std::thread t([&] { (*job)(); });
  t.join();
  EXPECT_EQ(seen, "stop");
  EXPECT_FALSE(q.Running());
}

}  // namespace
}  // namespace wb::daemon
