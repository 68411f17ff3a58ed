"""What every trainer hook and engine extension shares: register with layout discovery, copy the
framework's tensors into (trainer) or out of (rollout) the registered buffer by local name.

Tensors may be numpy arrays (what CI uses: torch is not installed there) or torch tensors (CPU or
CUDA; torch is imported only when one is given). numpy stand-ins for bfloat16 tensors are their
uint16 bits (numpy has no bfloat16); float32 arrays given for a bfloat16 tensor are rounded to
nearest even.
"""

from typing import Dict, Iterable, Optional, Tuple

import numpy as np

from weightbridge._proto import pb
from weightbridge.client import ModelConfig, WorkerClient
from weightbridge.discovery import _DTYPES_BY_NAME, LayoutDescription
from weightbridge.layouts import ExplicitLayout, PresetLayout, row_major_strides


def bf16_bits(x):
    """float32 array -> bfloat16 bits (uint16), round to nearest even (NaN stays NaN)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, (b >> np.uint32(16)).astype(np.uint16) | np.uint16(0x40), rounded)


def _is_torch(t):
    return type(t).__module__.startswith("torch")


def _np_bytes(a):
    """uint8 view of an array whose last axis is contiguous (its bytes, same memory), else None."""
    if not isinstance(a, np.ndarray) or a.ndim == 0 or a.strides[-1] != a.itemsize:
        return None
    return a.view(np.uint8)


def _torch_bytes(t):
    import torch
    try:
        return t.view(torch.uint8)
    except RuntimeError:  # last dim not contiguous
        return None


def copy_out(name, src, target):
    """Copies a local tensor `src` (a view of the buffer) into the engine parameter `target` (numpy
    array or torch tensor). Same shape: by value (a floating dtype may convert, e.g. bfloat16 into a
    float32 parameter), but between a raw-byte dtype and another of its size (float8_e8m0 scales
    and vLLM's uint8 ones, float8 and uint8) the bits. Another shape: the bits, when both hold the
    same bytes in the same order - their byte views have one shape (int4 / e2m1 pairs as uint8
    [N, K/2] and vLLM's int32 weight_packed [N, K/8]); else ValueError naming both shapes (e.g.
    vLLM's transposed W4A16 MoE weights: not these bytes)."""
    if _is_torch(target):
        dst = target.data if hasattr(target, "data") else target
        if tuple(dst.shape) == tuple(src.shape):
            raw = not dst.dtype.is_floating_point or not src.dtype.is_floating_point or dst.element_size() == 1
            if dst.dtype != src.dtype and raw and dst.element_size() == src.element_size():
                dst.copy_(src.view(dst.dtype))  # the bits, not a value conversion
            else:
                dst.copy_(src)
            return
        tb, sb = _torch_bytes(dst), _torch_bytes(src)
        if tb is None or sb is None or tuple(tb.shape) != tuple(sb.shape):
            raise ValueError("parameter %s: shape %s, the layout holds %s" % (name, tuple(dst.shape), tuple(src.shape)))
        tb.copy_(sb)
        return
    if tuple(np.shape(target)) == tuple(src.shape):
        target[...] = src
        return
    tb, sb = _np_bytes(target), _np_bytes(src)
    if tb is None or sb is None or tb.shape != sb.shape:
        raise ValueError("parameter %s: shape %s, the layout holds %s" % (name, tuple(np.shape(target)), tuple(src.shape)))
    tb[...] = sb


def bind_view(name, view, param):
    """The view of the registered buffer that LayoutHook.bind re-points torch parameter `param` at:
    `view` (the local tensor in its layout dtype) when the parameter has that dtype and shape; else
    the same bytes as the parameter's dtype and shape (Tensor.view(dtype): float8_e8m0 scales as
    vLLM's uint8 ones, int4 pairs as an int32 weight_packed) where they are the same bytes in the
    same order - copy_out's rule: no two floating dtypes of more than one byte, which copy_ would
    convert by value. ValueError naming both otherwise: re-pointing would change the parameter's
    dtype or shape under the engine (leave it unbound: update / apply copy it)."""
    dst = param.data
    if not (_is_torch(view) and _is_torch(dst)):  # stand-ins (tests without torch): as they are
        return view
    if view.dtype == dst.dtype and tuple(view.shape) == tuple(dst.shape):
        return view
    if not dst.dtype.is_floating_point or not view.dtype.is_floating_point or dst.element_size() == 1:
        try:
            same = view.view(dst.dtype)
        except RuntimeError:  # the last dim not contiguous, or not a whole number of elements
            same = None
        if same is not None and tuple(same.shape) == tuple(dst.shape):
            return same
    raise ValueError("bind: parameter %s is %s %s, the layout holds %s %s: not the same bytes under the parameter's "
                     "dtype and shape; bind cannot re-point it (unbound, update / apply copy it)"
                     % (name, tuple(dst.shape), _dtype_name(dst.dtype), tuple(view.shape), _dtype_name(view.dtype)))


def strip_leading(name, prefixes):
    """`name` without any number of leading `prefixes`, in any order. Wrappers nest: Megatron with
    --bf16 / --fp16 is DDP(Float16Module(GPTModel)), so named_parameters() shows "module.module."
    (Megatron-Bridge and verl wrap the same way); torch.compile under DDP adds "_orig_mod."."""
    prefixes = [p for p in prefixes if p]  # an empty prefix would never stop
    stripped = True
    while stripped:
        stripped = False
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p):]
                stripped = True
    return name


# Module wrappers that insert a path segment in the middle of parameter names (removed wherever the
# exact segment occurs, as torch's own FQN cleaning in torch.distributed.checkpoint.state_dict does):
# torch's checkpoint_wrapper (activation checkpointing) wraps a block as "_checkpoint_wrapped_module",
# torch.compile of a block as "_orig_mod" (torchtitan does both, per transformer block).
TRAINER_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")
# Engines' LoRA wrappers: vLLM with --enable-lora replaces every linear layer by a *WithLoRA module
# holding the original as `base_layer` (vllm/lora/layers/base_linear.py), SGLang's BaseLayerWithLoRA
# likewise, so "...qkv_proj.weight" shows as "...qkv_proj.base_layer.weight".
ENGINE_WRAPPER_SEGMENTS = ("base_layer",)


def normalize_name(name, segments):
    """`name` without every dot-separated path segment that is exactly one of `segments`:
    "layers.0._checkpoint_wrapped_module._orig_mod.mlp.weight" -> "layers.0.mlp.weight" (a
    segment that merely contains the word, e.g. "my_base_layer", stays)."""
    if not any(s in name for s in segments):
        return name
    return ".".join(part for part in name.split(".") if part not in segments)


def trainer_name(given, strip_prefixes=("module.",)):
    """A trainer's parameter name as the layout names it: wrapper segments
    (TRAINER_WRAPPER_SEGMENTS) removed wherever they occur, then leading `strip_prefixes`. One
    place for LayoutHook.write and the hooks that look at names before writing (Megatron's MTP
    skip)."""
    return strip_leading(normalize_name(given, TRAINER_WRAPPER_SEGMENTS), strip_prefixes)


def engine_params(named, segments=ENGINE_WRAPPER_SEGMENTS):
    """{name: parameter} of an engine's (name, parameter) pairs or dict, every name normalised
    (normalize_name: LoRA's "base_layer" dropped), ValueError naming both when two parameters
    collapse to one name (one would silently receive the other's bytes)."""
    items = named.items() if hasattr(named, "items") else named
    out, origin = {}, {}
    for name, p in items:
        key = normalize_name(name, segments)
        if key in out:
            raise ValueError("engine parameters %r and %r both address %r once wrapper segments (%s) are removed"
                             % (origin[key], name, key, ", ".join(segments)))
        out[key], origin[key] = p, name
    return out


def cuda_device(t):
    """The torch.device of `t` when it is a torch CUDA tensor, else None."""
    if not _is_torch(t):
        return None
    dev = getattr(t, "device", None)
    return dev if getattr(dev, "type", None) == "cuda" else None


def synchronize(devices):
    """Waits until the work queued on each CUDA device in `devices` (torch.device) is done.

    A torch copy_ between two CUDA tensors only queues the copy on the current stream and returns
    (aten/src/ATen/native/cuda/Copy.cu, copy_device_to_device: CUDACachingAllocator::memcpyAsync or
    a copy kernel, no host synchronisation; only copies to or from the host with
    non_blocking=False end in memcpy_and_sync). The daemon reads (Publish) and writes (Apply, the
    sync commit) our CUDA buffers from its own process and streams, which do not wait for this
    process's streams: every copy into or out of a registered buffer must have finished before
    the daemon is told to go on."""
    if not devices:
        return
    import torch  # only when a torch CUDA tensor was copied
    for d in devices:
        torch.cuda.synchronize(d)


def local_tensor(t):
    """A DTensor's local shard (torch FSDP2 parameters are DTensors); anything else as is."""
    return t.to_local() if hasattr(t, "to_local") else t


_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _dtype_name(dtype):
    """torch.bfloat16 -> "bfloat16" (also a stand-in's dtype given as a string)."""
    return str(dtype).split(".")[-1]


def _byte_shape(shape, nbytes_last_dim):
    return tuple(int(d) for d in shape[:-1]) + (nbytes_last_dim,)


def check_engine_param(name, place, p):
    """memory="engine": ValueError naming `name` unless engine parameter `p` (torch CUDA tensor or
    a duck-typed stand-in: data_ptr, is_contiguous, element_size, nelement, shape, dtype) holds
    exactly the bytes of local tensor `place` in the same order, so versions can land in it as the
    layout writes the buffer: contiguous, place row-major, the same size in bytes and the same
    byte-view shape (the last dim in bytes; int4 / e2m1 pairs as bytes, so vLLM's int32
    weight_packed [N, K/8] matches int4 [N, K]); a floating dtype other than the layout's
    (bfloat16 into float32, or into float16) is refused: that needs a value conversion, which
    only a copy (memory="cuda") does. Returns the parameter's size in bytes."""
    shape = tuple(int(d) for d in place.shape)
    got_shape = tuple(int(d) for d in p.shape)
    nbytes = int(p.nelement()) * int(p.element_size())
    what = "engine parameter %s (shape %s, %s, %d bytes) vs the layout's local tensor (shape %s, %s, %d bytes)" % (
        name, got_shape, _dtype_name(p.dtype), nbytes, shape, place.dtype, place.size_bytes)
    if not p.is_contiguous():
        raise ValueError("%s: the parameter is not contiguous; memory='engine' writes it as one row-major block "
                         "(use memory='cuda')" % what)
    if [int(x) for x in place.strides] != row_major_strides(shape) and 0 not in shape:
        raise ValueError("%s: the layout places it with strides %s, not row-major (use memory='cuda')"
                         % (what, tuple(place.strides)))
    if nbytes != place.size_bytes:
        raise ValueError("%s: sizes differ" % what)
    bits = _DTYPES_BY_NAME[place.dtype][1]
    want = _byte_shape(shape, shape[-1] * bits // 8) if shape else (place.size_bytes,)
    got = _byte_shape(got_shape, got_shape[-1] * int(p.element_size())) if got_shape else (nbytes,)
    if want != got:
        raise ValueError("%s: shapes differ (as bytes %s vs %s)" % (what, got, want))
    pd = _dtype_name(p.dtype)
    if pd in _FLOAT_DTYPES and place.dtype in _FLOAT_DTYPES and pd != place.dtype:
        raise ValueError("%s: dtypes differ (a value conversion: use memory='cuda')" % what)
    return nbytes


class _ProtoPiece:
    """A pb.Piece as it is (ExplicitLayout of re-based description pieces)."""

    def __init__(self, piece):
        self.piece = piece

    def to_proto(self):
        return self.piece


class LayoutHook:
    """Registers one worker whose buffer the layout discovery sized, and moves tensors by name.

    `memory`: "host" (a POSIX shm buffer; torch tensors on a GPU are copied device -> host),
    "cuda" (a CUDA IPC buffer on `gpu`; needs a GPU and torch for the copies) or, rollouts only,
    "engine" (zero copy: the engine's own parameter memory `params` is registered and versions
    land in the parameters themselves; _register_engine). `client` may be given (tests, or a
    worker that registers other things itself); it is then not closed by close().
    """

    def __init__(self, socket_path: Optional[str], model: ModelConfig, worker_id: str, role: str, preset: PresetLayout,
                 memory: str = "host", gpu: int = -1, client: Optional[WorkerClient] = None, shm_prefix: str = "hook",
                 params=None):
        if memory not in ("host", "cuda", "engine"):
            raise ValueError("memory must be 'host', 'cuda' or 'engine', got %r" % memory)
        if memory == "engine":
            if role != "rollout":
                raise ValueError("memory='engine' is for rollouts (the engine's parameters receive the versions)")
            if params is None:
                raise ValueError("memory='engine' needs params (the engine's {name: CUDA parameter})")
            params = engine_params(params)
        self.engine_params = params if memory == "engine" else None
        self.own_client = client is None
        self.client = client or WorkerClient(socket_path, shm_prefix=shm_prefix)
        self.model = model
        self.preset = preset
        self.memory = memory
        self.worker_id, self.role, self.gpu = worker_id, role, gpu
        self.buffer = None
        self.bound = False  # bind() re-pointed the engine's parameters into the buffer
        self._register()

    def _register(self):
        """Registers the worker with a new buffer: discovery, register_worker, a buffer of the
        discovered size, register_layout. Run at construction, and again by RolloutHook.reacquire
        (an engine woke up) with the same worker id, role, gpu and preset."""
        # Discovery first: the buffer is sized from the daemon's answer, never computed here.
        desc = self.client.describe_layout(self.preset, model=self.model)
        if self.memory == "engine":
            self._register_engine(desc)
            return
        self.client.register_worker(self.model, self.worker_id, self.role, gpu=self.gpu if self.memory == "cuda" else -1)
        size = desc.buffer_bytes(0)
        if self.memory == "cuda":
            self.buffer = self.client.create_cuda_buffer(size, self.gpu)
        else:
            self.buffer = self.client.create_buffer(size)
        info = self.client.register_layout(self.preset)
        self.layout: LayoutDescription = info.layout or desc
        self.info = info
        self._np_views = self.layout.views(self.client.buffers) if self.memory == "host" else {}
        self._torch_views = None

    def _register_engine(self, desc):
        """memory="engine": registers the engine's parameter memory itself. Every local tensor that
        holds pieces (and the scale / global-scale tensors its quantised pieces name) must have a
        parameter holding exactly its bytes (check_engine_param; refused, naming it, before
        anything is registered). Each parameter's allocation is registered once - cudaMalloc memory
        by CUDA IPC of the allocation's base (add_cuda_ipc_buffer), CUDA VMM memory (expandable
        segments) by fd, one buffer per run of allocations mapped back to back (add_cuda_vmm_buffer;
        VMM memory created without a POSIX fd handle type, as vLLM's sleep-mode pool is, is refused
        before registering: cuda.NOT_EXPORTABLE; so is stream-ordered pool memory, torch's
        backend:cudaMallocAsync: cuda.not_ipc_capable) - and the description's pieces are re-based into them:
        offset = piece offset - local tensor offset + (parameter address - buffer base), scales
        likewise through their tensors' parameters. The engine's memory is never freed here."""
        from weightbridge import cuda
        params = self.engine_params
        tensors = desc.tensors
        needed = {}
        for name, place in tensors.items():
            if not place.pieces:
                continue
            needed[name] = place
            if any(desc.pieces[i].quant_dtype for i in place.pieces):
                for extra in (place.scale_tensor, place.global_scale_tensor):
                    if extra:
                        needed[extra] = tensors[extra]
        missing = [n for n in needed if n not in params]
        if missing:
            raise KeyError("memory='engine': the engine has no parameter for %d local tensors: %s"
                           % (len(missing), ", ".join(missing[:8])))
        sizes = {n: check_engine_param(n, place, params[n]) for n, place in needed.items()}
        gpus = {int(params[n].device.index) for n in needed}
        gpu = self.gpu if self.gpu >= 0 else (min(gpus) if gpus else 0)
        if gpus - {gpu}:
            raise ValueError("memory='engine': the parameters lie on GPUs %s, the rank's GPU is %d" % (sorted(gpus), gpu))
        # VMM memory the daemon cannot map (created without a POSIX fd handle type: vLLM's sleep-mode
        # allocator) is refused here, before anything is registered.
        vmm, spans = {}, {}  # name -> address; allocation base -> size
        for n in needed:
            ptr = int(params[n].data_ptr())
            try:
                alloc = cuda.device_allocation_of(ptr)
            except ValueError as e:  # stream-ordered pool memory (cuda.not_ipc_capable), not device memory
                raise ValueError("memory='engine': engine parameter %s: %s" % (n, e)) from None
            if alloc.vmm:
                vmm[n] = ptr
                try:
                    ranges = cuda.vmm_allocations_of(ptr, sizes[n], exportable=True)
                except ValueError as e:
                    raise ValueError("memory='engine': engine parameter %s: %s" % (n, e)) from None
                for r in ranges:
                    spans[r.base] = r.size
                    r.close()
        self.client.register_worker(self.model, self.worker_id, self.role, gpu=gpu)
        try:
            where = {}  # name -> (buffer, address of the buffer's byte 0)
            for n in needed:
                if n not in vmm:
                    b = self.client.add_cuda_ipc_buffer(int(params[n].data_ptr()), sizes[n], gpu)
                    where[n] = (b, b.base)
            if vmm:
                runs = []  # [base, end): allocations mapped back to back, one buffer each
                for base in sorted(spans):
                    if runs and runs[-1][1] == base:
                        runs[-1][1] = base + spans[base]
                    else:
                        runs.append([base, base + spans[base]])
                bufs = [self.client.add_cuda_vmm_buffer(b, e - b, gpu) for b, e in runs]
                for n, ptr in vmm.items():
                    b = next(b for b in bufs if b.ptr <= ptr < b.ptr + b.size_bytes)
                    where[n] = (b, b.ptr)

            def rebase(name, buffer_id, offset, what):
                place = tensors[name]
                if buffer_id != place.buffer_id or not place.offset_bytes <= offset < place.offset_bytes + max(1, place.size_bytes):
                    raise ValueError("memory='engine': %s at buffer %d offset %d is not inside local tensor %s"
                                     % (what, buffer_id, offset, name))
                b, base = where[name]
                return b.id, offset - place.offset_bytes + (int(params[name].data_ptr()) - base)

            pieces = []
            for name, place in tensors.items():
                for i in place.pieces:
                    p = pb.Piece()
                    p.CopyFrom(desc.pieces[i])
                    p.buffer_id, p.offset_bytes = rebase(name, p.buffer_id, p.offset_bytes, "a piece of " + p.tensor)
                    if p.quant_dtype:
                        old_scale_buffer = p.scale_buffer_id
                        p.scale_buffer_id, p.scale_offset_bytes = rebase(
                            place.scale_tensor, old_scale_buffer, p.scale_offset_bytes, "the scales of " + p.tensor)
                        if p.HasField("quant_global_scale_offset"):
                            gb, go = rebase(place.global_scale_tensor, old_scale_buffer, p.quant_global_scale_offset,
                                            "the global scale of " + p.tensor)
                            if gb != p.scale_buffer_id:
                                raise ValueError("memory='engine': %s's global scale (%s) and block scales (%s) lie in two "
                                                 "allocations; a piece names one scale buffer (use memory='cuda')"
                                                 % (name, place.global_scale_tensor, place.scale_tensor))
                            p.quant_global_scale_offset = go
                    pieces.append(_ProtoPiece(p))
            info = self.client.register_layout(ExplicitLayout(pieces=pieces))
        except BaseException:
            try:
                self.client.deregister()
            finally:
                self.client.free_buffers()  # forgets them; the engine's memory is never freed
            raise
        self.layout: LayoutDescription = desc  # the preset's names and places (views are the parameters)
        self.engine_layout = info.layout
        self.info = info
        self.buffer = list(self.client.buffers)  # the engine's allocations, as registered
        self._np_views, self._torch_views = {}, None

    def _holding(self, what):
        """RuntimeError naming `what` when the buffer was released (RolloutHook.release): its views
        would address freed memory."""
        if self.buffer is None:
            raise RuntimeError("%s: worker %s of model %s released its buffer (the engine sleeps): reacquire() first"
                               % (what, self.worker_id, self.model.model_id))

    # ---- names -------------------------------------------------------------------------------
    @property
    def names(self):
        """Local tensor names of this rank (the framework's names), in buffer order."""
        return [n for n, t in self.layout.tensors.items()]

    def _torch(self):
        self._holding("torch views")
        if self._torch_views is None:
            self._torch_views = self.layout.torch_views(self.client.buffers)
        return self._torch_views

    def view(self, name):
        """The buffer's view of local tensor `name`: numpy (host memory) or torch (CUDA memory)."""
        self.layout[name]  # KeyError naming the layout's tensors
        self._holding("view(%r)" % name)
        if self.memory == "engine":
            return self.engine_params[name]  # the versions land in the parameter itself
        return self._np_views[name] if self.memory == "host" else self._torch()[name]

    # ---- trainer side ------------------------------------------------------------------------
    def write(self, named_tensors: Iterable[Tuple[str, object]], strip_prefixes=("module.",), require_all=True,
              missing_hint=""):
        """Copies each (name, tensor) into its place in the buffer. Names are the framework's
        (trainer_name: the wrapper segments "_checkpoint_wrapped_module" / "_orig_mod" removed
        wherever they occur, then leading `strip_prefixes` as often as they repeat: DDP's
        "module.", and "module.module." for Megatron's DDP(Float16Module(...))).
        ValueError for a name given twice (after that normalising) or a shape mismatch,
        KeyError for a name the layout lacks, and (require_all) for local tensors not given: a
        version must never go out with stale tensors in it (`missing_hint` is added to that error)."""
        seen, devices = set(), []
        for given, t in named_tensors:
            name = trainer_name(given, strip_prefixes)
            if name in seen:
                raise ValueError("tensor %r (given as %r) was given twice" % (name, given))
            if name not in self.layout.tensors:
                raise KeyError("tensor %r is not a local tensor of this rank's %s layout (it has %d: %s ...)"
                               % (name, self.preset.preset, len(self.layout.tensors), ", ".join(self.names[:4])))
            dev = self._copy_in(name, local_tensor(t))
            if dev is not None and dev not in devices:
                devices.append(dev)
            seen.add(name)
        # The copies into a CUDA buffer are queued on this process's stream; publish() lets the
        # daemon read the buffer from its own process right away (synchronize).
        synchronize(devices)
        if require_all:
            missing = [n for n, t in self.layout.tensors.items() if n not in seen and t.pieces]
            if missing:
                raise KeyError("%d local tensors of this rank were not given: %s%s"
                               % (len(missing), ", ".join(missing[:8]), missing_hint))
        return seen

    def _copy_in(self, name, t):
        """Copies `t` into local tensor `name`'s place; returns the CUDA device the copy was queued
        on (its destination is CUDA memory: write() synchronizes it), else None."""
        place = self.layout[name]
        if _is_torch(t):
            dst = self._torch()[name]  # torch views over the buffer (host or CUDA)
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError("tensor %s: shape %s, the layout holds %s" % (name, tuple(t.shape), tuple(dst.shape)))
            dst.copy_(t.detach())
            return cuda_device(dst)
        if self.memory == "cuda":
            raise TypeError("tensor %s: numpy arrays need memory='host'" % name)
        dst = self._np_views[name]
        a = np.asarray(t)
        if tuple(a.shape) != tuple(dst.shape):
            raise ValueError("tensor %s: shape %s, the layout holds %s" % (name, tuple(a.shape), tuple(dst.shape)))
        if place.dtype == "bfloat16" and a.dtype == np.float32:
            a = bf16_bits(a)
        elif a.dtype != dst.dtype:
            raise TypeError("tensor %s: dtype %s, the layout holds %s (%s)" % (name, a.dtype, place.dtype, dst.dtype))
        dst[...] = a
        return None

    # ---- rollout side ------------------------------------------------------------------------
    def read_into(self, params: Dict[str, object], strict=True):
        """Copies every local tensor of the buffer into the engine's parameter of the same name
        (numpy arrays or torch tensors, e.g. dict(model.named_parameters())). Names are normalised
        first (engine_params: LoRA's "base_layer" segment dropped; ValueError if two collapse).
        strict: every local tensor holding pieces must have a parameter (KeyError naming the missing
        ones)."""
        self._holding("read_into")
        if self.memory == "engine":
            return []  # the versions land in the parameters themselves: nothing to copy
        params = engine_params(params)
        missing = [n for n, t in self.layout.tensors.items() if t.pieces and n not in params]
        if strict and missing:
            raise KeyError("the engine has no parameter for %d local tensors: %s" % (len(missing), ", ".join(missing[:8])))
        done, devices = [], []
        for name in self.layout.tensors:
            if name not in params:
                continue
            p = params[name]
            src = self._torch()[name] if _is_torch(p) else self._np_views[name]
            copy_out(name, src, p)
            for dev in (cuda_device(p), cuda_device(src)):
                if dev is not None and dev not in devices:
                    devices.append(dev)
            done.append(name)
        # Copies out of a CUDA buffer (or into CUDA parameters) are queued on this process's stream:
        # finished before the daemon may write the buffer with the next version (synchronize).
        synchronize(devices)
        return done

    def bind(self, params, copy_current=True):
        """CUDA memory, torch: points every parameter at its place in the registered buffer
        (param.data = view), so versions land in the engine's weights with no copy of ours (Apply
        / the sync commit write them). Only for an engine that captured no CUDA graph over its
        parameters (vLLM enforce_eager, SGLang --disable-cuda-graph) or captures them after this:
        a graph keeps the addresses it was captured with, so after bind it would go on reading the
        parameters' old memory (freed, then reused) - the versions would silently not reach it.
        Unbound, a CUDA rollout's update / apply copies each version into the parameters in place
        (device to device), which keeps every captured address valid at the cost of a second copy
        of the weights on the GPU. `copy_current`: copy the parameters' current weights in
        first (after loading); False after RolloutHook.reacquire, where the parameters still point
        at the buffer freed by release() and their bytes must not be read - the new buffer holds
        nothing until the next update / apply. Names normalised as for read_into."""
        if self.memory != "cuda":
            raise ValueError("bind needs memory='cuda' (host buffers: use read_into after each update)")
        params = engine_params(params)
        views = self._torch()
        # Every parameter's view first (a refusal re-points none), in the parameter's dtype and shape.
        targets = {name: bind_view(name, views[name], p) for name, p in params.items() if name in views}
        devices = []
        for name, view in targets.items():
            p = params[name]
            if copy_current:
                view.copy_(p.data)  # same dtype and shape: the bits
                dev = cuda_device(view)
                if dev is not None and dev not in devices:
                    devices.append(dev)
            p.data = view
        # The current weights' copies into the registered buffer are queued on this process's
        # stream: finished before the daemon may write the buffer (synchronize).
        synchronize(devices)
        self.bound = True

    def close(self):
        if self.own_client:
            self.client.close()
