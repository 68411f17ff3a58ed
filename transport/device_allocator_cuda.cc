// DeviceAllocator on the CUDA runtime: cudaMalloc / cudaFree on the requested device.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "transport/cuda_ipc/cuda_status.h"
#include "transport/device_allocator.h"

namespace wb::transport {
namespace {

// Makes `device` current on this thread for the scope and restores the previous one: the daemon's
// threads serve several GPUs, and a stray current device would put later allocations elsewhere.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      (void)cudaGetLastError();
      prev_ = -1;
    }
    status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
  ~DeviceScope() {
    if (prev_ >= 0 && cudaSetDevice(prev_) != cudaSuccess) (void)cudaGetLastError();
  }
  const absl::Status& status() const { return status_; }

 private:
  int prev_ = -1;
  absl::Status status_;
};

class CudaDeviceMemory : public DeviceMemory {
 public:
  CudaDeviceMemory(void* p, int64_t size, int device) : p_(p), size_(size), device_(device) {}
  ~CudaDeviceMemory() override {
    DeviceScope scope(device_);
    if (cudaFree(p_) != cudaSuccess) (void)cudaGetLastError();  // a sticky context error: nothing to recover
  }
  void* data() const override { return p_; }
  int64_t size() const override { return size_; }
  int device() const override { return device_; }

 private:
  void* p_;
  int64_t size_;
  int device_;
};

class CudaDeviceAllocator : public DeviceAllocator {
 public:
  absl::StatusOr<std::unique_ptr<DeviceMemory>> Allocate(int device, int64_t size_bytes, absl::string_view label) override {
    const std::string what = absl::StrCat(label, ": ", size_bytes, " bytes on GPU ", device);
    if (size_bytes <= 0) return absl::InvalidArgumentError(absl::StrCat(what, ": size must be > 0"));
    int n = 0;
    if (absl::Status s = CudaStatus(cudaGetDeviceCount(&n), "cudaGetDeviceCount"); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": ", s.message()));
    }
    if (device < 0 || device >= n) return absl::InvalidArgumentError(absl::StrCat(what, ": only ", n, " GPUs visible"));
    DeviceScope scope(device);
    if (!scope.status().ok()) return absl::Status(scope.status().code(), absl::StrCat(what, ": ", scope.status().message()));
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, static_cast<size_t>(size_bytes));
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(what, ": out of device memory"));
    }
    if (absl::Status s = CudaStatus(e, absl::StrCat("cudaMalloc (", what, ")")); !s.ok()) return s;
    return std::unique_ptr<DeviceMemory>(new CudaDeviceMemory(p, size_bytes, device));
  }
};

}  // namespace

std::unique_ptr<DeviceAllocator> NewDeviceAllocator() { return std::make_unique<CudaDeviceAllocator>(); }

}  // namespace wb::transport
