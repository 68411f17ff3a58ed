"""The client's torch / CUDA paths against a stand-in for torch that behaves as the real one does
where the client depends on it (torch is not installed here and there is no GPU).

The stand-in (`FakeTorch`, installed as sys.modules["torch"] in this process only) follows
pytorch's sources, read at pytorch/pytorch commit 007aa8aee7ee70454229698ca4b2e45283f15239:
  - aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda / copy_device_to_device: a copy_ between
    two CUDA tensors is only QUEUED on the current stream (CUDACachingAllocator::memcpyAsync or a
    copy kernel; no host synchronisation); a copy between host and device with non_blocking=False
    ends in at::cuda::memcpy_and_sync (the stream's earlier work and the copy are done when it
    returns). Here: a device-to-device copy_ is pending until torch.cuda.synchronize(device) or a
    blocking host copy on that device; the "device memory" a daemon sees is what the finished
    copies wrote.
  - torch/csrc/utils/tensor_numpy.cpp, tensor_from_cuda_array_interface: `typestr` is parsed by
    numpy (PyArray_DescrConverter) and mapped with numpy_dtype_to_aten - there is no type string
    for bfloat16, float8 or float4; `strides` optional.
  - Tensor.view(dtype) (aten/src/ATen/native/TensorConversions.cpp view_dtype): the same element
    size always; another size needs the last dim contiguous (stride 1).
  - c10/core/ScalarType.h: float8_e4m3fn / float8_e8m0fnu are floating types (isFloat8Type).
The daemon is stood in for by a client whose calls (Publish / Apply) read or write the registered
buffers' device memory at once, as the daemon's own process would, and record any copy of this
process still pending then. Run by //client/python:torch_conformance_test.
"""

import os
import sys
import types
import unittest

import numpy as np

# ------------------------------------------------------------------------------ the torch stand-in

_DEVICE_MEMORY = {}  # base address -> numpy uint8 array: the emulated GPU 0's allocations
_next_address = [0x7f0000000000]


def device_alloc(nbytes):
    """`nbytes` of emulated device memory (zeros); returns (address, its uint8 array)."""
    base = _next_address[0]
    _next_address[0] += (nbytes + 4095) // 4096 * 4096 + 4096
    mem = np.zeros(nbytes, dtype=np.uint8)
    _DEVICE_MEMORY[base] = mem
    return base, mem


def _region(ptr):
    for base, mem in _DEVICE_MEMORY.items():
        if base <= ptr < base + mem.size:
            return base, mem
    raise RuntimeError("0x%x is not device memory" % ptr)


class _Dtype:
    def __init__(self, name, np_dtype, itemsize, floating):
        self.name, self.np, self.itemsize, self.is_floating_point = name, np.dtype(np_dtype), itemsize, floating

    def __repr__(self):
        return "torch." + self.name

    __str__ = __repr__


_Dtype.__module__ = "torch"


class _Device:
    def __init__(self, spec):
        spec = str(spec)
        self.type = spec.split(":")[0]
        self.index = int(spec.split(":")[1]) if ":" in spec else (0 if self.type == "cuda" else None)

    def __eq__(self, other):
        return isinstance(other, _Device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))

    def __repr__(self):
        return "device(type=%r, index=%r)" % (self.type, self.index)


_Device.__module__ = "torch"


def _bf16_to_f32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16(x):
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


class Tensor:
    """A torch tensor over numpy storage `arr` (the dtype's storage type; a view shares memory)."""

    def __init__(self, arr, dtype, device="cpu"):
        self.arr, self.dtype, self.device = arr, dtype, device if isinstance(device, _Device) else _Device(device)

    # -- attributes the client reads
    @property
    def shape(self):
        return tuple(self.arr.shape)

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    @property
    def data(self):
        return self

    def element_size(self):
        return self.dtype.itemsize

    def nelement(self):
        return int(self.arr.size)

    def is_contiguous(self):
        return self.arr.flags["C_CONTIGUOUS"]

    def data_ptr(self):
        addr = self.arr.__array_interface__["data"][0]
        if self.is_cuda:  # the emulated device address of that byte
            for base, mem in _DEVICE_MEMORY.items():
                start = mem.__array_interface__["data"][0]
                if start <= addr < start + mem.size:
                    return base + addr - start
        return addr

    def detach(self):
        return self

    def __getitem__(self, idx):
        return Tensor(self.arr[idx], self.dtype, self.device)

    def values(self):
        """float32 values (floating dtypes) or the stored integers."""
        if self.dtype.name == "bfloat16":
            return _bf16_to_f32(self.arr)
        if self.dtype.name == "float8_e8m0fnu":  # 2^(bits - 127), 255 = NaN
            return np.where(self.arr == 255, np.float32("nan"), np.exp2(self.arr.astype(np.float32) - 127))
        if self.dtype.name in ("float8_e4m3fn", "float4_e2m1fn_x2"):
            raise NotImplementedError("stand-in: no value conversion of %s" % self.dtype)
        return self.arr

    def view(self, dtype):
        if dtype.itemsize != self.dtype.itemsize:
            if self.arr.ndim == 0 or self.arr.strides[-1] != self.arr.itemsize:
                raise RuntimeError("self.stride(-1) must be 1 to view %s as %s" % (self.dtype, dtype))
        return Tensor(self.arr.view(dtype.np), dtype, self.device)

    def as_strided(self, shape, strides):
        base = self.arr
        return Tensor(np.lib.stride_tricks.as_strided(base, shape=tuple(shape),
                                                      strides=[int(s) * base.itemsize for s in strides]),
                      self.dtype, self.device)

    def _assign(self, src):
        """The copy itself: the bits between equal dtypes, else by value (as torch's copy_ converts:
        uint8 127 into float8_e8m0fnu is the e8m0 code of 127.0, not 127)."""
        if src.dtype is self.dtype:
            self.arr[...] = src.arr
        elif self.dtype.name == "bfloat16":
            self.arr[...] = _f32_to_bf16(src.values())
        elif self.dtype.name == "float8_e8m0fnu":
            v = np.asarray(src.values(), dtype=np.float32)
            self.arr[...] = np.where(np.isnan(v) | (v <= 0), 255, np.clip(np.round(np.log2(np.where(v > 0, v, 1))) + 127,
                                                                        0, 254)).astype(np.uint8)
        elif self.dtype.name in ("float8_e4m3fn", "float4_e2m1fn_x2"):
            raise NotImplementedError("stand-in: no value conversion into %s" % self.dtype)
        else:
            self.arr[...] = src.values().astype(self.dtype.np)

    # -- kernels: on a CUDA tensor queued on the current stream, as copies are
    def _kernel(self, out, fill):
        if out.is_cuda:
            cuda._pending.setdefault(out.device.index, []).append(fill)
        else:
            fill()
        return out

    def to(self, device=None, dtype=None):
        dtype = dtype or self.dtype
        out = _empty(self.shape, dtype, device or self.device)
        return self._kernel(out, lambda: out._assign(self))

    def __mul__(self, k):
        out = _empty(self.shape, torch.float32, self.device)

        def fill():
            out.arr[...] = self.values().astype(np.float32) * np.float32(k)
        return self._kernel(out, fill)

    def __setitem__(self, idx, value):
        def fill():
            self.arr[idx] = value
        self._kernel(self, fill)

    # -- copies, with CUDA's stream semantics
    def copy_(self, src, non_blocking=False):
        if tuple(src.shape) != self.shape:
            raise RuntimeError("copy_: shapes %s and %s" % (self.shape, tuple(src.shape)))

        def run():
            self._assign(src)

        if self.is_cuda and src.is_cuda:  # copy_device_to_device: queued on the current stream
            cuda._pending.setdefault(self.device.index, []).append(run)
        elif self.is_cuda or src.is_cuda:  # memcpy_and_sync: the stream's work, then this copy, is done
            cuda.synchronize((self if self.is_cuda else src).device)
            run()
        else:
            run()
        return self


Tensor.__module__ = "torch"


class _Cuda:
    """torch.cuda: the queued device work of each GPU."""

    def __init__(self):
        self._pending = {}
        self.synchronize_calls = []

    def synchronize(self, device=None):
        self.synchronize_calls.append(device)
        index = None if device is None else (device.index if isinstance(device, _Device) else int(device))
        for i in list(self._pending):
            if index is None or i == index:
                for run in self._pending.pop(i):
                    run()

    def pending(self):
        return sum(len(v) for v in self._pending.values())

    def is_initialized(self):
        return True


cuda = _Cuda()

torch = types.ModuleType("torch")
torch.Tensor = Tensor
torch.cuda = cuda
for _name, _np, _size, _floating in (("bfloat16", np.uint16, 2, True), ("float16", np.float16, 2, True),
                                     ("float32", np.float32, 4, True), ("int64", np.int64, 8, False),
                                     ("int32", np.int32, 4, False), ("int16", np.int16, 2, False),
                                     ("uint8", np.uint8, 1, False), ("float8_e4m3fn", np.uint8, 1, True),
                                     ("float8_e8m0fnu", np.uint8, 1, True), ("float4_e2m1fn_x2", np.uint8, 1, False)):
    setattr(torch, _name, _Dtype(_name, _np, _size, _floating))
_BY_NUMPY = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, np.dtype(np.int64): torch.int64,
             np.dtype(np.int32): torch.int32, np.dtype(np.int16): torch.int16, np.dtype(np.uint8): torch.uint8}


def _empty(shape, dtype, device="cpu"):
    return Tensor(np.zeros(shape, dtype=dtype.np), dtype, device)


def _from_numpy(a):
    if a.dtype not in _BY_NUMPY:
        raise TypeError("can't convert np.ndarray of type %s" % a.dtype)
    return Tensor(a, _BY_NUMPY[a.dtype], "cpu")


def _as_tensor(obj, device=None):
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is None:
        raise TypeError("as_tensor: only __cuda_array_interface__ objects here")
    npd = np.dtype(iface["typestr"])  # numpy parses the type string, as torch does
    if npd not in _BY_NUMPY:
        raise TypeError("can't convert CUDA array interface type %s" % iface["typestr"])
    ptr = iface["data"][0]
    base, mem = _region(ptr)
    shape = tuple(iface["shape"])
    arr = np.ndarray(shape, dtype=npd, buffer=mem, offset=ptr - base, strides=iface.get("strides"))
    return Tensor(arr, _BY_NUMPY[npd], device or "cuda:0")


class Parameter(Tensor):
    """torch.nn.Parameter as far as `.data` and requires_grad go: torch/csrc/autograd/variable.cpp
    VariableHooks::set_data refuses data of a non-differentiable dtype while the parameter requires
    grad ("data set to a tensor that requires gradients must be floating point or complex dtype"),
    and requires_grad_(True) on an integer tensor fails ("only Tensors of floating point dtype can
    require gradients")."""

    def __init__(self, data, requires_grad=True):
        self._data, self.requires_grad = data, requires_grad

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, new):
        if self.requires_grad and not new.dtype.is_floating_point:
            raise RuntimeError("data set to a tensor that requires gradients must be floating point or complex dtype")
        self._data = new

    def requires_grad_(self, requires_grad=True):
        if requires_grad and not self._data.dtype.is_floating_point:
            raise RuntimeError("only Tensors of floating point dtype can require gradients")
        self.requires_grad = requires_grad
        return self

    @property
    def shape(self):
        return self._data.shape


Parameter.__module__ = "torch.nn.parameter"


def _full(shape, value, dtype=None, device="cpu"):
    return Tensor(np.full(shape, value, dtype=dtype.np), dtype, device)


def _numpy(self):
    if self.is_cuda:
        raise TypeError("can't convert cuda tensor to numpy")
    return self.arr


Tensor.numpy = _numpy
torch.nn = types.SimpleNamespace(Parameter=Parameter)
torch.full = _full
torch.empty = _empty
torch.from_numpy = _from_numpy
torch.as_tensor = _as_tensor
torch.device = _Device


def cuda_tensor(values, dtype):
    """A CUDA tensor in its own emulated allocation holding `values` (storage type of `dtype`)."""
    values = np.ascontiguousarray(values, dtype=dtype.np)
    base, mem = device_alloc(max(1, values.nbytes))
    arr = np.ndarray(values.shape, dtype=dtype.np, buffer=mem)
    arr[...] = values
    return Tensor(arr, dtype, "cuda:0")


sys.modules["torch"] = torch

import weightbridge as wb  # noqa: E402
from weightbridge import cuda as wb_cuda  # noqa: E402
from weightbridge.client import LayoutInfo  # noqa: E402
from weightbridge.discovery import LayoutDescription, TensorPlace  # noqa: E402
from weightbridge.integrations import megatron  # noqa: E402
from weightbridge.integrations._rollout import RolloutHook  # noqa: E402


# ------------------------------------------------------------------------------ the daemon stand-in

class DeviceBuffer(wb_cuda._DeviceBytes):
    """A registered CUDA buffer (what create_cuda_buffer returns) in emulated device memory."""

    def __init__(self, size_bytes, gpu, buffer_id=0):
        self.id, self.gpu, self.size_bytes = buffer_id, gpu, size_bytes
        self.ptr, self.mem = device_alloc(size_bytes)

    def close(self):
        pass


class FakeDaemonClient:
    """WorkerClient's calls the hooks make, answered as the daemon would: describe / register the
    layout `desc`; publish reads the buffer's device memory at once (another process reads it
    then), apply writes `versions[v]` into it at once. Each call records how many copies of this
    process were still pending on the device when the daemon touched the buffer."""

    def __init__(self, desc, versions=None):
        self.desc, self.versions = desc, versions or {}
        self.buffers, self.published, self.pending_at_daemon = [], {}, []

    def describe_layout(self, layout, model=None):
        return self.desc

    def register_worker(self, model, worker_id, role, gpu=-1):
        return 1

    def create_cuda_buffer(self, size_bytes, gpu):
        b = DeviceBuffer(size_bytes, gpu, len(self.buffers))
        self.buffers.append(b)
        return b

    def register_layout(self, layout):
        return LayoutInfo(0, 0, "preset", self.desc)

    def _touch(self):
        self.pending_at_daemon.append(cuda.pending())

    def publish(self, version, timeout=60.0):
        self._touch()
        b = self.buffers[0]
        self.published[version] = {n: _DEVICE_MEMORY[b.ptr][t.offset_bytes:t.offset_bytes + t.size_bytes].copy()
                                   for n, t in self.desc.tensors.items()}
        return types.SimpleNamespace(version=version, stall_seconds=0.0)

    def apply(self, version=0, timeout=60.0):
        self._touch()
        b = self.buffers[0]
        for n, t in self.desc.tensors.items():
            _DEVICE_MEMORY[b.ptr][t.offset_bytes:t.offset_bytes + t.size_bytes] = self.versions[version][n]
        return types.SimpleNamespace(applied_version=version, stall_seconds=0.0)

    def close(self):
        pass


def description(tensors, dtypes=None):
    """A LayoutDescription of tensors {name: shape} (bfloat16 unless `dtypes` names another)
    packed row-major, 256-byte aligned."""
    places, off = {}, 0
    for i, (name, shape) in enumerate(tensors.items()):
        dtype = (dtypes or {}).get(name, "bfloat16")
        n = int(np.prod(shape)) * {"bfloat16": 2, "float32": 4, "float8_e8m0": 1, "float8_e4m3": 1}[dtype]
        strides = tuple(int(np.prod(shape[k + 1:])) for k in range(len(shape)))
        places[name] = TensorPlace(name, tuple(shape), dtype, 0, off, strides, n, (i,))
        off += (n + 255) // 256 * 256
    return LayoutDescription({0: off}, places, [None] * len(places), off, "preset")


TENSORS = {"decoder.layers.0.mlp.linear_fc1.weight": (8, 16), "decoder.final_layernorm.weight": (16,)}
MODEL = wb.ModelConfig(model_id="m", explicit_tensors=[("x", [1])], mode="one_step_off")


def bf16_values(seed, shape):
    rng = np.random.default_rng(seed)
    return _f32_to_bf16(rng.standard_normal(shape).astype(np.float32))


class CudaCopiesFinishBeforeTheDaemonTest(unittest.TestCase):
    """torch copies into or out of a registered CUDA buffer are queued on this process's stream
    (Copy.cu); the daemon reads (Publish) and writes (Apply) the buffer from its own process, so
    the hooks must have synchronized them before the call."""

    def setUp(self):
        cuda._pending.clear()

    def test_trainer_copies_land_before_publish(self):
        desc = description(TENSORS)
        client = FakeDaemonClient(desc)
        hook = megatron.MegatronTrainerHook(None, MODEL, rank=0, memory="cuda", gpu=0, client=client)
        params = {n: cuda_tensor(bf16_values(i, s), torch.bfloat16) for i, (n, s) in enumerate(TENSORS.items())}
        hook.publish(1, [("module." + n, t) for n, t in params.items()])
        self.assertEqual(client.pending_at_daemon, [0], "copies into the CUDA buffer still queued at Publish")
        for n, t in params.items():
            np.testing.assert_array_equal(client.published[1][n].view(np.uint16), t.arr.ravel(), err_msg=n)

    def rollout(self, versions, desc=None):
        client = FakeDaemonClient(desc or description(TENSORS), versions)
        return RolloutHook("vllm", None, MODEL, memory="cuda", gpu=0, client=client), client

    def test_rollout_copies_out_of_the_buffer_finish_before_the_next_apply(self):
        versions = {v: {n: bf16_values(10 * v + i, s).view(np.uint8).ravel() for i, (n, s) in enumerate(TENSORS.items())}
                    for v in (1, 2)}
        rollout, client = self.rollout(versions)
        params = {n: cuda_tensor(np.zeros(s), torch.bfloat16) for n, s in TENSORS.items()}
        self.assertEqual(rollout.apply(1, params), 1)
        self.assertEqual(rollout.apply(2, params), 2)
        # Apply v2 wrote the buffer: a copy of v1 still queued then would have read v2's bytes.
        self.assertEqual(client.pending_at_daemon, [0, 0], "copies out of the CUDA buffer still queued at the next Apply")
        cuda.synchronize()
        for n, p in params.items():
            np.testing.assert_array_equal(p.arr.view(np.uint8).ravel(), versions[2][n], err_msg=n)

    def test_bind_copies_current_weights_before_the_daemon_writes(self):
        rollout, client = self.rollout({1: {n: np.zeros(int(np.prod(s)) * 2, np.uint8) for n, s in TENSORS.items()}})
        weights = {n: bf16_values(i, s) for i, (n, s) in enumerate(TENSORS.items())}
        params = {n: types.SimpleNamespace(data=cuda_tensor(w, torch.bfloat16)) for n, w in weights.items()}
        rollout.bind(params)
        b = client.buffers[0]
        self.assertEqual(cuda.pending(), 0, "bind's copies of the current weights still queued")
        for n, t in rollout.layout.tensors.items():
            got = _DEVICE_MEMORY[b.ptr][t.offset_bytes:t.offset_bytes + t.size_bytes].view(np.uint16)
            np.testing.assert_array_equal(got, weights[n].ravel(), err_msg=n)


class LoraLayer:
    """vLLM's linear *WithLoRA layer as create_lora_weights makes it (vllm-project/vllm
    vllm/lora/layers/base_linear.py, read at 01235a494f173b84814002c8382137e379371b07): tuples of
    CUDA tensors lora_a_stacked [max_loras, 1, max_lora_rank, in], lora_b_stacked
    [max_loras, 1, out, max_lora_rank], in the LoRA dtype."""

    def __init__(self, max_loras, rank, n_in, n_out):
        self.lora_a_stacked = (cuda_tensor(np.zeros((max_loras, 1, rank, n_in)), torch.bfloat16),)
        self.lora_b_stacked = (cuda_tensor(np.zeros((max_loras, 1, n_out, rank)), torch.bfloat16),)


class BindKeepsTheParametersDtypeTest(unittest.TestCase):
    """bind() re-points each parameter at its place in the CUDA buffer. Where vLLM holds a tensor in
    another dtype of the same bytes (MXFP8's e8m0 scales as uint8: the layout's float8_e8m0 is
    torch.float8_e8m0fnu in torch_views), the parameter must keep its dtype and shape (the engine's
    kernels read it as such) and the current weights must go in as bits: torch's copy_ between two
    dtypes converts values."""

    def setUp(self):
        cuda._pending.clear()

    def test_e8m0_scales_held_as_uint8(self):
        scale, weight = "model.layers.0.mlp.down_proj.weight_scale", "model.layers.0.mlp.down_proj.weight"
        desc = description({weight: (4, 64), scale: (4, 2)}, {scale: "float8_e8m0"})
        rollout, client = CudaCopiesFinishBeforeTheDaemonTest.rollout(self, {}, desc)
        bits = np.array([[127, 130], [120, 126], [131, 127], [100, 140]], np.uint8)
        params = {weight: types.SimpleNamespace(data=cuda_tensor(bf16_values(1, (4, 64)), torch.bfloat16)),
                  scale: types.SimpleNamespace(data=cuda_tensor(bits, torch.uint8))}
        rollout.bind(params)
        self.assertIs(params[scale].data.dtype, torch.uint8)
        self.assertEqual(params[scale].data.shape, (4, 2))
        t = desc.tensors[scale]
        np.testing.assert_array_equal(_DEVICE_MEMORY[client.buffers[0].ptr][t.offset_bytes:t.offset_bytes + 8],
                                      bits.ravel())
        self.assertEqual(params[scale].data.data_ptr(), client.buffers[0].ptr + t.offset_bytes)  # bound

    def test_another_shape_or_a_value_conversion_refused_before_anything_is_bound(self):
        first, norm = list(TENSORS)
        for bad in (cuda_tensor(np.zeros((16,)), torch.float32),     # bfloat16 into float32: values
                    cuda_tensor(np.zeros((4, 4)), torch.bfloat16)):  # another shape
            rollout, client = CudaCopiesFinishBeforeTheDaemonTest.rollout(self, {})
            kept = cuda_tensor(np.zeros((8, 16)), torch.bfloat16)
            params = {first: types.SimpleNamespace(data=kept), norm: types.SimpleNamespace(data=bad)}
            with self.assertRaisesRegex(ValueError, "bind: parameter %s .*not the same bytes" % norm):
                rollout.bind(params)
            self.assertFalse(rollout.bound)
            self.assertIs(params[first].data, kept)  # nothing re-pointed
            self.assertIs(params[norm].data, bad)


class VllmLoraSlotCopiesTest(unittest.TestCase):
    """vllm_lora with memory="cuda": each version is copied (lora_b scaled) from the CUDA buffer
    into the adapter's slot on this process's stream; finished before the daemon's next Apply
    writes the buffer."""

    def setUp(self):
        cuda._pending.clear()

    def test_slot_copies_finish_before_the_next_apply(self):
        from weightbridge.integrations import vllm_lora
        module, max_rank, n_in, n_out, adapter, slot = "model.layers.0.self_attn.o_proj", 16, 8, 8, 7, 1
        shapes = {module + ".lora_a_stacked.0": (max_rank, n_in), module + ".lora_b_stacked.0": (n_out, max_rank)}
        desc = description(shapes)
        desc.pieces = [types.SimpleNamespace(tensor=n, offset_bytes=t.offset_bytes, strides=list(t.strides),
                                             box=types.SimpleNamespace(begin=[0, 0], end=list(t.shape)))
                       for n, t in desc.tensors.items()]
        versions = {v: {n: bf16_values(10 * v + i, s).view(np.uint8).ravel() for i, (n, s) in enumerate(shapes.items())}
                    for v in (1, 2)}
        client = FakeDaemonClient(desc, versions)
        layer = LoraLayer(4, max_rank, n_in, n_out)
        model_obj = types.SimpleNamespace(named_modules=lambda: [("", None), (module, layer)])
        manager = types.SimpleNamespace(lora_index_to_id=[None, adapter, None, None], model=model_obj,
                                        _active_adapters=types.SimpleNamespace(pinned_items={adapter}),
                                        get_adapter=lambda i: types.SimpleNamespace(rank=2))
        model = wb.ModelConfig(model_id="lora", hf_config_json="{}", mode="one_step_off",
                               lora=wb.LoraConfig(target_modules=["o_proj"], r=2, alpha=4.0))
        rollout = vllm_lora.VllmLoraRollout(None, model, adapter, lora_manager=manager, memory="cuda", gpu=0, client=client)
        self.assertEqual(rollout.apply(1), 1)
        self.assertEqual(rollout.apply(2), 2)
        self.assertEqual(client.pending_at_daemon, [0, 0], "copies out of the CUDA buffer still queued at the next Apply")
        cuda.synchronize()
        a, b = (_bf16_to_f32(versions[2][n].view(np.uint16).reshape(s)) for n, s in shapes.items())
        np.testing.assert_array_equal(_bf16_to_f32(layer.lora_a_stacked[0].arr[slot, 0]), a)
        np.testing.assert_array_equal(_bf16_to_f32(layer.lora_b_stacked[0].arr[slot, 0]), b * 2)  # alpha / r


class SglangDerivedCopiesTest(unittest.TestCase):
    """sglang.refresh_derived after a version landed: post_load_weights (bind_or_assign:
    target.copy_(source), sgl-project/sglang python/sglang/srt/utils.py) and the _weight_fp32
    refreshes read the parameters with queued device copies; with memory="engine" (or bound) the
    parameters are the registered memory the daemon writes next, so they must be finished when
    refresh_derived returns."""

    def setUp(self):
        cuda._pending.clear()

    def test_refreshes_finished_when_it_returns(self):
        from weightbridge.integrations import sglang
        weight = cuda_tensor(bf16_values(3, (4, 8)), torch.bfloat16)
        gate = types.SimpleNamespace(weight=weight, _weight_fp32=cuda_tensor(np.zeros((4, 8)), torch.float32))
        w_kc = cuda_tensor(np.zeros((4, 8)), torch.bfloat16)

        class Model:
            def post_load_weights(self, is_nextn=False, weight_names=None):
                w_kc.copy_(weight)  # bind_or_assign(self_attn.w_kc, ...)

            def modules(self):
                return [self, gate]

        self.assertEqual(sglang.refresh_derived(Model()), 1)
        self.assertEqual(cuda.pending(), 0, "refresh_derived's copies still queued when it returned")
        np.testing.assert_array_equal(gate._weight_fp32.arr, _bf16_to_f32(weight.arr))
        np.testing.assert_array_equal(w_kc.arr, weight.arr)


class InferLayoutTorchTest(unittest.TestCase):
    """layouts.infer_layout_torch swaps each parameter's data for an int64 probe: parameters that
    require grad (any nn.Module not built for inference) must take it too, and get their data and
    requires_grad back."""

    def test_parameters_that_require_grad(self):
        weight = Tensor(np.ones((4, 3), np.float32), torch.float32)
        param = Parameter(weight, requires_grad=True)
        model = types.SimpleNamespace(named_parameters=lambda: [("layer.w", param)])

        def load_weights(m, weights):
            for name, t in weights:
                dict(m.named_parameters())["layer." + name].data.arr[...] = t.arr

        inferred = wb.layouts.infer_layout_torch(model, load_weights, [("w", (4, 3))], dtype="float32")
        self.assertEqual([t.name for t in inferred.tensors], ["layer.w"])
        np.testing.assert_array_equal(inferred.tensors[0].probe, np.arange(12).reshape(4, 3))
        self.assertIs(param.data, weight)
        self.assertTrue(param.requires_grad)


class DeviceBytesTensorTest(unittest.TestCase):
    """weightbridge.cuda's .tensor(dtype, shape): a torch view of a CUDA buffer in any dtype the
    layouts hold, through __cuda_array_interface__ (whose type strings are numpy's)."""

    def test_views_in_float8_float4_and_int32(self):
        buf = DeviceBuffer(4096, 0)
        for dtype, shape in ((torch.float8_e4m3fn, (4, 8)), (torch.float8_e8m0fnu, (2, 3)),
                             (torch.float4_e2m1fn_x2, (4, 4)), (torch.int32, (5,)), (torch.bfloat16, (3, 2)),
                             (torch.float32, (2,))):
            t = buf.tensor(dtype, shape, offset_bytes=256)
            self.assertIs(t.dtype, dtype)
            self.assertEqual(t.shape, shape)
            self.assertEqual(t.data_ptr(), buf.ptr + 256)
        t = buf.tensor(torch.float8_e4m3fn, (4, 8), offset_bytes=512)
        t.arr[1, 2] = 0x38  # writes go to the buffer
        self.assertEqual(int(_DEVICE_MEMORY[buf.ptr][512 + 8 + 2]), 0x38)


if __name__ == "__main__":
    unittest.main()
