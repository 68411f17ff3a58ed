#pragma once
// Seam: opening a local worker's GPU memory (a CUDA IPC handle, or CUDA VMM allocations whose fds
// came over the fd channel) as a region of the node's cuda_ipc transport.
//
// Implementations: NewGpuImport() is the build's own - CUDA IPC / VMM through the cuda_ipc
// transport when built with CUDA (gpu_import_cuda.cc), else one that refuses every buffer naming
// it (gpu_import_none.cc); Bazel picks the file, the node daemon has no #if. FakeGpuImport
// (fake_gpu_import.h) is the tests' (scripted answers, call records).

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/fd_channel.h"
#include "daemon/node/live_copy.h"
#include "proto/weightbridge.pb.h"
#include "transport/transport.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

class GpuImport {
 public:
  // The fd a worker sent on the fd channel for VMM allocation `key` (DaemonFront::FindVmmFd):
  // a dup the callee closes.
  using VmmFdFn = std::function<absl::StatusOr<CudaVmmFd>(const std::string& worker, const std::string& key)>;

  virtual ~GpuImport() = default;
  // Opens `worker`'s buffer `b` (b.memory_case() is kCudaIpcHandle or kCudaVmmKey) on `t`, the
  // node's cuda_ipc transport (not null). Every error names the buffer with `what`. The result's
  // `device` is the buffer's GPU in the daemon's numbering (which may differ from b.gpu(), the
  // worker's, under CUDA_VISIBLE_DEVICES). `vmm_fd` may be empty (VMM buffers are then refused).
  // Thread-safe.
  virtual absl::StatusOr<std::shared_ptr<CudaImport>> Import(transport::Transport& t, const std::string& worker, const pb::BufferSpec& b,
                                                             const std::string& what, const VmmFdFn& vmm_fd) = 0;
};

// The build's implementation (see above).
std::shared_ptr<GpuImport> NewGpuImport();

}  // namespace wb::daemon
