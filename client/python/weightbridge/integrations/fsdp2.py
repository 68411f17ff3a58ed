"""torch FSDP2 (fully_shard) trainer hook.

    hook = FSDP2TrainerHook(socket, model, rank=dist.get_rank(), dp=dist.get_world_size())
    hook.publish(step, model.named_parameters(), model.named_buffers())

Preset "fsdp" (= FSDP2, docs/presets.md): each parameter's local shard is its DTensor's
`to_local()` - dim-0 rows [r*c, min(d0, (r+1)*c)) with c = ceil(d0 / dp), torch.chunk semantics,
empty on trailing ranks - under its HF name (FSDP2 does not rename parameters); the layout reserves
c rows per rank like FSDP2's padded storage. HSDP: replicas = the replicate dim (rank = replica *
dp + shard_rank). Shards are copied into the buffer at each publish.

Names: wrapper segments are removed wherever they occur (torch's checkpoint_wrapper
"_checkpoint_wrapped_module", per-block torch.compile "_orig_mod", as torchtitan wraps; _common).
Before anything is copied, every DTensor parameter's placements are checked against the preset
(check_placements): FSDP2's default Shard(0) on a 1-D mesh, (Replicate(), Shard(0)) on HSDP's
(replicate, shard) mesh, this rank's shard index on the shard dim. A shard_placement_fn returning
Shard(k != 0), or FSDP2 + TP (a mesh with a TP dim), lays out other bytes and is refused.
"""

from weightbridge.integrations._common import LayoutHook, trainer_name
from weightbridge.layouts import PresetLayout

UNDESCRIBED = "shard_placement_fn / FSDP2 + TP is not described by the fsdp preset"


def _is(p, kind):
    """p.is_shard() / p.is_replicate() (torch's Placement API; duck-typed, torch not imported)."""
    f = getattr(p, kind, None)
    return bool(callable(f) and f())


def _plain_shard0(p):
    """torch's Shard(0) itself: not another dim, not _StridedShard (FSDP2 + TP's split_factor)."""
    return _is(p, "is_shard") and getattr(p, "dim", None) == 0 and getattr(p, "split_factor", 1) == 1


def check_placements(name, t, dp, replicas, shard_rank):
    """ValueError unless DTensor `t` is laid out as the fsdp preset describes: placements exactly
    (Shard(0),) (replicas = 1) or (Replicate(), Shard(0)) (HSDP), the shard mesh dim of size dp,
    and this rank's index on it (device_mesh.get_local_rank, where the mesh has it) = shard_rank.
    Anything without `placements` / `device_mesh` (a plain tensor) is not checked."""
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return
    placements = tuple(placements)
    if replicas > 1:
        ok = len(placements) == 2 and _is(placements[0], "is_replicate") and _plain_shard0(placements[1])
        want = "(Replicate(), Shard(dim=0))"
    else:
        ok = len(placements) == 1 and _plain_shard0(placements[0])
        want = "(Shard(dim=0),)"
    if not ok:
        raise ValueError("parameter %s: placements %s, the fsdp preset (replicas=%d) describes %s; %s"
                         % (name, placements, replicas, want, UNDESCRIBED))
    shard_dim = len(placements) - 1
    size = getattr(mesh, "size", None)
    if callable(size) and size(shard_dim) != dp:
        raise ValueError("parameter %s: placements %s over a shard mesh dim of %d ranks, the preset has dp=%d"
                         % (name, placements, size(shard_dim), dp))
    local_rank = getattr(mesh, "get_local_rank", None)
    if callable(local_rank) and local_rank(shard_dim) != shard_rank:
        raise ValueError("parameter %s: placements %s, this rank holds shard %d of the mesh, the preset's rank "
                         "holds shard %d (rank = replica * dp + shard_rank)"
                         % (name, placements, local_rank(shard_dim), shard_rank))


class FSDP2TrainerHook(LayoutHook):
    def __init__(self, socket_path, model, rank, dp, replicas=1, worker_id=None, memory="host", gpu=-1, client=None,
                 strip_prefixes=("module.", "_orig_mod.")):
        preset = PresetLayout("fsdp", dp=dp, replicas=replicas, rank=rank)
        self.strip_prefixes = strip_prefixes
        self.dp, self.replicas, self.shard_rank = dp, replicas, rank % dp
        super().__init__(socket_path, model, worker_id or "trainer/%d" % rank, "trainer", preset, memory, gpu, client,
                         shm_prefix="fsdp2")

    def publish(self, version, named_parameters, named_buffers=None, timeout=300.0):
        """Checks every DTensor parameter's placements (check_placements: ValueError before any
        byte is copied), copies every local shard (DTensor.to_local()) into the buffer, publishes.

        `named_buffers` (model.named_buffers()): the buffers the layout holds are copied, the others
        (rotary inv_freq, ...) ignored. FSDP2 shards parameters only: a persistent buffer of the
        checkpoint - DeepSeek-V3 / Kimi-K2 / GLM-4.5's router `e_score_correction_bias` in HF
        transformers - stays whole on every rank, so this rank's rows are cut from it by the
        preset's rule (torch.chunk: rows [r*c, min(d0, (r+1)*c)), c = ceil(d0 / dp)); a DTensor
        buffer is taken as its local shard like a parameter. Without them such a model's publish
        fails naming the tensors not given."""
        named = list(named_parameters)
        for name, t in named:
            check_placements(name, t, self.dp, self.replicas, self.shard_rank)
        if named_buffers is not None:
            given = {trainer_name(n, self.strip_prefixes) for n, _ in named}
            for name, b in named_buffers:
                held = trainer_name(name, self.strip_prefixes)
                if held in given or held not in self.layout.tensors:
                    continue
                if hasattr(b, "to_local"):
                    check_placements(name, b, self.dp, self.replicas, self.shard_rank)
                    named.append((name, b))
                else:
                    named.append((name, self.shard_rows(b)))
        self.write(named, strip_prefixes=self.strip_prefixes,
                   missing_hint=" (persistent buffers such as a router's e_score_correction_bias: publish(..., "
                                "named_buffers=model.named_buffers()))")
        return self.client.publish(version, timeout).stall_seconds

    def shard_rows(self, t):
        """This rank's dim-0 rows of a whole tensor `t` (numpy or torch), as FSDP2 would shard it."""
        if len(t.shape) == 0:
            raise ValueError("a 0-d tensor has no rows to shard; the fsdp preset shards dim 0")
        d0 = int(t.shape[0])
        c = -(-d0 // self.dp)
        return t[min(d0, self.shard_rank * c):min(d0, (self.shard_rank + 1) * c)]
