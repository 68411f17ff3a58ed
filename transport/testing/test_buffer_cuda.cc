// Device-memory test buffers (built when @local_cuda found CUDA).
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "transport/testing/test_buffer.h"

namespace wb::transport {
namespace {

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

class CudaTestBuffer : public TestBuffer {
 public:
  CudaTestBuffer(void* p, int64_t size, int device, std::string label)
      : p_(p), size_(size), device_(device), label_(std::move(label)) {}
  ~CudaTestBuffer() override {
    cudaSetDevice(device_);
    cudaFree(p_);
  }
  MemorySpec spec() const override {
    MemorySpec s;
    s.kind = MemoryKind::kCuda;
    s.base = p_;
    s.size_bytes = size_;
    s.device = device_;
    s.label = label_;
    return s;
  }
  absl::Status Write(int64_t offset, const void* data, int64_t n) override {
    if (offset < 0 || n < 0 || offset + n > size_) return absl::OutOfRangeError("CudaTestBuffer::Write out of range");
    if (n == 0) return absl::OkStatus();
    if (auto s = Check(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    if (auto s = Check(cudaMemcpy(static_cast<char*>(p_) + offset, data, n, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
        !s.ok()) {
      return s;
    }
    // From pageable memory cudaMemcpy returns once the source is staged; "the DMA to final
    // destination may not have completed" (CUDA's API synchronization behavior). The transports
    // read these bytes from non-blocking streams and other processes (IPC), which do not order
    // after the legacy stream: wait until they landed.
    return Check(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize after H2D");
  }
  absl::Status Read(int64_t offset, void* out, int64_t n) const override {
    if (offset < 0 || n < 0 || offset + n > size_) return absl::OutOfRangeError("CudaTestBuffer::Read out of range");
    if (n == 0) return absl::OkStatus();
    if (auto s = Check(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    return Check(cudaMemcpy(out, static_cast<const char*>(p_) + offset, n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }

 private:
  void* p_;
  int64_t size_;
  int device_;
  std::string label_;
};

}  // namespace

int VisibleCudaDevices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

absl::StatusOr<std::unique_ptr<TestBuffer>> MakeCudaTestBuffer(int64_t size, int device, const std::string& label) {
  if (VisibleCudaDevices() <= device) return absl::FailedPreconditionError("no such CUDA device visible");
  if (auto s = Check(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  void* p = nullptr;
  if (auto s = Check(cudaMalloc(&p, size > 0 ? size : 1), "cudaMalloc"); !s.ok()) return s;
  return std::unique_ptr<TestBuffer>(new CudaTestBuffer(p, size, device, label));
}

}  // namespace wb::transport
