#pragma once
// The coordinator's planning work, waiting for its one planner thread (docs/daemon.md "Planning
// one model at a time, fairly"). Plain data (not thread-safe): CoordinatorCore keeps it under its
// mu_, the driver and catch-up push, the planner thread pops.
//
// Fairness: each model has its own queue, and models are served round-robin - the next job is the
// first waiting job of the first model after the one served last (in model id order, wrapping
// around). A model that keeps asking for plans (layouts re-submitted, workers joining and leaving)
// gets one job per round, like every other model with work, so another model's plan waits for at
// most one job of each other model, not for everything one model asked for.
// Coalescing: a job pushed with the key of a job of the same model that has not started yet
// replaces that job's work in its place; only the newest request is done. (The coordinator's plan
// jobs take their snapshot of the model when they start, so one queued job always plans the
// newest membership; driver.cc.)

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>

namespace wb::daemon {

class PlanQueue {
 public:
  using Job = std::function<void()>;

  // Queues `job` for `model` behind the model's earlier jobs; true when it replaced a waiting job
  // of the model with the same `key` instead (that job is dropped, this one keeps its place).
  bool Push(const std::string& model, const std::string& key, Job job);
  // The next job, round-robin over models (see above); nullopt when nothing waits. `model` (may be
  // null) gets the model it is for.
  std::optional<Job> Pop(std::string* model = nullptr);
  // Whether a job of `model` with `key` waits (not started).
  bool Waiting(const std::string& model, const std::string& key) const;
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  struct Entry {
    std::string key;
    Job job;
  };
  std::map<std::string, std::deque<Entry>> waiting_;  // model -> its jobs; only models with jobs
  std::optional<std::string> last_served_;             // the model served last (round-robin cursor)
  size_t size_ = 0;
};

}  // namespace wb::daemon
