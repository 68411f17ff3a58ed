// GpuImport through the cuda_ipc transport (builds with CUDA; the emulated CUDA runtime in tests).

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "daemon/node/gpu_import.h"
#include "transport/common.h"
#include "transport/cuda_ipc/cuda_ipc.h"

namespace wb::daemon {
namespace {

class CudaIpcImport final : public GpuImport {
 public:
  absl::StatusOr<std::shared_ptr<CudaImport>> Import(transport::Transport& t, const std::string& worker, const pb::BufferSpec& b,
                                                     const std::string& what, const VmmFdFn& vmm_fd) override {
    const bool is_vmm = b.memory_case() == pb::BufferSpec::kCudaVmmKey;
    transport::RawCudaIpcBuffer raw;
    raw.ipc_handle = b.cuda_ipc_handle();
    raw.offset_bytes = 0;
    raw.size_bytes = static_cast<int64_t>(b.size_bytes());
    raw.device = b.gpu() >= 0 ? b.gpu() : 0;
    if (!b.gpu_uuid().empty()) {
      if (b.gpu_uuid().size() != 16) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": gpu_uuid must be the 16 bytes of cudaDeviceProp::uuid, got ", b.gpu_uuid().size()));
      }
      raw.device_uuid = b.gpu_uuid();  // the GPU in OUR numbering, whatever the worker's CUDA_VISIBLE_DEVICES
    }
    // The worker reached us over our Unix socket, so it is on this machine: the transports' node
    // identity (the kernel boot id; main.cc leaves TransportConfig::node_id empty), not the
    // daemon's cluster node id (found by the emulated-GPU e2e test: every CUDA buffer was refused).
    raw.node_id = transport::DefaultNodeId();
    raw.label = what;
    absl::StatusOr<std::string> desc;
    absl::StatusOr<transport::RegionHandle> h;
    std::vector<std::string> allocation_keys;
    if (is_vmm) {
      // VMM memory: each allocation's fd came over the fd channel (only from the process bound to
      // this worker); the transport maps each allocation (or each ordered list of allocations, for a
      // buffer that spans several) once, whatever the number of buffers in it.
      if (!vmm_fd) return absl::FailedPreconditionError(absl::StrCat(what, ": this daemon has no fd channel"));
      std::vector<CudaVmmFd> fds;  // dups, closed once the transport imported (or refused) them
      auto close_fds = [&fds] {
        for (const CudaVmmFd& f : fds) ::close(f.fd);
      };
      for (int i = -1; i < b.cuda_vmm_next_keys_size(); ++i) {
        absl::StatusOr<CudaVmmFd> fd = vmm_fd(worker, i < 0 ? b.cuda_vmm_key() : b.cuda_vmm_next_keys(i));
        if (!fd.ok()) {
          close_fds();
          return Annotate(fd.status(), what);
        }
        fds.push_back(*fd);
        allocation_keys.push_back(fd->cache_key);
      }
      transport::RawCudaVmmBuffer vmm;
      vmm.fd = fds[0].fd;
      vmm.allocation_key = fds[0].cache_key;
      vmm.allocation_bytes = fds[0].allocation_bytes;
      for (size_t i = 1; i < fds.size(); ++i) vmm.next_allocations.push_back({fds[i].fd, fds[i].cache_key, fds[i].allocation_bytes});
      vmm.offset_bytes = static_cast<int64_t>(std::min<uint64_t>(b.cuda_vmm_offset(), INT64_MAX));
      vmm.size_bytes = raw.size_bytes;
      vmm.device = raw.device;
      vmm.device_uuid = raw.device_uuid;
      vmm.node_id = raw.node_id;
      vmm.label = what;
      desc = transport::CudaIpcDescriptorFromVmmFd(vmm);
      if (desc.ok()) h = t.ImportDescriptor(*desc);
      close_fds();  // the transport imported (or refused) them; the channel keeps its own copies
    } else {
      desc = transport::CudaIpcDescriptorFromRawHandle(raw);
      if (desc.ok()) h = t.ImportDescriptor(*desc);
    }
    if (!desc.ok()) return Annotate(desc.status(), what);
    if (!h.ok()) return Annotate(h.status(), what);
    auto imp = std::make_shared<CudaImport>();
    imp->t = &t;
    imp->h = *h;
    imp->allocation_keys = std::move(allocation_keys);
    imp->size = static_cast<int64_t>(b.size_bytes());
    // The GPU that holds the buffer in the daemon's numbering (found by UUID, or by the mapping).
    auto info = t.Describe(*h);
    imp->device = info.ok() && info->device >= 0 ? info->device : raw.device;
    return imp;
  }
};

}  // namespace

std::shared_ptr<GpuImport> NewGpuImport() { return std::make_shared<CudaIpcImport>(); }

}  // namespace wb::daemon
