#pragma once
// --memory=cuda_vmm of the test workers: the weights in ONE CUDA VMM allocation (cuMemCreate with
// a POSIX-fd handle type, as PyTorch's expandable segments allocate), handed to the daemon by its
// fd (client::WorkerClient::ShareCudaVmmAllocation) and registered as several buffers inside it
// (AddCudaVmmBuffer, cut by vmm_layout.h). With --vmm_allocations=N: N allocations mapped back to
// back in one range (as an expandable segment maps one allocation per page), each fd shared once,
// and a buffer that crosses allocations names them all in order. Upload/Download move the whole allocation from/to a
// host mirror, like CudaWorkerBuffer. Built on the CUDA runtime's driver entry points when
// @local_cuda has CUDA (real on a GPU machine, the emulated driver of //tests/fake_cuda in CI),
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
  // At least `min_size` zero-filled bytes (the size is rounded up to the allocation granularity),
  // in `allocations` equal allocations mapped back to back.
  static absl::StatusOr<std::unique_ptr<CudaVmmWorkerBuffer>> Create(int gpu, int64_t min_size, int allocations = 1);
  virtual int allocations() const = 0;
  virtual int64_t allocation_bytes() const = 0;  // each; allocation i at [i * that, (i + 1) * that)
  // A new POSIX fd of allocation i (cuMemExportToShareableHandle); the caller closes it.
  virtual absl::StatusOr<int> ExportFd(int i) const = 0;
};

struct VmmWeights {
  std::unique_ptr<CudaVmmWorkerBuffer> cuda;
  std::vector<int64_t> offsets;  // buffer j at offsets[j] of the range
  planner::WorkerLayout layout;  // the worker's pieces over those buffers
  int spanning_buffers = 0;      // buffers that cross an allocation boundary
};

// Allocates the weights of `layout` (one buffer) on `gpu` in one VMM allocation (or `allocations`
// back to back), shares its fd with the daemon under key "weights" (each under "weights/<i>") and
// adds `parts` buffers in it (fewer if the pieces offer fewer cuts), each naming the allocations it
// spans. `overrun_bytes` > 0 (a fault test) declares the last buffer that many bytes past the end
// of the range, which the daemon must refuse at RegisterLayout.
absl::StatusOr<VmmWeights> SetUpVmmWeights(client::WorkerClient& client, const planner::Inventory& inventory,
                                           const planner::WorkerLayout& layout, int gpu, bool send_gpu_uuid, int parts,
                                           int64_t overrun_bytes, int allocations = 1);

}  // namespace wb::e2e
