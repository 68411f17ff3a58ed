"""DeepSpeedZero3TrainerHook (weightbridge.integrations.deepspeed) against a real standalone
weightbridged, numpy stand-ins for DeepSpeed's ZeRO-3 parameters (neither deepspeed nor torch is
installed in CI). Run by //client/python:deepspeed_test.

The ZeRO-3 partitions are built here as DeepSpeed builds them (deepspeed/runtime/zero/
partition_parameters.py, Init._partition_param: partition_size = ceil(ds_numel / world) elements
per rank in a 1-D ds_tensor, rank r holding flat elements [r * c, (r + 1) * c), the tail of the
rank holding the end left as padding - torch.empty, filled with PAD here so a hook that published
it fails), independently of the daemon; the rollouts' expected parameters are vLLM's layout
transcribed independently too (integrations_test.vllm_tp, glm_vllm_tp1 below). Every rollout
parameter is compared element by element: tiny Qwen2 over ZeRO-3 world 2 -> vLLM tp=2 (sync) and
world 3 -> vLLM tp=1 (one-step-off), persistent parameters, a parameter DeepSpeed left whole,
ZeRO++ hpZ's secondary partition (not read), the engine's "module." and torch.compile's
"_orig_mod." prefixes; a tiny GLM-4.5 over world 3 (sync) with head_dim 2, so q/k norms and k/v
biases have fewer elements than ranks (rank 2 holds none of them), and the router's float32
e_score_correction_bias as a whole buffer (4 elements: rank 2 holds none). Refusals (wrong world
or rank, MiCS, ds_numel / ds_shape unlike the model's, ds_tensor of another size, quantised or
NVMe partitions, unknown / duplicate / missing tensors) are raised before a byte is copied.
"""

import json
import os
import sys
import types
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_test import Daemon, DaemonTestCase, TIMEOUT, TINY_CONFIG  # noqa: E402
from integrations_test import TINY_GLM, canonical, run_all, vllm_tp  # noqa: E402

import weightbridge as wb  # noqa: E402
from weightbridge.integrations import deepspeed, vllm  # noqa: E402

PAD = 0xDEAD  # what the stand-ins leave in ZeRO-3's tail padding: never to reach a rollout


class FakeGroup:
    """torch's ProcessGroup as the hook reads it: size() and this process's rank()."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class DsTensor(np.ndarray):
    """A ds_tensor: a 1-D array that carries DeepSpeed's attributes (ds_numel, ...)."""


_ids = iter(range(1 << 30))


class ZeroParam:
    """A parameter after deepspeed.zero.Init partitioned it over `world` ranks, as rank `rank`
    holds it (partition_parameters.py: _convert_to_deepspeed_param, _partition_param, free_param):
    ds_shape / ds_numel of the whole tensor, ds_tensor of c = ceil(n / world) elements holding flat
    elements [rank * c, +c) that exist (the rest PAD), param.data empty - or, ds_persist, the
    whole tensor gathered (stage3 _post_step) beside its partition."""

    def __init__(self, whole, world, rank, persist=False, group=None):
        flat = np.ascontiguousarray(whole).reshape(-1)
        n = flat.size
        c = -(-n // world)
        part = np.full(c, PAD, dtype=flat.dtype).view(DsTensor)
        valid = max(0, min(c, n - rank * c))
        part[:valid] = flat[rank * c:rank * c + valid]
        part.ds_numel = c
        self.ds_id = next(_ids)
        self.ds_shape, self.ds_numel, self.ds_tensor = tuple(whole.shape), n, part
        self.ds_persist = persist
        self.ds_process_group = group or FakeGroup(world, rank)
        self.ds_zero_param_process_group, self.ds_secondary_tensor = None, None
        self.data = whole.copy() if persist else np.empty((0,), flat.dtype)
        self.shape = self.data.shape


def with_hpz(p, whole, hpz, local_rank):
    """ZeRO++ hpZ (zero_hpz_partition_size = hpz): _partition_param_sec's node-local secondary
    partition (ceil(n / world) * world / hpz elements from local_rank's offset) beside the
    primary ds_tensor, which is laid out as without hpZ."""
    flat = whole.reshape(-1)
    world = p.ds_process_group.size()
    assert world % hpz == 0, "hpZ groups divide the world"
    size = p.ds_tensor.size * world // hpz  # _partition_param_sec: aligned size // hpz
    sec = np.full(size, PAD, dtype=flat.dtype)
    start = size * local_rank
    take = max(0, min(size, flat.size - start))
    sec[:take] = flat[start:start + take]
    p.ds_secondary_tensor = sec
    p.ds_zero_param_process_group = FakeGroup(hpz, local_rank)
    p.ds_secondary_tensor_num_of_groups = world // hpz
    return p


def zero3_params(c, world, rank, prefix="module.", persist=(), whole=(), hpz=0):
    """named_parameters() of rank `rank` of a DeepSpeed engine over `world` ranks: every tensor of
    `c` ({HF name: array}) a ZeRO-3 parameter, the names in `persist` persistent, those in `whole`
    plain arrays (not converted by ZeRO-3), hpz > 0: every parameter with an hpZ secondary."""
    out = []
    for n, a in c.items():
        if n in whole:
            p = a.copy()
        else:
            p = ZeroParam(a, world, rank, persist=n in persist)
            if hpz:
                with_hpz(p, a, hpz, rank % hpz)
        out.append((prefix + n, p))
    return out


def values(shapes, version, float32=()):
    """{name: array} of `version`: bfloat16 bits, or float32 for the names in `float32`."""
    out = {}
    for name, shape in shapes.items():
        h = sum((i + 1) * ord(ch) for i, ch in enumerate(name)) + 7919 * version
        n = int(np.prod(shape))
        with np.errstate(over="ignore"):
            bits = (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(h)) >> np.uint64(9)
        out[name] = (((bits % 2000).astype(np.float32) - 1000) / 64 if name in float32
                     else bits.astype(np.uint16)).reshape(shape)
    return out


# TINY_GLM with head_dim 2: q_proj [4, 128], k/v [2, 128], q/k norms [2], k/v biases [2].
GLM = dict(TINY_GLM, head_dim=2)
GH, GI, GMI, GE, GV, GHD = 128, 256, 64, 4, 1024, 2


def glm_shapes():
    """Glm4MoeForCausalLM's HF tensors for GLM (layer 0 dense, layer 1 MoE), independently of the daemon."""
    s = {"model.embed_tokens.weight": (GV, GH), "model.norm.weight": (GH,), "lm_head.weight": (GV, GH)}
    for l in range(2):
        p, a = "model.layers.%d." % l, "model.layers.%d.self_attn." % l
        s.update({p + "input_layernorm.weight": (GH,), p + "post_attention_layernorm.weight": (GH,),
                  a + "q_proj.weight": (2 * GHD, GH), a + "q_proj.bias": (2 * GHD,),
                  a + "k_proj.weight": (GHD, GH), a + "k_proj.bias": (GHD,),
                  a + "v_proj.weight": (GHD, GH), a + "v_proj.bias": (GHD,),
                  a + "o_proj.weight": (GH, 2 * GHD), a + "q_norm.weight": (GHD,), a + "k_norm.weight": (GHD,)})
        if l == 0:
            s.update({p + "mlp.gate_proj.weight": (GI, GH), p + "mlp.up_proj.weight": (GI, GH),
                      p + "mlp.down_proj.weight": (GH, GI)})
        else:
            s.update({p + "mlp.gate.weight": (GE, GH), p + "mlp.gate.e_score_correction_bias": (GE,)})
            for e in ["experts.%d" % j for j in range(GE)] + ["shared_experts"]:
                s.update({p + "mlp.%s.gate_proj.weight" % e: (GMI, GH), p + "mlp.%s.up_proj.weight" % e: (GMI, GH),
                          p + "mlp.%s.down_proj.weight" % e: (GH, GMI)})
    return s


BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def glm_vllm_tp1(c):
    """vLLM's named_parameters() of GLM at tp=1 (glm4_moe.py): qkv_proj = [q; k; v],
    gate_up_proj = [gate; up], experts.w13_weight [E, 2I, H] = per expert [gate; up],
    experts.w2_weight [E, H, I] = per expert down_proj; the rest under the HF names."""
    out = {n: a for n, a in c.items() if ".experts." not in n and not n.endswith(("q_proj.weight", "q_proj.bias"))
           and "k_proj" not in n and "v_proj" not in n and "gate_proj" not in n and "up_proj" not in n
           and not (n.startswith("model.layers.0.mlp.down_proj") or "shared_experts.down_proj" in n)}
    for l in range(2):
        p, a = "model.layers.%d." % l, "model.layers.%d.self_attn." % l
        for kind in ("weight", "bias"):
            out[a + "qkv_proj." + kind] = np.concatenate([c[a + x + "_proj." + kind] for x in "qkv"])
        m = p + ("mlp." if l == 0 else "mlp.shared_experts.")
        out[m + "gate_up_proj.weight"] = np.concatenate([c[m + "gate_proj.weight"], c[m + "up_proj.weight"]])
        out[m + "down_proj.weight"] = c[m + "down_proj.weight"]
    e = "model.layers.1.mlp.experts."
    out[e + "w13_weight"] = np.stack([np.concatenate([c[e + "%d.gate_proj.weight" % j], c[e + "%d.up_proj.weight" % j]])
                                      for j in range(GE)])
    out[e + "w2_weight"] = np.stack([c[e + "%d.down_proj.weight" % j] for j in range(GE)])
    return out


class DeepSpeedZero3Test(DaemonTestCase):
    def model(self, model_id, mode, trainers, rollouts, config=None):
        return wb.ModelConfig(model_id=model_id, hf_config_json=config or self.config, num_trainer_workers=trainers,
                              num_rollout_workers=rollouts, mode=mode)

    def hooks(self, model, world, prefix):
        hooks = [deepspeed.DeepSpeedZero3TrainerHook(None, model, rank=r, world=world,
                                                     client=self.daemon.client("%s%d" % (prefix, r)))
                 for r in range(world)]
        for h in hooks:
            self.addCleanup(h.close)
        return hooks

    def leave(self, hooks):
        for h in hooks:
            h.client.deregister()

    def test_world2_to_vllm_tp2_sync(self):
        """Even split over 2 ranks; norms and biases persistent (whole in param.data beside their
        partition); model.norm.weight a plain array DeepSpeed left whole; the engine's "module."."""
        model = self.model("ds_w2_vllm_tp2", "sync", 2, 2)
        hooks = self.hooks(model, 2, "dsa")
        engines = [vllm.VllmRollout(None, model, tp=2, tp_rank=r, client=self.daemon.client("dsv%d" % r)) for r in (0, 1)]
        for e in engines:
            self.addCleanup(e.close)
        params = [{n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 2, r).items()} for r in (0, 1)]
        persist = {n for n in canonical(0) if n.endswith(("layernorm.weight", ".bias"))}
        for version in (1, 2):
            c = canonical(version)
            errors = run_all([lambda e=e, p=p: e.update(version, p, timeout=TIMEOUT) for e, p in zip(engines, params)] +
                             [lambda h=h, r=r: h.publish(version, zero3_params(c, 2, r, persist=persist,
                                                                               whole={"model.norm.weight"}),
                                                         timeout=TIMEOUT) for r, h in enumerate(hooks)])
            self.assertEqual(errors, [])
            for r in (0, 1):
                for n, want in vllm_tp(c, 2, r).items():
                    np.testing.assert_array_equal(params[r][n], want, err_msg="vllm rank %d %s v%d" % (r, n, version))
        self.leave(hooks + engines)

    def test_world3_uneven_to_vllm_tp1_one_step_off(self):
        """ceil(n / 3) per rank: the embedding's 1048576 elements give 349526, 349526, 349524 (2 of
        rank 2's padding); 128-element biases 43, 43, 42. torch.compile's "_orig_mod." before the
        engine's "module."; version 2 with ZeRO++ hpZ attributes (one group of 3: its secondary
        partition is the primary's size; test_check_partition_tail_and_tiny_tensors has groups
        whose secondary differs)."""
        model = self.model("ds_w3_vllm_tp1", "one_step_off", 3, 1)
        hooks = self.hooks(model, 3, "dsb")
        self.assertEqual([h.layout["model.embed_tokens.weight"].shape for h in hooks], [(349526,), (349526,), (349524,)])
        self.assertEqual([h.layout["model.layers.0.self_attn.k_proj.bias"].shape for h in hooks], [(43,), (43,), (42,)])
        engine = vllm.VllmRollout(None, model, tp=1, client=self.daemon.client("dsw"))
        self.addCleanup(engine.close)
        params = {n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}
        for version in (1, 2, 3):
            c = canonical(version)
            for r, h in enumerate(hooks):
                named = zero3_params(c, 3, r, prefix="_orig_mod.module.", hpz=3 if version == 2 else 0,
                                     persist={"model.norm.weight"})
                h.publish(version, named, timeout=TIMEOUT)
            self.assertEqual(engine.apply(version, params, timeout=TIMEOUT), version)
            for n, want in vllm_tp(c, 1, 0).items():
                np.testing.assert_array_equal(params[n], want, err_msg="%s v%d" % (n, version))
        self.leave(hooks + [engine])

    def test_glm_tensors_smaller_than_the_world_and_the_router_bias_buffer(self):
        """World 3: q/k norms and k/v biases of 2 elements (c = 1: ranks 0 and 1 one each, rank 2
        padding only - the layout omits them there and the hook gives none), the float32
        e_score_correction_bias a whole buffer (HF registers it as one; ZeRO-3 partitions
        parameters only) cut to [0, 2), [2, 4) and nothing; rotary inv_freq ignored. Without
        named_buffers the publish fails naming the bias, before copying."""
        shapes = glm_shapes()
        model = self.model("ds_glm_vllm", "sync", 3, 1, config=json.dumps(GLM))
        hooks = self.hooks(model, 3, "dsg")
        self.assertEqual(hooks[0].hf_shapes, shapes)  # the daemon's inventory is the one transcribed here
        small = "model.layers.1.self_attn.k_norm.weight"
        self.assertEqual([h.layout[small].shape for h in hooks[:2]], [(1,), (1,)])
        self.assertNotIn(small, hooks[2].layout.tensors)
        self.assertNotIn(BIAS, hooks[2].layout.tensors)
        self.assertEqual(hooks[0].layout[BIAS].dtype, "float32")
        engine = vllm.VllmRollout(None, model, tp=1, client=self.daemon.client("dsx"))
        self.addCleanup(engine.close)
        params = {n: np.zeros(t.shape, t.numpy_dtype()) for n, t in engine.layout.tensors.items()}
        self.assertEqual(set(params), set(glm_vllm_tp1(values(shapes, 0, {BIAS}))))
        persist = {n for n, s in shapes.items() if len(s) == 1 and n != BIAS}  # below the persistence threshold

        def named(c, r):
            ps = {n: a for n, a in c.items() if n != BIAS}
            return (zero3_params(ps, 3, r, persist=persist),
                    [("module." + BIAS, c[BIAS].copy()), ("module.model.rotary_emb.inv_freq", np.ones((1,), np.float32))])

        before = {n: hooks[0].view(n).copy() for n in hooks[0].names}
        with self.assertRaises(KeyError) as cm:
            hooks[0].publish(1, named(values(shapes, 1, {BIAS}), 0)[0], timeout=TIMEOUT)
        self.assertIn(BIAS, str(cm.exception))
        self.assertIn("named_buffers", str(cm.exception))
        for n, a in before.items():
            np.testing.assert_array_equal(hooks[0].view(n), a, err_msg="copied before refusing: " + n)

        for version in (1, 2):
            c = values(shapes, version, {BIAS})
            errors = run_all([lambda: engine.update(version, params, timeout=TIMEOUT)] +
                             [lambda h=h, r=r: h.publish(version, *named(c, r), timeout=TIMEOUT) for r, h in enumerate(hooks)])
            self.assertEqual(errors, [])
            np.testing.assert_array_equal(hooks[1].view(BIAS), c[BIAS][2:4])
            np.testing.assert_array_equal(hooks[1].view(small), c[small][1:2])
            for n, want in glm_vllm_tp1(c).items():
                np.testing.assert_array_equal(params[n], want, err_msg="%s v%d" % (n, version))
        self.leave(hooks + [engine])

    def test_refusals_before_a_byte_is_copied(self):
        model = self.model("ds_refusals", "one_step_off", 3, 1)
        hook = self.hooks(model, 3, "dsr")[1]
        c = canonical(1)
        before = {n: hook.view(n).copy() for n in hook.names}
        emb = "model.embed_tokens.weight"

        def publish_with(name, p):
            named = [(n, p if n == "module." + name else q) for n, q in zero3_params(c, 3, 1)]
            hook.publish(1, named, timeout=TIMEOUT)

        def refused(exc, name, p, *words):
            with self.assertRaises(exc) as cm:
                publish_with(name, p)
            for w in (name,) + words:
                self.assertIn(w, str(cm.exception))

        # Partitioned over 4 ranks (another data-parallel group), or this process another rank of it.
        refused(ValueError, emb, ZeroParam(c[emb], 4, 1), "group of 4 ranks", "world is 3")
        refused(ValueError, emb, ZeroParam(c[emb], 3, 1, group=FakeGroup(3, 2)), "rank 2", "rank is 1")
        # MiCS: param.comm (MiCS_CommGroups) splits over a shard group.
        mics = ZeroParam(c[emb], 3, 1)
        mics.comm = types.SimpleNamespace(param_shard_size=2, param_shard_rank=1)
        refused(ValueError, emb, mics, "MiCS", "mics_shard_size=2")
        # Resized embeddings (ds_numel / ds_shape unlike the model's), or a ds_numel lying about them.
        refused(ValueError, emb, ZeroParam(np.zeros((4100, 256), np.uint16), 3, 1), "ds_numel 1049600", "(4096, 256)")
        wrong = ZeroParam(c[emb], 3, 1)
        wrong.ds_numel -= 1
        refused(ValueError, emb, wrong, "ds_numel 1048575")
        # A ds_tensor of another size (padded to another multiple, or not 1-D).
        short = ZeroParam(c[emb], 3, 1)
        short.ds_tensor = short.ds_tensor[:-1]
        refused(ValueError, emb, short, "ceil(1048576 / 3) = 349526")
        # Quantised non-trainable weights, partitions swapped out to NVMe.
        quant = ZeroParam(c[emb], 3, 1)
        quant.ds_tensor.ds_quant_scale = np.ones(1, np.float32)
        refused(ValueError, emb, quant, "zero_quantized_nontrainable_weights")
        nvme = ZeroParam(c[emb], 3, 1)
        nvme.ds_tensor.final_location = types.SimpleNamespace(value="nvme")
        refused(ValueError, emb, nvme, "offload_param.device=nvme")
        # A whole tensor of another shape.
        refused(ValueError, emb, np.zeros((256, 4096), np.uint16), "(256, 4096)")
        # Names: one the model lacks, one given twice, one not given.
        with self.assertRaises(KeyError) as cm:
            hook.publish(1, zero3_params(c, 3, 1) + [("module.model.layers.0.extra.weight", np.zeros(3, np.uint16))],
                         timeout=TIMEOUT)
        self.assertIn("model.layers.0.extra.weight", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            hook.publish(1, zero3_params(c, 3, 1) + [("_orig_mod." + emb, ZeroParam(c[emb], 3, 1))], timeout=TIMEOUT)
        self.assertIn("given twice", str(cm.exception))
        with self.assertRaises(KeyError) as cm:
            hook.publish(1, [(n, p) for n, p in zero3_params(c, 3, 1) if "layers.1.mlp" not in n], timeout=TIMEOUT)
        self.assertIn("not given", str(cm.exception))
        self.assertIn("model.layers.1.mlp.gate_proj.weight", str(cm.exception))
        with self.assertRaises(TypeError):  # publish(v, params, 30.0): the timeout must be a keyword
            hook.publish(1, zero3_params(c, 3, 1), 30.0)
        with self.assertRaises(ValueError):
            deepspeed.DeepSpeedZero3TrainerHook(None, model, rank=3, world=3, client=None)
        for n, a in before.items():
            np.testing.assert_array_equal(hook.view(n), a, err_msg="copied before refusing: " + n)
        hook.client.deregister()

    def test_check_partition_tail_and_tiny_tensors(self):
        """The preset's rule against ZeRO-3's, no daemon: every rank's valid elements concatenated
        in rank order are the tensor (what _allgather_param rebuilds), for n below, at and above
        the world, divisible or not."""
        for world in (1, 2, 3, 4, 7):
            for n in (1, 2, 3, 5, 6, 7, 8, 13, 64):
                whole = np.arange(n, dtype=np.uint16) + 1
                parts = [deepspeed.check_partition("t", ZeroParam(whole, world, r), (n,), world, r) for r in range(world)]
                self.assertTrue(all(PAD not in p for p in parts))
                np.testing.assert_array_equal(np.concatenate(parts), whole, err_msg="n=%d world=%d" % (n, world))
                plain = [deepspeed.check_partition("t", whole, (n,), world, r) for r in range(world)]
                for p, q in zip(parts, plain):
                    np.testing.assert_array_equal(p, q)
                # ZeRO++ hpZ: the secondary partition (other elements, other size) is not what is read.
                for hpz in [h for h in (2, 3) if world % h == 0 and h < world]:
                    hp = [deepspeed.check_partition("t", with_hpz(ZeroParam(whole, world, r), whole, hpz, r % hpz),
                                                    (n,), world, r) for r in range(world)]
                    np.testing.assert_array_equal(np.concatenate(hp), whole, err_msg="hpz=%d" % hpz)
        # Fewer elements than ranks: ds_tensor has ceil(2 / 3) = ceil(2 / 4) = 1 element either way;
        # only the partition group's size tells ZeRO-3 over 4 ranks from the preset's 3.
        with self.assertRaises(ValueError) as cm:
            deepspeed.check_partition("tiny", ZeroParam(np.arange(2, dtype=np.uint16), 4, 1), (2,), 3, 1)
        self.assertIn("group of 4 ranks", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
