#include "daemon/coordinator/plan_queue.h"

#include <utility>

namespace wb::daemon {

bool PlanQueue::Push(const std::string& model, const std::string& key, Job job) {
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
  it->second.pop_front();
  --size_;
  last_served_ = it->first;
  if (model != nullptr) *model = it->first;
  if (it->second.empty()) waiting_.erase(it);
  return job;
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
