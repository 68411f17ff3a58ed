#include "daemon/device_staging.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace wb::daemon {

DeviceStaging::DeviceStaging(std::shared_ptr<transport::DeviceAllocator> allocator, int64_t budget_per_gpu)
    : allocator_(std::move(allocator)), budget_per_gpu_(budget_per_gpu), state_(std::make_shared<State>()) {}

absl::StatusOr<std::shared_ptr<transport::DeviceMemory>> DeviceStaging::TryAllocate(int device, int64_t size_bytes,
                                                                                    absl::string_view label) {
  if (!enabled() || size_bytes <= 0) return std::shared_ptr<transport::DeviceMemory>();
  {
    // Reserve first, so two concurrent allocations cannot both pass the check.
    absl::MutexLock l(&state_->mu);
    int64_t& used = state_->used[device];
    if (used + size_bytes > budget_per_gpu_) return std::shared_ptr<transport::DeviceMemory>();
    used += size_bytes;
  }
  auto unreserve = [state = state_, device, size_bytes] {
    absl::MutexLock l(&state->mu);
    state->used[device] -= size_bytes;
  };
  auto mem = allocator_->Allocate(device, size_bytes, label);
  if (!mem.ok()) {
    unreserve();
    if (absl::IsResourceExhausted(mem.status())) return std::shared_ptr<transport::DeviceMemory>();
    return mem.status();
  }
  // The deleter frees the device memory, then returns its bytes to the budget.
  return std::shared_ptr<transport::DeviceMemory>(mem->release(), [unreserve](transport::DeviceMemory* m) {
    delete m;
    unreserve();
  });
}

int64_t DeviceStaging::used(int device) const {
  absl::MutexLock l(&state_->mu);
  auto it = state_->used.find(device);
  return it == state_->used.end() ? 0 : it->second;
}

}  // namespace wb::daemon
