"""Layout discovery: where a worker's local tensors live in its buffers (docs/integration.md).

WorkerClient.describe_layout(layout, model=...) asks the node daemon - before anything is
registered - how large each buffer must be and where every local tensor sits (the daemon computes
it with the same planner code it resolves layouts with: planner/layout_info.h);
register_layout(...) answers the same description in LayoutInfo.layout. Then:

    desc = client.describe_layout(wb.PresetLayout("megatron", tp=2, rank=0), model=model)
    buf = client.create_buffer(desc.buffer_bytes(0))
    client.register_layout(wb.PresetLayout("megatron", tp=2, rank=0))
    views = desc.views(client.buffers)          # {local name: numpy array over the shm buffer}
    views["decoder.layers.0.self_attention.linear_qkv.weight"][:] = ...   # fills the buffer in place

numpy has no bfloat16: bfloat16 tensors are viewed as uint16 (their bits; torch users: see
`torch_views`), float8 / e8m0 as uint8, int4 and float4_e2m1 (NVFP4) as uint8 with the last dim
halved (two elements per byte, the even one in the low nibble). CUDA buffers have no host view: `device_pointer(buffers,
name)` gives the device address (buffer base + offset) for a torch/cupy view of your own.
"""

import dataclasses
from typing import Dict, List, Optional

import numpy as np

from weightbridge._proto import pb

# proto DType -> (name, numpy dtype of the view, bits per element)
_DTYPES = {pb.DTYPE_BF16: ("bfloat16", np.uint16, 16), pb.DTYPE_F16: ("float16", np.float16, 16),
           pb.DTYPE_F32: ("float32", np.float32, 32), pb.DTYPE_F8_E4M3: ("float8_e4m3", np.uint8, 8),
           pb.DTYPE_I64: ("int64", np.int64, 64), pb.DTYPE_E8M0: ("float8_e8m0", np.uint8, 8),
           pb.DTYPE_I4: ("int4", np.uint8, 4), pb.DTYPE_F4_E2M1: ("float4_e2m1", np.uint8, 4)}


@dataclasses.dataclass
class TensorPlace:
    """One local tensor: a preset's framework tensor, a quantised tensor's scales (NVFP4: also its
    float32 global scale), or (explicit pieces) one piece named after its canonical tensor."""
    name: str
    shape: tuple        # elements (int4 / float4_e2m1: unpacked)
    dtype: str          # as stored: "bfloat16", ..., "float8_e4m3", "int4", "float4_e2m1", "float8_e8m0"
    buffer_id: int
    offset_bytes: int   # of element [0, ..., 0]
    strides: tuple      # elements per dim (row-major for preset tensors)
    size_bytes: int     # bytes spanned from offset_bytes
    pieces: tuple       # indices into LayoutDescription.pieces held in this tensor
    scale_tensor: str = ""  # quantised: the local tensor holding its scales
    scales_of: str = ""     # scales: the tensor they belong to
    global_scale_tensor: str = ""  # NVFP4: the local tensor holding its float32 global scale ("<name>_scale_2")
    global_scale_of: str = ""      # a global scale: the NVFP4 tensor it belongs to (shared: the first naming it)

    def numpy_dtype(self):
        return _DTYPES_BY_NAME[self.dtype][0]


_DTYPES_BY_NAME = {name: (npd, bits) for name, npd, bits in _DTYPES.values()}


@dataclasses.dataclass
class LayoutDescription:
    buffers: Dict[int, int]            # buffer id -> the least bytes it must have
    tensors: Dict[str, TensorPlace]    # by local name, in buffer order
    pieces: List                       # pb.Piece: canonical boxes and where they land
    piece_bytes: int                   # canonical bytes the pieces cover (moved per version)
    source: str                        # "preset" | "pieces" | "index_probe"

    @staticmethod
    def from_proto(d):
        tensors = {}
        for t in d.tensors:
            if t.dtype not in _DTYPES:
                raise ValueError("local tensor %s: unknown dtype %d" % (t.name, t.dtype))
            tensors[t.name] = TensorPlace(t.name, tuple(t.shape), _DTYPES[t.dtype][0], t.buffer_id, t.offset_bytes,
                                          tuple(t.strides), t.size_bytes, tuple(t.pieces), t.scale_tensor, t.scales_of,
                                          t.global_scale_tensor, t.global_scale_of)
        return LayoutDescription({b.buffer_id: b.size_bytes for b in d.buffers}, tensors, list(d.pieces),
                                 d.piece_bytes, d.source)

    def buffer_bytes(self, buffer_id=0):
        """The least size of buffer `buffer_id` (0 when the layout does not use it)."""
        return self.buffers.get(buffer_id, 0)

    def __getitem__(self, name) -> TensorPlace:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError("local tensor %r is not in the layout (it has %d, e.g. %s)"
                           % (name, len(self.tensors), ", ".join(list(self.tensors)[:3]))) from None

    def _buffer(self, buffers, t):
        for b in buffers:
            if b.id == t.buffer_id:
                if t.offset_bytes + t.size_bytes > b.size_bytes:
                    raise ValueError("local tensor %s [%d, +%d) reaches past buffer %d of %d bytes (size it %d as described)"
                                     % (t.name, t.offset_bytes, t.size_bytes, b.id, b.size_bytes, self.buffer_bytes(b.id)))
                return b
        raise ValueError("local tensor %s lives in buffer %d, which is not among the %d buffers given"
                         % (t.name, t.buffer_id, len(buffers)))

    def view(self, buffers, name):
        """numpy view (no copy, writable) of local tensor `name` in its host (shm) buffer, with the
        tensor's shape and strides (see the module doc for the element types)."""
        t = self[name]
        b = self._buffer(buffers, t)
        if not hasattr(b, "bytes") or b.bytes is None:
            raise ValueError("local tensor %s lives in buffer %d, which is not host memory: use device_pointer" % (name, b.id))
        npd, bits = _DTYPES_BY_NAME[t.dtype]
        shape, strides = list(t.shape), [int(s) for s in t.strides]
        if bits == 4:  # two per byte along the last dim (stride 1): a byte view of the pairs
            if shape and (shape[-1] % 2 or strides[-1] != 1):
                raise ValueError("%s tensor %s: last dim must be even with stride 1" % (t.dtype, name))
            if shape:
                shape[-1] //= 2
                strides = [s // 2 for s in strides[:-1]] + [1]
            item = 1
        else:
            item = np.dtype(npd).itemsize
        if t.size_bytes <= 0 or 0 in shape:
            return np.zeros(shape, dtype=npd)
        raw = b.bytes[t.offset_bytes:t.offset_bytes + t.size_bytes]
        base = raw[:t.size_bytes - t.size_bytes % item].view(npd)
        return np.lib.stride_tricks.as_strided(base, shape=shape, strides=[s * item for s in strides])

    def views(self, buffers):
        """{local name: numpy view} for every local tensor in a host buffer."""
        host = {b.id for b in buffers if getattr(b, "bytes", None) is not None}
        return {n: self.view(buffers, n) for n, t in self.tensors.items() if t.buffer_id in host}

    def device_pointer(self, buffers, name):
        """Device address of local tensor `name` in its CUDA buffer (CudaBuffer / VmmBuffer: base +
        offset_bytes), for a torch / cupy view made by the caller."""
        t = self[name]
        b = self._buffer(buffers, t)
        if not getattr(b, "ptr", 0):
            raise ValueError("local tensor %s lives in buffer %d, which is not CUDA memory: use view" % (name, b.id))
        return b.ptr + t.offset_bytes

    def torch_views(self, buffers):
        """{local name: torch tensor} over host (shm) or CUDA buffers (CudaBuffer, VmmBuffer), no
        copy, in the tensor's real dtype (bfloat16, float8_e4m3fn, float8_e8m0fnu when torch has
        them, else uint8); int4 and float4_e2m1 tensors as packed uint8 with the last dim halved.
        Needs torch."""
        import torch  # only when used

        tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int64": torch.int64,
               "float8_e4m3": getattr(torch, "float8_e4m3fn", torch.uint8),
               "float8_e8m0": getattr(torch, "float8_e8m0fnu", torch.uint8), "int4": torch.uint8,
               "float4_e2m1": torch.uint8}
        out = {}
        for name, t in self.tensors.items():
            b = self._buffer(buffers, t)
            dtype = tdt[t.dtype]
            if getattr(b, "bytes", None) is not None:  # host: through the numpy view (same memory)
                arr = self.view(buffers, name)
                # torch.from_numpy takes no uint16 before torch 2.3: reinterpret as int16 first.
                src = torch.from_numpy(arr.view(np.int16) if arr.dtype == np.uint16 else arr)
                out[name] = src.view(dtype) if src.element_size() == _itemsize(torch, dtype) else src
                continue
            shape, strides = list(t.shape), [int(x) for x in t.strides]
            if t.dtype in ("int4", "float4_e2m1") and shape:
                shape[-1] //= 2
                strides = [x // 2 for x in strides[:-1]] + [1]
            elem = _itemsize(torch, dtype)
            n = max(elem, t.size_bytes - t.size_bytes % elem)
            holder = type("CudaBytes", (), {})()
            holder.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (b.ptr + t.offset_bytes, False),
                                               "version": 2}
            raw = torch.as_tensor(holder, device="cuda:%d" % b.gpu)
            out[name] = raw.view(dtype).as_strided(shape, strides)
        return out


def _itemsize(torch, dtype):
    return torch.empty((), dtype=dtype).element_size()


def describe_request(model_id, worker_id, layout_spec, model_spec=None, role=pb.ROLE_UNSPECIFIED):
    req = pb.DescribeLayoutRequest(model_id=model_id, worker_id=worker_id or "", layout=layout_spec, role=role)
    if model_spec is not None:
        req.model.CopyFrom(model_spec)
    return req


def optional_description(resp) -> Optional[LayoutDescription]:
    """The description in a RegisterLayoutResponse (None from a daemon without layout discovery)."""
    if not resp.HasField("layout"):
        return None
    return LayoutDescription.from_proto(resp.layout)
