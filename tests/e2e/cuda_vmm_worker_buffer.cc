#include "tests/e2e/cuda_vmm_worker_buffer.h"

#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/e2e/vmm_layout.h"
#include "base/status_macros.h"

namespace wb::e2e {

absl::StatusOr<VmmWeights> SetUpVmmWeights(client::WorkerClient& client, const planner::Inventory& inventory,
                                           const planner::WorkerLayout& layout, int gpu, bool send_gpu_uuid, int parts,
                                           int64_t overrun_bytes, int allocations) {
  // 4 KiB before every buffer: offsets that are not 0 and not the allocation's granularity.
  ASSIGN_OR_RETURN(VmmLayout spread, SpreadOverVmmBuffers(inventory, layout, parts, 4096));
  VmmWeights w;
  ASSIGN_OR_RETURN(w.cuda, CudaVmmWorkerBuffer::Create(gpu, spread.bytes, allocations));
  const int n = w.cuda->allocations();
  const int64_t each = w.cuda->allocation_bytes();
  auto key = [n](int i) { return n == 1 ? std::string("weights") : absl::StrCat("weights/", i); };
  for (int i = 0; i < n; ++i) {
    ASSIGN_OR_RETURN(const int fd, w.cuda->ExportFd(i));
    absl::Status shared = client.ShareCudaVmmAllocation(key(i), fd, each);
    ::close(fd);  // the client keeps its own copy
    RETURN_IF_ERROR(shared);
  }
  const std::string uuid = send_gpu_uuid ? w.cuda->gpu_uuid() : std::string();
  for (size_t j = 0; j < spread.layout.buffers.size(); ++j) {
    int64_t size = spread.layout.buffers[j].size_bytes;
    if (overrun_bytes > 0 && j + 1 == spread.layout.buffers.size()) size = w.cuda->size() - spread.offsets[j] + overrun_bytes;
    // The allocations the buffer touches, in address order (an overrun ends in the last one).
    const int first = static_cast<int>(spread.offsets[j] / each);
    const int last = static_cast<int>(std::min<int64_t>((spread.offsets[j] + size - 1) / each, n - 1));
    std::vector<std::string> keys;
    for (int i = first; i <= last; ++i) keys.push_back(key(i));
    if (keys.size() > 1) ++w.spanning_buffers;
    RETURN_IF_ERROR(client.AddCudaVmmBuffer(keys, spread.offsets[j] - first * each, size, gpu, uuid).status());
  }
  w.offsets = std::move(spread.offsets);
  w.layout = std::move(spread.layout);
  return w;
}

}  // namespace wb::e2e
