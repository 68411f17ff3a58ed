#pragma once
// A CPU emulation of the part of the CUDA runtime API that WeightBridge calls, for tests on
// machines without a GPU. NOT a validation of GPU behaviour: it checks our *logic* (pointer and
// offset arithmetic, stream/event ordering, IPC handle exchange between processes, bounds, error
// paths) before the scarce GPU runs. Real numbers come only from tests/gpu/run_gpu_checks.sh.
//
// How a binary uses it: compile against the real CUDA headers (@local_cuda//:cuda_headers, as every
// CUDA source here does) and link `//tools/fake_cuda:fake_cudart` statically (`linkstatic = True`
// on the cc_test/cc_binary). The fake defines the cuda* symbols inside the executable, so they
// preempt libcudart.so's. Nothing here talks to a driver.
//
// Emulated semantics (the contract tests may rely on):
//  - Devices: WB_FAKE_CUDA_DEVICES (default 1) devices; per-thread current device (cudaSetDevice);
//    device UUIDs are deterministic per ordinal, so they match across processes.
//  - Device memory (cudaMalloc) is a POSIX shm segment mapped twice: the pointer handed out is a
//    PROT_NONE reservation (a host dereference of a device pointer crashes, as on a GPU) and the
//    emulator works through a private read-write alias. Every device access made by a copy/memset
//    is bounds-checked against one live allocation; a violation is a sticky
//    cudaErrorIllegalAddress (as a real fault would be) with a message on stderr.
//  - IPC: cudaIpcGetMemHandle(ptr inside an allocation) -> the allocation's handle (shm name);
//    cudaIpcOpenMemHandle maps it in another process and returns the allocation base; opening a
//    handle in the process that allocated it fails (as CUDA does); cudaIpcCloseMemHandle unmaps.
//  - Streams run their work in order on a worker thread each (asynchronously: a missing
//    synchronisation shows up as wrong data); events complete when the stream reaches them;
//    the legacy default stream (0) waits for all other streams first and runs synchronously.
//    WB_FAKE_CUDA_OP_DELAY_US adds a delay before each enqueued op (to expose races).
//  - cudaGetDriverEntryPointByVersion("cuMemGetAddressRange") returns an emulated driver call.

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

// Appends `fn` to `stream`'s queue (nullptr = the legacy default stream, which runs it now after
// every other stream drained). A non-success result of fn becomes the stream's sticky error,
// reported by later event/stream queries, like an asynchronous CUDA error. fn may block (an
// emulated collective); it must not enqueue on the same stream.
void Enqueue(cudaStream_t stream, std::function<cudaError_t()> fn);

// The device that `stream` belongs to (the current device when it was created); -1 if unknown.
int StreamDevice(cudaStream_t stream);

}  // namespace wb::fake_cuda
