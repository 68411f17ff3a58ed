"""Layouts: how a worker's local tensors map onto the model's canonical (HF) tensors.

Three sources, all ending in the daemon as one piece list (design.md "Canonical space and layouts"):
  * PresetLayout: a preset by name (megatron | fsdp | fsdp_flat | vllm | sglang) + parallel config + rank; the
    daemon computes the pieces from the model's HF config.
  * ExplicitLayout: pieces (canonical tensor, box) <-> (buffer, byte offset, strides).
  * infer_layout(load_fn, ...): run the engine's own weight loader on index tensors (every canonical
    element holds its canonical index, int64) and let an extractor recover the boxes: the daemon's
    (planner/index_probe.h, sent as an IndexProbe; the default) or, as a fallback for daemons
    without it or to avoid the probe buffer, the client-side one here (row/column splits and row
    concatenations such as fused qkv / gate_up, padding rows only).
"""

import dataclasses
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from weightbridge._proto import pb

DTYPES = {"bfloat16": (pb.DTYPE_BF16, 2), "float16": (pb.DTYPE_F16, 2), "float32": (pb.DTYPE_F32, 4),
          "float8_e4m3": (pb.DTYPE_F8_E4M3, 1), "int64": (pb.DTYPE_I64, 8), "float8_e8m0": (pb.DTYPE_E8M0, 1)}


def dtype_size(dtype):
    if dtype not in DTYPES:
        raise ValueError("unknown dtype %r (one of %s)" % (dtype, ", ".join(DTYPES)))
    return DTYPES[dtype][1]


def row_major_strides(shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return list(reversed(strides))


# Quantised element dtype -> (proto DType, the scale dtypes it takes) (planner/types.h Quantization).
# The 4-bit element dtypes are not in DTYPES (no byte size): they are only ever a piece's quant dtype.
_QUANT_DTYPES = {"float8_e4m3": (pb.DTYPE_F8_E4M3, ("float32", "float8_e8m0")),
                 "int4": (pb.DTYPE_I4, ("bfloat16", "float16", "float32")),
                 "float4_e2m1": (pb.DTYPE_F4_E2M1, ("float8_e4m3",))}


@dataclasses.dataclass
class Quantization:
    """A rollout piece held quantised with one scale per block (docs/daemon.md, "Quantized
    targets"): `block` elements per canonical dim; the scales, row-major over the box's block grid,
    at `scale_offset_bytes` of buffer `scale_buffer_id`.

    dtype="float8_e4m3" (the default): `scale_dtype` "float32" (scale_inv = amax / 448, elements
    x * (1 / scale_inv): DeepGEMM's per_block_cast_to_fp8, DeepSeek-V3 fp8 block) or "float8_e8m0" (MXFP8: one power-of-two byte per block, usually block=[1, 32]).
    dtype="int4" (compressed-tensors W4A16, symmetric): scale_dtype "bfloat16"/"float16"/"float32"
    (amax / 7.5), block=[1, G].
    dtype="float4_e2m1" (NVFP4, ModelOpt / vLLM modelopt_fp4): scale_dtype "float8_e4m3" (one e4m3
    byte per block), block=[1, ..., 1, 16], and `global_scale_offset_bytes` (required): where the
    float32 second-level scale (weight_scale_2) lies in the scale buffer, a multiple of 4; pieces of
    one worker naming the same offset share it (e.g. q, k, v of a fused qkv_proj: amax over all of
    them), and so do the TP ranks on one node holding parts of the same tensors (amax over the whole
    tensors, as ModelOpt exports it). It must be None for the other dtypes.
    int4 and float4_e2m1 elements are packed two per byte along the last dim (even element in the
    low nibble; int4 stored as q + 8, e2m1 as its sign-magnitude code); `strides` still count 4-bit
    elements (last 1, others even)."""
    block: Sequence[int]
    scale_buffer_id: int = 0
    scale_offset_bytes: int = 0
    dtype: str = "float8_e4m3"
    scale_dtype: str = "float32"
    global_scale_offset_bytes: Optional[int] = None


@dataclasses.dataclass
class Piece:
    """Canonical box [begin, end) of `tensor` at `offset_bytes` of buffer `buffer_id`.
    `strides`: local element stride per canonical dim (default: the box stored row-major).
    `quant`: rollouts only, the box is held quantised (elements of the quantised dtype's size; int4 /
    float4_e2m1: half a byte)."""
    tensor: str
    begin: Sequence[int]
    end: Sequence[int]
    buffer_id: int = 0
    offset_bytes: int = 0
    strides: Optional[Sequence[int]] = None
    quant: Optional[Quantization] = None

    def to_proto(self):
        shape = [e - b for b, e in zip(self.begin, self.end)]
        strides = self.strides if self.strides is not None else row_major_strides(shape)
        p = pb.Piece(tensor=self.tensor, box=pb.Box(begin=list(self.begin), end=list(self.end)),
                     buffer_id=self.buffer_id, offset_bytes=self.offset_bytes, strides=list(strides))
        if self.quant is not None:
            q = self.quant
            if q.dtype not in _QUANT_DTYPES:
                raise ValueError(f"piece of {self.tensor}: quantised dtype {q.dtype!r} is not supported "
                                 f"({', '.join(_QUANT_DTYPES)})")
            code, allowed = _QUANT_DTYPES[q.dtype]
            if q.scale_dtype not in allowed:
                raise ValueError(f"piece of {self.tensor}: scale dtype {q.scale_dtype!r} is not supported "
                                 f"for {q.dtype} ({' or '.join(allowed)})")
            if q.dtype == "float4_e2m1":
                if q.global_scale_offset_bytes is None:
                    raise ValueError(f"piece of {self.tensor}: float4_e2m1 (NVFP4) needs global_scale_offset_bytes "
                                     "(the float32 global scale's place in the scale buffer)")
                if int(q.global_scale_offset_bytes) < 0:
                    raise ValueError(f"piece of {self.tensor}: global_scale_offset_bytes "
                                     f"{q.global_scale_offset_bytes} is negative")
            elif q.global_scale_offset_bytes is not None:
                raise ValueError(f"piece of {self.tensor}: global_scale_offset_bytes is for float4_e2m1 (NVFP4) "
                                 f"pieces only, not {q.dtype}")
            p.quant_dtype = code
            p.quant_block.extend(list(q.block))
            p.scale_buffer_id = q.scale_buffer_id
            p.scale_offset_bytes = q.scale_offset_bytes
            p.quant_scale_dtype = DTYPES[q.scale_dtype][0]
            if q.global_scale_offset_bytes is not None:
                p.quant_global_scale_offset = int(q.global_scale_offset_bytes)
        return p


@dataclasses.dataclass
class ExplicitLayout:
    pieces: List[Piece]

    def to_proto(self):
        return pb.LayoutSpec(pieces=pb.ExplicitPieces(pieces=[p.to_proto() for p in self.pieces]))


@dataclasses.dataclass
class PresetLayout:
    # megatron | fsdp (= fsdp2, torch fully_shard) | fsdp2_tp (= fsdp_tp, FSDP2 + TP: tp, dp, replicas) |
    # fsdp_flat (= deepspeed_zero3) | vllm | sglang (docs/presets.md)
    preset: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 0
    expert_parallel: bool = False
    replicas: int = 1
    rank: int = 0
    quantization: str = ""  # vllm/sglang rollouts: "", "fp8_block128", "mxfp8", "w4a16_g32", "w4a16_experts_g32", "nvfp4"
    # megatron: --decoder-first/last-pipeline-num-layers (0 = not set), virtual pipeline size.
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    vpp: int = 1
    expert_placement: str = ""  # vllm expert_parallel: "" (linear) or "round_robin"
    # vllm: --all2all-backend / VLLM_ALL2ALL_BACKEND; sglang: --moe-a2a-backend ("" = the engine's
    # default). Decides whether shared experts are whole on every rank (docs/presets.md).
    moe_a2a_backend: str = ""
    # megatron: --make-vocab-size-divisible-by (0 = 128, Megatron-LM's default; 1 for Megatron-Bridge /
    # verl mcore models, whose vocab is unpadded), --moe-grouped-gemm (TEGroupedMLP expert names),
    # with --moe-use-legacy-grouped-gemm the legacy GroupedMLP (mlp.experts.weight1 / weight2), and
    # --use-tp-pp-dp-mapping (rank = tp_rank + tp * (pp_rank + pp * dp_rank)).
    make_vocab_size_divisible_by: int = 0
    moe_grouped_gemm: bool = False
    moe_use_legacy_grouped_gemm: bool = False
    use_tp_pp_dp_mapping: bool = False
    # sglang: --enable-dp-lm-head (DP attention, dp > 1, only: lm_head vocab-parallel over the
    # attention-TP group, the preset's tp ranks of a DP rank, instead of all dp*tp ranks) and
    # --moe-dense-tp-size (0 = not set; 1: DeepSeek-V2/V3's dense MLPs whole on every rank; dp*tp,
    # SGLang's --tp-size, is the same as not set). Others are refused, naming them (docs/presets.md).
    enable_dp_lm_head: bool = False
    moe_dense_tp_size: int = 0

    def to_proto(self):
        return pb.LayoutSpec(preset=pb.ParallelConfig(
            preset=self.preset, tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, etp=self.etp,
            expert_parallel=self.expert_parallel, replicas=self.replicas, rank=self.rank,
            quantization=self.quantization, first_stage_layers=self.first_stage_layers,
            last_stage_layers=self.last_stage_layers, vpp=self.vpp, expert_placement=self.expert_placement,
            moe_a2a_backend=self.moe_a2a_backend,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by, moe_grouped_gemm=self.moe_grouped_gemm,
            moe_use_legacy_grouped_gemm=self.moe_use_legacy_grouped_gemm,
            use_tp_pp_dp_mapping=self.use_tp_pp_dp_mapping, enable_dp_lm_head=self.enable_dp_lm_head,
            moe_dense_tp_size=self.moe_dense_tp_size))


@dataclasses.dataclass
class LocalTensor:
    """One local tensor of an inferred layout: where its weights live and its index probe."""
    name: str
    shape: Tuple[int, ...]
    offset_bytes: int  # in the weight buffer
    probe: np.ndarray  # int64, `shape`, canonical flat index per element (-1 = unmapped)


@dataclasses.dataclass
class InferredLayout:
    """Result of infer_layout: the local tensors, packed in one weight buffer of `buffer_bytes`.
    Register with WorkerClient.register_layout(inferred, weight_buffer=...)."""
    tensors: List[LocalTensor]
    buffer_bytes: int
    elem_size: int
    canonical: List[Tuple[str, Tuple[int, ...]]]

    def local(self, name):
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError("local tensor %r not in the inferred layout" % name)

    def probe_bytes(self):
        return sum(t.probe.size * 8 for t in self.tensors)

    def to_index_probe(self, weight_buffer_id, probe_buffer_id, probe_array):
        """Fills `probe_array` (an int64 numpy view of the probe buffer) and returns the layout."""
        out, pos = [], 0
        for t in self.tensors:
            n = t.probe.size
            probe_array[pos:pos + n] = t.probe.reshape(-1)
            out.append(pb.IndexProbe.LocalTensor(buffer_id=weight_buffer_id, offset_bytes=t.offset_bytes,
                                                 shape=list(t.shape), probe_buffer_id=probe_buffer_id,
                                                 probe_offset_bytes=pos * 8))
            pos += n
        return pb.LayoutSpec(index_probe=pb.IndexProbe(tensors=out))

    def to_explicit(self, weight_buffer_id=0):
        """Client-side extraction (see extract_pieces) into an ExplicitLayout."""
        names = [n for n, _ in self.canonical]
        shapes = [s for _, s in self.canonical]
        bases = canonical_bases(shapes)
        pieces = []
        for t in self.tensors:
            pieces += extract_pieces(t.probe, names, shapes, bases, t.offset_bytes, self.elem_size,
                                     weight_buffer_id, local_name=t.name)
        return ExplicitLayout(pieces)


def canonical_bases(shapes):
    """First canonical index of every tensor (planner TensorBases: cumulative element counts)."""
    sizes = [int(np.prod(s)) if len(s) else 1 for s in shapes]
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def index_tensors(canonical):
    """Yields (name, int64 array) with every element's canonical index, in inventory order: feed
    these to the engine's loader instead of checkpoint tensors."""
    bases = canonical_bases([s for _, s in canonical])
    for (name, shape), base in zip(canonical, bases):
        n = int(np.prod(shape)) if len(shape) else 1
        yield name, np.arange(base, base + n, dtype=np.int64).reshape(shape)


def extract_pieces(probe, names, shapes, bases, offset_bytes, elem_size, buffer_id=0, local_name="?"):
    """Recovers pieces from one local tensor's probe, client side.

    Supported (the cases tensor-parallel engines produce): every local row (dim 0) is either all -1
    (padding) or one contiguous run of one canonical row (a dim-0 slice of a 2-D tensor, any column
    range) / of a 1-D tensor; consecutive local rows with consecutive canonical rows merge into one
    box. Anything else (transposes, interleaves inside a row, FSDP flat shards across rows, rank > 2)
    raises NotImplementedError: use the daemon's extractor (planner/index_probe.h) for those.
    """
    p = np.asarray(probe, dtype=np.int64)
    if p.ndim == 1:
        p2 = p.reshape(-1, 1)
    elif p.ndim == 2:
        p2 = p
    else:
        raise NotImplementedError("%s: rank-%d local tensor; client-side extraction handles rank <= 2" % (local_name, p.ndim))
    rows, cols = p2.shape
    total = int(bases[-1]) + (int(np.prod(shapes[-1])) if len(shapes[-1]) else 1)
    first = p2[:, 0]
    valid = first >= 0
    if np.any(p2[~valid] != -1):
        raise NotImplementedError("%s: rows partially mapped (first element -1, others not)" % local_name)
    if np.any(p2[valid] >= total) or np.any(p2[valid] < -1):
        raise ValueError("%s: probe values outside the canonical index range [0, %d)" % (local_name, total))
    expect = first[:, None] + np.arange(cols, dtype=np.int64)[None, :]
    if np.any(p2[valid] != expect[valid]):
        raise NotImplementedError("%s: a local row is not one contiguous canonical run" % local_name)
    tidx = np.searchsorted(bases, first, side="right") - 1
    pieces = []
    i = 0
    while i < rows:
        if not valid[i]:
            i += 1
            continue
        t = int(tidx[i])
        shape = shapes[t]
        inner = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        flat0 = int(first[i] - bases[t])
        r0, c0 = divmod(flat0, inner)
        if len(shape) > 1 and c0 + cols > inner:
            raise NotImplementedError("%s row %d: run crosses a canonical row of %s" % (local_name, i, names[t]))
        if len(shape) != p.ndim:
            raise NotImplementedError("%s: rank-%d local tensor mapped onto rank-%d %s (flat shard?)"
                                      % (local_name, p.ndim, len(shape), names[t]))
        j = i + 1
        if len(shape) == 1:
            # 1-D: merge consecutive local elements with consecutive canonical indices.
            while j < rows and valid[j] and tidx[j] == t and first[j] == first[j - 1] + 1:
                j += 1
            pieces.append(Piece(names[t], [flat0], [flat0 + (j - i)], buffer_id,
                                offset_bytes + i * cols * elem_size, [1]))
        else:
            step = inner  # next canonical row, same columns
            while j < rows and valid[j] and tidx[j] == t and first[j] == first[j - 1] + step:
                j += 1
            if len(shape) != 2:
                raise NotImplementedError("%s: canonical %s has rank %d" % (local_name, names[t], len(shape)))
            pieces.append(Piece(names[t], [r0, c0], [r0 + (j - i), c0 + cols], buffer_id,
                                offset_bytes + i * cols * elem_size, [cols, 1]))
        i = j
    return pieces


def infer_layout(load_fn: Callable[[Iterable[Tuple[str, np.ndarray]]], Dict[str, np.ndarray]],
                 canonical: Sequence[Tuple[str, Sequence[int]]], dtype: str = "bfloat16",
                 align: int = 256) -> InferredLayout:
    """Runs the engine's loader on index tensors (numpy path).

    load_fn(weights) receives an iterable of (canonical name, int64 index array) exactly like an
    engine's `load_weights(weights)` receives checkpoint tensors, and returns {local tensor name:
    int64 array} (what landed in each local parameter; initialize parameters to -1 so padding stays
    unmapped). `canonical` is the model's inventory in the daemon's order ([(name, shape)]; the
    canonical index of an element is its tensor's base + row-major flat index). Local tensors are
    packed in one weight buffer, each at an `align`-byte boundary, in load_fn's dict order.
    """
    canonical = [(n, tuple(int(d) for d in s)) for n, s in canonical]
    local = load_fn(index_tensors(canonical))
    elem = dtype_size(dtype)
    tensors, pos = [], 0
    for name, arr in local.items():
        arr = np.asarray(arr)
        if arr.dtype != np.int64:
            raise TypeError("local tensor %s: the loader produced %s, expected int64 indices "
                            "(create the local parameters as int64 for the probe)" % (name, arr.dtype))
        pos = (pos + align - 1) // align * align
        tensors.append(LocalTensor(name, tuple(arr.shape), pos, arr.copy()))
        pos += arr.size * elem
    return InferredLayout(tensors, max(pos, 1), elem, canonical)


def infer_layout_torch(model, load_weights: Callable, canonical, dtype="bfloat16", align=256,
                       param_filter: Callable[[str], bool] = lambda name: True) -> InferredLayout:
    """Torch path (runs where torch is; not exercised in CI, which has no torch).

    `model` is the engine's module already built with its parallel config (e.g. a vLLM model on
    CPU); every parameter passing `param_filter` is swapped for an int64 tensor of -1 with the same
    shape, then `load_weights(model, weights)` (normally `model.load_weights`) runs on int64 index
    tensors, and what landed in each parameter is the probe. The module's original parameters are
    restored afterwards.
    """
    import torch  # imported only when used

    # A parameter that requires grad takes no int64 data: torch's set_data refuses it ("data set to a
    # tensor that requires gradients must be floating point or complex dtype",
    # torch/csrc/autograd/variable.cpp VariableHooks::set_data). requires_grad is off during the probe
    # and restored after the original data (an int64 tensor cannot require grad either).
    saved = {}
    try:
        for name, param in model.named_parameters():
            if param_filter(name):
                saved[name] = (param.data, param.requires_grad)
                param.requires_grad_(False)
                param.data = torch.full(tuple(param.shape), -1, dtype=torch.int64, device="cpu")

        def numpy_load(weights):
            load_weights(model, ((n, torch.from_numpy(a)) for n, a in weights))
            return {n: p.data.numpy().copy() for n, p in model.named_parameters() if n in saved}

        return infer_layout(numpy_load, canonical, dtype=dtype, align=align)
    finally:
        for name, param in model.named_parameters():
            if name in saved:
                data, requires_grad = saved[name]
                param.data = data
                param.requires_grad_(requires_grad)
