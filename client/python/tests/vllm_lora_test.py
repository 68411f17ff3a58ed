"""The vLLM LoRA engine hook (weightbridge.integrations.vllm_lora) against a real standalone
weightbridged: a PEFT trainer (preset "peft", through the generic LayoutHook) publishes versions of
a tiny Qwen2's LoRA adapters, and engine ranks (preset "vllm_lora") land them in the GPU slot their
adapter occupies in numpy stand-ins shaped like vLLM's `*WithLoRA` layers (lora_a_stacked /
lora_b_stacked tuples of [max_loras, 1, rows, cols] arrays, attributes, not parameters) and its
LoRA model manager (lora_index_to_id, pinned adapters).

What each slot must hold is transcribed here from vLLM's layers independently of the daemon and of
the hook: create_lora_weights' shapes, slice_lora_a / slice_lora_b per tp rank (column-parallel
qkv_proj / gate_up_proj, row-parallel o_proj / down_proj, KV heads split and replicated,
fully_sharded_loras), set_lora's reset of the slot then copy into [slot, 0, :rows, :cols], and
LoRALayerWeights.optimize's lora_b *= alpha / r in bfloat16 (float32 product, rounded to nearest
even - computed here by picking the nearer of the two neighbouring bfloat16 values). Every element
of every stacked array is compared, other slots included. Run by //client/python:vllm_lora_test.
"""

import dataclasses
import os
import sys
import types
import unittest
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_test import Daemon, DaemonTestCase, TIMEOUT, TINY_CONFIG  # noqa: E402
from integrations_test import run_all  # noqa: E402

import weightbridge as wb  # noqa: E402
from weightbridge._proto import pb  # noqa: E402
from weightbridge.integrations import vllm_lora  # noqa: E402
from weightbridge.integrations._common import LayoutHook  # noqa: E402

# tests/soak/testdata/qwen2-tiny.json: hidden 256, 4 heads / 2 KV heads of 64, intermediate 512, 2 layers.
H, I, L, HD, HEADS, KV = 256, 512, 2, 64, 4, 2
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")  # k_proj and gate_proj not targeted
R, ALPHA = 4, 3.0
SCALE = ALPHA / R  # 0.75: not a power of two, so the products round
ADAPTER, OTHER = 7, 3  # lora_int_ids: ours, and another adapter in slot 0
MAX_LORAS, SLOT = 3, 1

# PEFT module -> (in, out) on the whole model; vLLM module and slice index.
DIMS = {"q_proj": (H, HEADS * HD), "k_proj": (H, KV * HD), "v_proj": (H, KV * HD), "o_proj": (HEADS * HD, H),
        "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
PACKED = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
          "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


def peft_name(l, module, ab):
    part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return "base_model.model.model.layers.%d.%s.%s.lora_%s.weight" % (l, part, module, ab)


def adapters(version):
    """{canonical PEFT name: uint16 bfloat16 bits} of `version`: finite values (normal * 0.05,
    truncated to bfloat16), a function of name and version."""
    out = {}
    for l in range(L):
        for m in TARGETS:
            i, o = DIMS[m]
            for ab, shape in (("A", (R, i)), ("B", (o, R))):
                n = peft_name(l, m, ab)
                rng = np.random.default_rng(zlib.crc32(n.encode()) * 1000 + version)
                f = (rng.standard_normal(shape) * 0.05).astype(np.float32)
                out[n] = (f.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return out


def peft_named_parameters(c):
    """A PeftModel's named_parameters(): adapter "default" in the names, the frozen base weights too."""
    out = []
    for n, a in c.items():
        out.append((n.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"), a))
        if n.endswith("lora_A.weight"):
            out.append((n.replace(".lora_A.weight", ".base_layer.weight"), np.zeros((1,), np.uint16)))
    return out


def f32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def scaled_bf16(bits, scale):
    """bfloat16 bits of f32(bits) * f32(scale), rounded to nearest, ties to even: the nearer of the
    two bfloat16 values around the float32 product."""
    x = f32(bits) * np.float32(scale)
    lo = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # toward zero
    hi = lo + np.uint16(1)                                         # away from zero
    xd = x.astype(np.float64)
    d_lo, d_hi = np.abs(xd - f32(lo).astype(np.float64)), np.abs(f32(hi).astype(np.float64) - xd)
    return np.where((d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1)), hi, lo)


class Engine:
    """What one vLLM tp rank holds: shapes of create_lora_weights, and the slot contents set_lora
    writes for an adapter, transcribed from vllm/lora/layers/{base_linear,column_parallel_linear,
    row_parallel_linear}.py (and the *WithShardedLoRA layers for fully_sharded_loras)."""

    def __init__(self, tp, tp_rank, mlr, sharded=False):
        self.tp, self.rank, self.mlr, self.sharded = tp, tp_rank, mlr, sharded
        self.kv_heads = max(1, KV // tp)                    # KV heads per rank (replicated when tp > KV)
        self.kv_shard = tp_rank // max(1, tp // KV)         # tp_rank // num_kv_head_replicas

    def shapes(self, vm):
        """([lora_a slice shapes], [lora_b slice shapes]) of one slot of module `vm`."""
        tp = self.tp
        a_rows = self.mlr // tp if self.sharded else self.mlr
        if vm == "qkv_proj":
            outs = (HEADS * HD // tp, self.kv_heads * HD, self.kv_heads * HD)
            return [(a_rows, H)] * 3, [(o, self.mlr) for o in outs]
        if vm == "gate_up_proj":
            return [(a_rows, H)] * 2, [(I // tp, self.mlr)] * 2
        ins = HEADS * HD if vm == "o_proj" else I
        return [(self.mlr, ins // tp)], [(H // tp if self.sharded else H, self.mlr)]

    def slot(self, c, l, vm, scale, lora_b_dtype=np.uint16):
        """{(kind, i): array} of slot contents after vLLM's set_lora for adapter `c` (PEFT names)."""
        tp, r = self.tp, self.rank
        a_shapes, b_shapes = self.shapes(vm)
        out = {}
        for i, m in enumerate(PACKED[vm][1]):
            a = np.zeros(a_shapes[i], np.uint16)
            b = np.zeros(b_shapes[i], np.uint16 if lora_b_dtype == np.uint16 else np.float32)
            out[("lora_a_stacked", i)], out[("lora_b_stacked", i)] = a, b
            if m not in TARGETS:
                continue  # reset_lora: zero
            A, B = c[peft_name(l, m, "A")], c[peft_name(l, m, "B")]
            B = scaled_bf16(B, scale) if lora_b_dtype == np.uint16 else f32(B) * np.float32(scale)
            if vm in ("o_proj", "down_proj"):  # RowParallelLinearWithLoRA: lora_a columns of this rank
                n = A.shape[1] // tp
                A = A[:, r * n:(r + 1) * n]
                if self.sharded:                # RowParallelLinearWithShardedLoRA: lora_b rows too
                    n = B.shape[0] // tp
                    B = B[r * n:(r + 1) * n]
            else:
                if self.sharded:                # column-parallel sharded: lora_a rows [rank*s, +s) that exist
                    s = a_shapes[i][0]
                    A = A[r * s:(r + 1) * s]
                if m == "q_proj":
                    n = b_shapes[i][0]
                    B = B[r * n:(r + 1) * n]
                elif m in ("k_proj", "v_proj"):
                    n = b_shapes[i][0]
                    B = B[self.kv_shard * n:(self.kv_shard + 1) * n]
                else:                            # gate / up: MergedColumnParallelLinearWithLoRA
                    n = b_shapes[i][0]
                    B = B[r * n:(r + 1) * n]
            a[:A.shape[0], :A.shape[1]] = A
            b[:B.shape[0], :B.shape[1]] = B
        return out


class FakeLoraLayer:
    """A vLLM linear *WithLoRA layer as the hook sees it: the wrapped base_layer and the two tuples
    of stacked arrays [max_loras, 1, rows, cols], every slot filled with other bytes at first (other
    adapters, and the CPU copy vLLM activated into our slot)."""

    def __init__(self, a_shapes, b_shapes, rng, dtype=np.uint16):
        def stack(shape):
            full = (MAX_LORAS, 1) + tuple(shape)
            if dtype == np.uint16:
                return rng.integers(0x3C00, 0x3F00, size=full, dtype=np.uint16)
            return rng.standard_normal(full).astype(dtype)
        self.base_layer = types.SimpleNamespace()
        self.lora_a_stacked = tuple(stack(s) for s in a_shapes)
        self.lora_b_stacked = tuple(stack(s) for s in b_shapes)


class FakeEmbeddingWithLoRA:
    """vLLM's embedding / logits LoRA layers hold single tensors, not tuples: not linear slots."""

    def __init__(self):
        self.lora_a_stacked = np.zeros((MAX_LORAS, 8, 8), np.uint16)
        self.lora_b_stacked = np.zeros((MAX_LORAS, 1, 8, 8), np.uint16)


class FakeModel:
    """The LoRA-wrapped model: named_modules() as torch lists them (wrappers and their base_layer,
    modules without LoRA)."""

    def __init__(self, engine, seed, dtype=np.uint16):
        rng = np.random.default_rng(seed)
        self.mods = [("", self), ("model", types.SimpleNamespace()), ("model.embed_tokens", FakeEmbeddingWithLoRA())]
        self.layers = {}
        for l in range(L):
            for vm, (part, _) in PACKED.items():
                name = "model.layers.%d.%s.%s" % (l, part, vm)
                layer = FakeLoraLayer(*engine.shapes(vm), rng, dtype)
                self.layers[name] = layer
                self.mods += [(name, layer), (name + ".base_layer", layer.base_layer)]
            self.mods.append(("model.layers.%d.input_layernorm" % l, types.SimpleNamespace(weight=np.zeros(H))))

    def named_modules(self):
        return iter(list(self.mods))


class FakeLRUCache(dict):
    """vLLM's LRUCache as far as the hook looks: membership and pinned_items."""

    def __init__(self):
        super().__init__()
        self.pinned_items = set()

    def pin(self, key):
        if key not in self:
            raise ValueError("Cannot pin key: %s not in cache." % key)
        self.pinned_items.add(key)


class FakeLoraManager:
    """vLLM's LRUCacheLoRAModelManager: slot -> adapter id (lora_index_to_id), registered (CPU) and
    active (GPU) adapters with pins, the model it wrapped (which points back at it)."""

    def __init__(self, model):
        self.model = model
        model.lora_manager = self
        self.lora_index_to_id = [None] * MAX_LORAS
        self._registered_adapters, self._active_adapters = FakeLRUCache(), FakeLRUCache()

    def add(self, lora_id, rank, slot, pin=True):
        self._registered_adapters[lora_id] = types.SimpleNamespace(id=lora_id, rank=rank)
        self._active_adapters[lora_id] = None
        self.lora_index_to_id[slot] = lora_id
        if pin:
            self.pin_adapter(lora_id)

    def pin_adapter(self, lora_id):
        self._registered_adapters.pin(lora_id)
        self._active_adapters.pin(lora_id)
        return True

    def get_adapter(self, lora_id):
        return self._registered_adapters.get(lora_id)


def engine_stand_in(engine, seed, rank=R, dtype=np.uint16, pin=True):
    model = FakeModel(engine, seed, dtype)
    manager = FakeLoraManager(model)
    manager.add(OTHER, 8, 0)           # another adapter, slot 0
    manager.add(ADAPTER, rank, SLOT, pin=pin)
    return model, manager


def fake_worker(manager, tp=1, rank=0, mlr=16, sharded=False):
    """A vLLM GPU worker with the LoRA extension mixed in, as wb_lora_init reads it. The model
    runner's `model` is a wrapper without named_modules (as a CUDA-graph wrapper would be): the
    layers are found through the LoRA manager's model."""
    w = vllm_lora.WeightBridgeLoraWorkerExtension()
    w.parallel_config = types.SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=1, data_parallel_rank=0)
    w.rank = rank
    w.device = types.SimpleNamespace(index=0)
    w.lora_config = types.SimpleNamespace(max_lora_rank=mlr, fully_sharded_loras=sharded, max_loras=MAX_LORAS)
    w.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(runnable=manager.model),
                                           lora_manager=types.SimpleNamespace(_adapter_manager=manager))
    return w


def snapshot(model):
    return {(n, k, i): a.copy() for n, layer in model.layers.items()
            for k in ("lora_a_stacked", "lora_b_stacked") for i, a in enumerate(getattr(layer, k))}


class VllmLoraHookTest(DaemonTestCase):
    def model(self, model_id, mode, rollouts, max_lora_rank=0, sharded=False):
        return wb.ModelConfig(model_id=model_id, hf_config_json=self.config, num_trainer_workers=1, num_rollout_workers=rollouts,
                              mode=mode, lora=wb.LoraConfig(target_modules=list(TARGETS), r=R, alpha=ALPHA,
                                                            max_lora_rank=max_lora_rank, fully_sharded_loras=sharded))

    def trainer(self, model, prefix):
        return LayoutHook(None, model, "trainer/0", "trainer", wb.PresetLayout("peft"), client=self.daemon.client(prefix))

    def publish(self, trainer, version, c):
        # A PeftModel's named_parameters() also shows the frozen base weights: only lora_ ones go.
        named = [(n, a) for n, a in peft_named_parameters(c) if ".lora_" in n]
        trainer.write(named)
        trainer.client.publish(version, TIMEOUT)

    def check(self, engine, model, before, c, tag, slot=SLOT, lora_b_dtype=np.uint16):
        """Every element of every stacked array: slot `slot` as vLLM's set_lora leaves it for `c`,
        every other slot as it was."""
        for (name, kind, i), was in before.items():
            now = getattr(model.layers[name], kind)[i]
            l, vm = int(name.split(".")[2]), name.rsplit(".", 1)[1]
            want = engine.slot(c, l, vm, SCALE, lora_b_dtype)[(kind, i)]
            if lora_b_dtype != np.uint16 and kind == "lora_a_stacked":
                want = f32(want)
            np.testing.assert_array_equal(now[slot, 0], want, err_msg="%s %s.%s[%d] slot %d" % (tag, name, kind, i, slot))
            for s in range(MAX_LORAS):
                if s != slot:
                    np.testing.assert_array_equal(now[s], was[s], err_msg="%s %s.%s[%d] other slot %d" % (tag, name, kind, i, s))

    def sync_ranks(self, tag, tp, mlr, sharded=False):
        """A PEFT trainer -> tp vllm_lora ranks (sync, update()), two versions, every slot checked."""
        model = self.model("lora_sync_" + tag, "sync", tp, max_lora_rank=mlr, sharded=sharded)
        trainer = self.trainer(model, "pt" + tag)
        engines = [Engine(tp, r, mlr, sharded) for r in range(tp)]
        stand_ins = [engine_stand_in(e, seed=100 + r) for r, e in enumerate(engines)]
        hooks = [vllm_lora.VllmLoraRollout(None, model, ADAPTER, lora_manager=mgr, tp=tp, tp_rank=r,
                                           client=self.daemon.client("vl" + tag))
                 for r, (_, mgr) in enumerate(stand_ins)]
        for h in hooks:
            self.assertEqual(h.slot, SLOT)
            self.assertEqual(h.buffer.size_bytes, h.layout.buffer_bytes(0))
            # Bytes no piece covers (rows / columns past r, a sharded rank's empty lora_a) as an
            # uninitialised (CUDA) buffer would hold them: they must never reach a slot.
            for n in h.names:
                h.view(n)[...] = 0x4242
        before = [snapshot(m) for m, _ in stand_ins]
        for version in (1, 2):
            c = adapters(version)
            errors = run_all([lambda h=h: h.update(version, timeout=TIMEOUT) for h in hooks] +
                             [lambda: self.publish(trainer, version, c)])
            self.assertEqual(errors, [])
            for r, (e, (m, _)) in enumerate(zip(engines, stand_ins)):
                self.check(e, m, before[r], c, "%s rank %d v%d" % (tag, r, version))
        for h in [trainer] + hooks:
            h.client.deregister()
            h.client.close()
        return engines, stand_ins

    def test_peft_trainer_to_vllm_lora_tp2_sync(self):
        engines, stand_ins = self.sync_ranks("tp2", tp=2, mlr=8)
        # Untargeted slices (k_proj, gate_proj) of the slot: zeroed, as set_lora's reset leaves them.
        m = stand_ins[1][0]
        self.assertFalse(m.layers["model.layers.0.self_attn.qkv_proj"].lora_a_stacked[1][SLOT].any())
        self.assertFalse(m.layers["model.layers.1.mlp.gate_up_proj"].lora_b_stacked[0][SLOT].any())
        # Columns [r, max_lora_rank) of lora_b: zero (were other bytes before).
        self.assertFalse(m.layers["model.layers.0.self_attn.o_proj"].lora_b_stacked[0][SLOT, 0, :, R:].any())
        self.assertTrue(m.layers["model.layers.0.self_attn.o_proj"].lora_b_stacked[0][SLOT, 0, :, :R].any())

    def test_tp4_kv_heads_replicated(self):
        # tp 4 > 2 KV heads: each KV head on two ranks (kv shard = tp_rank // 2); max_lora_rank 16.
        self.sync_ranks("tp4", tp=4, mlr=16)

    def test_fully_sharded_loras_tp4(self):
        # --fully-sharded-loras: column-parallel lora_a rows [rank*2, +2) of r=4 (ranks 2, 3: an empty
        # slot), row-parallel lora_b rows [rank*64, +64).
        engines, stand_ins = self.sync_ranks("fs4", tp=4, mlr=8, sharded=True)
        self.assertFalse(stand_ins[3][0].layers["model.layers.0.self_attn.qkv_proj"].lora_a_stacked[0][SLOT].any())
        self.assertTrue(stand_ins[1][0].layers["model.layers.0.self_attn.qkv_proj"].lora_a_stacked[0][SLOT].any())

    def test_worker_extension_one_step_off_float32_slots(self):
        """wb_lora_init / wb_lora_apply on a stand-in worker (tp=1, vLLM's default max_lora_rank 16,
        --lora-dtype float32 slots: lora_a the bfloat16 values exactly, lora_b their float32 product
        with alpha / r); the model config given as a dict, as collective_rpc passes it."""
        model = self.model("lora_ext", "one_step_off", 1)
        trainer = self.trainer(model, "pte")
        engine = Engine(1, 0, 16)
        m, mgr = engine_stand_in(engine, seed=7, dtype=np.float32)
        worker = fake_worker(mgr, mlr=16)
        self.assertEqual(worker.wb_lora_init(self.daemon.socket, dataclasses.asdict(model), ADAPTER), SLOT)
        before = snapshot(m)
        # Nothing committed yet: applied version 0, the slot keeps what vLLM loaded (not the empty buffer).
        self.assertEqual(worker.wb_lora_apply(timeout=TIMEOUT), 0)
        for k, a in before.items():
            np.testing.assert_array_equal(getattr(m.layers[k[0]], k[1])[k[2]], a, err_msg=str(k))
        for version in (1, 2):
            c = adapters(version)
            self.publish(trainer, version, c)
            self.assertEqual(worker.wb_lora_apply(version, timeout=TIMEOUT), version)
            self.check(engine, m, before, c, "ext v%d" % version, lora_b_dtype=np.float32)
        # The adapter moved (removed, re-added into slot 2 and pinned again): the next version follows it.
        mgr.lora_index_to_id[SLOT] = None
        mgr.lora_index_to_id[2] = ADAPTER
        before = snapshot(m)
        c = adapters(3)
        self.publish(trainer, 3, c)
        self.assertEqual(worker.wb_lora_apply(3, timeout=TIMEOUT), 3)
        self.assertEqual(worker.wb_lora.slot, 2)
        self.check(engine, m, before, c, "moved v3", slot=2, lora_b_dtype=np.float32)
        for h in (trainer, worker.wb_lora):
            h.client.deregister()
            h.client.close()

    def registered_rollouts(self, model_id):
        c = self.daemon.client("st")
        try:
            return [w.worker_id for w in c.status(model_id=model_id).workers if w.role == pb.ROLE_ROLLOUT]
        finally:
            c.close()

    def test_refusals_name_what_is_wrong_before_registering(self):
        model = self.model("lora_refused", "one_step_off", 1, max_lora_rank=8)
        trainer = self.trainer(model, "ptr")  # the model exists on the daemon
        engine = Engine(1, 0, 8)

        def refused(exc, *texts, **kw):
            m, mgr = kw.pop("stand_in", None) or engine_stand_in(engine, seed=9)
            before = snapshot(m)
            with self.assertRaises(exc) as cm:
                vllm_lora.VllmLoraRollout(None, model, kw.pop("lora_int_id", ADAPTER), lora_manager=mgr,
                                          client=self.daemon.client("rf"))
            for t in texts:
                self.assertIn(t, str(cm.exception))
            self.assertEqual(self.registered_rollouts(model.model_id), [])
            for k, a in before.items():  # nothing written
                np.testing.assert_array_equal(getattr(m.layers[k[0]], k[1])[k[2]], a)

        # Not resident: in no GPU slot (never added, or evicted).
        refused(vllm_lora.LoraSlotError, "lora_int_id=9", "not resident", "pin_lora(9)", lora_int_id=9)
        # Resident, not pinned: the LRU would hand the slot away.
        refused(vllm_lora.LoraSlotError, "lora_int_id=7", "slot 1", "not pinned", "pin_lora(7)",
                stand_in=engine_stand_in(engine, seed=9, pin=False))
        # Added with another rank.
        refused(ValueError, "lora_int_id=7", "rank 8", "r=4", stand_in=engine_stand_in(engine, seed=9, rank=8))
        # A slot of another shape: the engine's max_lora_rank is 16, the model's 8.
        refused(ValueError, "model.layers.0.self_attn.qkv_proj.lora_a_stacked.0", "(3, 1, 16, 256)", "(8, 256)",
                "max_lora_rank=8", stand_in=engine_stand_in(Engine(1, 0, 16), seed=9))
        # One layer's lora_b of another shape (named), the others right.
        m, mgr = engine_stand_in(engine, seed=9)
        layer = m.layers["model.layers.1.self_attn.o_proj"]
        layer.lora_b_stacked = (np.zeros((MAX_LORAS, 1, H, 16), np.uint16),)
        refused(ValueError, "model.layers.1.self_attn.o_proj.lora_b_stacked.0", "(3, 1, 256, 16)", "(256, 8)", stand_in=(m, mgr))
        # A targeted module vLLM did not wrap (not among its LoRA targets).
        m, mgr = engine_stand_in(engine, seed=9)
        m.mods = [(n, x) for n, x in m.mods if n != "model.layers.0.mlp.down_proj"]
        refused(ValueError, "model.layers.0.mlp.down_proj.lora_a_stacked.0", "no LoRA layer model.layers.0.mlp.down_proj",
                stand_in=(m, mgr))
        # A packed module with fewer slices than the layout's index.
        m, mgr = engine_stand_in(engine, seed=9)
        qkv = m.layers["model.layers.0.self_attn.qkv_proj"]
        qkv.lora_a_stacked, qkv.lora_b_stacked = qkv.lora_a_stacked[:1], qkv.lora_b_stacked[:1]
        refused(ValueError, "model.layers.0.self_attn.qkv_proj.lora_a_stacked.2", "has 1 lora_a_stacked slices", stand_in=(m, mgr))
        # No LoRA manager at all.
        with self.assertRaises(vllm_lora.LoraSlotError) as cm:
            vllm_lora.VllmLoraRollout(None, model, ADAPTER, engine_model=FakeModel(engine, 1), client=self.daemon.client("rf"))
        self.assertIn("enable_lora", str(cm.exception))
        # The worker extension: vLLM's own LoRA settings checked against the model's.
        m, mgr = engine_stand_in(engine, seed=9)
        for kw, texts in ((dict(mlr=16), ("--max-lora-rank 16", "max_lora_rank=8")),
                          (dict(mlr=8, sharded=True), ("fully_sharded_loras=True", "fully_sharded_loras=False"))):
            worker = fake_worker(mgr, **kw)
            with self.assertRaises(ValueError) as cm:
                worker.wb_lora_init(self.daemon.socket, model, ADAPTER)
            for t in texts:
                self.assertIn(t, str(cm.exception))
            self.assertFalse(hasattr(worker, "wb_lora"))
        worker = fake_worker(mgr, mlr=8)
        worker.lora_config = None
        with self.assertRaises(vllm_lora.LoraSlotError):
            worker.wb_lora_init(self.daemon.socket, model, ADAPTER)
        self.assertEqual(self.registered_rollouts(model.model_id), [])
        with self.assertRaises(ValueError):  # a model without adapters
            vllm_lora.VllmLoraRollout(None, wb.ModelConfig(model_id="x", hf_config_json=self.config), ADAPTER, lora_manager=mgr,
                                      client=self.daemon.client("rf"))
        for bad in (0, -1, True, "7"):
            with self.assertRaises(ValueError):
                vllm_lora.VllmLoraRollout(None, model, bad, lora_manager=mgr, client=self.daemon.client("rf"))
        trainer.client.deregister()
        trainer.client.close()

    def test_a_version_is_not_written_once_the_adapter_left_its_slot(self):
        """Checked again at every version: evicted (slot freed), or unpinned, after wb_lora_init -
        the version lands in the buffer, the slots are left alone, the error names the id."""
        model = self.model("lora_evicted", "one_step_off", 1, max_lora_rank=8)
        trainer = self.trainer(model, "ptv")
        engine = Engine(1, 0, 8)
        m, mgr = engine_stand_in(engine, seed=11)
        hook = vllm_lora.VllmLoraRollout(None, model, ADAPTER, lora_manager=mgr, client=self.daemon.client("ev"))
        before = snapshot(m)
        c = adapters(1)
        self.publish(trainer, 1, c)
        self.assertEqual(hook.apply(1, timeout=TIMEOUT), 1)
        self.check(engine, m, before, c, "v1")
        after = snapshot(m)
        mgr._active_adapters.pinned_items.discard(ADAPTER)  # unpinned
        self.publish(trainer, 2, adapters(2))
        with self.assertRaises(vllm_lora.LoraSlotError) as cm:
            hook.apply(2, timeout=TIMEOUT)
        self.assertIn("lora_int_id=7", str(cm.exception))
        self.assertIn("not pinned", str(cm.exception))
        mgr.lora_index_to_id[SLOT] = None  # evicted
        with self.assertRaises(vllm_lora.LoraSlotError) as cm:
            hook.write_slot()
        self.assertIn("not resident", str(cm.exception))
        for k, a in after.items():
            np.testing.assert_array_equal(getattr(m.layers[k[0]], k[1])[k[2]], a, err_msg=str(k))
        with self.assertRaises(ValueError):  # the slots are never bound to the buffer
            hook.bind({})
        for h in (trainer, hook):
            h.client.deregister()
            h.client.close()

    def test_independent_rounding_matches_known_values(self):
        # 1.0078125 (0x3F81) * 0.75 = 0.755859375: between 0x3F41 (0.75390625) and 0x3F42 (0.7578125),
        # exactly halfway -> even (0x3F42); 1.5 * 0.75 = 1.125 exact (0x3F90).
        np.testing.assert_array_equal(scaled_bf16(np.array([0x3F81, 0x3FC0, 0xBF81], np.uint16), 0.75),
                                      np.array([0x3F42, 0x3F90, 0xBF42], np.uint16))

    def test_module_imports_without_torch(self):
        self.assertNotIn("torch", sys.modules)
        self.assertTrue(hasattr(vllm_lora, "WeightBridgeLoraWorkerExtension"))


if __name__ == "__main__":
    unittest.main()
