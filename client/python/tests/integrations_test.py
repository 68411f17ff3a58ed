"""The trainer hooks and engine extensions (weightbridge.integrations) against a real standalone
weightbridged, numpy arrays standing in for torch tensors (torch is not installed in CI).

The frameworks' local tensors are built here independently of the daemon (how Megatron-Core,
FSDP2, vLLM and SGLang shard the tiny Qwen2 model), so a hook that put a tensor at a wrong place
in its buffer, or an engine parameter that received another tensor's bytes, fails the test.
Run by //client/python:integrations_test.
"""

import os
import sys
import threading
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_test import TIMEOUT, TINY_CONFIG, Daemon  # noqa: E402

import weightbridge as wb  # noqa: E402
from weightbridge.integrations import fsdp2, megatron, sglang, vllm  # noqa: E402

# tests/soak/testdata/qwen2-tiny.json: hidden 256, 4 heads / 2 KV heads of 64, intermediate 512,
# 2 layers, vocab 4096, tied embeddings, q/k/v biases.
H, I, V, L, HD = 256, 512, 4096, 2, 64


def canonical_shapes():
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for l in range(L):
        p = "model.layers.%d." % l
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (4 * HD, H), p + "self_attn.q_proj.bias": (4 * HD,),
                       p + "self_attn.k_proj.weight": (2 * HD, H), p + "self_attn.k_proj.bias": (2 * HD,),
                       p + "self_attn.v_proj.weight": (2 * HD, H), p + "self_attn.v_proj.bias": (2 * HD,),
                       p + "self_attn.o_proj.weight": (H, 4 * HD), p + "mlp.gate_proj.weight": (I, H),
                       p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
    return shapes


def canonical(version):
    """{HF name: uint16 array} (bfloat16 bits) of `version`, a function of name, version, index."""
    out = {}
    for name, shape in canonical_shapes().items():
        h = sum((i + 1) * ord(c) for i, c in enumerate(name)) + 7919 * version
        n = int(np.prod(shape))
        with np.errstate(over="ignore"):
            out[name] = ((np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(h)) >> np.uint64(9)).astype(
                np.uint16).reshape(shape)
    return out


def megatron_tp2(c, r):
    """Megatron-Core (TE spec) named_parameters() of tp rank r of 2: vocab-parallel embedding,
    linear_qkv = per query group [q heads; k; v] (one group per rank here), linear_proj and
    linear_fc2 column slices, linear_fc1 = [gate shard; up shard], layer norms fused into TE linears."""
    out = {"embedding.word_embeddings.weight": c["model.embed_tokens.weight"][r * V // 2:(r + 1) * V // 2],
           "decoder.final_layernorm.weight": c["model.norm.weight"]}
    for l in range(L):
        p, m = "model.layers.%d." % l, "decoder.layers.%d." % l
        a = p + "self_attn."
        q, k, v = (c[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj"))
        qb, kb, vb = (c[a + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj"))
        g = slice(r * 2 * HD, (r + 1) * 2 * HD)  # the 2 query heads of group r
        kv = slice(r * HD, (r + 1) * HD)          # KV head r
        out.update({
            m + "self_attention.linear_qkv.layer_norm_weight": c[p + "input_layernorm.weight"],
            m + "self_attention.linear_qkv.weight": np.concatenate([q[g], k[kv], v[kv]]),
            m + "self_attention.linear_qkv.bias": np.concatenate([qb[g], kb[kv], vb[kv]]),
            m + "self_attention.linear_proj.weight": c[a + "o_proj.weight"][:, r * 128:(r + 1) * 128],
            m + "mlp.linear_fc1.layer_norm_weight": c[p + "post_attention_layernorm.weight"],
            m + "mlp.linear_fc1.weight": np.concatenate([c[p + "mlp.gate_proj.weight"][r * 256:(r + 1) * 256],
                                                         c[p + "mlp.up_proj.weight"][r * 256:(r + 1) * 256]]),
            m + "mlp.linear_fc2.weight": c[p + "mlp.down_proj.weight"][:, r * 256:(r + 1) * 256],
        })
    return out


def vllm_tp(c, tp, r):
    """vLLM / SGLang model.named_parameters() of tp rank r: qkv_proj = [q rows; k rows; v rows] of
    the rank, gate_up_proj = [gate; up] shards, o_proj / down_proj column slices, vocab-parallel
    embedding (4096 is a multiple of 64 * tp: no padding), norms whole."""
    out = {"model.embed_tokens.weight": c["model.embed_tokens.weight"][r * V // tp:(r + 1) * V // tp],
           "model.norm.weight": c["model.norm.weight"]}
    for l in range(L):
        p = "model.layers.%d." % l
        a = p + "self_attn."
        qs, ks = slice(r * 4 * HD // tp, (r + 1) * 4 * HD // tp), slice(r * 2 * HD // tp, (r + 1) * 2 * HD // tp)
        ins = slice(r * I // tp, (r + 1) * I // tp)
        out.update({
            p + "input_layernorm.weight": c[p + "input_layernorm.weight"],
            p + "post_attention_layernorm.weight": c[p + "post_attention_layernorm.weight"],
            a + "qkv_proj.weight": np.concatenate([c[a + "q_proj.weight"][qs], c[a + "k_proj.weight"][ks], c[a + "v_proj.weight"][ks]]),
            a + "qkv_proj.bias": np.concatenate([c[a + "q_proj.bias"][qs], c[a + "k_proj.bias"][ks], c[a + "v_proj.bias"][ks]]),
            a + "o_proj.weight": c[a + "o_proj.weight"][:, qs],
            p + "mlp.gate_up_proj.weight": np.concatenate([c[p + "mlp.gate_proj.weight"][ins], c[p + "mlp.up_proj.weight"][ins]]),
            p + "mlp.down_proj.weight": c[p + "mlp.down_proj.weight"][:, ins],
        })
    return out


class FakeDTensor:
    """What FSDP2's parameters expose here: the local shard."""

    def __init__(self, local):
        self.local = local

    def to_local(self):
        return self.local


def fsdp2_shard(c, dp, r):
    """FSDP2 fully_shard: dim-0 chunks with torch.chunk semantics, as DTensors, HF names."""
    out = {}
    for name, t in c.items():
        ch = -(-t.shape[0] // dp)
        out[name] = FakeDTensor(t[min(t.shape[0], r * ch):min(t.shape[0], (r + 1) * ch)])
    return out


def run_all(fns):
    errors, threads = [], []
    for fn in fns:
        def wrap(fn=fn):
            try:
                fn()
            except Exception as e:  # reported below
                errors.append(e)
        threads.append(threading.Thread(target=wrap))
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    return errors


class IntegrationsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        with open(TINY_CONFIG) as f:
            cls.config = f.read()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def model(self, model_id, mode, trainers, rollouts):
        return wb.ModelConfig(model_id=model_id, hf_config_json=self.config, num_trainer_workers=trainers,
                              num_rollout_workers=rollouts, mode=mode)

    def test_megatron_trainers_to_a_vllm_engine_one_step_off(self):
        model = self.model("int_megatron_vllm", "one_step_off", 2, 1)
        trainers = [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("meg")) for r in (0, 1)]
        engine = vllm.VllmRollout(None, model, tp=1, client=self.daemon.client("vllm"))
        for t in trainers:  # the buffer is the size discovery said, not a sum of tensor sizes
            self.assertEqual(t.buffer.size_bytes, t.layout.buffer_bytes(0))
        params = {n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}
        for version in (1, 2):
            c = canonical(version)
            for r, t in enumerate(trainers):
                # DDP's "module." prefix as Megatron's wrapped model shows it.
                t.publish(version, (("module." + n, a) for n, a in megatron_tp2(c, r).items()), timeout=TIMEOUT)
            self.assertEqual(engine.apply(version, params, timeout=TIMEOUT), version)
            for n, want in vllm_tp(c, 1, 0).items():
                np.testing.assert_array_equal(params[n], want, err_msg="%s v%d" % (n, version))
        for h in trainers + [engine]:
            h.client.deregister()
            h.client.close()

    def test_fsdp2_trainers_to_sglang_tp2_sync(self):
        model = self.model("int_fsdp2_sglang", "sync", 2, 2)
        trainers = [fsdp2.FSDP2TrainerHook(None, model, rank=r, dp=2, client=self.daemon.client("fsdp")) for r in (0, 1)]
        engines = [sglang.SglangRollout(None, model, tp=2, tp_rank=r, client=self.daemon.client("sgl")) for r in (0, 1)]
        params = [{n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 2, r).items()} for r in (0, 1)]
        for version in (1, 2):
            c = canonical(version)
            errors = run_all([lambda e=e, p=p: e.update(version, p, timeout=TIMEOUT) for e, p in zip(engines, params)] +
                             [lambda t=t, r=r: t.publish(version, fsdp2_shard(c, 2, r).items(), timeout=TIMEOUT)
                              for r, t in enumerate(trainers)])
            self.assertEqual(errors, [])
            for r in (0, 1):
                for n, want in vllm_tp(c, 2, r).items():
                    np.testing.assert_array_equal(params[r][n], want, err_msg="sglang rank %d %s v%d" % (r, n, version))
        for h in trainers + engines:
            h.client.deregister()
            h.client.close()

    def test_a_hook_refuses_to_publish_a_partial_or_misshapen_version(self):
        model = self.model("int_refusals", "one_step_off", 1, 1)
        hook = megatron.MegatronTrainerHook(None, model, rank=0, tp=1, client=self.daemon.client("ref"))
        full = dict(vllm_tp(canonical(1), 1, 0))  # vLLM names: not Megatron's
        with self.assertRaises(KeyError) as cm:
            hook.publish(1, full.items(), timeout=TIMEOUT)
        self.assertIn("model.embed_tokens.weight", str(cm.exception))
        mine = {"embedding.word_embeddings.weight": np.zeros((V, H), np.uint16)}
        with self.assertRaises(KeyError) as cm:  # the other local tensors missing: nothing published
            hook.publish(1, mine.items(), timeout=TIMEOUT)
        self.assertIn("not given", str(cm.exception))
        with self.assertRaises(ValueError):
            hook.write([("embedding.word_embeddings.weight", np.zeros((V, H + 1), np.uint16))], require_all=False)
        # float32 values for a bfloat16 tensor are rounded to bfloat16 bits.
        hook.write([("decoder.final_layernorm.weight", np.full((H,), 1.0 + 2 ** -9, np.float32))], require_all=False)
        np.testing.assert_array_equal(hook.view("decoder.final_layernorm.weight"), np.full((H,), 0x3F80, np.uint16))
        hook.client.deregister()
        hook.client.close()

    def test_copy_out_moves_bits_into_engine_dtypes(self):
        """A rollout's read_into (copy_out): int4 pairs held as uint8 [N, K/2] land in vLLM's int32
        weight_packed [N, K/8] byte for byte; a layout whose bytes are in another order (vLLM's
        transposed W4A16 MoE weights) is refused, not copied; same shapes copy by value."""
        from weightbridge.integrations._common import copy_out
        rng = np.random.default_rng(3)
        packed = rng.integers(0, 256, size=(4, 16), dtype=np.uint8)  # [N, K/2] with K = 32
        weight_packed = np.zeros((4, 4), dtype=np.int32)             # vLLM: [N, K/8]
        copy_out("w.weight_packed", packed, weight_packed)
        np.testing.assert_array_equal(weight_packed.view(np.uint8), packed)
        self.assertEqual(int(weight_packed[0, 0]), int.from_bytes(bytes(packed[0, :4]), "little", signed=True))
        with self.assertRaises(ValueError) as cm:  # [K/8, N]: other bytes at each place
            copy_out("w13_weight_packed", packed, np.zeros((4, 4), dtype=np.int32).T)
        self.assertIn("w13_weight_packed", str(cm.exception))
        with self.assertRaises(ValueError):
            copy_out("w", packed, np.zeros((16, 4), dtype=np.uint8))
        bits = rng.integers(0, 1 << 16, size=(2, 3), dtype=np.uint16)
        same = np.zeros((2, 3), dtype=np.uint16)
        copy_out("n", bits, same)
        np.testing.assert_array_equal(same, bits)

    def test_modules_import_without_torch(self):
        self.assertNotIn("torch", sys.modules)
        self.assertTrue(hasattr(vllm, "WeightBridgeWorkerExtension"))


if __name__ == "__main__":
    unittest.main()
