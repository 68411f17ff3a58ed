"""FSDP2 + TP trainers (weightbridge.integrations.fsdp2.FSDP2TrainerHook with tp > 1, preset
fsdp2_tp) through a real standalone weightbridged, numpy arrays standing in for torch DTensors.

Each trainer rank's parameters are built here as torch builds them, independently of the daemon:
parallelize_module with NeMo-RL's plan gives every TP rank its torch.chunk part (ColwiseParallel:
Shard(0) of q/k/v/gate/up weight and bias and lm_head; RowwiseParallel: Shard(1) of o_proj /
down_proj weights, biases replicated; RowwiseParallel on embed_tokens: Shard(0); norms whole),
then fully_shard takes the TP-local tensor's dim-0 chunk over dp_shard (torch.chunk, empty trailing
chunks), with the placements and 2-D mesh FSDP2 records. The rollouts (vLLM layout, transcribed in
integrations_test.vllm_tp) must receive every byte. Run by //client/python:fsdp2_tp_test.
"""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_test import DaemonTestCase, TIMEOUT  # noqa: E402
from integrations_test import (FakeDTensor, FakeMesh, FakeReplicate, FakeShard, canonical,  # noqa: E402
                               run_all, vllm_tp)

import weightbridge as wb  # noqa: E402
from weightbridge.integrations import fsdp2, vllm  # noqa: E402


class FakeStridedShard(FakeShard):
    """torch's _StridedShard(dim, split_factor): how FSDP2 records its chunk of a TP Shard(0) tensor."""

    def __init__(self, dim, split_factor):
        super().__init__(dim)
        self.split_factor = split_factor

    def __repr__(self):
        return "_StridedShard(dim=%d, sf=%d)" % (self.dim, self.split_factor)


def torch_chunk(x, parts, axis=0):
    """torch.chunk(x, parts, axis) padded with empty chunks to `parts` (DTensor's Shard._split_tensor,
    FSDP2's _chunk_with_empty): ceil(n / parts) per chunk, the last short, the rest empty."""
    n = x.shape[axis]
    c = -(-n // parts)
    idx = [slice(None)] * x.ndim
    out = []
    for i in range(parts):
        idx[axis] = slice(min(n, i * c), min(n, (i + 1) * c))
        out.append(x[tuple(idx)])
    return out


def tp_placement(name):
    """NeMo-RL's plan for the tiny Qwen2 (nemo_rl/models/dtensor/parallelize.py _parallelize_qwen)."""
    module, _, param = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens"):
        return 0
    if leaf in ("o_proj", "down_proj"):
        return 1 if param == "weight" else None
    return None


def fsdp2_tp_shard(c, tp, dp, rank, replicas=1, strided=True):
    """named_parameters() of global rank `rank` on the (dp_replicate, dp_shard, tp) mesh: DTensors
    whose to_local() is FSDP2's dim-0 chunk of the TP-local tensor."""
    tp_rank, shard, replica = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    lead = (FakeReplicate(),) if replicas > 1 else ()
    sizes = ((replicas,) if replicas > 1 else ()) + (dp, tp)
    coords = ((replica,) if replicas > 1 else ()) + (shard, tp_rank)
    out = {}
    for name, t in c.items():
        d = tp_placement(name)
        local = t if d is None else torch_chunk(t, tp, d)[tp_rank]
        local = torch_chunk(local, dp, 0)[shard]
        if d is None and name.endswith("norm.weight"):
            # Not parallelized by TP (NeMo-RL without sequence parallelism): FSDP2 on the dp mesh alone.
            out[name] = FakeDTensor(local, lead + (FakeShard(0),), FakeMesh(sizes[:-1], coords[:-1]))
            continue
        dp_place = FakeStridedShard(0, tp) if d == 0 and strided else FakeShard(0)
        tp_place = FakeReplicate() if d is None else FakeShard(d)
        out[name] = FakeDTensor(local, lead + (dp_place, tp_place), FakeMesh(sizes, coords))
    return out


class Fsdp2TpTest(DaemonTestCase):
    def model(self, model_id, mode, trainers, rollouts):
        return wb.ModelConfig(model_id=model_id, hf_config_json=self.config, num_trainer_workers=trainers,
                              num_rollout_workers=rollouts, mode=mode)

    def run_case(self, model_id, mode, tp, dp, replicas, engine_tp, strided=True):
        world = tp * dp * replicas
        model = self.model(model_id, mode, world, engine_tp)
        trainers = [fsdp2.FSDP2TrainerHook(None, model, rank=r, dp=dp, tp=tp, replicas=replicas,
                                           client=self.daemon.client("%s_t%d" % (model_id, r))) for r in range(world)]
        self.assertEqual(trainers[0].preset.preset, "fsdp2_tp")
        engines = [vllm.VllmRollout(None, model, tp=engine_tp, tp_rank=r, client=self.daemon.client("%s_e%d" % (model_id, r)))
                   for r in range(engine_tp)]
        params = [{n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), engine_tp, r).items()} for r in range(engine_tp)]
        for version in (1, 2):
            c = canonical(version)
            publish = [lambda t=t, r=r: t.publish(version, fsdp2_tp_shard(c, tp, dp, r, replicas, strided).items(),
                                                  timeout=TIMEOUT) for r, t in enumerate(trainers)]
            if mode == "sync":
                errors = run_all([lambda e=e, p=p: e.update(version, p, timeout=TIMEOUT) for e, p in zip(engines, params)] +
                                 publish)
                self.assertEqual(errors, [])
            else:
                self.assertEqual(run_all(publish), [])
                for e, p in zip(engines, params):
                    self.assertEqual(e.apply(version, p, timeout=TIMEOUT), version)
            for r in range(engine_tp):
                for n, want in vllm_tp(c, engine_tp, r).items():
                    np.testing.assert_array_equal(params[r][n], want, err_msg="engine rank %d %s v%d" % (r, n, version))
        for h in trainers + engines:
            h.client.deregister()
            h.client.close()

    def test_tp2_dp2_to_vllm_tp2_sync(self):
        self.run_case("f2tp_sync", "sync", tp=2, dp=2, replicas=1, engine_tp=2)

    def test_tp2_dp3_uneven_to_vllm_tp1_one_step_off(self):
        # dp = 3: every TP-local dim 0 splits unevenly (q_proj 128 rows -> 43, 43, 42; k_proj 64 -> 22, 22, 20).
        self.run_case("f2tp_uneven", "one_step_off", tp=2, dp=3, replicas=1, engine_tp=1)

    def test_hsdp_tp4_to_vllm_tp2_async_with_old_torch_placements(self):
        # HSDP (replicas 2, rank = (replica * dp + shard) * tp + tp_rank), placements as torch
        # releases that record FSDP2's chunk of a TP Shard(0) tensor as a plain Shard(0) do.
        self.run_case("f2tp_hsdp", "async", tp=2, dp=2, replicas=2, engine_tp=2, strided=False)

    @staticmethod
    def boxes(desc, place):
        return [(list(desc.pieces[i].box.begin), list(desc.pieces[i].box.end)) for i in place.pieces]

    def test_layout_reserves_fsdp2_padded_shards(self):
        model = self.model("f2tp_desc", "one_step_off", 6, 1)
        hook = fsdp2.FSDP2TrainerHook(None, model, rank=5, dp=3, tp=2, client=self.daemon.client("f2tp_desc"))
        desc = hook.layout
        # rank 5 = dp_shard 2, tp_rank 1: embed_tokens rows 2048..4095 (TP), then rows 1366..2047 of them.
        emb = desc.tensors["model.embed_tokens.weight"]
        self.assertEqual(tuple(emb.shape), (682, 256))
        self.assertEqual(self.boxes(desc, emb), [([2048 + 1366, 0], [4096, 256])])
        # FSDP2's padded storage: chunk 0's 683 rows reserved, so the next tensor starts after them.
        names = list(desc.tensors)
        after = desc.tensors[names[names.index("model.embed_tokens.weight") + 1]]
        self.assertGreaterEqual(after.offset_bytes - emb.offset_bytes, 683 * 256 * 2)
        o = desc.tensors["model.layers.0.self_attn.o_proj.weight"]
        self.assertEqual(tuple(o.shape), (84, 128))
        self.assertEqual(self.boxes(desc, o), [([172, 128], [256, 256])])
        hook.client.deregister()
        hook.client.close()

    def test_refuses_placements_and_ranks_the_preset_does_not_describe(self):
        model = self.model("f2tp_refuse", "one_step_off", 4, 1)
        hook = fsdp2.FSDP2TrainerHook(None, model, rank=1, dp=2, tp=2, client=self.daemon.client("f2tp_refuse"))
        try:
            c = canonical(1)
            good = fsdp2_tp_shard(c, 2, 2, 1)
            q = "model.layers.0.self_attn.q_proj.weight"
            cases = {
                # q_proj sharded on columns (a RowwiseParallel plan): other bytes.
                "placements": FakeDTensor(good[q].local, (FakeStridedShard(0, 2), FakeShard(1)), good[q].device_mesh),
                # A dp-major mesh (tp slowest): this rank's tp coordinate is not rank % tp.
                "tp mesh dim": FakeDTensor(good[q].local, good[q].placements, FakeMesh((2, 2), (0, 0))),
                # FSDP2 sharding dim 1 (shard_placement_fn).
                "Shard(dim=0) over dp_shard": FakeDTensor(good[q].local, (FakeShard(1), FakeShard(0)), good[q].device_mesh),
            }
            for words, bad in cases.items():
                named = dict(good)
                named[q] = bad
                with self.assertRaises(ValueError) as cm:
                    hook.publish(1, named.items(), timeout=TIMEOUT)
                self.assertIn(q, str(cm.exception))
            # A norm given TP Shard(0) placements: the plan replicates norms.
            named = dict(good)
            n = "model.norm.weight"
            named[n] = FakeDTensor(good[n].local, (FakeShard(0), FakeShard(0)), FakeMesh((2, 2), (0, 1)))
            with self.assertRaises(ValueError) as cm:
                hook.publish(1, named.items(), timeout=TIMEOUT)
            self.assertIn("Replicate()", str(cm.exception))
            # A wrong local shape (the TP-local tensor, FSDP2's chunk not taken) is refused by the write.
            named = dict(good)
            named[q] = FakeDTensor(c[q][128:], good[q].placements, good[q].device_mesh)
            with self.assertRaises(ValueError):
                hook.publish(1, named.items(), timeout=TIMEOUT)
            # The right ones pass the checks and are written (a publish would wait for the other ranks).
            for n, t in good.items():
                hook._check(n, t)
            hook.write(good.items(), strip_prefixes=hook.strip_prefixes)
            np.testing.assert_array_equal(hook.view(q), good[q].local)
        finally:
            hook.client.deregister()
            hook.client.close()

    def test_tp_that_does_not_divide_the_kv_heads_is_refused_by_discovery(self):
        model = self.model("f2tp_kv", "one_step_off", 4, 1)
        with self.assertRaises(wb.WeightBridgeError) as cm:
            fsdp2.FSDP2TrainerHook(None, model, rank=0, dp=1, tp=4, client=self.daemon.client("f2tp_kv"))
        self.assertIn("num_key_value_heads", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
