"""GPU buffers for the daemon: device memory exported as a CUDA IPC handle.

torch is imported only when a torch tensor is asked for; the allocation itself goes through the
CUDA runtime (libcudart via ctypes) so that the buffer is one cudaMalloc'ed block starting at the
handle's base: the daemon opens it with cudaIpcOpenMemHandle and the layout's byte offsets are
relative to that base. (Tensors from torch's caching allocator can sit at an offset inside a larger
block, and expandable segments cannot be exported at all, which is why we do not export arbitrary
torch tensors: allocate here, then use .tensor() views.)

The runtime is found as libcudart.so(.13/.12), or at $WB_CUDART when set (CI points it at the
emulated runtime, //tools/fake_cuda:libwb_fake_cudart.so, to run this module without a GPU:
client/python/tests/client_cuda_test.py). write()/read() move bytes without torch. Never run on a
real GPU yet.
"""

import ctypes
import ctypes.util
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


class CudaBuffer:
    """`size_bytes` of device memory on `gpu`, zero-filled, exportable by CUDA IPC."""

    def __init__(self, size_bytes, gpu, buffer_id=0):
        self.id = buffer_id
        self.gpu = int(gpu)
        self.size_bytes = int(size_bytes)
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
        typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.int64: "<i8", torch.uint8: "|u1",
                   torch.int16: "<i2"}
        # bfloat16 has no array-interface type string: view the bytes as int16 and reinterpret.
        view_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
        holder = type("CudaArray", (), {})()
        holder.__cuda_array_interface__ = {"shape": tuple(int(d) for d in shape), "typestr": typestr[view_dtype],
                                          "data": (self.ptr + offset_bytes, False), "version": 2}
        t = torch.as_tensor(holder, device="cuda:%d" % self.gpu)
        return t.view(dtype) if view_dtype != dtype else t

    def close(self):
        if self.ptr:
            _rt().cudaFree(ctypes.c_void_p(self.ptr))
            self.ptr = 0
