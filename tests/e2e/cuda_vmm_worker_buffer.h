#pragma once
// --memory=cuda_vmm of the test workers: the weights in ONE CUDA VMM allocation (cuMemCreate with
// a POSIX-fd handle type, as PyTorch's expandable segments allocate), handed to the daemon by its
// fd (client::WorkerClient::ShareCudaVmmAllocation) and registered as several buffers inside it
// (AddCudaVmmBuffer, cut by vmm_layout.h). Upload/Download move the whole allocation from/to a
// host mirror, like CudaWorkerBuffer. Built on the CUDA runtime's driver entry points when
// @local_cuda has CUDA (real on a GPU machine, the emulated driver of //tools/fake_cuda in CI),
// else UNIMPLEMENTED.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/worker_client.h"
#include "planner/types.h"
#include "tests/e2e/cuda_worker_buffer.h"

namespace wb::e2e {

class CudaVmmWorkerBuffer : public CudaWorkerBuffer {
 public:
  // At least `min_size` zero-filled bytes (the size is rounded up to the allocation granularity).
  static absl::StatusOr<std::unique_ptr<CudaVmmWorkerBuffer>> Create(int gpu, int64_t min_size);
  // A new POSIX fd of the allocation (cuMemExportToShareableHandle); the caller closes it.
  virtual absl::StatusOr<int> ExportFd() const = 0;
};

struct VmmWeights {
  std::unique_ptr<CudaVmmWorkerBuffer> cuda;
  std::vector<int64_t> offsets;  // buffer j at offsets[j] of the allocation
  planner::WorkerLayout layout;  // the worker's pieces over those buffers
};

// Allocates the weights of `layout` (one buffer) on `gpu` in one VMM allocation, shares its fd with
// the daemon under key "weights" and adds `parts` buffers in it (fewer if the pieces offer fewer
// cuts). `overrun_bytes` > 0 (a fault test) declares the last buffer that many bytes past the end
// of the allocation, which the daemon must refuse at RegisterLayout.
absl::StatusOr<VmmWeights> SetUpVmmWeights(client::WorkerClient& client, const planner::Inventory& inventory,
                                           const planner::WorkerLayout& layout, int gpu, bool send_gpu_uuid, int parts,
                                           int64_t overrun_bytes);

}  // namespace wb::e2e
