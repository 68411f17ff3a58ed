#pragma once
// "cuda_ipc": same-node transport for CUDA device memory (one-sided; see transport.h).
//
// Memory: RegisterMemory(kCuda) records the pointer, its device and where it sits in its
// allocation (cuMemGetAddressRange, reached through cudaGetDriverEntryPointByVersion so no
// libcuda link is needed). ExportDescriptor carries cudaIpcGetMemHandle of the ALLOCATION base +
// the region's offset in it + size + device ordinal and UUID + node id. ImportDescriptor maps the
// device by UUID (ordinals differ under CUDA_VISIBLE_DEVICES), opens the handle once per
// (handle, device) with cudaIpcMemLazyEnablePeerAccess and shares that mapping between imports;
// the last Release (or the destructor) closes it. Host memory may be registered too (pinned with
// cudaHostRegister when possible) for host <-> device ops; host regions cannot be exported (that is
// host_shm's job), and an op with no device side is INVALID_ARGUMENT. Worker buffers in CUDA VMM
// memory (cuMemCreate) come in as RawCudaVmmBuffer descriptors (below). Our OWN cuMemCreate memory
// registers and copies like any device memory, but ExportDescriptor refuses it
// (FAILED_PRECONDITION: cudaIpcGetMemHandle cannot export it, and a descriptor is bytes, which
// cannot carry the fd VMM sharing needs); the daemon's own staging comes from cudaMalloc.
//
// Copies: Post enqueues every op at once (cuda_copy.h: one cudaMemcpyAsync per contiguous op,
// cudaMemcpy2DAsync / cudaMemcpy3DAsync for strided boxes) on dedicated non-blocking streams of the
// executing device (CudaIpcOptions::streams per device, ops dealt round robin by bytes), then
// records one event per used stream. Poll/Wait query the events (Wait backs off between queries up
// to 1 ms and never calls a blocking synchronize). A copy cannot be recalled once enqueued: on
// deadline Wait marks the batch DEADLINE_EXCEEDED and waits at most CudaIpcTransport's grace period
// (10 s) for the enqueued copies to drain before it returns; copies that still have not finished
// leave their regions pinned (Release refuses them) rather than let memory be freed under them.
// No checksums (Capabilities::checksums == false).

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/config.h"
#include "transport/transport.h"

namespace wb::transport {

absl::StatusOr<std::unique_ptr<Transport>> CreateCudaIpcTransport(const TransportConfig& config);

// What a worker that exported a raw cudaIpcMemHandle_t (e.g. the Python client) tells the daemon.
struct RawCudaIpcBuffer {
  std::string ipc_handle;       // the 64 bytes of cudaIpcMemHandle_t of the allocation base
  int64_t offset_bytes = 0;     // region start within the allocation
  int64_t size_bytes = 0;
  int device = 0;               // ordinal in the WORKER's numbering (used when uuid is empty)
  std::string device_uuid;      // 16 bytes of cudaDeviceProp::uuid, or empty
  std::string owner_instance;   // empty: a same-node worker's buffer; the import then behaves like
                                // a region of this process (any batch, kNoPeer included, may use
                                // it). Non-empty: batches must name the peer with this instance.
  std::string node_id;          // the daemon's own node id (the worker is on this node)
  std::string label;
};

// Builds a cuda_ipc descriptor from a raw handle so the daemon can ImportDescriptor() a worker's
// buffer. Pure encoding (no CUDA calls); INVALID_ARGUMENT if the handle is not 64 bytes.
absl::StatusOr<std::string> CudaIpcDescriptorFromRawHandle(const RawCudaIpcBuffer& buffer);

// A worker's buffer inside a CUDA VMM allocation (cuMemCreate; e.g. PyTorch expandable segments),
// which legacy IPC cannot export. The worker exported the allocation with
// cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) and passed the fd to this
// process (SCM_RIGHTS: base/fd_passing.h, daemon/fd_channel.h).
//
// Import (ImportDescriptor of the descriptor built below), through the driver entry points
// (transport/cuda_ipc/cuda_vmm.h): cuMemImportFromShareableHandle(fd), cuMemAddressReserve +
// cuMemMap(allocation_bytes) + cuMemSetAccess(read-write for the GPU that holds it), once per
// `allocation_key`: every buffer of that allocation (any offset) shares the mapping, and the last
// Release unmaps, frees the range and releases the handle. The fd is only read during the import
// (the caller keeps and closes it); the descriptor names it by number, so it is valid only in the
// process that built it (its pid is in the descriptor; any other process gets INVALID_ARGUMENT).
// [offset, offset + size) must lie inside allocation_bytes (INVALID_ARGUMENT, nothing mapped), and
// allocation_bytes must be the allocation's real size: the driver refuses to map more.
//
// Several allocations (PyTorch's expandable segments back one segment with one allocation per
// 2 MiB / 20 MiB page, mapped back to back, so a large tensor spans several): `next_allocations`
// lists the ones mapped right after the first, in the worker's order. The import then imports every
// fd, reserves ONE range of the summed size, maps each allocation at its offset in it and grants
// read-write access once over the range, so the buffer [offset, offset + size) of the
// concatenation is one contiguous device range (copies, strided ones included, run across the
// allocations' boundaries). Such a mapping is cached by the ordered list of keys (the same list
// shares it; another list, even one sharing allocations, maps its own) and undone on its last
// Release. Every allocation must be on one GPU and a multiple of its granularity, keys distinct;
// the buffer must start in the first allocation and end in the last (INVALID_ARGUMENT naming the
// allocation otherwise, nothing mapped).
struct CudaVmmAllocationRef {
  int fd = -1;          // the exported allocation, open in THIS process
  std::string key;      // as RawCudaVmmBuffer::allocation_key
  int64_t bytes = 0;    // the allocation's size (what cuMemCreate was given)
};

struct RawCudaVmmBuffer {
  int fd = -1;                   // the exported allocation, open in THIS process
  std::string allocation_key;    // unique per allocation (and per exporting process): the mapping cache key
  int64_t allocation_bytes = 0;  // the allocation's size (what cuMemCreate was given)
  std::vector<CudaVmmAllocationRef> next_allocations;  // mapped after the first, in order (usually empty)
  int64_t offset_bytes = 0;      // the buffer's start inside the (first) allocation
  int64_t size_bytes = 0;
  int device = 0;                // as RawCudaIpcBuffer
  std::string device_uuid;
  std::string node_id;           // the daemon's own node id
  std::string label;
};

// Pure encoding (no CUDA calls); INVALID_ARGUMENT for a negative fd/field, an empty or repeated
// key, more than kMaxCudaVmmAllocationsPerBuffer allocations, sizes whose sum overflows, or a bad uuid.
constexpr size_t kMaxCudaVmmAllocationsPerBuffer = 4096;
absl::StatusOr<std::string> CudaIpcDescriptorFromVmmFd(const RawCudaVmmBuffer& buffer);

}  // namespace wb::transport
