"""Megatron-Core trainer hook: what a trainer rank calls after each optimizer step.

    hook = MegatronTrainerHook(socket, model, rank=torch.distributed.get_rank(), tp=8, pp=4, dp=2, ep=8)
    ...
    hook.publish(step, model.named_parameters())   # [chunk.named_parameters() for chunk in model] with vpp > 1

The rank's local tensors are the preset's ("megatron", docs/presets.md): the names
named_parameters() shows under the Transformer Engine layer spec (DDP's "module." prefix is
stripped; with virtual pipeline stages each chunk v's names get "model{v}."), in the layout's
buffer at the places layout discovery returned. Host memory by default (the copy device -> shm is
part of the trainer's publish; one-step-off / async then snapshot it in the daemon), or
memory="cuda" (a CUDA IPC buffer; the daemon reads it on the GPU). Weights are copied at each
publish: Megatron's parameters keep their own storage (optimizer, distributed optimizer buffers).
"""

from weightbridge.integrations._common import LayoutHook
from weightbridge.layouts import PresetLayout


class MegatronTrainerHook(LayoutHook):
    def __init__(self, socket_path, model, rank, tp=1, pp=1, dp=1, ep=1, etp=0, first_stage_layers=0,
                 last_stage_layers=0, vpp=1, worker_id=None, memory="host", gpu=-1, client=None):
        preset = PresetLayout("megatron", tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, rank=rank,
                              first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers, vpp=vpp)
        self.vpp = vpp
        super().__init__(socket_path, model, worker_id or "trainer/%d" % rank, "trainer", preset, memory, gpu, client,
                         shm_prefix="megatron")

    def named(self, named_parameters):
        """(name, tensor) pairs; with vpp > 1 `named_parameters` is one iterable per model chunk."""
        if self.vpp > 1:
            for v, chunk in enumerate(named_parameters):
                for name, t in chunk:
                    if name.startswith("module."):
                        name = name[len("module."):]
                    yield "model%d.%s" % (v, name), t
        else:
            yield from named_parameters

    def publish(self, version, named_parameters, timeout=300.0):
        """Copies every local tensor into the buffer, then publishes `version`. Sync mode returns
        once the version is in every rollout; one-step-off / async once the daemon took its
        snapshot. Returns the daemon's stall (seconds)."""
        self.write(self.named(named_parameters))
        return self.client.publish(version, timeout).stall_seconds
