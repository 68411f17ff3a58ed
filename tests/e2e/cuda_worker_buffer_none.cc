// CudaWorkerBuffer of a build without CUDA.
#include "absl/strings/str_cat.h"
#include "tests/e2e/cuda_worker_buffer.h"

namespace wb::e2e {

absl::StatusOr<std::unique_ptr<CudaWorkerBuffer>> CudaWorkerBuffer::Create(int gpu, int64_t size) {
  return absl::UnimplementedError(absl::StrCat("--memory=cuda (", size, " bytes on GPU ", gpu, "): built without CUDA"));
}

}  // namespace wb::e2e
