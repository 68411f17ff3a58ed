"""Layout discovery (describe_layout, LayoutInfo.layout, numpy views) against a real standalone
weightbridged (temp Unix socket, port 0). Run by //client/python:discovery_test."""

import os
import sys
import json
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_test import Daemon, DaemonTestCase, TIMEOUT, TINY_CONFIG, WORKSPACE  # noqa: E402

import weightbridge as wb  # noqa: E402


def value(name, flat):
    """Canonical value of elements `flat` of tensor `name` (test-local; both sides compute it)."""
    h = np.uint64(sum((i + 1) * ord(c) for i, c in enumerate(name)) & 0xFFFFFF)
    with np.errstate(over="ignore"):
        return ((np.asarray(flat, dtype=np.uint64) * np.uint64(2654435761) + h * np.uint64(31)) >> np.uint64(7)).astype(np.uint16)


def canonical(name, shape):
    return value(name, np.arange(int(np.prod(shape)), dtype=np.uint64)).reshape(shape)


def piece_view(buf, piece):
    """numpy view of a bf16 piece's box in `buf` (canonical dim order), from the piece alone."""
    shape = [e - b for b, e in zip(piece.box.begin, piece.box.end)]
    base = buf.bytes[piece.offset_bytes:].view(np.uint8)
    return np.lib.stride_tricks.as_strided(base[:(base.size // 2) * 2].view(np.uint16), shape=shape,
                                           strides=[s * 2 for s in piece.strides])


class DiscoveryTest(DaemonTestCase):
    def test_describe_before_registering_then_views_carry_a_version(self):
        model = wb.ModelConfig(model_id="py_discover", hf_config_json=self.config, num_trainer_workers=2,
                               num_rollout_workers=1, mode="one_step_off")
        pre = self.daemon.client("dsc")
        with self.assertRaises(wb.WeightBridgeError) as cm:  # no model known, none given
            pre.describe_layout(wb.PresetLayout("megatron", tp=2, rank=0))
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(wb.WeightBridgeError) as cm:  # tp=3 does not fit 4 heads / 2 KV heads
            pre.describe_layout(wb.PresetLayout("megatron", tp=3, rank=0), model=model)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT, cm.exception.message)
        # The rollout (vLLM tp=1) holds every tensor whole: its pieces give the canonical shapes.
        rdesc = pre.describe_layout(wb.PresetLayout("vllm"), model=model)
        shapes = {p.tensor: tuple(p.box.end) for p in rdesc.pieces}
        pre.close()

        trainers = []
        for rank in (0, 1):
            c = self.daemon.client("dsc")
            preset = wb.PresetLayout("megatron", tp=2, rank=rank)
            desc = c.describe_layout(preset, model=model)
            self.assertEqual(desc.source, "preset")
            qkv = desc["decoder.layers.0.self_attention.linear_qkv.weight"]
            self.assertEqual(qkv.shape, (256, 256))  # one query group of (2 + 1 + 1) heads of 64
            self.assertEqual(qkv.strides, (256, 1))
            self.assertEqual(qkv.offset_bytes % 256, 0)
            c.register_worker(model, "trainer/%d" % rank, "trainer")
            buf = c.create_buffer(desc.buffer_bytes(0))
            info = c.register_layout(preset)
            self.assertEqual([t.offset_bytes for t in info.layout.tensors.values()],
                             [t.offset_bytes for t in desc.tensors.values()])
            self.assertEqual(info.bytes, info.layout.piece_bytes)  # LayoutInfo.bytes: what the pieces cover
            self.assertLessEqual(info.bytes, buf.size_bytes)
            views = info.layout.views(c.buffers)
            self.assertEqual(set(views), set(desc.tensors))
            for name, t in info.layout.tensors.items():
                v = views[name]
                self.assertEqual(v.shape, t.shape)
                self.assertEqual(v.dtype, np.uint16)  # bfloat16 bits
                # Every piece lies inside its local tensor's view: fill through the piece.
                for k in t.pieces:
                    p = info.layout.pieces[k]
                    self.assertGreaterEqual(p.offset_bytes, t.offset_bytes)
                    box = tuple(slice(b, e) for b, e in zip(p.box.begin, p.box.end))
                    piece_view(buf, p)[...] = canonical(p.tensor, shapes[p.tensor])[box]
            # A view is the buffer itself: writing it writes the shm segment.
            emb = views["embedding.word_embeddings.weight"]
            self.assertTrue(np.shares_memory(emb, buf.bytes))
            trainers.append(c)

        ro = self.daemon.client("dsc")
        ro.register_worker(model, "rollout/0", "rollout")
        # Registered: the node knows the model, no spec needed.
        rdesc2 = ro.describe_layout(wb.PresetLayout("vllm"))
        self.assertEqual(rdesc2.buffer_bytes(0), rdesc.buffer_bytes(0))
        ro.create_buffer(rdesc.buffer_bytes(0))
        rinfo = ro.register_layout(wb.PresetLayout("vllm"))
        for c in trainers:
            c.publish(1, timeout=TIMEOUT)
        self.assertEqual(ro.apply(1, timeout=TIMEOUT).applied_version, 1)
        views = rinfo.layout.views(ro.buffers)
        att = "model.layers.1.self_attn."
        want = np.concatenate([canonical(att + n + ".weight", shapes[att + n + ".weight"]) for n in ("q_proj", "k_proj", "v_proj")])
        np.testing.assert_array_equal(views[att + "qkv_proj.weight"], want)  # the fused [q; k; v], by local shape alone
        want_b = np.concatenate([canonical(att + n + ".bias", shapes[att + n + ".bias"]) for n in ("q_proj", "k_proj", "v_proj")])
        np.testing.assert_array_equal(views[att + "qkv_proj.bias"], want_b)
        np.testing.assert_array_equal(views["model.embed_tokens.weight"],
                                      canonical("model.embed_tokens.weight", shapes["model.embed_tokens.weight"]))
        for c in trainers + [ro]:
            c.deregister()
            c.close()

    def test_model_tensors_are_the_inventory_whole(self):
        """client.model_tensors: every HF tensor of the model with its whole shape and dtype, in
        inventory order, before registering (model=) and after registering as a rollout; nothing is
        registered by it."""
        model = wb.ModelConfig(model_id="py_model_tensors", hf_config_json=self.config, num_trainer_workers=1,
                               num_rollout_workers=1, mode="sync")
        c = self.daemon.client("mtn")
        with self.assertRaises(wb.WeightBridgeError) as cm:
            c.model_tensors()
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        tensors = c.model_tensors(model)
        cfg = json.loads(self.config)
        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        names = list(tensors)
        self.assertEqual(names[0], "model.embed_tokens.weight")
        self.assertEqual(tuple(tensors["model.embed_tokens.weight"].shape), (vocab, hidden))
        self.assertEqual(tuple(tensors["model.layers.0.mlp.down_proj.weight"].shape), (cfg["intermediate_size"], hidden)[::-1])
        self.assertEqual(tensors["model.norm.weight"].dtype, "bfloat16")
        # The same tensors as a vLLM tp=1 rollout's pieces cover, whole.
        rdesc = c.describe_layout(wb.PresetLayout("vllm"), model=model)
        covered = {p.tensor: tuple(e - b for b, e in zip(p.box.begin, p.box.end)) for p in rdesc.pieces}
        self.assertEqual({n: tuple(t.shape) for n, t in tensors.items()}, covered)
        c.register_worker(model, "r0", "rollout")
        self.assertEqual(list(c.model_tensors()), names)
        c.deregister()
        c.close()

    def test_explicit_pieces_transposed_and_quantised(self):
        model = wb.ModelConfig(model_id="py_discover_pieces", explicit_tensors=[("q", (8, 8)), ("w", (256, 192))],
                               num_trainer_workers=1, num_rollout_workers=1, mode="one_step_off")
        c = self.daemon.client("dsp")
        layout = wb.ExplicitLayout([
            wb.Piece("q", [0, 0], [8, 8], buffer_id=1, offset_bytes=64, strides=[1, 8]),  # transposed
            wb.Piece("w", [0, 0], [256, 192], buffer_id=0, offset_bytes=0,
                     quant=wb.Quantization(block=[128, 128], scale_buffer_id=1, scale_offset_bytes=256)),
        ])
        desc = c.describe_layout(layout, model=model)
        self.assertEqual(desc.buffers, {0: 256 * 192, 1: 256 + 4 * 4})
        self.assertEqual(desc["q"].strides, (1, 8))
        self.assertEqual(desc["w"].dtype, "float8_e4m3")
        self.assertEqual(desc["w"].scale_tensor, "w_scale_inv")
        self.assertEqual(desc["w_scale_inv"].shape, (2, 2))
        self.assertEqual(desc["w_scale_inv"].dtype, "float32")
        self.assertEqual(desc.piece_bytes, (64 + 256 * 192) * 2)
        bad = wb.ExplicitLayout([wb.Piece("q", [0, 0], [9, 8])])
        with self.assertRaises(wb.WeightBridgeError) as cm:  # q has 8 rows: named
            c.describe_layout(bad, model=model)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("q", cm.exception.message)

        # Move a version into it: the transposed piece's view reads q in canonical order.
        tr = self.daemon.client("dsp")
        tr.register_worker(model, "trainer/0", "trainer")
        tbuf = tr.create_buffer((64 + 256 * 192) * 2)
        tr.register_layout(wb.ExplicitLayout([wb.Piece("q", [0, 0], [8, 8]), wb.Piece("w", [0, 0], [256, 192], offset_bytes=128)]))
        q = canonical("q", (8, 8))
        tbuf.array("uint16", (8, 8))[:] = q
        tbuf.array("uint16", (256, 192), 128)[:] = np.uint16(0x3F80)  # 1.0: scales 1/448
        c.register_worker(model, "rollout/0", "rollout")
        for b in range(2):
            c.create_buffer(desc.buffer_bytes(b))
        info = c.register_layout(layout)
        self.assertEqual(info.layout.source, "pieces")
        tr.publish(1, timeout=TIMEOUT)
        self.assertEqual(c.apply(1, timeout=TIMEOUT).applied_version, 1)
        views = info.layout.views(c.buffers)
        np.testing.assert_array_equal(views["q"], q)
        self.assertFalse(views["q"].flags["C_CONTIGUOUS"])
        np.testing.assert_array_equal(views["w_scale_inv"], np.full((2, 2), np.float32(1.0) / np.float32(448.0), np.float32))
        self.assertTrue(np.all(views["w"] == 0x7E))  # 448 in e4m3
        for x in (tr, c):
            x.deregister()
            x.close()

    def test_nvfp4_pieces_share_a_global_scale_and_view_as_packed_bytes(self):
        rows, cols, split = 8, 32, 2
        model = wb.ModelConfig(model_id="py_discover_nvfp4", explicit_tensors=[("w", (rows, cols))],
                               num_trainer_workers=1, num_rollout_workers=1, mode="one_step_off")
        c = self.daemon.client("dnv")

        def quant(scale_at):
            return wb.Quantization(block=[1, 16], scale_buffer_id=1, scale_offset_bytes=scale_at, dtype="float4_e2m1",
                                   scale_dtype="float8_e4m3", global_scale_offset_bytes=16)
        layout = wb.ExplicitLayout([
            wb.Piece("w", [0, 0], [split, cols], quant=quant(0)),
            wb.Piece("w", [split, 0], [rows, cols], offset_bytes=split * cols // 2, quant=quant(split * 2)),
        ])
        desc = c.describe_layout(layout, model=model)
        self.assertEqual(desc.buffers, {0: rows * cols // 2, 1: 16 + 4})
        elems = [t for t in desc.tensors.values() if t.dtype == "float4_e2m1"]
        self.assertEqual([t.shape for t in elems], [(split, cols), (rows - split, cols)])  # unpacked elements
        a, b = elems
        self.assertEqual(desc[a.scale_tensor].dtype, "float8_e4m3")
        self.assertEqual(desc[b.scale_tensor].shape, (rows - split, cols // 16))
        self.assertEqual(desc[b.scale_tensor].scales_of, b.name)
        self.assertEqual(a.global_scale_tensor, a.name + "_scale_2")
        self.assertEqual(b.global_scale_tensor, a.global_scale_tensor)  # one shared global scale
        gs = desc[a.global_scale_tensor]
        self.assertEqual((gs.dtype, gs.shape, gs.buffer_id, gs.offset_bytes, gs.size_bytes), ("float32", (1,), 1, 16, 4))
        self.assertEqual(gs.global_scale_of, a.name)
        self.assertEqual([p.quant_global_scale_offset for p in desc.pieces], [16, 16])

        tr = self.daemon.client("dnv")
        tr.register_worker(model, "trainer/0", "trainer")
        tbuf = tr.create_buffer(rows * cols * 2)
        tr.register_layout(wb.ExplicitLayout([wb.Piece("w", [0, 0], [rows, cols])]))
        w = np.full((rows, cols), 0x3F80, np.uint16)  # 1.0
        w[5, 0] = 0x4000                                # 2.0, in the second piece: the group's amax
        tbuf.array("uint16", (rows, cols))[:] = w
        c.register_worker(model, "rollout/0", "rollout")
        for buf_id in range(2):
            c.create_buffer(desc.buffer_bytes(buf_id))
        info = c.register_layout(layout)
        tr.publish(1, timeout=TIMEOUT)
        self.assertEqual(c.apply(1, timeout=TIMEOUT).applied_version, 1)
        views = info.layout.views(c.buffers)
        va, vb = views[a.name], views[b.name]
        self.assertEqual((va.dtype, va.shape, vb.shape), (np.uint8, (split, cols // 2), (rows - split, cols // 2)))
        g = np.float32(2.0) / np.float32(2688.0)
        np.testing.assert_array_equal(views[a.global_scale_tensor], np.array([g], np.float32))
        # amax-1 blocks: scale 1 / (6 g) = 224 (e4m3 0x76), 1.0 / (224 g) = 6 -> code 7; the block
        # holding 2.0: scale 448 (0x7e), 2.0 -> 6 (code 7), 1.0 -> 3 (code 5).
        want_s = np.full((rows, cols // 16), 0x76, np.uint8)
        want_s[5, 0] = 0x7E
        want_q = np.full((rows, cols // 2), 0x77, np.uint8)
        want_q[5, :8] = 0x55
        want_q[5, 0] = 0x57
        np.testing.assert_array_equal(np.concatenate([views[a.scale_tensor], views[b.scale_tensor]]), want_s)
        np.testing.assert_array_equal(np.concatenate([va, vb]), want_q)
        for x in (tr, c):
            x.deregister()
            x.close()

    def test_nvfp4_preset_names_the_global_scale(self):
        model = wb.ModelConfig(model_id="py_discover_nvfp4_preset", hf_config_json=self.config, num_trainer_workers=1,
                               num_rollout_workers=1)
        c = self.daemon.client("dnp")
        desc = c.describe_layout(wb.PresetLayout("vllm", quantization="nvfp4"), model=model)
        name = "model.layers.0.self_attn.qkv_proj.weight"
        qkv = desc[name]
        self.assertEqual(qkv.dtype, "float4_e2m1")
        self.assertEqual((qkv.scale_tensor, qkv.global_scale_tensor), (name + "_scale", name + "_scale_2"))
        sc, gs = desc[name + "_scale"], desc[name + "_scale_2"]
        self.assertEqual((sc.dtype, sc.shape, sc.scales_of), ("float8_e4m3", (qkv.shape[0], qkv.shape[1] // 16), name))
        self.assertEqual((gs.dtype, gs.shape, gs.global_scale_of), ("float32", (1,), name))
        self.assertEqual(len(qkv.pieces), 3)  # q, k, v: one global scale
        for k in qkv.pieces:
            self.assertEqual(desc.pieces[k].quant_dtype, wb.pb.DTYPE_F4_E2M1)
            self.assertEqual(desc.pieces[k].quant_global_scale_offset, gs.offset_bytes)
        c.create_buffer(desc.buffer_bytes(0))
        views = desc.views(c.buffers)
        self.assertEqual((views[name].dtype, views[name].shape), (np.uint8, (qkv.shape[0], qkv.shape[1] // 2)))
        self.assertEqual((views[name + "_scale_2"].dtype, views[name + "_scale_2"].shape), (np.float32, (1,)))
        c.close()

    def test_lora_adapter_model_describes_peft_and_vllm_lora(self):
        """ModelSpec.lora (issue 17.3): the model is the adapters alone; vllm_lora tp=2 rank 1 holds
        the q slice's lora_B rows of its heads and o_proj's lora_A columns of its shard."""
        lora = wb.LoraConfig(target_modules=["q_proj", "o_proj"], r=4, alpha=8)
        model = wb.ModelConfig(model_id="py_lora", hf_config_json=self.config, num_trainer_workers=1,
                               num_rollout_workers=2, lora=lora)
        c = self.daemon.client("lora")
        peft = c.describe_layout(wb.PresetLayout("peft"), model=model)
        qa = peft.tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
        self.assertEqual(qa.shape[0], 4)
        desc = c.describe_layout(wb.PresetLayout("vllm_lora", tp=2, rank=1), model=model)
        qb = desc.tensors["model.layers.0.self_attn.qkv_proj.lora_b_stacked.0"]
        q_rows = peft.tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"].shape[0]
        self.assertEqual(qb.shape, (q_rows // 2, 16))  # r=4 in vLLM's default 16-wide slot (max_lora_rank=0)
        self.assertEqual(tuple(desc.pieces[qb.pieces[0]].box.begin), (q_rows // 2, 0))
        oa = desc.tensors["model.layers.0.self_attn.o_proj.lora_a_stacked.0"]
        self.assertEqual(oa.shape, (16, q_rows // 2))
        with self.assertRaises(wb.WeightBridgeError) as cm:  # base presets do not apply to adapters
            c.describe_layout(wb.PresetLayout("vllm"), model=model)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT, cm.exception.message)
        c.close()

    def test_a_large_model_description_arrives(self):
        """FSDP2 over Kimi-K2 (dp=256): ~70k local tensors, a ~10 MB answer; gRPC's default 4 MB
        receive limit refused it (RESOURCE_EXHAUSTED) before the client raised its limit."""
        with open(os.path.join(WORKSPACE, "planner", "testdata", "kimi-k2.json")) as f:
            config = f.read()
        model = wb.ModelConfig(model_id="py_discover_kimi", hf_config_json=config, num_trainer_workers=256,
                               num_rollout_workers=1)
        c = self.daemon.client("kimi")
        desc = c.describe_layout(wb.PresetLayout("fsdp", dp=256, rank=255), model=model)
        self.assertGreater(len(desc.tensors), 60000)
        self.assertEqual(len(desc.pieces), sum(len(t.pieces) for t in desc.tensors.values()))
        c.close()


if __name__ == "__main__":
    unittest.main()
