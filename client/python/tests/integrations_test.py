"""The trainer hooks and engine extensions (weightbridge.integrations) against a real standalone
weightbridged, numpy arrays standing in for torch tensors (torch is not installed in CI).

The frameworks' local tensors are built here independently of the daemon (how Megatron-Core,
FSDP2, vLLM and SGLang shard the tiny Qwen2 model), so a hook that put a tensor at a wrong place
in its buffer, or an engine parameter that received another tensor's bytes, fails the test.
Run by //client/python:integrations_test.
"""

import json
import os
import sys
import threading
import types
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_test import Daemon, DaemonTestCase, TIMEOUT, TINY_CONFIG  # noqa: E402

import weightbridge as wb  # noqa: E402
from weightbridge.integrations import fsdp2, megatron, sglang, vllm  # noqa: E402
from weightbridge.integrations._common import normalize_name  # noqa: E402

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


class FakeShard:
    """torch's Shard(dim) placement as the FSDP2 hook sees it (is_shard, dim)."""

    def __init__(self, dim):
        self.dim = dim

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim

    def is_replicate(self):
        return False

    def __repr__(self):
        return "Shard(dim=%d)" % self.dim


class FakeReplicate:
    def is_shard(self, dim=None):
        return False

    def is_replicate(self):
        return True

    def __repr__(self):
        return "Replicate()"


class FakeMesh:
    """A DeviceMesh: its dims' sizes and this rank's coordinate on each (get_local_rank)."""

    def __init__(self, sizes, coords):
        self.sizes, self.coords = sizes, coords
        self.ndim = len(sizes)

    def size(self, mesh_dim=None):
        return self.sizes[mesh_dim]

    def get_local_rank(self, mesh_dim=None):
        return self.coords[mesh_dim]


class FakeDTensor:
    """What FSDP2's parameters expose here: the local shard, its placements and device mesh."""

    def __init__(self, local, placements, device_mesh):
        self.local, self.placements, self.device_mesh = local, placements, device_mesh

    def to_local(self):
        return self.local


def fsdp2_shard(c, dp, r):
    """FSDP2 fully_shard: dim-0 chunks with torch.chunk semantics, as DTensors (Shard(0) over a 1-D
    mesh of dp ranks), HF names."""
    out = {}
    for name, t in c.items():
        ch = -(-t.shape[0] // dp)
        out[name] = FakeDTensor(t[min(t.shape[0], r * ch):min(t.shape[0], (r + 1) * ch)], (FakeShard(0),),
                                FakeMesh((dp,), (r,)))
    return out


# vLLM with --enable-lora (and SGLang's LoRA wrapper): every linear layer and the embedding are
# *WithLoRA modules holding the original as `base_layer`; norms are not wrapped.
LORA_WRAPPED = ("qkv_proj.", "o_proj.", "gate_up_proj.", "down_proj.", "embed_tokens.")


def with_base_layer(name):
    """`name` as named_parameters() shows it under a LoRA wrapper: "...qkv_proj.base_layer.weight"."""
    for m in LORA_WRAPPED:
        i = name.find(m)
        if i >= 0:
            return name[:i + len(m)] + "base_layer." + name[i + len(m):]
    return name


class FakeEngineModel:
    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(list(self.params.items()))


def fake_vllm_worker(params, tp=1, rank=0):
    """A vLLM GPU worker with the WeightBridge extension mixed in, as wb_init reads it."""
    w = vllm.WeightBridgeWorkerExtension()
    w.parallel_config = types.SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=1, data_parallel_rank=0,
                                              enable_expert_parallel=False, all2all_backend="")
    w.rank = rank
    w.device = types.SimpleNamespace(index=0)
    w.model_runner = types.SimpleNamespace(model=FakeEngineModel(params))
    return w


# A tiny GLM-4.5 (Glm4MoeForCausalLM): layer 0 dense, layer 1 MoE with 4 experts, a shared expert and
# the router's float32 e_score_correction_bias (Megatron: router.expert_bias, a registered buffer).
TINY_GLM = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 64,
            "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 1, "n_group": 1, "topk_group": 1, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 2, "norm_topk_prob": True,
            "use_qk_norm": True, "num_nextn_predict_layers": 1, "vocab_size": 1024, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "partial_rotary_factor": 0.5, "routed_scaling_factor": 2.5}


def filled(layout, seed):
    """{local name: array} of every local tensor of `layout`, distinct values per tensor."""
    rng = np.random.default_rng(seed)
    out = {}
    for n, t in layout.tensors.items():
        dt = np.dtype(t.numpy_dtype())
        if dt == np.float32:
            out[n] = rng.standard_normal(t.shape).astype(np.float32)
        else:
            out[n] = rng.integers(0, np.iinfo(dt).max, size=t.shape, dtype=dt)
    return out


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


class FakeSglangModule:
    """A module of SGLang's model as refresh_derived sees it: a `weight`, a cached `_weight_fp32`."""

    def __init__(self, weight, cached):
        self.weight = weight
        self._weight_fp32 = cached


class FakeSglangModel:
    """SGLang's model_runner.model as the hook sees it: post_load_weights (DeepSeek: w_kc / w_vc
    from kv_b_proj) records what the parameter it derives from held when it ran; modules() as torch."""

    def __init__(self, source, mods):
        self.source, self.mods, self.seen = source, mods, []

    def post_load_weights(self, is_nextn=False, weight_names=None):
        self.seen.append((is_nextn, weight_names, self.source.copy()))

    def modules(self):
        return [self] + self.mods


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


class IntegrationsTest(DaemonTestCase):
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

    def test_megatron_names_under_nested_wrappers_and_vpp_chunks(self):
        """--bf16 Megatron is DDP(Float16Module(GPTModel)): every name starts "module.module." (and
        so in each vpp chunk); each prefix is stripped, and the tensors reach their local tensors."""
        model = self.model("int_megatron_bf16", "one_step_off", 2, 1)
        trainers = [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("mbf"))
                    for r in (0, 1)]
        engine = vllm.VllmRollout(None, model, tp=1, client=self.daemon.client("vbf"))
        params = {n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}
        c = canonical(1)
        for r, t in enumerate(trainers):
            t.publish(1, (("module.module." + n, a) for n, a in megatron_tp2(c, r).items()), timeout=TIMEOUT)
        self.assertEqual(engine.apply(1, params, timeout=TIMEOUT), 1)
        for n, want in vllm_tp(c, 1, 0).items():
            np.testing.assert_array_equal(params[n], want, err_msg=n)

        # 4 layers, pp = 2, vpp = 2: each stage has two chunks, named model0. / model1. by the hook.
        cfg = json.loads(self.config)
        cfg["num_hidden_layers"] = 4
        vmodel = wb.ModelConfig(model_id="int_megatron_vpp", hf_config_json=json.dumps(cfg), num_trainer_workers=2,
                                num_rollout_workers=1, mode="one_step_off")
        stages = [megatron.MegatronTrainerHook(None, vmodel, rank=r, pp=2, vpp=2, client=self.daemon.client("mvp"))
                  for r in (0, 1)]
        vengine = vllm.VllmRollout(None, vmodel, tp=1, client=self.daemon.client("vvp"))
        given = [filled(h.layout, seed=10 + r) for r, h in enumerate(stages)]
        chunked = []
        for g in given:
            chunks = [[], []]
            for n, a in g.items():
                v, rest = n.split(".", 1)
                self.assertIn(v, ("model0", "model1"))
                chunks[int(v[len("model"):])].append(("module.module." + rest, a))
            chunked.append(chunks)
        self.assertTrue(all(ch[0] and ch[1] for ch in chunked))
        errors = run_all([lambda h=h, ch=ch: h.publish(1, ch, timeout=TIMEOUT) for h, ch in zip(stages, chunked)])
        self.assertEqual(errors, [])
        for h, g in zip(stages, given):
            for n, a in g.items():
                np.testing.assert_array_equal(h.view(n), a, err_msg=n)
        for h in trainers + stages + [engine, vengine]:
            h.client.deregister()
            h.client.close()

    def test_megatron_overlap_param_gather_completed_before_copying(self):
        """Megatron's distributed optimizer with --overlap-param-gather (NVIDIA/Megatron-LM
        megatron/core/optimizer/distrib_optimizer.py at d08b402b6e74e733c0bcac6a5e3b8ec548a8e5ab:
        "If overlapping all-gather for parameters ... all-gathers are launched in the forward
        pre-hook"): after optimizer.step() only this rank's shard of each bucket holds the new
        weights until the next forward, or until the DDP chunk's start_param_sync(force_sync=True)
        (megatron/core/distributed/distributed_data_parallel.py at 293e10419fd1b79c8680a0f4a206fc0a373729b5).
        publish(..., model=chunk) forces it before copying; a chunk without the overlap is left alone."""
        model = self.model("int_megatron_overlap", "one_step_off", 2, 1)
        trainers = [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("mov")) for r in (0, 1)]
        engine = vllm.VllmRollout(None, model, tp=1, client=self.daemon.client("vov"))

        class OverlapGatherDDP:
            """A DDP chunk right after optimizer.step(): with the overlap its parameters hold the
            previous step's bytes (outside this rank's shard) until the all-gather runs."""

            def __init__(self, stale, gathered, overlap):
                self.ddp_config = types.SimpleNamespace(use_distributed_optimizer=True, overlap_param_gather=overlap)
                self.params = {n: a.copy() for n, a in (stale if overlap else gathered).items()}
                self.gathered, self.syncs = gathered, []

            def named_parameters(self):
                return (("module." + n, a) for n, a in self.params.items())

            def start_param_sync(self, *unused, force_sync=False, force_dispatch=False):
                self.syncs.append(force_sync)
                if force_sync:  # the synchronous all-gather
                    for n, a in self.gathered.items():
                        self.params[n][...] = a

        params = {n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}
        for version, overlap in ((2, True), (3, False)):
            chunks = [OverlapGatherDDP(megatron_tp2(canonical(version - 1), r), megatron_tp2(canonical(version), r), overlap)
                      for r in (0, 1)]
            for t, chunk in zip(trainers, chunks):
                t.publish(version, chunk.named_parameters(), timeout=TIMEOUT, model=[chunk] if overlap else chunk)
            # Overlap: gathered first; without it the optimizer step gathered already (left alone).
            self.assertEqual([c.syncs for c in chunks], [[True], [True]] if overlap else [[], []])
            self.assertEqual(engine.apply(version, params, timeout=TIMEOUT), version)
            for n, want in vllm_tp(canonical(version), 1, 0).items():
                np.testing.assert_array_equal(params[n], want, err_msg="%s v%d" % (n, version))
        for h in trainers + [engine]:
            h.client.deregister()
            h.client.close()

    def test_megatron_router_expert_bias_buffer_and_mtp(self):
        """Megatron's router.expert_bias is a registered buffer (float32), not a parameter: publish
        takes named_buffers() and copies the ones the layout holds; MTP parameters ("mtp.") are not
        in WeightBridge layouts and are skipped; any other unknown name is still refused."""
        model = wb.ModelConfig(model_id="int_megatron_bias", hf_config_json=json.dumps(TINY_GLM), num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        hook = megatron.MegatronTrainerHook(None, model, rank=0, client=self.daemon.client("mbi"))
        engine = vllm.VllmRollout(None, model, tp=1, client=self.daemon.client("vbi"))
        bias_name = "decoder.layers.1.mlp.router.expert_bias"
        self.assertEqual(hook.layout[bias_name].dtype, "float32")
        local = filled(hook.layout, seed=5)
        bias = local.pop(bias_name)
        mtp = [("module.module.mtp.layers.0.enorm.weight", np.zeros((128,), np.uint16)),
               ("module.module.mtp.layers.0.eh_proj.weight", np.zeros((128, 256), np.uint16)),
               # torch.compile's wrapper in front of the MTP block: still MTP, still skipped
               ("_orig_mod.module.mtp.layers.0.hnorm.weight", np.zeros((128,), np.uint16))]
        named_parameters = [("module.module." + n, a) for n, a in local.items()] + mtp
        named_buffers = [("module.module." + bias_name, bias),
                         ("module.module.rotary_pos_emb.inv_freq", np.ones((32,), np.float32)),  # not a weight
                         ("module.module.decoder.layers.1.mlp.router.local_tokens_per_expert",
                          np.zeros((4,), np.float32))]
        with self.assertRaises(KeyError) as cm:  # parameters alone: the bias is missing, nothing published
            hook.publish(1, named_parameters, timeout=TIMEOUT)
        self.assertIn(bias_name, str(cm.exception))
        self.assertIn("named_buffers", str(cm.exception))
        with self.assertRaises(KeyError) as cm:
            hook.publish(1, named_parameters + [("module.module.decoder.layers.9.extra.weight", np.zeros(1))],
                         named_buffers, timeout=TIMEOUT)
        self.assertIn("decoder.layers.9.extra.weight", str(cm.exception))
        hook.publish(1, named_parameters, named_buffers, timeout=TIMEOUT)
        np.testing.assert_array_equal(hook.view(bias_name), bias)
        params = {n: np.zeros(t.shape, t.numpy_dtype()) for n, t in engine.layout.tensors.items()}
        self.assertEqual(engine.apply(1, params, timeout=TIMEOUT), 1)
        np.testing.assert_array_equal(params["model.layers.1.mlp.gate.e_score_correction_bias"], bias)
        np.testing.assert_array_equal(params["model.layers.1.mlp.gate.weight"],
                                      local["decoder.layers.1.mlp.router.weight"])
        for h in (hook, engine):
            h.client.deregister()
            h.client.close()

    def test_fsdp2_router_bias_buffer_is_sharded_like_a_parameter(self):
        """HF transformers registers GLM-4.5's (and DeepSeek-V3's, Kimi-K2's) router
        e_score_correction_bias as a float32 buffer, which FSDP2 does not shard: every rank holds it
        whole. publish takes named_buffers(), cuts this rank's rows by the preset's rule (dp=3 over
        4 experts: rows 0-1, 2-3 and none), ignores buffers the layout lacks (rotary inv_freq);
        without them the publish fails naming the bias and named_buffers. The rollout gets the
        bias whole."""
        dp = 3
        model = wb.ModelConfig(model_id="int_fsdp2_bias", hf_config_json=json.dumps(TINY_GLM), num_trainer_workers=dp,
                               num_rollout_workers=1, mode="one_step_off")
        hooks = [fsdp2.FSDP2TrainerHook(None, model, rank=r, dp=dp, client=self.daemon.client("fbi%d" % r))
                 for r in range(dp)]
        engine = vllm.VllmRollout(None, model, tp=1, client=self.daemon.client("vfb"))
        bias_name, router = "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"
        self.assertEqual(hooks[0].layout[bias_name].dtype, "float32")
        self.assertEqual([h.layout[bias_name].shape[0] for h in hooks], [2, 2, 0])
        rng = np.random.default_rng(17)
        full = {}  # {HF name: whole tensor}, its rows summed over the ranks' shards
        for n, t in hooks[0].layout.tensors.items():
            shape = (sum(h.layout[n].shape[0] for h in hooks),) + tuple(t.shape[1:])
            dt = np.dtype(t.numpy_dtype())
            full[n] = (rng.standard_normal(shape).astype(np.float32) if dt == np.float32
                       else rng.integers(0, np.iinfo(dt).max, size=shape, dtype=dt))
        bias = full.pop(bias_name)
        buffers = [("model.layers.1.mlp.gate." + "e_score_correction_bias", bias),
                   ("model.rotary_emb.inv_freq", np.ones((16,), np.float32))]  # not a weight: ignored

        def params(r):
            return fsdp2_shard(full, dp, r).items()

        with self.assertRaises(KeyError) as cm:  # parameters alone: the bias is missing, nothing published
            hooks[0].publish(1, params(0), timeout=TIMEOUT)
        self.assertIn(bias_name, str(cm.exception))
        self.assertIn("named_buffers", str(cm.exception))
        errors = run_all([lambda r=r: hooks[r].publish(1, params(r), buffers, timeout=TIMEOUT) for r in range(dp)])
        self.assertEqual(errors, [])
        np.testing.assert_array_equal(hooks[0].view(bias_name), bias[0:2])
        np.testing.assert_array_equal(hooks[1].view(bias_name), bias[2:4])
        out = {n: np.zeros(t.shape, t.numpy_dtype()) for n, t in engine.layout.tensors.items()}
        self.assertEqual(engine.apply(1, out, timeout=TIMEOUT), 1)
        np.testing.assert_array_equal(out[bias_name], bias)
        np.testing.assert_array_equal(out[router], full[router])
        for h in hooks + [engine]:
            h.client.deregister()
            h.client.close()

    def test_sglang_refreshes_derived_copies_after_each_version(self):
        """SGLang derives copies at load time (DeepSeek's w_kc / w_vc in post_load_weights, GLM-4.5's
        gate _weight_fp32); WeightBridge writes parameters in place, so each applied version
        refreshes them, after the parameters hold it."""
        model = self.model("int_sglang_derived", "one_step_off", 1, 1)
        trainer = fsdp2.FSDP2TrainerHook(None, model, rank=0, dp=1, client=self.daemon.client("fsd"))
        params = {n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}
        src = "model.layers.0.self_attn.qkv_proj.weight"  # stands in for kv_b_proj
        gate = FakeSglangModule(params["model.norm.weight"], np.zeros((H,), np.float32))
        cache = gate._weight_fp32
        lazy = FakeSglangModule(params["model.norm.weight"], None)  # not computed yet: stays None
        other = FakeSglangModule(np.zeros((3,), np.uint16), np.zeros((H,), np.float32))  # another shape: dropped
        fake = FakeSglangModel(params[src], [gate, lazy, other])
        engine = sglang.SglangRollout(None, model, tp=1, engine_model=fake, client=self.daemon.client("sgd"))
        for version in (1, 2):
            c = canonical(version)
            trainer.publish(version, fsdp2_shard(c, 1, 0).items(), timeout=TIMEOUT)
            self.assertEqual(engine.apply(version, params, timeout=TIMEOUT), version)
            want = vllm_tp(c, 1, 0)
            self.assertEqual(len(fake.seen), version)
            is_nextn, weight_names, seen = fake.seen[-1]
            self.assertEqual((is_nextn, weight_names), (False, None))  # every layer
            np.testing.assert_array_equal(seen, want[src])  # ran after the parameters held the version
            self.assertIs(gate._weight_fp32, cache)  # in place: a captured CUDA graph reads this memory
            np.testing.assert_array_equal(gate._weight_fp32, bf16_to_f32(want["model.norm.weight"]))
            self.assertIsNone(lazy._weight_fp32)
            self.assertIsNone(other._weight_fp32)
        # Older post_load_weights(self, is_nextn) without a default get is_nextn=False; a model with
        # neither post_load_weights nor modules() is left alone.
        calls = []

        class Old:
            def post_load_weights(self, is_nextn):
                calls.append(is_nextn)

        self.assertEqual(sglang.refresh_derived(Old()), 0)
        self.assertEqual(calls, [False])
        self.assertEqual(sglang.refresh_derived(object()), 0)
        for h in (trainer, engine):
            h.client.deregister()
            h.client.close()

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

    def test_lora_wrapped_engines_land_under_base_layer_names(self):
        """vLLM --enable-lora (and SGLang's LoRA) wrap each linear layer: named_parameters() shows
        "...qkv_proj.base_layer.weight". The vLLM extension (wb_init / wb_apply on a stand-in worker)
        and SGLang's read_into address them without the segment, byte for byte; two parameters that
        collapse to one name are refused before anything is registered."""
        for engine in ("vllm", "sglang"):
            model = self.model("int_lora_names_" + engine, "one_step_off", 1, 1)
            trainer = fsdp2.FSDP2TrainerHook(None, model, rank=0, dp=1, client=self.daemon.client("fln"))
            params = {with_base_layer(n): np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}
            wrapped = [n for n in params if ".base_layer." in n]
            self.assertIn("model.layers.0.self_attn.qkv_proj.base_layer.weight", wrapped)
            self.assertIn("model.layers.1.mlp.gate_up_proj.base_layer.weight", wrapped)
            if engine == "vllm":
                worker = fake_vllm_worker(params)
                worker.wb_init(self.daemon.socket, model)
                hook, land = worker.wb, worker.wb_apply
            else:
                hook = sglang.SglangRollout(None, model, tp=1, client=self.daemon.client("sln"))
                land = lambda v: hook.apply(v, params, timeout=TIMEOUT)  # noqa: E731
            for version in (1, 2):
                c = canonical(version)
                trainer.publish(version, fsdp2_shard(c, 1, 0).items(), timeout=TIMEOUT)
                self.assertEqual(land(version), version)
                for n, want in vllm_tp(c, 1, 0).items():
                    np.testing.assert_array_equal(params[with_base_layer(n)], want,
                                                  err_msg="%s %s v%d" % (engine, n, version))
            for h in (trainer, hook):
                h.client.deregister()
                h.client.close()

        # Both the wrapped and an unwrapped parameter for one name: refused, naming both.
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        both = dict(params)
        both[qkv] = np.zeros_like(params[with_base_layer(qkv)])
        worker = fake_vllm_worker(both)
        model = self.model("int_lora_collide", "one_step_off", 1, 1)
        with self.assertRaises(ValueError) as cm:
            worker.wb_init(self.daemon.socket, model)
        self.assertIn(qkv, str(cm.exception))
        self.assertIn(with_base_layer(qkv), str(cm.exception))
        self.assertFalse(hasattr(worker, "wb"))  # refused before registering
        engine = vllm.VllmRollout(None, model, tp=1, client=self.daemon.client("vcl"))
        with self.assertRaises(ValueError) as cm:  # read_into checks the same for a dict given directly
            engine.read_into(both)
        self.assertIn(with_base_layer(qkv), str(cm.exception))
        engine.client.deregister()
        engine.client.close()
        # Only the exact segment goes.
        self.assertEqual(normalize_name("a.my_base_layer.base_layer.w", ("base_layer",)), "a.my_base_layer.w")

    def test_vllm_extension_sleeps_and_wakes(self):
        """The vLLM extension's wb_sleep / wb_wake on a stand-in worker (host memory): wb_sleep
        leaves the daemon and unlinks the shm buffer, wb_wake registers again with a new, empty one,
        and the next version reaches the parameters through wb_apply. A second wb_wake is refused."""
        model = self.model("int_vllm_sleep", "one_step_off", 2, 1)
        trainers = [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("msl")) for r in (0, 1)]
        params = {n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}
        worker = fake_vllm_worker(params)
        size = worker.wb_init(self.daemon.socket, model)
        for version in (1, 2):
            c = canonical(version)
            for r, t in enumerate(trainers):
                t.publish(version, megatron_tp2(c, r).items(), timeout=TIMEOUT)
            self.assertEqual(worker.wb_apply(version, timeout=TIMEOUT), version)
            for n, want in vllm_tp(c, 1, 0).items():
                np.testing.assert_array_equal(params[n], want, err_msg="%s v%d" % (n, version))
            if version == 1:
                segment = "/dev/shm" + worker.wb.buffer.name
                worker.wb_sleep(timeout=TIMEOUT)
                self.assertFalse(os.path.exists(segment))
                self.assertNotIn("rollout/0", [w.worker_id for w in trainers[0].client.status(model_id=model.model_id).workers])
                self.assertEqual(worker.wb_wake(), size)
                self.assertEqual(worker.wb.buffer.id, 0)
                self.assertFalse(worker.wb.view("model.norm.weight").any(), "the new buffer is empty")
        with self.assertRaisesRegex(RuntimeError, "not released"):
            worker.wb_wake()
        for h in trainers + [worker.wb]:
            h.client.deregister()
            h.client.close()

    def test_vllm_binds_only_without_cuda_graphs(self):
        """wb_init(memory="cuda") re-points the parameters into the buffer (bind) only when vLLM
        captured no CUDA graph over them (enforce_eager, cudagraph_mode NONE); else versions are
        copied in place. Unknown configs count as captured."""
        ns = types.SimpleNamespace
        self.assertTrue(vllm.captures_cuda_graphs(ns()))
        self.assertTrue(vllm.captures_cuda_graphs(ns(model_config=ns(enforce_eager=False))))
        self.assertFalse(vllm.captures_cuda_graphs(ns(model_config=ns(enforce_eager=True))))
        self.assertFalse(vllm.captures_cuda_graphs(ns(vllm_config=ns(model_config=ns(enforce_eager=True)))))
        graphs = ns(vllm_config=ns(model_config=ns(enforce_eager=False), compilation_config=ns(cudagraph_mode=ns(name="FULL_AND_PIECEWISE"))))
        self.assertTrue(vllm.captures_cuda_graphs(graphs))
        graphs.vllm_config.compilation_config.cudagraph_mode = ns(name="NONE")
        self.assertFalse(vllm.captures_cuda_graphs(graphs))

    def test_fsdp2_names_with_checkpoint_and_compile_wrappers(self):
        """torchtitan wraps each block in checkpoint_wrapper and torch.compile: the segments
        "_checkpoint_wrapped_module" / "_orig_mod" sit in the middle of the names (in either order,
        and "_orig_mod." leading for a compiled whole model); they are removed wherever they are and
        every shard lands at its place (checked byte for byte in two SGLang tp=2 engines)."""
        model = self.model("int_fsdp2_wrapped", "sync", 2, 2)
        trainers = [fsdp2.FSDP2TrainerHook(None, model, rank=r, dp=2, client=self.daemon.client("fwr")) for r in (0, 1)]
        engines = [sglang.SglangRollout(None, model, tp=2, tp_rank=r, client=self.daemon.client("swr")) for r in (0, 1)]
        params = [{n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 2, r).items()} for r in (0, 1)]

        def wrapped(name):
            name = name.replace("model.layers.0.", "model.layers.0._orig_mod._checkpoint_wrapped_module.")
            name = name.replace("model.layers.1.", "model.layers.1._checkpoint_wrapped_module._orig_mod.")
            return "_orig_mod." + name

        c = canonical(1)
        given = [[(wrapped(n), t) for n, t in fsdp2_shard(c, 2, r).items()] for r in (0, 1)]
        self.assertIn("_orig_mod.model.layers.0._orig_mod._checkpoint_wrapped_module.mlp.up_proj.weight",
                      [n for n, _ in given[0]])
        errors = run_all([lambda e=e, p=p: e.update(1, p, timeout=TIMEOUT) for e, p in zip(engines, params)] +
                         [lambda t=t, g=g: t.publish(1, g, timeout=TIMEOUT) for t, g in zip(trainers, given)])
        self.assertEqual(errors, [])
        for r in (0, 1):
            for n, want in vllm_tp(c, 2, r).items():
                np.testing.assert_array_equal(params[r][n], want, err_msg="sglang rank %d %s" % (r, n))
        for h in trainers + engines:
            h.client.deregister()
            h.client.close()

    def test_fsdp2_refuses_placements_the_preset_does_not_describe(self):
        """FSDP2 with a shard_placement_fn returning Shard(1), or FSDP2 + TP (a 2-D mesh with a TP
        dim), or a rank whose shard index on the mesh is not the preset's: other bytes than the fsdp
        preset describes. Refused naming the parameter and its placements, before any byte is copied."""
        model = self.model("int_fsdp2_placements", "one_step_off", 2, 1)
        hook = fsdp2.FSDP2TrainerHook(None, model, rank=0, dp=2, client=self.daemon.client("fpl"))
        c = canonical(1)
        first = "model.embed_tokens.weight"
        self.assertEqual(next(iter(c)), first)
        bad = "model.layers.0.self_attn.q_proj.weight"
        q = c[bad]
        cases = [
            # shard_placement_fn -> Shard(1): columns [0, 128) of every row.
            (FakeDTensor(q[:, :128], (FakeShard(1),), FakeMesh((2,), (0,))), "Shard(dim=1)"),
            # FSDP2 + TP: (dp, tp) mesh, the TP dim sharding rows too.
            (FakeDTensor(q[:64], (FakeShard(0), FakeShard(0)), FakeMesh((2, 2), (0, 0))), "Shard(dim=0), Shard(dim=0)"),
            # FSDP2 + TP for a parameter TP replicates: the same shape as dp=2's shard, yet refused.
            (FakeDTensor(q[:128], (FakeShard(0), FakeReplicate()), FakeMesh((2, 2), (0, 1))), "Replicate()"),
        ]
        for t, found in cases:
            named = dict(fsdp2_shard(c, 2, 0))
            named[bad] = t
            with self.assertRaises(ValueError) as cm:
                hook.publish(1, named.items(), timeout=TIMEOUT)
            msg = str(cm.exception)
            self.assertIn(bad, msg)
            self.assertIn(found, msg)
            self.assertIn("shard_placement_fn / FSDP2 + TP is not described by the fsdp preset", msg)
            self.assertFalse(hook.view(first).any())  # nothing copied, not even the tensors before it
        # Shard(0), but this process holds shard 1 of the mesh, not the preset's rank 0: every shape
        # matches (all dim-0 sizes are even), the bytes are another shard's.
        with self.assertRaises(ValueError) as cm:
            hook.publish(1, fsdp2_shard(c, 2, 1).items(), timeout=TIMEOUT)
        self.assertIn("shard 1", str(cm.exception))
        self.assertFalse(hook.view(first).any())
        # HSDP: (Replicate(), Shard(0)) over (replicate, shard) is what replicas > 1 describes; a
        # 1-D Shard(0) there is not.
        check = fsdp2.check_placements
        check("w", FakeDTensor(None, (FakeReplicate(), FakeShard(0)), FakeMesh((2, 4), (1, 3))), 4, 2, 3)
        with self.assertRaises(ValueError):
            check("w", FakeDTensor(None, (FakeShard(0),), FakeMesh((4,), (3,))), 4, 2, 3)
        with self.assertRaises(ValueError):  # the shard dim has 8 ranks, the preset dp = 4
            check("w", FakeDTensor(None, (FakeShard(0),), FakeMesh((8,), (3,))), 4, 1, 3)
        check("w", np.zeros(3), 4, 1, 3)  # not a DTensor: not checked
        for r in (0, 1):  # FSDP2's own placements pass (and go out in the tests above)
            for n, t in fsdp2_shard(c, 2, r).items():
                check(n, t, 2, 1, r)
        hook.client.deregister()
        hook.client.close()

    def test_modules_import_without_torch(self):
        self.assertNotIn("torch", sys.modules)
        self.assertTrue(hasattr(vllm, "WeightBridgeWorkerExtension"))



# A small DeepSeek-V3 (planner/presets_test.cc kSmallDeepseekV3 with vocab 1024: no padding rows):
# hidden 64, 8 MLA heads (q_lora 24, kv_lora 16, nope 8, rope 4, v 8), dense layer 0
# (intermediate 128), MoE layers 1-2 (8 routed experts of 32, 2 shared: 64).
TINY_DEEPSEEK = json.dumps({
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 8, "vocab_size": 1024, "n_routed_experts": 8, "n_shared_experts": 2,
    "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "v_head_dim": 8})


def hashed(shapes_dtypes, version):
    """{HF name: array} of `version`: bfloat16 bits (uint16) or float32, a function of name, version, index."""
    out = {}
    for name, (shape, dtype) in shapes_dtypes.items():
        h = sum((i + 1) * ord(c) for i, c in enumerate(name)) + 7919 * version
        n = int(np.prod(shape))
        with np.errstate(over="ignore"):
            bits = ((np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(h)) >> np.uint64(9)).astype(np.uint16)
        out[name] = (bits.astype(np.float32) if dtype == "float32" else bits).reshape(shape)
    return out


def sglang_deepseek_dp_attention(c, T, D, tp_rank, dp_lm_head, dense_tp1):
    """SGLang DeepseekV2ForCausalLM.named_parameters() of tp_rank under --tp-size T --dp-size D
    --enable-dp-attention, transcribed from models/deepseek_v2.py and layers/dp_attention.py
    independently of the preset: attention-TP rank a = tp_rank % (T/D) over A = T/D ranks for the MLA
    projections and embed_tokens (VocabParallelEmbedding use_attn_tp_group); lm_head over all T ranks,
    or over the A ranks with --enable-dp-lm-head (ParallelLMHead use_attn_tp_group=enable_dp_lm_head);
    the dense MLP over all T ranks, or whole with --moe-dense-tp-size 1 (DeepseekV2MLP tp_rank 0,
    tp_size 1); shared and routed experts over all T ranks (FusedMoE, no EP)."""
    A = T // D
    a = tp_rank % A

    def rows(x, parts, part):
        n = x.shape[0] // parts
        return x[part * n:(part + 1) * n]

    def cols(x, parts, part):
        n = x.shape[1] // parts
        return x[:, part * n:(part + 1) * n]

    out = {"model.embed_tokens.weight": rows(c["model.embed_tokens.weight"], A, a),
           "model.norm.weight": c["model.norm.weight"],
           "lm_head.weight": rows(c["lm_head.weight"], A, a) if dp_lm_head else rows(c["lm_head.weight"], T, tp_rank)}
    for l in range(3):
        p = "model.layers.%d." % l
        at, m = p + "self_attn.", p + "mlp."
        out.update({
            p + "input_layernorm.weight": c[p + "input_layernorm.weight"],
            p + "post_attention_layernorm.weight": c[p + "post_attention_layernorm.weight"],
            at + "fused_qkv_a_proj_with_mqa.weight": np.concatenate([c[at + "q_a_proj.weight"], c[at + "kv_a_proj_with_mqa.weight"]]),
            at + "q_a_layernorm.weight": c[at + "q_a_layernorm.weight"],
            at + "kv_a_layernorm.weight": c[at + "kv_a_layernorm.weight"],
            at + "q_b_proj.weight": rows(c[at + "q_b_proj.weight"], A, a),
            at + "kv_b_proj.weight": rows(c[at + "kv_b_proj.weight"], A, a),
            at + "o_proj.weight": cols(c[at + "o_proj.weight"], A, a),
        })
        if l == 0:
            parts, part = (1, 0) if dense_tp1 else (T, tp_rank)
            out[m + "gate_up_proj.weight"] = np.concatenate([rows(c[m + "gate_proj.weight"], parts, part),
                                                             rows(c[m + "up_proj.weight"], parts, part)])
            out[m + "down_proj.weight"] = cols(c[m + "down_proj.weight"], parts, part)
            continue
        s = m + "shared_experts."
        out.update({
            m + "gate.weight": c[m + "gate.weight"],
            s + "gate_up_proj.weight": np.concatenate([rows(c[s + "gate_proj.weight"], T, tp_rank),
                                                       rows(c[s + "up_proj.weight"], T, tp_rank)]),
            s + "down_proj.weight": cols(c[s + "down_proj.weight"], T, tp_rank),
            m + "experts.w13_weight": np.stack([np.concatenate([rows(c[m + "experts.%d.gate_proj.weight" % e], T, tp_rank),
                                                                rows(c[m + "experts.%d.up_proj.weight" % e], T, tp_rank)])
                                                for e in range(8)]),
            m + "experts.w2_weight": np.stack([cols(c[m + "experts.%d.down_proj.weight" % e], T, tp_rank) for e in range(8)]),
        })
        if m + "gate.e_score_correction_bias" in c:
            out[m + "gate.e_score_correction_bias"] = c[m + "gate.e_score_correction_bias"]
    return out


class SglangDpAttentionOptionsTest(unittest.TestCase):
    """SglangRollout(enable_dp_attention=True, enable_dp_lm_head=..., moe_dense_tp_size=...) through a
    real weightbridged: an FSDP2 trainer (dp=1: whole HF tensors) publishes, four SGLang ranks of
    --tp-size 4 --dp-size 2 receive, and every element of every engine parameter is compared with the
    transcription above, for each option on and off."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def check(self, tag, dp_lm_head, moe_dense_tp_size):
        model = wb.ModelConfig(model_id="int_sglang_dpattn_" + tag, hf_config_json=TINY_DEEPSEEK, num_trainer_workers=1,
                               num_rollout_workers=4, mode="sync")
        trainer = fsdp2.FSDP2TrainerHook(None, model, rank=0, dp=1, client=self.daemon.client("dsf" + tag))
        canon = {n: (t.shape, t.dtype) for n, t in trainer.layout.tensors.items()}
        engines = [sglang.SglangRollout(None, model, tp=4, tp_rank=r, dp=2, enable_dp_attention=True, enable_dp_lm_head=dp_lm_head,
                                        moe_dense_tp_size=moe_dense_tp_size, client=self.daemon.client("dsr" + tag))
                   for r in range(4)]
        dense_tp1 = moe_dense_tp_size == 1
        zero = hashed(canon, 0)
        params = []
        for r, e in enumerate(engines):
            want = sglang_deepseek_dp_attention(zero, 4, 2, r, dp_lm_head, dense_tp1)
            # The layout the daemon describes is the engine's parameter list, shape for shape.
            self.assertEqual(sorted(e.layout.tensors), sorted(want), "rank %d" % r)
            for n, t in e.layout.tensors.items():
                self.assertEqual(tuple(t.shape), want[n].shape, "rank %d %s" % (r, n))
            params.append({n: np.zeros_like(a) for n, a in want.items()})
        for version in (1, 2):
            c = hashed(canon, version)
            errors = run_all([lambda e=e, p=p: e.update(version, p, timeout=TIMEOUT) for e, p in zip(engines, params)] +
                             [lambda: trainer.publish(version, c.items(), timeout=TIMEOUT)])
            self.assertEqual(errors, [])
            for r in range(4):
                for n, want in sglang_deepseek_dp_attention(c, 4, 2, r, dp_lm_head, dense_tp1).items():
                    np.testing.assert_array_equal(params[r][n], want, err_msg="%s rank %d %s v%d" % (tag, r, n, version))
        for h in [trainer] + engines:
            h.client.deregister()
            h.client.close()
        return engines

    def test_default_layout(self):
        engines = self.check("plain", False, None)
        self.assertEqual(engines[3].layout["lm_head.weight"].shape, (256, 64))  # 1024 rows over all 4 ranks
        self.assertEqual(engines[3].layout["model.layers.0.mlp.gate_up_proj.weight"].shape, (64, 64))

    def test_enable_dp_lm_head(self):
        engines = self.check("lmhead", True, None)
        self.assertEqual(engines[3].layout["lm_head.weight"].shape, (512, 64))  # over the attention-TP group of 2

    def test_moe_dense_tp_size_1(self):
        engines = self.check("dense1", False, 1)
        self.assertEqual(engines[3].layout["model.layers.0.mlp.gate_up_proj.weight"].shape, (256, 64))  # whole
        self.assertEqual(engines[3].layout["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].shape, (32, 64))

    def test_both_and_moe_dense_tp_size_equal_to_tp_size(self):
        self.check("both", True, 1)
        engines = self.check("dense4", False, 4)  # --moe-dense-tp-size = --tp-size: as not set
        self.assertEqual(engines[0].layout["model.layers.0.mlp.gate_up_proj.weight"].shape, (64, 64))

    def test_refusals_name_the_option(self):
        model = wb.ModelConfig(model_id="int_sglang_dpattn_refused", hf_config_json=TINY_DEEPSEEK, num_trainer_workers=1,
                               num_rollout_workers=4, mode="sync")
        c = self.daemon.client("dsx")
        # SGLang asserts --enable-dp-attention with --enable-dp-lm-head.
        with self.assertRaisesRegex(Exception, "enable_dp_lm_head needs DP attention"):
            sglang.SglangRollout(None, model, tp=4, tp_rank=0, enable_dp_lm_head=True, client=c)
        # check_server_args: --moe-dense-tp-size is None, 1 or --tp-size.
        with self.assertRaisesRegex(Exception, "moe_dense_tp_size=2"):
            sglang.SglangRollout(None, model, tp=4, tp_rank=0, dp=2, enable_dp_attention=True, moe_dense_tp_size=2, client=c)
        for bad in (0, -1, True, "1"):
            with self.assertRaisesRegex(ValueError, "moe_dense_tp_size"):
                sglang.SglangRollout(None, model, tp=4, tp_rank=0, moe_dense_tp_size=bad, client=c)
        c.close()

    def test_preset_layout_carries_both_options(self):
        pc = wb.PresetLayout("sglang", tp=1, dp=8, rank=3, enable_dp_lm_head=True, moe_dense_tp_size=1).to_proto().preset
        self.assertTrue(pc.enable_dp_lm_head)
        self.assertEqual(pc.moe_dense_tp_size, 1)
        pc = wb.PresetLayout("sglang", tp=8).to_proto().preset
        self.assertFalse(pc.enable_dp_lm_head)
        self.assertEqual(pc.moe_dense_tp_size, 0)


class SglangDpAttentionRanksTest(unittest.TestCase):
    def test_sglang_numbers_become_the_presets(self):
        # --tp-size 4 --dp-size 2 --enable-dp-attention: attention-TP groups of 2; the preset's
        # rank (dp_rank * tp + tp_rank) is SGLang's tp_rank.
        for tp_rank in range(4):
            got = sglang.dp_attention_ranks(tp=4, tp_rank=tp_rank, dp=2, memory="host")
            self.assertEqual(got, dict(tp=2, tp_rank=tp_rank % 2, dp=2, dp_rank=tp_rank // 2, memory="host"))
            self.assertEqual(got["dp_rank"] * got["tp"] + got["tp_rank"], tp_rank)
        self.assertEqual(sglang.dp_attention_ranks(tp=8, tp_rank=5, dp=8), dict(tp=1, tp_rank=0, dp=8, dp_rank=5))

    def test_bad_numbers_are_refused(self):
        with self.assertRaisesRegex(ValueError, "must divide"):
            sglang.dp_attention_ranks(tp=4, tp_rank=0, dp=3)
        with self.assertRaisesRegex(ValueError, "outside"):
            sglang.dp_attention_ranks(tp=4, tp_rank=4, dp=2)
        with self.assertRaisesRegex(ValueError, "not dp_rank"):
            sglang.dp_attention_ranks(tp=4, tp_rank=1, dp=2, dp_rank=0)


if __name__ == "__main__":
    unittest.main()
