#include "daemon/coordinator/plan_queue.h"

#include <utility>

namespace wb::daemon {

thread_local const PlanQueue::RunState* PlanQueue::current_ = nullptr;

void PlanQueue::RunState::Cancel(const std::string& why) {
  std::lock_guard<std::mutex> l(mu);
  if (cancelled.load(std::memory_order_relaxed)) return;  // the first reason stays
  reason = why;
  cancelled.store(true, std::memory_order_release);
}

bool PlanQueue::Push(const std::string& model, const std::string& key, Job job) {
  // The running job of this model and key would be discarded: this one plans the newest state.
  if (running_ && !running_->done.load(std::memory_order_acquire) && running_->model == model && running_->key == key) {
    running_->Cancel("a newer " + key + " job of the model is queued");
  }
  std::deque<Entry>& jobs = waiting_[model];
  for (Entry& e : jobs) {
    if (e.key == key) {
      e.job = std::move(job);
      return true;
    }
  }
  jobs.push_back({key, std::move(job)});
  ++size_;
  return false;
}

std::optional<PlanQueue::Job> PlanQueue::Pop(std::string* model) {
  if (waiting_.empty()) return std::nullopt;
  // The first model after the one served last, wrapping around: every model with work gets one
  // job per round.
  auto it = last_served_.has_value() ? waiting_.upper_bound(*last_served_) : waiting_.begin();
  if (it == waiting_.end()) it = waiting_.begin();
  Job job = std::move(it->second.front().job);
  std::string key = std::move(it->second.front().key);
  it->second.pop_front();
  --size_;
  last_served_ = it->first;
  if (model != nullptr) *model = it->first;
  auto state = std::make_shared<RunState>();
  state->model = it->first;
  state->key = std::move(key);
  running_ = state;
  if (it->second.empty()) waiting_.erase(it);
  // While the job runs, CurrentJobCancelled() on its thread reads `state` (the previous value is
  // put back after: a job run inside another job's run keeps each its own).
  return Job([state, job = std::move(job)] {
    const RunState* outer = current_;
    current_ = state.get();
    struct Restore {
      const RunState* outer;
      RunState* state;
      ~Restore() {
        current_ = outer;
        state->done.store(true, std::memory_order_release);
      }
    } restore{outer, state.get()};
    job();
  });
}

bool PlanQueue::CancelRunning(const std::string& reason, const std::string& model, const std::string& key) {
  if (!running_ || running_->done.load(std::memory_order_acquire)) return false;
  if (!model.empty() && running_->model != model) return false;
  if (!key.empty() && running_->key != key) return false;
  running_->Cancel(reason);
  return true;
}

bool PlanQueue::Running(std::string* model, std::string* key) const {
  if (!running_ || running_->done.load(std::memory_order_acquire)) return false;
  if (model != nullptr) *model = running_->model;
  if (key != nullptr) *key = running_->key;
  return true;
}

std::optional<std::string> PlanQueue::CurrentJobCancelled() {
  const RunState* s = current_;
  if (s == nullptr || !s->cancelled.load(std::memory_order_acquire)) return std::nullopt;
  std::lock_guard<std::mutex> l(s->mu);
  return s->reason;
}

bool PlanQueue::Waiting(const std::string& model, const std::string& key) const {
  auto it = waiting_.find(model);
  if (it == waiting_.end()) return false;
  for (const Entry& e : it->second) {
    if (e.key == key) return true;
  }
  return false;
}

}  // namespace wb::daemon
