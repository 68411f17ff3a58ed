#pragma once
// GPU staging with a per-GPU byte budget (docs/daemon.md, "GPU-direct staging").
//
// The node daemon stages a version between a trainer and a rollout whose weights live in CUDA
// memory on the GPU itself when it may: the snapshot of a trainer's CUDA buffers at Publish
// (one-step-off / async) and the incoming copy of a rollout's CUDA buffers. A version then moves
// device to device (cuda_ipc) and never crosses PCIe twice. GPU memory is what RL users run out
// of, so it is opt-in and bounded: `budget_per_gpu` bytes per device (0 = never), counted over
// every live allocation of this pool; an allocation past the budget, or one the device refuses
// (out of memory), is not an error: TryAllocate returns nullptr and the caller stages in host
// memory, as it would without a GPU.
//
// Thread-safe. Allocations may outlive the pool's users but not the pool's allocator (the pool
// keeps a shared reference to it).

#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "transport/device_allocator.h"

namespace wb::daemon {

class DeviceStaging {
 public:
  // `allocator` may be null (no GPU staging: every TryAllocate returns nullptr).
  DeviceStaging(std::shared_ptr<transport::DeviceAllocator> allocator, int64_t budget_per_gpu);

  bool enabled() const { return allocator_ != nullptr && budget_per_gpu_ > 0; }

  // `size_bytes` (> 0) on GPU `device`, or nullptr when GPU staging is off, the budget of that GPU
  // would be exceeded, or the device is out of memory (callers fall back to host staging). Other
  // allocation failures (a bad device ordinal, a broken CUDA context) are returned as errors.
  absl::StatusOr<std::shared_ptr<transport::DeviceMemory>> TryAllocate(int device, int64_t size_bytes, absl::string_view label);

  // Bytes currently allocated by this pool on `device`.
  int64_t used(int device) const;
  int64_t budget_per_gpu() const { return budget_per_gpu_; }

 private:
  struct State {
    absl::Mutex mu;
    std::map<int, int64_t> used ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<transport::DeviceAllocator> allocator_;
  const int64_t budget_per_gpu_;
  // Shared with every allocation's deleter, which gives its bytes back (possibly after the pool is gone).
  std::shared_ptr<State> state_;
};

}  // namespace wb::daemon
