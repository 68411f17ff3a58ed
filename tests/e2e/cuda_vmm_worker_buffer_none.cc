// CudaVmmWorkerBuffer of a build without CUDA.
#include "absl/strings/str_cat.h"
#include "tests/e2e/cuda_vmm_worker_buffer.h"

namespace wb::e2e {

absl::StatusOr<std::unique_ptr<CudaVmmWorkerBuffer>> CudaVmmWorkerBuffer::Create(int gpu, int64_t min_size, int) {
  return absl::UnimplementedError(absl::StrCat("--memory=cuda_vmm (", min_size, " bytes on GPU ", gpu, "): built without CUDA"));
}

}  // namespace wb::e2e
