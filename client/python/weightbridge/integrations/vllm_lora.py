"""vLLM LoRA adapter rollout: lands each version of a LoRA-adapter model (preset "vllm_lora",
docs/presets.md "LoRA adapters") in the GPU slot vLLM keeps the adapter in.

    llm = LLM(model=base, enable_lora=True, max_lora_rank=16, max_loras=2,
              worker_extension_cls="weightbridge.integrations.vllm_lora.WeightBridgeLoraWorkerExtension")
    llm.llm_engine.add_lora(LoRARequest("policy", 1, initial_adapter_dir))   # rank r, the model's targets
    llm.llm_engine.pin_lora(1)                                               # or LRU eviction reuses the slot
    llm.collective_rpc("wb_lora_init", args=(socket, model_cfg, 1))
    # sync: generation paused, then
    llm.collective_rpc("wb_lora_update", args=(version,))
    # one-step-off / async, between engine steps:
    llm.collective_rpc("wb_lora_apply")

What vLLM holds (read in vLLM's sources as stored for its main branch: vllm/lora/model_manager.py
(vllm/lora/models.py in earlier releases), vllm/lora/layers/base_linear.py,
column_parallel_linear.py, row_parallel_linear.py, vllm/lora/worker_manager.py,
vllm/lora/lora_weights.py, vllm/v1/worker/lora_model_runner_mixin.py, vllm/v1/engine/llm_engine.py
(add_lora / pin_lora); written for the V1 engine, vLLM 0.8 and later, the layers in the
vllm/lora/layers/ package from 0.11 on (vllm/lora/layers.py before). Releases whose unpacked LoRA
layers hold one tensor instead of a tuple are refused, naming the layer, not written. Not run
against a real vLLM here):

- With --enable-lora every targeted linear layer is replaced by a `*WithLoRA` module (the original
  kept as `base_layer`) that owns `lora_a_stacked` / `lora_b_stacked`: tuples (one per packed
  slice: qkv_proj has 3, gate_up_proj 2, o_proj / down_proj 1) of plain tensors
  [max_loras, 1, max_lora_rank, in] and [max_loras, 1, out, max_lora_rank] - not parameters, so
  `named_parameters()` never shows them. `lora_layers` finds them by walking `named_modules()`.
- The LoRA model manager (`model_runner.lora_manager._adapter_manager`, also set on the model as
  `model.lora_manager`) maps slot -> adapter in `lora_index_to_id`; activating an adapter resets
  its slot and copies the adapter's CPU copy into `[slot, 0, :rows, :cols]` of every slice, lora_b
  already multiplied by its scaling (`LoRALayerWeights.optimize`: alpha / r). The LRU managers
  evict the oldest active adapter when a request needs a slot, and a re-activated adapter is copied
  from that CPU copy again: the adapter must be pinned (`pin_lora`, which pins it in
  `_active_adapters.pinned_items`) or a version written here is silently replaced.

What this hook does after each version lands in its buffer (sync `update`, one-step-off / async
`apply`, as the other rollout hooks): for every local tensor
`<module>.lora_a_stacked.<i>` / `<module>.lora_b_stacked.<i>` of the preset, it writes
`module.lora_a_stacked[i][slot, 0]` / `module.lora_b_stacked[i][slot, 0]` whole - the elements the
layout's pieces cover from the buffer (lora_b multiplied by alpha / r, computed in float32 and
rounded to the slot's dtype once, as vLLM's in-place `lora_b *= scaling` does), every other element
(rows / columns in [r, max_lora_rank), a fully_sharded_loras rank's empty lora_a) zero - and zeroes
the slot of the slices of those modules that the adapter does not target (as vLLM's set_lora resets
the slot first). Other slots, and LoRA modules the layout has no tensor of, are not touched.
Scaling: alpha / r only - WeightBridge's LoraConfig has no rsLoRA flag (vLLM's alpha / sqrt(r)
for `use_rslora`), so an rsLoRA adapter would get the wrong factor; train with rsLoRA off.

Refused, naming what is wrong: an adapter id that is in no slot (not added, or evicted), one that is
not pinned (where the manager shows its pins), an adapter vLLM loaded with another rank than the
model's r, a local tensor whose module or slice the engine lacks, or whose slot [slot, 0] has
another shape than the layout's (the engine's max_lora_rank, fully_sharded_loras or tp differ from
the model's). All of it is checked before the worker registers, and the slot is looked up again
(still resident, still pinned) each time a version is written.

Tensors: torch (the engine) or numpy arrays (stand-ins in CI); bfloat16 numpy stand-ins are uint16
bits, as everywhere in weightbridge.
"""

import re

import numpy as np

from weightbridge.client import LoraConfig, ModelConfig, WorkerClient
from weightbridge.integrations._common import _is_torch, bf16_bits, cuda_device, synchronize
from weightbridge.integrations._rollout import RolloutHook
from weightbridge.layouts import PresetLayout

# vLLM's --max-lora-rank choices (docs/presets.md); the preset's max_lora_rank 0 means vLLM's
# default 16, or the smallest of these that holds r.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

_LOCAL = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_[ab]_stacked)\.(?P<slice>\d+)$")
_ITEM = {"bfloat16": 2, "float16": 2, "float32": 4}


class LoraSlotError(RuntimeError):
    """The adapter is not where the hook must write it: no LoRA manager, not resident in a GPU slot,
    or not pinned there."""


def effective_max_lora_rank(lora: LoraConfig):
    """The max_lora_rank the vllm_lora preset lays slots out with: the configured one, else vLLM's
    default 16, or the smallest --max-lora-rank value that holds r."""
    if lora.max_lora_rank:
        return lora.max_lora_rank
    if lora.r <= 16:
        return 16
    return min(v for v in VLLM_MAX_LORA_RANKS if v >= lora.r)


def lora_model_manager(obj):
    """vLLM's LoRA model manager (the object with `lora_index_to_id`) reached from `obj`: the manager
    itself, the worker's LRUCacheWorkerLoRAManager (`_adapter_manager`), a model runner
    (`lora_manager`), a worker (`model_runner`), or a LoRA-wrapped model (the manager sets
    `model.lora_manager`). None when there is none (LoRA not enabled)."""
    for _ in range(8):
        if obj is None:
            return None
        if hasattr(obj, "lora_index_to_id"):
            return obj
        nxt = None
        for attr in ("_adapter_manager", "lora_manager", "model_runner"):
            nxt = getattr(obj, attr, None)
            if nxt is not None:
                break
        obj = nxt
    return None


def lora_layers(model):
    """{module name: module} of every module of `model` (anything with torch's named_modules())
    that holds LoRA slots: `lora_a_stacked` and `lora_b_stacked` as tuples of tensors (vLLM's linear
    `*WithLoRA` layers; the embedding / logits LoRA layers hold single tensors and are not
    included)."""
    out = {}
    for name, m in model.named_modules():
        a, b = getattr(m, "lora_a_stacked", None), getattr(m, "lora_b_stacked", None)
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            out[name] = m
    return out


def _first_attr(obj, names):
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return None


def _registered_adapter(manager, lora_int_id):
    """The LoRAModel vLLM registered under lora_int_id (its CPU copy), or None where not visible."""
    get = getattr(manager, "get_adapter", None)
    if callable(get):
        return get(lora_int_id)
    listed = _first_attr(manager, ("list_adapters", "list_loras"))
    if callable(listed):
        found = listed()
        if isinstance(found, dict):
            return found.get(lora_int_id)
    return None


def adapter_slot(manager, lora_int_id, rank=None):
    """The GPU slot index of adapter `lora_int_id` in vLLM's LoRA model manager. LoraSlotError when
    it is in no slot or (where the manager shows pins: `_active_adapters.pinned_items`) not pinned;
    ValueError when vLLM registered it with another rank than `rank`."""
    slots = list(manager.lora_index_to_id)
    if lora_int_id not in slots:
        raise LoraSlotError(
            "LoRA adapter lora_int_id=%d is not resident in any of vLLM's %d GPU LoRA slots (they hold %s): add it "
            "(a LoRARequest with lora_int_id=%d and the model's rank) and pin it (pin_lora(%d)) before the hook writes "
            "it" % (lora_int_id, len(slots), slots, lora_int_id, lora_int_id))
    if slots.count(lora_int_id) != 1:
        raise LoraSlotError("LoRA adapter lora_int_id=%d is in %d GPU slots %s" % (lora_int_id, slots.count(lora_int_id), slots))
    slot = slots.index(lora_int_id)
    active = _first_attr(manager, ("_active_adapters", "_active_loras"))
    pinned = getattr(active, "pinned_items", None)
    if pinned is not None and lora_int_id not in pinned:
        raise LoraSlotError(
            "LoRA adapter lora_int_id=%d is in GPU slot %d but not pinned: vLLM's LRU eviction would give the slot to "
            "another adapter, and re-activating this one would overwrite it from vLLM's CPU copy; pin it (pin_lora(%d))"
            % (lora_int_id, slot, lora_int_id))
    if rank is not None:
        adapter = _registered_adapter(manager, lora_int_id)
        got = getattr(adapter, "rank", None)
        if got is not None and got != rank:
            raise ValueError("LoRA adapter lora_int_id=%d was added to vLLM with rank %d, the WeightBridge model has r=%d: "
                             "add it with a rank-%d adapter" % (lora_int_id, got, rank, rank))
    return slot


def _covered(desc, name):
    """bool array of local tensor `name`'s shape: True where one of its pieces lands (from the
    description's piece offsets and strides, not from any rule about r)."""
    t = desc.tensors[name]
    shape = tuple(t.shape)
    if not t.pieces or 0 in shape:
        return np.zeros(shape, dtype=bool)
    item = _ITEM[t.dtype]
    span = t.size_bytes // item
    flat = np.zeros(span, dtype=bool)
    for p in t.pieces:
        piece = desc.pieces[p]
        rel = piece.offset_bytes - t.offset_bytes
        box = [int(e) - int(b) for b, e in zip(piece.box.begin, piece.box.end)]
        strides = [int(s) for s in piece.strides]
        last = rel // item + sum((n - 1) * s for n, s in zip(box, strides))
        if rel < 0 or rel % item or any(s < 0 for s in strides) or (0 not in box and last >= span):
            raise ValueError("local tensor %s: piece of %s at byte %d lies outside the tensor" % (name, piece.tensor, piece.offset_bytes))
        if 0 in box:
            continue
        np.lib.stride_tricks.as_strided(flat[rel // item:], shape=box, strides=strides)[...] = True
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=[int(s) for s in t.strides]).copy()


class _Slice:
    """One local tensor and where it goes: `module.<kind>[index][slot, 0]`."""

    def __init__(self, name, module_name, module, kind, index, mask, scaled):
        self.name, self.module_name, self.module, self.kind, self.index = name, module_name, module, kind, index
        self.mask = None if mask.all() else mask  # None: every element comes from the buffer
        self.scaled = scaled
        self._torch_mask = None

    def target(self):
        return getattr(self.module, self.kind)[self.index]


def plan_slots(desc, layers, slot, lora, tp):
    """Matches every local tensor of a vllm_lora description with its vLLM LoRA slice, checking
    names, slice indices and the [slot, 0] shapes. Returns ([_Slice], [(module, kind, index)] of the
    untargeted slices of those modules); ValueError naming the tensor otherwise."""
    slices, wanted = [], {}
    hint = ("the engine's --max-lora-rank, --fully-sharded-loras and tensor parallel size must be the model's "
            "(max_lora_rank=%d, fully_sharded_loras=%s, tp=%d)" % (effective_max_lora_rank(lora), lora.fully_sharded_loras, tp))
    for name, t in desc.tensors.items():
        m = _LOCAL.match(name)
        if m is None:
            raise ValueError("local tensor %s is not a vllm_lora slot tensor (<module>.lora_a_stacked.<i>)" % name)
        module_name, kind, index = m.group("module"), m.group("kind"), int(m.group("slice"))
        module = layers.get(module_name)
        if module is None:
            raise ValueError("local tensor %s: the engine has no LoRA layer %s (it has %d, e.g. %s); is LoRA enabled and "
                             "the module among vLLM's LoRA targets?" % (name, module_name, len(layers), ", ".join(list(layers)[:3])))
        stack = getattr(module, kind)
        if index >= len(stack):
            raise ValueError("local tensor %s: LoRA layer %s has %d %s slices" % (name, module_name, len(stack), kind))
        full = tuple(stack[index].shape)
        if len(full) != 4 or full[1] != 1 or full[2:] != tuple(t.shape):
            raise ValueError("local tensor %s: vLLM's %s.%s[%d] is %s, its slot [slot, 0] must be %s as the layout holds; %s"
                             % (name, module_name, kind, index, full, tuple(t.shape), hint))
        if slot >= full[0]:
            raise ValueError("local tensor %s: slot %d is outside vLLM's %s.%s[%d] of %d slots" % (name, slot, module_name, kind, index, full[0]))
        if t.dtype not in _ITEM:
            raise ValueError("local tensor %s: dtype %s, LoRA slots hold bfloat16, float16 or float32" % (name, t.dtype))
        slices.append(_Slice(name, module_name, module, kind, index, _covered(desc, name), kind == "lora_b_stacked"))
        wanted.setdefault(module_name, set()).add((kind, index))
    untargeted = []
    for module_name in wanted:
        module = layers[module_name]
        for kind in ("lora_a_stacked", "lora_b_stacked"):
            for index in range(len(getattr(module, kind))):
                if (kind, index) not in wanted[module_name]:
                    untargeted.append((module, kind, index))
    return slices, untargeted


def _bf16_values(bits):
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _np_store(dst, values):
    """float32 `values` into numpy slot `dst` (uint16: bfloat16 bits, rounded to nearest even)."""
    dst[...] = bf16_bits(values) if dst.dtype == np.uint16 else values.astype(dst.dtype)


class VllmLoraRollout(RolloutHook):
    """One vLLM engine rank holding adapter `lora_int_id` as a rollout worker of a LoRA-adapter
    model (preset "vllm_lora"). `lora_manager`: vLLM's LoRA model manager, or anything it can be
    reached from (the worker, its model runner, the LoRA-wrapped model; lora_model_manager).
    `engine_model`: the model whose named_modules() hold the `*WithLoRA` layers (default: the
    manager's `model`). update() / apply() as RolloutHook; `params` is ignored (the slots are not
    parameters). memory="cuda": the buffer is on the GPU and the copies into the slots stay there;
    the slots are never bound to the buffer (lora_b is scaled on the way)."""

    def __init__(self, socket_path, model: ModelConfig, lora_int_id, lora_manager=None, engine_model=None, tp=1, tp_rank=0,
                 dp=1, dp_rank=0, replica=0, replicas=1, worker_id=None, memory="host", gpu=-1, client=None):
        lora = getattr(model, "lora", None)
        if lora is None:
            raise ValueError("model %s has no lora config: the vllm_lora hook moves LoRA-adapter models (ModelConfig.lora)"
                             % model.model_id)
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1:
            raise ValueError("lora_int_id must be vLLM's positive LoRARequest.lora_int_id, got %r" % (lora_int_id,))
        self.lora_int_id, self.lora = lora_int_id, lora
        self.scale = float(lora.alpha) / float(lora.r)  # alpha / r (no rsLoRA flag in LoraConfig)
        self.manager = lora_model_manager(lora_manager if lora_manager is not None else engine_model)
        if self.manager is None:
            raise LoraSlotError("no vLLM LoRA model manager (lora_index_to_id) found for adapter lora_int_id=%d: is the engine "
                                "running with enable_lora=True?" % lora_int_id)
        engine_model = engine_model if engine_model is not None else getattr(self.manager, "model", None)
        if engine_model is not None and callable(getattr(engine_model, "named_modules", None)):
            self.layers = lora_layers(engine_model)
        else:
            self.layers = dict(getattr(self.manager, "modules", {}) or {})
        self.slot = adapter_slot(self.manager, lora_int_id, rank=lora.r)
        # Everything engine-side is checked against the layout before this rollout registers (a
        # registered rollout that can never land a version would hold a sync trainer up).
        own = client is None
        client = client or WorkerClient(socket_path, shm_prefix="vllm_lora")
        rank = (replica * dp + dp_rank) * tp + tp_rank
        try:
            desc = client.describe_layout(PresetLayout("vllm_lora", tp=tp, dp=dp, replicas=replicas, rank=rank), model=model)
            self.slices, self.untargeted = plan_slots(desc, self.layers, self.slot, lora, tp)
            super().__init__("vllm_lora", socket_path, model, tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank, replica=replica,
                             replicas=replicas, worker_id=worker_id, memory=memory, gpu=gpu, client=client)
        except BaseException:
            if own:
                client.close()
            raise
        self.own_client = own

    def bind(self, params):
        raise ValueError("vllm_lora: vLLM's LoRA slots are slices of its stacked tensors and lora_b is scaled on the way; "
                         "they are written by copy after each version (update / apply), not bound to the buffer")

    def apply(self, version=0, params=None, timeout=300.0):
        """One-step-off / async, at a step boundary: makes `version` (0 = newest committed) live and
        writes it into the slot. Applied version 0 (nothing committed yet): the buffer holds no
        version, and the slot keeps the adapter vLLM loaded."""
        got = self.client.apply(version, timeout).applied_version
        if got:
            self._landed(params)
        return got

    def _landed(self, params):
        self.write_slot()
        self.refresh_derived()

    def write_slot(self):
        """Writes the version in the buffer into the adapter's slot (looked up again: it must still be
        resident and pinned; it may have moved). Returns the slot."""
        slot = adapter_slot(self.manager, self.lora_int_id, rank=self.lora.r)
        self.slot = slot
        devices = []
        for s in self.slices:
            dst = s.target()
            if _is_torch(dst):
                self._write_torch(s, dst[slot, 0])
                for t in (dst, self._torch()[s.name]):
                    dev = cuda_device(t)
                    if dev is not None and dev not in devices:
                        devices.append(dev)
            else:
                self._write_numpy(s, dst[slot, 0])
        for module, kind, index in self.untargeted:
            getattr(module, kind)[index][slot, 0] = 0
        # The copies out of a CUDA buffer are queued on this process's stream: finished before the
        # daemon may write the buffer with the next version (_common.synchronize).
        synchronize(devices)
        return slot

    def _write_numpy(self, s, dst):
        if self.memory != "host":
            raise TypeError("LoRA slot %s.%s[%d]: numpy slots need memory='host'" % (s.module_name, s.kind, s.index))
        src = self._np_views[s.name]
        bf16 = self.layout[s.name].dtype == "bfloat16"
        if not s.scaled and (dst.dtype == src.dtype):
            dst[...] = src  # same dtype: the bits (bfloat16 as uint16)
        else:
            values = _bf16_values(src) if bf16 else np.asarray(src, dtype=np.float32)
            if s.scaled:
                values = values * np.float32(self.scale)
            _np_store(dst, values)
        if s.mask is not None:
            dst[~s.mask] = 0

    def _write_torch(self, s, dst):
        import torch  # only with torch slots

        src = self._torch()[s.name]
        if s.scaled:
            # float32 product, rounded once into the slot's dtype (as vLLM's bf16 `lora_b *= scaling`).
            dst.copy_(src.to(device=dst.device, dtype=torch.float32) * self.scale)
        else:
            dst.copy_(src)
        if s.mask is not None:
            if s._torch_mask is None or s._torch_mask.device != dst.device:
                s._torch_mask = torch.from_numpy(~s.mask).to(dst.device)
            dst.masked_fill_(s._torch_mask, 0)


def _model_config(model_cfg):
    if isinstance(model_cfg, ModelConfig):
        return model_cfg
    cfg = dict(model_cfg)
    if isinstance(cfg.get("lora"), dict):
        cfg["lora"] = LoraConfig(**cfg["lora"])
    return ModelConfig(**cfg)


class WeightBridgeLoraWorkerExtension:
    """Mixed into vLLM's GPU worker (worker_extension_cls; V1 engine): `self` has model_runner
    (its `lora_manager`), parallel_config, rank, device and lora_config (vLLM's --enable-lora
    settings). Methods named wb_lora_*, so that a class deriving from both this and
    vllm.WeightBridgeWorkerExtension moves base weights and adapters (two WeightBridge models)."""

    def wb_lora_init(self, socket_path, model_cfg, lora_int_id, replica=0, replicas=1, memory="host"):
        """Registers this rank as a rollout of LoRA-adapter model `model_cfg` (ModelConfig, or its
        fields as a dict with `lora` as a dict) whose versions go into the slot of adapter
        `lora_int_id` (added with a LoRARequest of that id and the model's rank, and pinned).
        Refuses, before registering, an engine whose LoRA settings lay the slots out otherwise.
        Returns the slot index."""
        model = _model_config(model_cfg)
        if model.lora is None:
            raise ValueError("model %s has no lora config (ModelConfig.lora)" % model.model_id)
        lc = getattr(self, "lora_config", None)
        if lc is None:
            lc = getattr(getattr(self, "vllm_config", None), "lora_config", None)
        if lc is None:
            raise LoraSlotError("vLLM runs without LoRA (enable_lora=False): no slot for adapter lora_int_id=%d" % lora_int_id)
        want = effective_max_lora_rank(model.lora)
        if getattr(lc, "max_lora_rank", want) != want:
            raise ValueError("vLLM runs with --max-lora-rank %d, model %s lays its slots out for max_lora_rank=%d (LoraConfig."
                             "max_lora_rank %d)" % (lc.max_lora_rank, model.model_id, want, model.lora.max_lora_rank))
        if bool(getattr(lc, "fully_sharded_loras", False)) != bool(model.lora.fully_sharded_loras):
            raise ValueError("vLLM runs with fully_sharded_loras=%s, model %s with fully_sharded_loras=%s"
                             % (bool(lc.fully_sharded_loras), model.model_id, bool(model.lora.fully_sharded_loras)))
        pc = self.parallel_config
        tp, dp = pc.tensor_parallel_size, getattr(pc, "data_parallel_size", 1)
        tp_rank = self.rank % tp if hasattr(self, "rank") else 0
        dp_rank = getattr(pc, "data_parallel_rank", 0)
        manager = lora_model_manager(self.model_runner)
        engine_model = getattr(manager, "model", None) if manager is not None else None
        if engine_model is None:
            engine_model = getattr(self.model_runner, "model", None)
        self.wb_lora = VllmLoraRollout(socket_path, model, lora_int_id, lora_manager=manager, engine_model=engine_model,
                                       tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank, replica=replica, replicas=replicas,
                                       memory=memory, gpu=self.device.index if memory == "cuda" else -1)
        return self.wb_lora.slot

    def wb_lora_update(self, version, timeout=300.0):
        """Sync: generation paused; returns once `version` is in the adapter's slot."""
        return self.wb_lora.update(version, timeout=timeout)

    def wb_lora_apply(self, version=0, timeout=300.0):
        """One-step-off / async, between engine steps: the newest committed version (or `version`)
        into the adapter's slot."""
        return self.wb_lora.apply(version, timeout=timeout)


__all__ = ["VllmLoraRollout", "WeightBridgeLoraWorkerExtension", "LoraSlotError", "lora_layers", "lora_model_manager",
           "adapter_slot", "effective_max_lora_rank", "plan_slots"]
