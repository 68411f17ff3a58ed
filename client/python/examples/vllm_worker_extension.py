"""vLLM worker extension: what a vLLM rollout worker calls per RL step (sketch).

STATUS (honest): not run against vLLM here (no vLLM, torch or GPU in CI), and the current daemon
accepts only host shared-memory buffers (cuda_ipc_handle -> UNIMPLEMENTED), so on GPUs this needs
the daemon's CUDA transport. The calls and their order are the ones tested with numpy buffers in
client/python/tests/client_test.py. Use with vLLM's `worker_extension_cls` (collective_rpc calls
these methods on every worker).
"""

import weightbridge as wb


class WeightBridgeWorkerExtension:
    """Mixed into vLLM's GPU worker (self.model_runner.model is the loaded model)."""

    def wb_init(self, socket_path, model_cfg: dict, replica: int, tp_rank: int, canonical):
        self.wb = wb.WorkerClient(socket_path, shm_prefix="vllm")
        model = wb.ModelConfig(**model_cfg)
        self.wb.register_worker(model, "rollout/%d/%d" % (replica, tp_rank), "rollout", gpu=self.device.index)
        self.wb_mode = model.mode
        net = self.model_runner.model
        # Infer the layout with vLLM's own loader: fused qkv/gate_up, TP splits, padding, all found.
        layout = wb.infer_layout_torch(net, lambda m, w: m.load_weights(w), canonical)
        buf = self.wb.create_cuda_buffer(layout.buffer_bytes, self.device.index)
        # Point every parameter at its place in the exported buffer (copy current weights once).
        for t in layout.tensors:
            p = dict(net.named_parameters())[t.name]
            view = buf.tensor(p.dtype, t.shape, t.offset_bytes)
            view.copy_(p.data)
            p.data = view
        self.wb.register_layout(layout, weight_buffer=buf)

    # sync: the engine paused generation (e.g. llm.sleep/pause), then:
    def wb_sync_update(self, version, timeout=300.0):
        self.wb.begin_update(timeout)
        return self.wb.wait_version(version, timeout)  # bytes landed in live weights

    # one-step-off / async: at a step boundary (between engine steps), no pause needed:
    def wb_apply(self, version=0, timeout=300.0):
        return self.wb.apply(version, timeout).applied_version  # 0 = newest committed
