// CudaVmmWorkerBuffer on transport::VmmAllocation (the runtime's driver entry points).
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "tests/e2e/cuda_vmm_worker_buffer.h"
#include "base/status_macros.h"
#include "transport/cuda_ipc/cuda_vmm.h"

namespace wb::e2e {
namespace {

absl::Status Check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " ", cudaGetErrorString(e)));
}

class Impl : public CudaVmmWorkerBuffer {
 public:
  Impl(std::unique_ptr<transport::VmmAllocation> a, std::string uuid) : a_(std::move(a)), uuid_(std::move(uuid)) {}
  std::string ipc_handle() const override { return ""; }  // legacy IPC cannot export VMM memory
  std::string gpu_uuid() const override { return uuid_; }
  int64_t size() const override { return a_->size(); }
  int allocations() const override { return a_->allocations(); }
  int64_t allocation_bytes() const override { return a_->allocation_bytes(); }
  absl::StatusOr<int> ExportFd(int i) const override { return a_->ExportFd(i); }
  absl::Status Upload(const void* host) override {
    RETURN_IF_ERROR(Check(cudaSetDevice(a_->device()), "cudaSetDevice"));
    RETURN_IF_ERROR(Check(cudaMemcpy(a_->data(), host, static_cast<size_t>(size()), cudaMemcpyHostToDevice), "upload (cudaMemcpy H2D)"));
    // As CudaWorkerBuffer: the daemon reads these bytes from another process right after Publish.
    return Check(cudaDeviceSynchronize(), "upload (cudaDeviceSynchronize)");
  }
  absl::Status Download(void* host) const override {
    RETURN_IF_ERROR(Check(cudaSetDevice(a_->device()), "cudaSetDevice"));
    return Check(cudaMemcpy(host, a_->data(), static_cast<size_t>(size()), cudaMemcpyDeviceToHost), "download (cudaMemcpy D2H)");
  }

 private:
  std::unique_ptr<transport::VmmAllocation> a_;
  std::string uuid_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaVmmWorkerBuffer>> CudaVmmWorkerBuffer::Create(int gpu, int64_t min_size, int allocations) {
  if (gpu < 0 || min_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--memory=cuda_vmm needs --gpu >= 0 and a size > 0 (", min_size, " bytes on GPU ", gpu, ")"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<transport::VmmAllocation> a, transport::VmmAllocation::Create(gpu, min_size, allocations));
  // cuMemCreate memory is not zeroed; the checks expect untouched bytes to be 0 (as cudaMemset does for --memory=cuda).
  RETURN_IF_ERROR(Check(cudaMemset(a->data(), 0, static_cast<size_t>(a->size())), "cudaMemset"));
  RETURN_IF_ERROR(Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  cudaDeviceProp prop;
  RETURN_IF_ERROR(Check(cudaGetDeviceProperties(&prop, gpu), "cudaGetDeviceProperties"));
  return std::unique_ptr<CudaVmmWorkerBuffer>(new Impl(std::move(a), std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes))));
}

}  // namespace wb::e2e
