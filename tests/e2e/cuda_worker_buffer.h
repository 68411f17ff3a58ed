#pragma once
// A test worker's weights in CUDA memory: one cudaMalloc allocation on `gpu`, announced to the
// daemon by its IPC handle (client::WorkerClient::AddCudaBuffer), with explicit uploads/downloads
// from a host mirror that the weight fill/verify code (weights.h) works on. Built against the CUDA
// runtime when @local_cuda has it (cuda_worker_buffer_cuda.cc; real on a GPU machine, the emulated
// runtime of //tests/fake_cuda in CI), else every call is UNIMPLEMENTED (cuda_worker_buffer_none.cc).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace wb::e2e {

class CudaWorkerBuffer {
 public:
  virtual ~CudaWorkerBuffer() = default;
  // `size` (> 0) zero-filled bytes on CUDA device `gpu`.
  static absl::StatusOr<std::unique_ptr<CudaWorkerBuffer>> Create(int gpu, int64_t size);
  // The 64 bytes of cudaIpcMemHandle_t of the allocation.
  virtual std::string ipc_handle() const = 0;
  // The 16 bytes of cudaDeviceProp::uuid of its GPU.
  virtual std::string gpu_uuid() const = 0;
  virtual int64_t size() const = 0;
  // Host -> device / device -> host of the whole buffer (synchronous).
  virtual absl::Status Upload(const void* host) = 0;
  virtual absl::Status Download(void* host) const = 0;
};

}  // namespace wb::e2e
