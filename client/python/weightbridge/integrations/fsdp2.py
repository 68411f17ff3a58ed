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
Shard(k != 0), or FSDP2 + TP (a mesh with a TP dim) given tp=1, lays out other bytes and is refused.

FSDP2 + TP (tp > 1; NeMo-RL's DTensor policy with tensor_parallel_size > 1, torchtitan): preset
"fsdp2_tp" (docs/presets.md) on the (dp_replicate, dp_shard, tp) mesh, tp fastest: tp_rank =
rank % tp, shard_rank = (rank // tp) % dp. Each parameter's to_local() is FSDP2's dim-0 chunk of its
TP-local tensor; check_placements_tp checks the 2-D placements before copying: (_StridedShard(0,
split_factor=tp), Shard(0)) for the ColwiseParallel / vocab-parallel tensors (q/k/v/gate/up weight
and bias, embed_tokens, lm_head), (Shard(0), Shard(1)) for o_proj / down_proj weights, (Shard(0),
Replicate()) or a 1-D (Shard(0),) for what TP replicates (norms, o/down biases), a leading
Replicate() with HSDP, and this rank's coordinate on the dp_shard and tp mesh dims.

    hook = FSDP2TrainerHook(socket, model, rank=dist.get_rank(), dp=dp_shard, tp=tp)
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


# Modules torch's ColwiseParallel / RowwiseParallel shard in the fsdp2_tp plan (NeMo-RL's
# nemo_rl/models/dtensor/parallelize.py; torch/distributed/tensor/parallel/style.py): the tensor dim
# each of their parameters is sharded on over the tp mesh dim, None when replicated.
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens")
_ROWWISE = ("o_proj", "down_proj")


def tp_shard_dim(name):
    """0 (ColwiseParallel nn.Linear weight and bias, RowwiseParallel nn.Embedding weight), 1
    (RowwiseParallel nn.Linear weight) or None (replicated: norms, RowwiseParallel biases)."""
    module, _, param = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in _COLWISE:
        return 0
    if leaf in _ROWWISE:
        return 1 if param == "weight" else None
    return None


def check_placements_tp(name, t, dp, tp, replicas, shard_rank, tp_rank):
    """ValueError unless DTensor `t` is laid out as the fsdp2_tp preset describes its parameter
    `name` (HF name, wrappers stripped): FSDP2's dim-0 shard over the dp_shard mesh dim (a
    _StridedShard(0, split_factor=tp) when TP shards dim 0 too), then the plan's TP placement over
    the tp dim, a leading Replicate() with HSDP; or, for what TP replicates, FSDP2 alone on the dp
    mesh ((Shard(0),) / (Replicate(), Shard(0))). This rank's coordinates must be shard_rank and
    tp_rank. A plain tensor is not checked."""
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return
    placements = tuple(placements)
    want_tp = tp_shard_dim(name)
    lead = 1 if replicas > 1 else 0
    if lead and not (len(placements) > 0 and _is(placements[0], "is_replicate")):
        raise ValueError("parameter %s: placements %s, HSDP (replicas=%d) has Replicate() first" % (name, placements, replicas))
    rest = placements[lead:]
    dp_ok = len(rest) >= 1 and _is(rest[0], "is_shard") and getattr(rest[0], "dim", None) == 0
    split = getattr(rest[0], "split_factor", 1) if rest else 1
    if len(rest) == 1:  # FSDP2 only: the tensor is whole on every TP rank
        ok = dp_ok and split == 1 and want_tp is None
        tp_dim = None
    else:
        tp_p = rest[1] if len(rest) == 2 else None
        if want_tp is None:
            tp_ok = tp_p is not None and _is(tp_p, "is_replicate")
        else:
            tp_ok = (tp_p is not None and _is(tp_p, "is_shard") and getattr(tp_p, "dim", None) == want_tp
                     and getattr(tp_p, "split_factor", 1) == 1)
        # torch records FSDP2's chunk of a TP Shard(0) tensor as _StridedShard(0, split_factor=tp)
        # (older releases as a plain Shard(0)): the same bytes, the TP-local tensor's dim-0 chunk.
        ok = dp_ok and tp_ok and split in ((1, tp) if want_tp == 0 else (1,))
        tp_dim = lead + 1
    if not ok:
        want = {0: "Shard(dim=0)", 1: "Shard(dim=1)", None: "Replicate()"}[want_tp]
        raise ValueError("parameter %s: placements %s, the fsdp2_tp preset (dp=%d, tp=%d, replicas=%d) describes FSDP2's "
                         "Shard(0) over dp_shard then %s over tp (NeMo-RL's plan); other plans or shard dims hold other "
                         "bytes" % (name, placements, dp, tp, replicas, want))
    size = getattr(mesh, "size", None)
    local_rank = getattr(mesh, "get_local_rank", None)
    for dim, n, mine, what in ((lead, dp, shard_rank, "dp_shard"), (tp_dim, tp, tp_rank, "tp")):
        if dim is None:
            continue
        if callable(size) and size(dim) != n:
            raise ValueError("parameter %s: placements %s over a %s mesh dim of %d ranks, the preset has %d"
                             % (name, placements, what, size(dim), n))
        if callable(local_rank) and local_rank(dim) != mine:
            raise ValueError("parameter %s: this rank is %d on the %s mesh dim, the preset's rank is %d there (rank = "
                             "(replica * dp + shard_rank) * tp + tp_rank: tp the fastest mesh dim)"
                             % (name, local_rank(dim), what, mine))


class FSDP2TrainerHook(LayoutHook):
    def __init__(self, socket_path, model, rank, dp, replicas=1, worker_id=None, memory="host", gpu=-1, client=None,
                 strip_prefixes=("module.", "_orig_mod."), tp=1):
        """tp > 1: FSDP2 + TP on the (dp_replicate, dp_shard, tp) mesh (preset fsdp2_tp); `rank` is
        the global rank, tp the fastest mesh dim."""
        self.strip_prefixes = strip_prefixes
        self.dp, self.replicas, self.tp = dp, replicas, tp
        if tp > 1:
            preset = PresetLayout("fsdp2_tp", tp=tp, dp=dp, replicas=replicas, rank=rank)
            self.tp_rank, self.shard_rank = rank % tp, (rank // tp) % dp
        else:
            preset = PresetLayout("fsdp", dp=dp, replicas=replicas, rank=rank)
            self.tp_rank, self.shard_rank = 0, rank % dp
        super().__init__(socket_path, model, worker_id or "trainer/%d" % rank, "trainer", preset, memory, gpu, client,
                         shm_prefix="fsdp2")

    def _check(self, name, t):
        if self.tp > 1:
            check_placements_tp(trainer_name(name, self.strip_prefixes), t, self.dp, self.tp, self.replicas,
                                self.shard_rank, self.tp_rank)
        else:
            check_placements(name, t, self.dp, self.replicas, self.shard_rank)

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
            self._check(name, t)
        if named_buffers is not None:
            given = {trainer_name(n, self.strip_prefixes) for n, _ in named}
            for name, b in named_buffers:
                held = trainer_name(name, self.strip_prefixes)
                if held in given or held not in self.layout.tensors:
                    continue
                if hasattr(b, "to_local"):
                    self._check(name, b)
                    named.append((name, b))
                else:
                    named.append((name, self.shard_rows(b)))
        self.write(named, strip_prefixes=self.strip_prefixes,
                   missing_hint=" (persistent buffers such as a router's e_score_correction_bias: publish(..., "
                                "named_buffers=model.named_buffers()))")
        return self.client.publish(version, timeout).stall_seconds

    def shard_rows(self, t):
        """This rank's dim-0 rows of a whole tensor `t` (numpy or torch), as FSDP2 would shard it
        (buffers are never tensor-parallel: with tp > 1 the same rows on every TP rank)."""
        if len(t.shape) == 0:
            raise ValueError("a 0-d tensor has no rows to shard; the fsdp preset shards dim 0")
        d0 = int(t.shape[0])
        c = -(-d0 // self.dp)
        return t[min(d0, self.shard_rank * c):min(d0, (self.shard_rank + 1) * c)]
