"""Megatron / FSDP trainer hook: what a trainer rank calls per RL step (sketch).

STATUS (honest): not run against Megatron-LM or torch FSDP here (no torch/GPU in CI). With host
memory (numpy / pinned CPU copies) the same calls are tested in client/python/tests. On GPUs it
needs the daemon's CUDA transport (the current daemon accepts only shared-memory buffers).
"""

import weightbridge as wb


class WeightBridgeTrainerHook:
    def __init__(self, socket_path, model_cfg: dict, parallel: dict, rank: int, local_params):
        """parallel: {"preset": "megatron", "tp":..., "pp":..., "dp":..., "ep":...} or
        {"preset": "fsdp", "dp": world}; local_params: {name: tensor} in the preset's order."""
        self.client = wb.WorkerClient(socket_path, shm_prefix="trainer")
        model = wb.ModelConfig(**model_cfg)
        self.client.register_worker(model, "trainer/%d" % rank, "trainer")
        self.mode = model.mode
        size = sum(t.numel() * t.element_size() for t in local_params.values())
        self.buf = self.client.create_buffer(size)  # host staging the daemon maps (numpy view)
        self.params = local_params
        self.client.register_layout(wb.PresetLayout(rank=rank, **parallel))

    def after_optimizer_step(self, version, timeout=300.0):
        # Copy this rank's shards (preset order) into the buffer, then publish.
        off = 0
        for t in self.params.values():
            n = t.numel() * t.element_size()
            self.buf.bytes[off:off + n] = t.detach().contiguous().view(-1).view(__import__("torch").uint8).cpu().numpy()
            off += n
        res = self.client.publish(version, timeout)  # sync: returns when rollouts have it
        if self.mode == "sync":
            self.client.wait_version(version, timeout)
        return res.stall_seconds  # one-step-off / async: only the daemon's snapshot
