#include "transport/host_tcp/send_pacer.h"

#include <algorithm>

namespace wb::transport {

SendPacer::SendPacer(double bytes_per_second, Clock* clock) : bytes_per_second_(bytes_per_second), clock_(clock) {}

absl::Time SendPacer::Reserve(int64_t bytes) {
  const absl::Time now = clock_->Now();
  const absl::Duration length = absl::Seconds(static_cast<double>(std::max<int64_t>(bytes, 0)) / bytes_per_second_);
  absl::MutexLock l(&mu_);
  const absl::Time start = std::max(now, next_free_);
  next_free_ = start + length;
  return start;
}

absl::Duration SendPacer::Acquire(int64_t bytes) {
  const absl::Time start = Reserve(bytes);
  const absl::Time now = clock_->Now();
  if (start <= now) return absl::ZeroDuration();
  clock_->SleepUntil(start);
  return start - now;
}

}  // namespace wb::transport
