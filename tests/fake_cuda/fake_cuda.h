#pragma once
// A CPU emulation of the part of the CUDA runtime API that WeightBridge calls, for tests on
// machines without a GPU. NOT a validation of GPU behaviour: it checks our *logic* (pointer and
// offset arithmetic, stream/event ordering, IPC handle exchange between processes, bounds, error
// paths) before the scarce GPU runs. Real numbers come only from tests/gpu/run_gpu_checks.sh.
//
// How a binary uses it: compile against the real CUDA headers (@local_cuda//:cuda_headers, as every
// CUDA source here does) and link `//tests/fake_cuda:fake_cudart` statically (`linkstatic = True`
// on the cc_test/cc_binary). The fake defines the cuda* symbols inside the executable, so they
// preempt libcudart.so's. Nothing here talks to a driver.
//
// Emulated semantics (the contract tests may rely on):
//  - Devices: WB_FAKE_CUDA_DEVICES (default 1) devices on the machine; CUDA_VISIBLE_DEVICES (a list
//    of ordinals) shows a process only those, renumbered from 0 in list order (the list ends at
//    the first entry that is not a device); per-thread current device (cudaSetDevice); device
//    UUIDs are deterministic per device of the machine, so they match across processes whatever
//    their numbering. An IPC mapping belongs to the GPU that holds the memory
//    (cudaPointerGetAttributes), in the opener's numbering; memory of a GPU the opener cannot see
//    cannot be opened (cudaErrorInvalidDevice). Each device has
//    WB_FAKE_CUDA_MEM_BYTES (default 16 GiB) of memory (cudaErrorMemoryAllocation beyond).
//  - Device memory (cudaMalloc) is a POSIX shm segment (/dev/shm/wbfc.<pid>.<token>.<n>, 0600)
//    mapped twice: the pointer handed out is a PROT_NONE reservation (a host dereference of a device
//    pointer crashes, as on a GPU) and the emulator works through a private read-write alias. Fresh
//    memory is filled with 0xA5 (a GPU does not zero it). Every device access made by a copy/memset
//    is bounds-checked, when it RUNS, against one live allocation (or against cuMemMap mappings
//    that lie back to back, all accessible: one virtual range over several allocations, which a
//    GPU copies across as PyTorch's expandable segments need); a violation (also: memory freed
//    or IPC-closed meanwhile) is a sticky cudaErrorIllegalAddress (as a real fault would be) with an
//    "ILLEGAL ADDRESS" line on stderr: every later call of the process returns it.
//  - cudaFree unlinks the segment (importers keep their mapping, as with CUDA) and synchronises
//    the device; freed address ranges stay reserved, so a use after free is caught, not reused.
//    A detached reaper process unlinks a process's segments when it dies, also by kill -9.
//  - IPC: cudaIpcGetMemHandle(ptr inside an allocation) -> the allocation's handle (shm name);
//    cudaIpcOpenMemHandle (flags must be cudaIpcMemLazyEnablePeerAccess) maps it in another process
//    and returns the allocation base; opening it again returns the same pointer (reference counted,
//    one cudaIpcCloseMemHandle per open); opening a handle in the process that allocated it fails
//    with cudaErrorDeviceUninitialized ("invalid device context"), as CUDA does.
//  - Streams run their work in order on a worker thread each (asynchronously: a missing
//    synchronisation shows up as wrong data); events complete when the stream reaches them (an
//    event never recorded is complete). The legacy default stream (0 / cudaStreamLegacy, one per
//    device, also a worker) waits for the work already enqueued on the device's BLOCKING streams
//    and they wait for it; non-blocking streams (cudaStreamNonBlocking) are not ordered with it,
//    exactly as in CUDA. Host synchronisation follows CUDA's documented rules: async copies from
//    pageable memory to the device stage the source and return; to pageable memory they return
//    when done; cudaMemcpy waits except device->device and pageable->device ("the DMA to final
//    destination may not have completed": another stream or process must synchronise first);
//    cudaMemset on device memory is asynchronous on the legacy stream.
//    WB_FAKE_CUDA_OP_DELAY_US adds a delay before each enqueued op (to expose races).
//    Synchronising calls give up after WB_FAKE_CUDA_SYNC_TIMEOUT_S (default 120) with
//    cudaErrorLaunchTimeout instead of hanging.
//  - Stricter than CUDA (cheap checks our code documents anyway): a copy on a stream whose device
//    is not current is cudaErrorInvalidResourceHandle; an explicit cudaMemcpyKind that contradicts
//    the pointers is cudaErrorInvalidMemcpyDirection; cudaMemcpy3D needs pos.y + height <= ysize
//    on both sides when depth > 1; CUDA used in a fork()ed child (without exec) is
//    cudaErrorInitializationError (gtest death tests must use the "threadsafe" style).
//  - Errors: per-thread last error (cudaGetLastError returns and clears it; a sticky error is
//    returned forever); every failing call prints why on stderr ("fake_cuda[pid]: ...").
//  - cudaGetDriverEntryPointByVersion hands out emulated driver calls: cuMemGetAddressRange (base
//    and size of the live allocation or cuMemMap mapping containing the pointer), the VMM calls
//    and cuPointerGetAttribute below; other symbols: not found.
//  - VMM (PyTorch expandable segments): cuMemGetAllocationGranularity (2 MiB), cuMemCreate (pinned,
//    device location, requestedHandleTypes NONE or POSIX_FILE_DESCRIPTOR; a memfd named
//    "wbfc-vmm.p<machine device>", filled with 0xA5), cuMemRelease (the handle dies, mapped bytes
//    stay until unmapped), cuMemAddressReserve / cuMemAddressFree (a PROT_NONE range; freed ranges
//    stay reserved; free with live mappings is refused), cuMemMap (offset 0, granularity-aligned,
//    inside one reservation, no overlap; several allocations may be mapped back to back in one
//    reservation), cuMemSetAccess (the range must be whole mappings, one or several; until
//    read-write access is granted a copy touching the mapping is a sticky illegal address),
//    cuMemUnmap (whole mappings; no implicit synchronisation), cuMemExportToShareableHandle
//    (POSIX fd only: a dup of the memfd; refused if the allocation did not request that type),
//    cuMemImportFromShareableHandle (fd of this emulator's export, also across processes; the
//    device comes from the memfd's name and must be visible: CUDA_ERROR_INVALID_DEVICE),
//    cuMemGetAllocationPropertiesFromHandle, cuMemRetainAllocationHandle (any address inside a
//    mapping -> the handle mapped there, one more reference; cuMemRelease drops references one by
//    one). A mapping is device memory for the runtime calls
//    (cudaPointerGetAttributes, copies); cudaIpcGetMemHandle and cudaFree refuse it, as CUDA does.
//  - Stream-ordered allocator (PyTorch's PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), each
//    device's default pool only (cudaDeviceGetDefaultMemPool; cudaMallocFromPoolAsync takes no other
//    pool: cudaErrorInvalidValue): cudaMallocAsync (the stream's device) / cudaMallocFromPoolAsync
//    give device memory like cudaMalloc's, flagged as pool memory and usable at once (a use on
//    another stream before the allocating stream reached it is not caught); cudaFreeAsync frees own
//    memory (pool or cudaMalloc, as CUDA allows) when the stream reaches the free, cudaFree frees
//    pool memory too; a second free of memory whose free is queued is cudaErrorInvalidValue.
//    cudaIpcGetMemHandle refuses pool memory with cudaErrorInvalidValue, as CUDA does (pools share
//    memory by cudaMemPoolExportPointer, not emulated).
//  - cuPointerGetAttribute (driver entry point) answers CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
//    (an int: 1 for own cudaMalloc memory only; 0 for pool memory, cuMemMap mappings, IPC imports,
//    pinned host memory) and CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE (the default pool of the memory's
//    device for pool memory, else NULL); CUDA_ERROR_INVALID_VALUE for a pointer it does not know,
//    CUDA_ERROR_NOT_SUPPORTED (with a line on stderr) for every other attribute.
// Not emulated: kernels, CUDA arrays, memory pools other than the default ones (cudaMemPoolCreate,
// pool attributes, trimming, IPC pools), multicast / fabric handles, managed memory,
// cudaStreamPerThread, timing events, peer-access control, the GPU memory model and performance.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>

namespace wb::fake_cuda {

// The emulator's host address for the device bytes [dptr, dptr + n), or nullptr when that range
// is not inside one live allocation (own or IPC-opened) of this process. For other fakes (the NCCL
// emulation) and tests; host code under test must never call this.
void* DeviceToHost(const void* dptr, size_t n);

// True when p lies inside a live device allocation (own or IPC-opened) of this process.
bool IsDevicePointer(const void* p);

// Appends `fn` to `stream`'s queue. nullptr / cudaStreamLegacy = the current device's legacy
// stream: fn runs after the work already enqueued on that device's blocking streams, and Enqueue
// returns only after fn ran. A non-success result of fn becomes the stream's sticky error,
// reported by later event/stream queries, like an asynchronous CUDA error. fn runs without the
// emulator's lock held; it may block (an emulated collective) and may call DeviceToHost, but must
// not enqueue on the same stream. An unknown or destroyed stream aborts the process.
void Enqueue(cudaStream_t stream, std::function<cudaError_t()> fn);

// The device that `stream` belongs to (the current device when it was created); -1 if unknown.
int StreamDevice(cudaStream_t stream);

// The machine's device behind this process's ordinal `device` (CUDA_VISIBLE_DEVICES), or -1.
int PhysicalDevice(int device);

}  // namespace wb::fake_cuda
