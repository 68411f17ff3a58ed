#include "daemon/coordinator/rpc_lanes.h"

#include <utility>

namespace wb::daemon {

RpcLanes::RpcLanes(Options options) : options_(std::move(options)) {
  const size_t n = options_.threads == 0 ? 1 : options_.threads;
  workers_.reserve(n);
  for (size_t i = 0; i < n; ++i) workers_.emplace_back([this] { Work(); });
}

RpcLanes::~RpcLanes() { Shutdown(); }

void RpcLanes::Post(const std::string& lane, std::function<void()> call) {
  absl::MutexLock l(&mu_);
  if (stopping_) return;
  Lane& ln = lanes_[lane];
  ln.calls.push_back(std::move(call));
  // A lane is in ready_ at most once: when it has calls and no worker (a running lane re-queues
  // itself after its call if more came meanwhile).
  if (!ln.running && ln.calls.size() == 1) ready_.push_back(lane);
}

bool RpcLanes::Busy(const std::string& lane) const {
  absl::MutexLock l(&mu_);
  return lanes_.count(lane) > 0;
}

bool RpcLanes::AwaitIdle(absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return lanes_.empty(); };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

void RpcLanes::Shutdown() {
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return;
    stopping_ = true;
    // Calls not started are dropped; a running one finishes (its worker then sees stopping_).
    for (auto it = lanes_.begin(); it != lanes_.end();) {
      if (it->second.running) {
        while (it->second.calls.size() > 1) it->second.calls.pop_back();
        ++it;
      } else {
        it = lanes_.erase(it);
      }
    }
    ready_.clear();
  }
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void RpcLanes::Work() {
  while (true) {
    std::string lane;
    std::function<void()> call;
    {
      absl::MutexLock l(&mu_);
      auto has_work = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !ready_.empty(); };
      // Idle until a Post or Shutdown (re-checked every second: no wait without a bound).
      while (!mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Seconds(1))) {
      }
      if (ready_.empty()) return;             // stopping_, nothing left to start
      lane = std::move(ready_.front());
      ready_.pop_front();
      Lane& ln = lanes_.at(lane);
      ln.running = true;
      call = std::move(ln.calls.front());  // stays in the deque (moved-from) until it returned
    }
    call();
    {
      absl::MutexLock l(&mu_);
      Lane& ln = lanes_.at(lane);
      ln.calls.pop_front();
      ln.running = false;
      if (ln.calls.empty()) {
        lanes_.erase(lane);
      } else if (!stopping_) {
        ready_.push_back(lane);
      } else {
        lanes_.erase(lane);
      }
    }
    if (options_.on_idle) options_.on_idle();
  }
}

}  // namespace wb::daemon
