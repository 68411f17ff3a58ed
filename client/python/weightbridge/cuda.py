"""GPU buffers for the daemon: device memory exported as a CUDA IPC handle, or CUDA VMM memory.

Two kinds of device memory reach the daemon:
  - CudaBuffer: one cudaMalloc'ed block starting at the handle's base, exported by legacy CUDA IPC
    (cudaIpcGetMemHandle): the daemon opens it with cudaIpcOpenMemHandle and the layout's byte
    offsets are relative to that base. (Tensors from torch's caching allocator can sit at an
    offset inside a larger block, and legacy IPC cannot export expandable segments at all, which
    is why we do not export arbitrary torch tensors that way: allocate here, then use .tensor().)
  - CUDA VMM memory (cuMemCreate: torch's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or a
    VmmAllocation made here): vmm_allocation_of(ptr) finds the allocation that holds a pointer
    (cuMemGetAddressRange + cuMemRetainAllocationHandle), vmm_allocations_of(ptr, size) every
    allocation under a range (an expandable segment maps one per page, back to back), and
    export_fd() gives an allocation's POSIX fd (cuMemExportToShareableHandle), which
    WorkerClient.add_cuda_vmm_buffer sends to the daemon over its fd channel, once per allocation
    however many buffers lie in it.
  Stream-ordered memory-pool memory (cudaMallocAsync / cudaMallocFromPoolAsync: torch's
  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) is neither: legacy IPC cannot export it and it
  has no fd. device_allocation_of asks the driver (cuPointerGetAttribute:
  CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) and refuses
  such memory with a ValueError saying what to use instead (not_ipc_capable), before anything is
  exported; a driver that cannot answer leaves it to cudaIpcGetMemHandle, as before.

The runtime is found as libcudart.so(.13/.12), or at $WB_CUDART when set (CI points it at the
emulated runtime, //tests/fake_cuda:libwb_fake_cudart.so, to run this module without a GPU:
client/python/tests/client_cuda_test.py). Driver calls (cuMem*) come from the runtime's
cudaGetDriverEntryPointByVersion (CUDA >= 12.5 runtimes; the emulation has it), else from
libcuda.so.1. write()/read() move bytes without torch. Never run on a real GPU yet.
"""

import ctypes
import ctypes.util
import itertools
import os

_IPC_HANDLE_BYTES = 64
_cudart = None


def _rt():
    global _cudart
    if _cudart is None:
        explicit = os.environ.get("WB_CUDART")
        if explicit:
            # An explicit runtime is never silently replaced by another one.
            try:
                _cudart = ctypes.CDLL(explicit)
            except OSError as e:
                raise RuntimeError("WB_CUDART=%s cannot be loaded: %s" % (explicit, e))
            return _cudart
        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
            if not name:
                continue
            try:
                _cudart = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if _cudart is None:
            raise RuntimeError("CUDA runtime (libcudart) not found")
    return _cudart


def _check(err, what):
    if err != 0:
        rt = _rt()
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError("%s failed: %s (cudaError %d)" % (what, rt.cudaGetErrorString(err).decode(), err))


def gpu_uuid(gpu):
    """The 16 bytes of cudaDeviceProp::uuid of device `gpu` (as this process numbers it).

    Sent with every CUDA buffer so that the daemon finds the GPU even when this process's
    CUDA_VISIBLE_DEVICES numbers GPUs differently from the daemon's (containers, one GPU per rank).
    cudaDeviceProp starts with char name[256] then the uuid in every CUDA version; the rest of the
    struct is not read (a generous buffer absorbs its size, which varies between versions).
    """
    rt = _rt()
    props = ctypes.create_string_buffer(16384)
    fn = getattr(rt, "cudaGetDeviceProperties_v2", None) or rt.cudaGetDeviceProperties
    _check(fn(props, int(gpu)), "cudaGetDeviceProperties(%d)" % int(gpu))
    return props.raw[256:272]


class _DeviceBytes:
    """`size_bytes` of device memory at `ptr` on `gpu`: bounded host copies and torch views."""

    ptr = 0
    size_bytes = 0
    gpu = 0

    def _span(self, offset, n):
        if not self.ptr:
            raise ValueError("buffer is closed")
        if offset < 0 or n < 0 or offset + n > self.size_bytes:
            raise ValueError("%d bytes at %d outside the %d-byte buffer" % (n, offset, self.size_bytes))

    def write(self, offset, data):
        """Copies the bytes-like `data` to the device at byte `offset` (synchronous)."""
        data = memoryview(data).cast("B")
        self._span(offset, len(data))
        src = (ctypes.c_char * len(data)).from_buffer_copy(data)
        rt = _rt()
        _check(rt.cudaSetDevice(self.gpu), "cudaSetDevice(%d)" % self.gpu)
        _check(rt.cudaMemcpy(ctypes.c_void_p(self.ptr + offset), src, ctypes.c_size_t(len(data)), 1),
               "cudaMemcpy host->device")
        # A copy from pageable memory may return before the DMA lands; the daemon reads the buffer
        # from another process right after publish(), so finish it here (see publish()).
        _check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def read(self, offset, n):
        """The `n` device bytes at byte `offset`, as bytes (synchronous)."""
        self._span(offset, n)
        dst = ctypes.create_string_buffer(max(n, 1))
        rt = _rt()
        _check(rt.cudaSetDevice(self.gpu), "cudaSetDevice(%d)" % self.gpu)
        _check(rt.cudaMemcpy(dst, ctypes.c_void_p(self.ptr + offset), ctypes.c_size_t(n), 2), "cudaMemcpy device->host")
        return dst.raw[:n]

    def tensor(self, dtype, shape, offset_bytes=0):
        """A torch CUDA tensor viewing this buffer (no copy); imports torch."""
        import torch  # imported only when used

        elem = torch.empty((), dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= int(d)
        if offset_bytes < 0 or offset_bytes + n * elem > self.size_bytes:
            raise ValueError("view of %d bytes at %d outside the %d-byte buffer" % (n * elem, offset_bytes, self.size_bytes))
        # The array interface's type strings are numpy's, which has no bfloat16 and no float8 / float4
        # (torch parses them with numpy: torch/csrc/utils/tensor_numpy.cpp): view the bytes as the
        # integer type of the element's size, then reinterpret them in `dtype` (Tensor.view(dtype),
        # same element size: any dtype).
        ints = {1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"), 8: (torch.int64, "<i8")}
        if elem not in ints:
            raise ValueError("no view of %s (%d-byte elements)" % (dtype, elem))
        view_dtype, typestr = ints[elem]
        holder = type("CudaArray", (), {})()
        holder.__cuda_array_interface__ = {"shape": tuple(int(d) for d in shape), "typestr": typestr,
                                          "data": (self.ptr + offset_bytes, False), "version": 2}
        t = torch.as_tensor(holder, device="cuda:%d" % self.gpu)
        return t.view(dtype) if view_dtype != dtype else t



class CudaBuffer(_DeviceBytes):
    """`size_bytes` of device memory on `gpu`, zero-filled, exportable by CUDA IPC."""

    def __init__(self, size_bytes, gpu, buffer_id=0):
        self.id = buffer_id
        self.gpu = int(gpu)
        from weightbridge.shm import byte_count
        self.size_bytes = byte_count("CUDA buffer size", size_bytes)
        if self.size_bytes <= 0:
            raise ValueError("CUDA buffer size must be > 0, got %d" % self.size_bytes)
        rt = _rt()
        _check(rt.cudaSetDevice(self.gpu), "cudaSetDevice(%d)" % self.gpu)
        ptr = ctypes.c_void_p()
        _check(rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(self.size_bytes)), "cudaMalloc(%d)" % self.size_bytes)
        self.ptr = ptr.value
        _check(rt.cudaMemset(ptr, 0, ctypes.c_size_t(self.size_bytes)), "cudaMemset")
        handle = (ctypes.c_byte * _IPC_HANDLE_BYTES)()
        _check(rt.cudaIpcGetMemHandle(ctypes.byref(handle), ptr), "cudaIpcGetMemHandle")
        self.ipc_handle = bytes(handle)
        self.gpu_uuid = gpu_uuid(self.gpu)

    def close(self):
        if self.ptr:
            _rt().cudaFree(ctypes.c_void_p(self.ptr))
            self.ptr = 0


# ---------------------------------------------------------------- CUDA VMM (cuMem*) driver calls

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CU_DEVICEPTR = ctypes.c_uint64
_CU_HANDLE = ctypes.c_uint64  # CUmemGenericAllocationHandle


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_P = ctypes.POINTER
_DRIVER_SIGNATURES = {
    "cuMemGetAddressRange": (_P(_CU_DEVICEPTR), _P(ctypes.c_size_t), _CU_DEVICEPTR),
    "cuMemRetainAllocationHandle": (_P(_CU_HANDLE), ctypes.c_void_p),
    "cuMemExportToShareableHandle": (ctypes.c_void_p, _CU_HANDLE, ctypes.c_int, ctypes.c_ulonglong),
    "cuMemGetAllocationPropertiesFromHandle": (_P(_AllocProp), _CU_HANDLE),
    "cuMemRelease": (_CU_HANDLE,),
    "cuMemGetAllocationGranularity": (_P(ctypes.c_size_t), _P(_AllocProp), ctypes.c_int),
    "cuMemCreate": (_P(_CU_HANDLE), ctypes.c_size_t, _P(_AllocProp), ctypes.c_ulonglong),
    "cuMemAddressReserve": (_P(_CU_DEVICEPTR), ctypes.c_size_t, ctypes.c_size_t, _CU_DEVICEPTR, ctypes.c_ulonglong),
    "cuMemAddressFree": (_CU_DEVICEPTR, ctypes.c_size_t),
    "cuMemMap": (_CU_DEVICEPTR, ctypes.c_size_t, ctypes.c_size_t, _CU_HANDLE, ctypes.c_ulonglong),
    "cuMemUnmap": (_CU_DEVICEPTR, ctypes.c_size_t),
    "cuMemSetAccess": (_CU_DEVICEPTR, ctypes.c_size_t, _P(_AccessDesc), ctypes.c_size_t),
    "cuPointerGetAttribute": (ctypes.c_void_p, ctypes.c_int, _CU_DEVICEPTR),
}
# libcuda.so exports some calls only under their versioned names.
_LIBCUDA_NAMES = {"cuMemGetAddressRange": "cuMemGetAddressRange_v2"}
_driver_fns = {}


def _driver(name):
    """The driver call `name` (12.0 ABI) as a ctypes function returning its CUresult."""
    fn = _driver_fns.get(name)
    if fn is not None:
        return fn
    proto = ctypes.CFUNCTYPE(ctypes.c_int, *_DRIVER_SIGNATURES[name])
    rt = _rt()
    addr = None
    by_version = getattr(rt, "cudaGetDriverEntryPointByVersion", None)
    if by_version is not None:
        out = ctypes.c_void_p()
        status = ctypes.c_int(-1)  # cudaDriverEntryPointQueryResult; 0 = found
        err = by_version(name.encode(), ctypes.byref(out), ctypes.c_uint(12000), ctypes.c_ulonglong(0), ctypes.byref(status))
        if err == 0 and status.value == 0 and out.value:
            addr = out.value
        else:
            rt.cudaGetLastError()
    if addr is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            addr = ctypes.cast(getattr(lib, _LIBCUDA_NAMES.get(name, name)), ctypes.c_void_p).value
        except (OSError, AttributeError) as e:
            raise RuntimeError("CUDA driver call %s not found (runtime entry points or libcuda.so.1): %s" % (name, e))
    fn = proto(addr)
    _driver_fns[name] = fn
    return fn


def _cu(name, *args):
    """Calls driver function `name`; RuntimeError naming it and the CUresult when it fails."""
    r = _driver(name)(*args)
    if r != 0:
        raise RuntimeError("%s failed: CUresult %d" % (name, r))


def _pointer_device(ptr):
    """The device (this process's numbering) holding device pointer `ptr`; ValueError if none."""
    rt = _rt()
    # cudaPointerAttributes: int type, int device, then pointers and (CUDA 13) reserved words; a
    # generous buffer absorbs its size, which varies between versions.
    attrs = ctypes.create_string_buffer(1024)
    err = rt.cudaPointerGetAttributes(attrs, ctypes.c_void_p(ptr))
    kind, device = ctypes.c_int.from_buffer(attrs, 0).value, ctypes.c_int.from_buffer(attrs, 4).value
    if err != 0 or kind != 2:  # cudaMemoryTypeDevice
        rt.cudaGetLastError()
        raise ValueError("0x%x is not device memory of this process" % ptr)
    return device


_ALLOCATION_IDS = itertools.count(1)


class VmmRange:
    """The CUDA VMM allocation holding a pointer (vmm_allocation_of): [base, base + size) on `gpu`.

    Holds a reference to the allocation (cuMemRetainAllocationHandle) until close(), so that the
    handle, and with it `key`, names this allocation and no other while it is open.
    """

    def __init__(self, base, size, gpu, handle, exportable=True):
        self.base, self.size, self.gpu, self.handle = base, size, gpu, handle
        # Whether cuMemCreate requested CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (the only way the
        # daemon can map it; True where the properties could not be read: export_fd then decides).
        self.exportable = exportable
        self.key = "vmm-%x-%x-%x" % (base, size, handle)
        # Sent with every offer of this allocation (offer_vmm_fd): unique in this process, so a
        # later allocation that happens to get the same key is mapped anew by the daemon.
        self.allocation_id = next(_ALLOCATION_IDS)

    def export_fd(self):
        """A new POSIX fd of the allocation (cuMemExportToShareableHandle); the caller closes it."""
        fd = ctypes.c_int(-1)
        try:
            _cu("cuMemExportToShareableHandle", ctypes.byref(fd), _CU_HANDLE(self.handle),
                _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        except RuntimeError as e:
            raise RuntimeError("%s (was the memory created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in "
                               "requestedHandleTypes? torch requests it for expandable segments only in versions that "
                               "can share them between processes)" % e) from None
        return fd.value

    def close(self):
        if self.handle:
            _cu("cuMemRelease", _CU_HANDLE(self.handle))
            self.handle = 0


def vmm_allocation_of(ptr):
    """The CUDA VMM allocation (cuMemCreate + cuMemMap) that device pointer `ptr` lies in.

    ValueError when `ptr` is not device memory or not VMM memory (cudaMalloc memory: use
    CudaBuffer). With torch's expandable segments each segment is mapped from many allocations
    (one per 2 MiB / 20 MiB page), so a large tensor may cross several: vmm_allocations_of.
    """
    ptr = int(ptr)
    gpu = _pointer_device(ptr)
    rt = _rt()
    _check(rt.cudaSetDevice(gpu), "cudaSetDevice(%d)" % gpu)  # makes the device's context current for the driver
    base, size, handle = _CU_DEVICEPTR(), ctypes.c_size_t(), _CU_HANDLE()
    _cu("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), _CU_DEVICEPTR(ptr))
    if _driver("cuMemRetainAllocationHandle")(ctypes.byref(handle), ctypes.c_void_p(ptr)) != 0:
        raise ValueError("0x%x is device memory but not CUDA VMM memory (cuMemCreate); cudaMalloc memory goes by "
                         "CUDA IPC (CudaBuffer)" % ptr)
    prop = _AllocProp()
    exportable = True
    if _driver("cuMemGetAllocationPropertiesFromHandle")(ctypes.byref(prop), handle) == 0:
        gpu = prop.location.id
        exportable = bool(prop.requestedHandleTypes & _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return VmmRange(base.value, size.value, gpu, handle.value, exportable)


# Why VMM memory without a POSIX fd handle type is refused (vmm_allocations_of(exportable=True)).
NOT_EXPORTABLE = ("created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in requestedHandleTypes, so no other process "
                  "can map it (vLLM's sleep-mode CuMemAllocator, csrc/cumem_allocator.cpp, and SGLang's "
                  "--enable-memory-saver, torch_memory_saver's cu_mem_create, create their memory that way): "
                  "use memory='cuda' for such an engine")


def vmm_allocations_of(ptr, size_bytes, exportable=False):
    """The CUDA VMM allocations that hold [ptr, ptr + size_bytes), in address order: a list of
    VmmRange (each holding a reference until close()). Walks the range mapping by mapping
    (cuMemGetAddressRange gives the allocation mapped at an address, its end is where the next one
    must start), as torch's expandable segments map one allocation per page back to back.
    ValueError when a byte of the range is not mapped VMM memory, or the allocations are on two
    GPUs, or (`exportable`) one was created without the POSIX fd handle type (NOT_EXPORTABLE);
    nothing stays retained then."""
    ptr, end = int(ptr), int(ptr) + int(size_bytes)
    out = []
    try:
        at = ptr
        while at < end:
            try:
                r = vmm_allocation_of(at)
            except ValueError:
                if not out:
                    raise
                last = out[-1]
                raise ValueError("%d bytes at 0x%x run %d bytes past the end of their CUDA VMM allocations: nothing is mapped "
                                 "at 0x%x, the end of allocation [0x%x, +%d)" % (end - ptr, ptr, end - at, at, last.base,
                                                                                last.size)) from None
            out.append(r)
            if r.base + r.size <= at:  # the driver's range must contain the address asked for
                raise RuntimeError("cuMemGetAddressRange(0x%x) returned [0x%x, +%d)" % (at, r.base, r.size))
            if exportable and not r.exportable:
                raise ValueError("CUDA VMM allocation [0x%x, +%d) under [0x%x, +%d) was %s" % (r.base, r.size, ptr, end - ptr,
                                                                                           NOT_EXPORTABLE))
            if r.gpu != out[0].gpu:
                raise ValueError("[0x%x, +%d) spans CUDA VMM allocations on GPU %d and GPU %d; a buffer lies on one GPU"
                                 % (ptr, end - ptr, out[0].gpu, r.gpu))
            at = r.base + r.size
    except BaseException:
        for r in out:
            r.close()
        raise
    return out


class DeviceAllocation:
    """The allocation holding a device pointer (device_allocation_of): [base, base + size) on `gpu`;
    `vmm`: CUDA VMM memory (cuMemCreate + cuMemMap: torch's expandable segments, vLLM's sleep-mode
    pool), shared by fd (WorkerClient.add_cuda_vmm_buffer) where it was created exportable (vLLM's
    pool is not: NOT_EXPORTABLE); else cudaMalloc memory (torch's
    caching allocator by default), shared by a CUDA IPC handle of `base`
    (WorkerClient.add_cuda_ipc_buffer). `legacy_ipc`: what the driver says of cudaIpcGetMemHandle
    on it (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE; None: not asked - VMM memory - or the
    driver could not answer); `mempool`: the stream-ordered pool it came from
    (CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE; 0: none, or not known), which nothing here can share."""

    def __init__(self, base, size, gpu, vmm, legacy_ipc=None, mempool=0):
        self.base, self.size, self.gpu, self.vmm = base, size, gpu, vmm
        self.legacy_ipc, self.mempool = legacy_ipc, mempool

    def shareable(self):
        """False when the driver ruled out both paths: pool memory, or non-VMM memory legacy IPC
        cannot export (True where it could not tell: cudaIpcGetMemHandle decides)."""
        return not self.mempool and (self.vmm or self.legacy_ipc is not False)


_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = 17


def _pointer_attribute(ptr, attribute):
    """cuPointerGetAttribute(attribute, ptr) as an int, or None where the driver cannot answer (no
    such entry point, or an older driver that does not know the attribute). Read from 8 zeroed
    bytes: the driver writes a boolean / int (IS_LEGACY_CUDA_IPC_CAPABLE) or a handle
    (MEMPOOL_HANDLE), whatever its width."""
    try:
        fn = _driver("cuPointerGetAttribute")
    except RuntimeError:
        return None
    out = ctypes.c_uint64(0)
    if fn(ctypes.byref(out), int(attribute), _CU_DEVICEPTR(int(ptr))) != 0:
        return None
    return out.value


def not_ipc_capable(base, size, gpu, mempool):
    """Why device memory [base, base + size) on `gpu` that legacy CUDA IPC cannot export is refused,
    and what to do instead (`mempool`: the driver's pool handle, 0 when it named none)."""
    if mempool:
        what = ("stream-ordered memory-pool memory (pool 0x%x; cudaMallocAsync / cudaMallocFromPoolAsync, as torch's "
                "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync allocates)" % mempool)
    else:
        what = "device memory the CUDA driver reports as not legacy-IPC capable (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 0)"
    return ("[0x%x, +%d) on GPU %d is %s: legacy CUDA IPC (cudaIpcGetMemHandle) cannot export it and it has no fd, so the "
            "daemon cannot map it. Use torch's native caching allocator instead (PYTORCH_CUDA_ALLOC_CONF without "
            "backend:cudaMallocAsync; optionally with expandable_segments:True, whose memory is shared by fd: "
            "add_cuda_vmm_buffer), or memory='cuda' (WeightBridge owns the buffer and copies each version into the "
            "parameters)" % (base, size, gpu, what))


def device_allocation_of(ptr, shareable=True):
    """The allocation that device pointer `ptr` lies in (cuMemGetAddressRange gives its base and
    size; cuMemRetainAllocationHandle succeeds for VMM memory only, which tells the two kinds
    apart). For VMM memory base/size are those of the one mapping at `ptr` (an expandable segment
    maps many back to back: vmm_allocations_of). ValueError when `ptr` is not device memory of this
    process, and (`shareable`, the default) when it is memory that neither path can share: the
    driver says it came from a stream-ordered memory pool (CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
    cudaMallocAsync, torch's backend:cudaMallocAsync) or, not being VMM memory, that legacy CUDA
    IPC cannot export it (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 0); the message
    (not_ipc_capable) names the range and what to use instead. Where the driver cannot answer
    (older drivers), legacy_ipc is None and cudaIpcGetMemHandle decides, as before. Holds no
    reference."""
    ptr = int(ptr)
    gpu = _pointer_device(ptr)
    rt = _rt()
    _check(rt.cudaSetDevice(gpu), "cudaSetDevice(%d)" % gpu)
    base, size, handle = _CU_DEVICEPTR(), ctypes.c_size_t(), _CU_HANDLE()
    _cu("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), _CU_DEVICEPTR(ptr))
    vmm = _driver("cuMemRetainAllocationHandle")(ctypes.byref(handle), ctypes.c_void_p(ptr)) == 0
    if vmm:
        _cu("cuMemRelease", handle)
    else:
        rt.cudaGetLastError()
    mempool = _pointer_attribute(ptr, _CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE) or 0
    capable = None if vmm else _pointer_attribute(ptr, _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)
    legacy_ipc = None if capable is None else capable != 0
    if mempool:
        legacy_ipc = False  # pool memory: never legacy-IPC capable, whatever else the driver says
    alloc = DeviceAllocation(base.value, size.value, gpu, vmm, legacy_ipc=legacy_ipc, mempool=mempool)
    if shareable and not alloc.shareable():
        raise ValueError(not_ipc_capable(alloc.base, alloc.size, gpu, mempool))
    return alloc


class IpcBuffer(_DeviceBytes):
    """A worker buffer over EXISTING cudaMalloc memory that is not ours (an engine's parameters
    from torch's caching allocator; WorkerClient.add_cuda_ipc_buffer): the whole allocation
    [ptr, ptr + size_bytes) found with cuMemGetAddressRange, exported by the CUDA IPC handle of its
    base (cudaIpcGetMemHandle). The daemon opens the handle, which maps the whole allocation from
    its base, so a tensor inside it is addressed by layout offsets relative to that base - as
    torch's own CUDA IPC sends (handle, offset from the allocation's base). Memory the driver
    says legacy IPC cannot export (stream-ordered pool memory: alloc.mempool / alloc.legacy_ipc
    False) is refused with not_ipc_capable's ValueError before cudaIpcGetMemHandle is called.
    close() only forgets the memory: it stays its owner's, never freed here."""

    def __init__(self, alloc, buffer_id=0):
        if alloc.vmm:
            raise ValueError("[0x%x, +%d) is CUDA VMM memory (cuMemCreate), which CUDA IPC handles cannot export: "
                             "add_cuda_vmm_buffer" % (alloc.base, alloc.size))
        if getattr(alloc, "mempool", 0) or getattr(alloc, "legacy_ipc", None) is False:
            # Refused before cudaIpcGetMemHandle, whose bare "invalid argument" would not say why.
            raise ValueError(not_ipc_capable(alloc.base, alloc.size, alloc.gpu, getattr(alloc, "mempool", 0)))
        self.id = buffer_id
        self.gpu = int(alloc.gpu)
        self.ptr = alloc.base
        self.size_bytes = int(alloc.size)
        rt = _rt()
        _check(rt.cudaSetDevice(self.gpu), "cudaSetDevice(%d)" % self.gpu)
        handle = (ctypes.c_byte * _IPC_HANDLE_BYTES)()
        _check(rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(self.ptr)), "cudaIpcGetMemHandle")
        self.ipc_handle = bytes(handle)
        self.gpu_uuid = gpu_uuid(self.gpu)
        self.base = self.ptr  # stays after close(), for offsets computed against it

    def close(self):
        self.ptr = 0  # forgets it; the memory is its owner's


class VmmAllocation(_DeviceBytes):
    """One CUDA VMM allocation of at least `size_bytes` (rounded up to the granularity) on `gpu`,
    exportable as a POSIX fd, mapped read-write here and zero-filled: a home for a worker's weights
    that the daemon maps with ONE fd, whatever the number of buffers (WorkerClient.add_cuda_vmm_buffer
    with pointers inside it). .tensor() views it in torch.

    `allocations` > 1: that many equal allocations (size_bytes / allocations, rounded up) mapped
    back to back in one range, the way torch's expandable segments map one allocation per page
    (for tests: a buffer over them needs one fd per allocation)."""

    def __init__(self, size_bytes, gpu, allocations=1):
        self.gpu = int(gpu)
        self.ptr = 0
        self._va = 0
        self._handles = []
        self._mapped = 0
        n = int(allocations)
        if n < 1:
            raise ValueError("VmmAllocation: allocations must be >= 1, got %d" % n)
        rt = _rt()
        _check(rt.cudaSetDevice(self.gpu), "cudaSetDevice(%d)" % self.gpu)
        prop = _AllocProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED, requestedHandleTypes=_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                          location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.gpu))
        g = ctypes.c_size_t()
        _cu("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop), _CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        each = (int(size_bytes) + n - 1) // n
        self.allocation_bytes = (each + g.value - 1) // g.value * g.value
        self.size_bytes = self.allocation_bytes * n
        va = _CU_DEVICEPTR()
        try:
            for _ in range(n):
                h = _CU_HANDLE()
                _cu("cuMemCreate", ctypes.byref(h), self.allocation_bytes, ctypes.byref(prop), 0)
                self._handles.append(h)
            _cu("cuMemAddressReserve", ctypes.byref(va), self.size_bytes, 0, _CU_DEVICEPTR(0), 0)
            self._va = va.value
            for i, h in enumerate(self._handles):
                _cu("cuMemMap", _CU_DEVICEPTR(self._va + i * self.allocation_bytes), self.allocation_bytes, 0, h, 0)
                self._mapped = i + 1
            self.ptr = va.value
            access = _AccessDesc(location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.gpu),
                                 flags=_CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            _cu("cuMemSetAccess", va, self.size_bytes, ctypes.byref(access), 1)
            _check(rt.cudaMemset(ctypes.c_void_p(self.ptr), 0, ctypes.c_size_t(self.size_bytes)), "cudaMemset")
            _check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        except Exception:
            self.close()
            raise
        self.gpu_uuid = gpu_uuid(self.gpu)

    def close(self):
        for i in range(self._mapped):
            _driver("cuMemUnmap")(_CU_DEVICEPTR(self._va + i * self.allocation_bytes), self.allocation_bytes)
        self._mapped = 0
        self.ptr = 0
        if self._va:
            _driver("cuMemAddressFree")(_CU_DEVICEPTR(self._va), self.size_bytes)
            self._va = 0
        for h in self._handles:
            _driver("cuMemRelease")(h)
        self._handles = []


class VmmBuffer:
    """A worker buffer inside a CUDA VMM allocation (WorkerClient.add_cuda_vmm_buffer): `size_bytes`
    at `ptr`, i.e. at `vmm_offset` of the allocation shared under `vmm_key` and on through the
    allocations of `vmm_next_keys` (mapped right after it, in order), if any. The memory stays the
    caller's (close() frees nothing); it must stay allocated while the buffer is registered."""

    def __init__(self, buffer_id, ptr, size_bytes, gpu, gpu_uuid_bytes, vmm_key, vmm_offset, vmm_next_keys=()):
        self.id = buffer_id
        self.ptr = ptr
        self.size_bytes = size_bytes
        self.gpu = gpu
        self.gpu_uuid = gpu_uuid_bytes
        self.vmm_key = vmm_key
        self.vmm_offset = vmm_offset
        self.vmm_next_keys = list(vmm_next_keys)

    def close(self):
        pass
