#pragma once
// Device memory the daemon allocates for itself: GPU staging, so that a version moving between
// CUDA buffers on one node never leaves the GPU (docs/daemon.md, "GPU-direct staging").
//
// Contract:
//  - Allocate(device, size, label) returns `size` bytes of device memory on CUDA ordinal `device`
//    (contents unspecified), freed when the returned object is destroyed (from any thread).
//    size must be > 0. Errors: UNIMPLEMENTED when the binary has no CUDA, INVALID_ARGUMENT for a
//    bad device or size, RESOURCE_EXHAUSTED when the device is out of memory; messages name
//    `label`, the device and the size.
//  - The memory is not host-accessible: move bytes with a transport that reaches
//    MemoryKind::kCuda (cuda_ipc), registering {kind=kCuda, base=data(), device=device()}.
//  - Thread-safe.
// Implementations: device_allocator_cuda.cc (cudaMalloc/cudaFree) when built with CUDA, else
// device_allocator_none.cc. Tests without a GPU link the CUDA one against the emulated runtime
// (//tests/fake_cuda).

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wb::transport {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual void* data() const = 0;
  virtual int64_t size() const = 0;
  virtual int device() const = 0;
};

class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual absl::StatusOr<std::unique_ptr<DeviceMemory>> Allocate(int device, int64_t size_bytes, absl::string_view label) = 0;
};

// The allocator of this build: cudaMalloc with CUDA, else one whose Allocate is UNIMPLEMENTED.
std::unique_ptr<DeviceAllocator> NewDeviceAllocator();

}  // namespace wb::transport
