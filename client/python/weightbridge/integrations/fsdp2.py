"""torch FSDP2 (fully_shard) trainer hook.

    hook = FSDP2TrainerHook(socket, model, rank=dist.get_rank(), dp=dist.get_world_size())
    hook.publish(step, model.named_parameters())

Preset "fsdp" (= FSDP2, docs/presets.md): each parameter's local shard is its DTensor's
`to_local()` - dim-0 rows [r*c, min(d0, (r+1)*c)) with c = ceil(d0 / dp), torch.chunk semantics,
empty on trailing ranks - under its HF name (FSDP2 does not rename parameters); the layout reserves
c rows per rank like FSDP2's padded storage. HSDP: replicas = the replicate dim (rank = replica *
dp + shard_rank). Shards are copied into the buffer at each publish.
"""

from weightbridge.integrations._common import LayoutHook
from weightbridge.layouts import PresetLayout


class FSDP2TrainerHook(LayoutHook):
    def __init__(self, socket_path, model, rank, dp, replicas=1, worker_id=None, memory="host", gpu=-1, client=None,
                 strip_prefixes=("module.", "_orig_mod.")):
        preset = PresetLayout("fsdp", dp=dp, replicas=replicas, rank=rank)
        self.strip_prefixes = strip_prefixes
        super().__init__(socket_path, model, worker_id or "trainer/%d" % rank, "trainer", preset, memory, gpu, client,
                         shm_prefix="fsdp2")

    def publish(self, version, named_parameters, timeout=300.0):
        """Copies every parameter's local shard (DTensor.to_local()) into the buffer and publishes."""
        self.write(named_parameters, strip_prefixes=self.strip_prefixes)
        return self.client.publish(version, timeout).stall_seconds
