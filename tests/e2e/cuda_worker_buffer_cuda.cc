// CudaWorkerBuffer on the CUDA runtime.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "tests/e2e/cuda_worker_buffer.h"

namespace wb::e2e {
namespace {

absl::Status Check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " ", cudaGetErrorString(e)));
}

class Impl : public CudaWorkerBuffer {
 public:
  Impl(int gpu, void* p, int64_t size, std::string handle, std::string uuid)
      : gpu_(gpu), p_(p), size_(size), handle_(std::move(handle)), uuid_(std::move(uuid)) {}
  ~Impl() override {
    (void)cudaSetDevice(gpu_);
    if (cudaFree(p_) != cudaSuccess) (void)cudaGetLastError();
  }
  std::string ipc_handle() const override { return handle_; }
  std::string gpu_uuid() const override { return uuid_; }
  int64_t size() const override { return size_; }
  absl::Status Upload(const void* host) override {
    if (absl::Status s = Check(cudaSetDevice(gpu_), "cudaSetDevice"); !s.ok()) return s;
    if (absl::Status s = Check(cudaMemcpy(p_, host, static_cast<size_t>(size_), cudaMemcpyHostToDevice), "upload (cudaMemcpy H2D)");
        !s.ok()) {
      return s;
    }
    // cudaMemcpy from pageable memory may return before the DMA has landed; the daemon reads these
    // bytes from another process right after Publish, so the upload must be complete first (the
    // contract of Publish for CUDA buffers; found by the emulated runtime, which enforces it).
    return Check(cudaDeviceSynchronize(), "upload (cudaDeviceSynchronize)");
  }
  absl::Status Download(void* host) const override {
    if (absl::Status s = Check(cudaSetDevice(gpu_), "cudaSetDevice"); !s.ok()) return s;
    return Check(cudaMemcpy(host, p_, static_cast<size_t>(size_), cudaMemcpyDeviceToHost), "download (cudaMemcpy D2H)");
  }

 private:
  int gpu_;
  void* p_;
  int64_t size_;
  std::string handle_;
  std::string uuid_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaWorkerBuffer>> CudaWorkerBuffer::Create(int gpu, int64_t size) {
  const std::string what = absl::StrCat(size, " bytes on GPU ", gpu);
  if (gpu < 0 || size <= 0) return absl::InvalidArgumentError(absl::StrCat("--memory=cuda needs --gpu >= 0 and a size > 0 (", what, ")"));
  if (absl::Status s = Check(cudaSetDevice(gpu), absl::StrCat("cudaSetDevice(", gpu, ")")); !s.ok()) return s;
  void* p = nullptr;
  if (absl::Status s = Check(cudaMalloc(&p, static_cast<size_t>(size)), absl::StrCat("cudaMalloc ", what)); !s.ok()) return s;
  absl::Status s = Check(cudaMemset(p, 0, static_cast<size_t>(size)), "cudaMemset");
  cudaIpcMemHandle_t h;
  if (s.ok()) s = Check(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle");
  cudaDeviceProp prop;
  if (s.ok()) s = Check(cudaGetDeviceProperties(&prop, gpu), "cudaGetDeviceProperties");
  if (!s.ok()) {
    (void)cudaFree(p);
    return s;
  }
  return std::unique_ptr<CudaWorkerBuffer>(new Impl(gpu, p, size, std::string(reinterpret_cast<const char*>(&h), sizeof(h)),
                                                    std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes))));
}

}  // namespace wb::e2e
