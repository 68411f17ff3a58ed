#pragma once
// CUDA virtual memory management (cuMem*: cuMemCreate memory, e.g. PyTorch's
// expandable_segments:True) reached through the runtime's driver entry points
// (cudaGetDriverEntryPointByVersion), so nothing links -lcuda. Built only with CUDA.
//
// Two users:
//  - the cuda_ipc transport imports a worker's exported allocation (an fd from
//    cuMemExportToShareableHandle(..., CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)): CudaVmmApi;
//  - a C++ worker (and the tests) that allocates such memory itself: VmmAllocation.
// Real CUDA needs the target device's primary context current on the calling thread for the
// driver calls; the functions below cudaSetDevice() first, which makes it current.

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wb::transport {

// The driver calls, all found (version 12.0 ABI) or LoadCudaVmmApi fails.
struct CudaVmmApi {
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&::cuMemGetAllocationPropertiesFromHandle) properties = nullptr;
};

// Loaded once per process; FAILED_PRECONDITION naming the missing symbol (old driver, or a
// runtime without driver entry points).
absl::StatusOr<const CudaVmmApi*> LoadCudaVmmApi();

// A CUresult as a status: CUDA_ERROR_INVALID_VALUE / INVALID_HANDLE / INVALID_DEVICE ->
// INVALID_ARGUMENT, OUT_OF_MEMORY -> RESOURCE_EXHAUSTED, NOT_SUPPORTED / NOT_PERMITTED ->
// FAILED_PRECONDITION, anything else INTERNAL. `what` names the call and the object.
absl::Status CuStatus(CUresult r, absl::string_view what);

// An exportable cuMemCreate allocation of `size()` bytes (the request rounded up to the
// granularity) on one device, mapped read-write for that device at data(). Destruction unmaps and
// releases it (an importer that mapped it keeps the memory alive, as CUDA does).
//
// With `allocations` > 1: that many allocations of equal size (min_bytes / allocations rounded up
// to the granularity) mapped back to back in ONE reserved range, as PyTorch's expandable segments
// map one allocation per page: data() is the start of the range, size() the sum, and each
// allocation exports on its own (ExportFd(i)).
class VmmAllocation {
 public:
  static absl::StatusOr<std::unique_ptr<VmmAllocation>> Create(int device, int64_t min_bytes, int allocations = 1);
  ~VmmAllocation();
  VmmAllocation(const VmmAllocation&) = delete;
  VmmAllocation& operator=(const VmmAllocation&) = delete;

  void* data() const { return reinterpret_cast<void*>(va_); }
  int64_t size() const { return size_; }
  int device() const { return device_; }
  int allocations() const { return static_cast<int>(handles_.size()); }
  // Allocation i lies at [i * allocation_bytes(), (i + 1) * allocation_bytes()) of the range.
  int64_t allocation_bytes() const { return handles_.empty() ? 0 : size_ / static_cast<int64_t>(handles_.size()); }
  // A new POSIX fd for allocation i (the caller owns and closes it); send it with SCM_RIGHTS.
  absl::StatusOr<int> ExportFd(int i = 0) const;

 private:
  VmmAllocation() = default;
  const CudaVmmApi* api_ = nullptr;
  std::vector<CUmemGenericAllocationHandle> handles_;
  CUdeviceptr va_ = 0;
  int64_t size_ = 0;
  int device_ = 0;
  int mapped_ = 0;  // allocations mapped so far (in order)
};

}  // namespace wb::transport
