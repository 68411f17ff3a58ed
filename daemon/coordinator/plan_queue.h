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
// Cancellation (docs/planner.md "Cancelling a plan"): Pop hands out each job wrapped so
// that, while it runs, CurrentJobCancelled() on the thread running it says whether the job was
// cancelled and why. A job is cancelled when a job of the same model and key is pushed while it
// runs (its plan would be discarded: the model's membership changed since its snapshot, and the
// newer job plans the newest one), or by CancelRunning (coordinator shutdown; a membership change
// of the model whose plan runs, also when no newer job can be queued: CoordinatorCore's
// MarkPlanDirtyLocked).
// The coordinator's PlanCache polls it (PlanCache::Options::cancelled) while the planner works, so
// a superseded plan stops within a few ms instead of holding the planner thread to its end.

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace wb::daemon {

class PlanQueue {
 public:
  using Job = std::function<void()>;

  // Queues `job` for `model` behind the model's earlier jobs; true when it replaced a waiting job
  // of the model with the same `key` instead (that job is dropped, this one keeps its place).
  // A job of the model with the same key that is running (popped, not returned yet) is cancelled:
  // "a newer KEY job of the model is queued".
  bool Push(const std::string& model, const std::string& key, Job job);
  // The next job, round-robin over models (see above); nullopt when nothing waits. `model` (may be
  // null) gets the model it is for. The job returned is wrapped: while it runs, on its thread,
  // CurrentJobCancelled() reads its cancellation. It is the running job until it returns or
  // the next Pop.
  std::optional<Job> Pop(std::string* model = nullptr);
  // Whether a job of `model` with `key` waits (not started).
  bool Waiting(const std::string& model, const std::string& key) const;
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  // Cancels the running job (if one runs and, with a non-empty `model` / `key`, it is that model's
  // / of that key) with `reason`; true when it did. The first reason given to a job is the one it
  // reports.
  bool CancelRunning(const std::string& reason, const std::string& model = "", const std::string& key = "");
  // Whether a popped job still runs; `model` and `key` (may be null) get its model and key.
  bool Running(std::string* model = nullptr, std::string* key = nullptr) const;

  // On the thread running a popped job: nullopt while the job may go on, its cancel reason once
  // it was cancelled. Elsewhere (no job of a PlanQueue running on this thread): nullopt. Cheap
  // (one atomic load) until cancelled; lock-free for the caller's locks (it takes none of them),
  // so the planner polls it without the coordinator's mu_.
  static std::optional<std::string> CurrentJobCancelled();

 private:
  // A popped job's state, shared by the queue and the job's wrapper (thread-safe).
  struct RunState {
    std::string model, key;
    std::atomic<bool> cancelled{false};
    std::atomic<bool> done{false};
    mutable std::mutex mu;  // guards reason
    std::string reason;  // the first cancel reason
    void Cancel(const std::string& why);
  };
  static thread_local const RunState* current_;  // the job running on this thread (its wrapper)

  struct Entry {
    std::string key;
    Job job;
  };
  std::map<std::string, std::deque<Entry>> waiting_;  // model -> its jobs; only models with jobs
  std::optional<std::string> last_served_;             // the model served last (round-robin cursor)
  size_t size_ = 0;
  std::shared_ptr<RunState> running_;  // the job popped last (done once its wrapper returned)
};

}  // namespace wb::daemon
