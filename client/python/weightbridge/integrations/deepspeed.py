"""DeepSpeed ZeRO stage 3 trainer hook (what OpenRLHF and TRL / accelerate GRPO trainers run):
publish without gathering the model.

    hook = DeepSpeedZero3TrainerHook(socket, model, rank=dist.get_rank(), world=dist.get_world_size())
    engine.step()
    hook.publish(step, engine.named_parameters(), engine.named_buffers())

Preset "fsdp_flat" (docs/presets.md) with dp = `world`: every HF tensor flattened and split into
`world` contiguous ranges of c = ceil(n / world) elements, rank r holding flat elements
[min(n, r*c), min(n, (r+1)*c)) as a 1-D local tensor under the HF name; empty ranges are not in
the layout. That is ZeRO-3's own partitioning, read in DeepSpeed's source
(deepspeed/runtime/zero/partition_parameters.py, class Init):

- `_convert_to_deepspeed_param` keeps the whole tensor's `ds_shape` and unpadded `ds_numel`, the
  group it is split over (`ds_process_group`, the data-parallel group: all ranks by default),
  `ds_persist`, and for ZeRO++ hpZ a secondary copy (`ds_secondary_tensor`,
  `ds_zero_param_process_group`);
- `_padding_size` / `_aligned_size` pad ds_numel up to a multiple of `num_partitions` (the group's
  size); `_partition_param` gives every rank `partition_size = aligned // num_partitions` = c
  elements in `param.ds_tensor` (1-D, the parameter's dtype; `ds_tensor.ds_numel` = c), copies
  flat elements [c * get_partition_rank(), +c) of the parameter into it - only the ds_numel - start
  that exist on the rank holding the end, the rest of its c is padding - and frees `param.data`
  (`free_param`: an empty tensor); the all-gathers (`_allgather_param`, `all_gather_coalesced`)
  rebuild the parameter as `flat.narrow(0, 0, ds_numel).view(ds_shape)` of the ranks' ds_tensors
  in rank order. A tensor with fewer elements than ranks gives c = 1: the trailing ranks hold
  padding only, as the preset's omitted ranges say.
- After the optimizer step the ds_tensors hold the new weights: deepspeed/runtime/zero/stage3.py
  `_create_fp16_partitions_with_defragmentation` makes `fp16_partitioned_groups` the parameters'
  ds_tensors, and `_reassign_or_swap_out_partitioned_parameters` copies the fp32 master partition
  into `fp16_partitioned_groups_flat` and re-points each ds_tensor into it
  (`_unflatten_partitioned_parameters`). Persistent parameters (`ds_persist`,
  stage3_param_persistence_threshold: DeepSpeedZeRoOffload.mark_persistent_parameters marks
  already partitioned ones) keep their ds_tensor too and are re-gathered from it in `_post_step`,
  so the ds_tensor is every ZeRO-3 parameter's authoritative copy and the one read here.
- ZeRO++ hpZ (zero_hpz_partition_size > 1): `Init._partition` runs `_partition_param_sec` (the
  node-local secondary copy used by the forward all-gathers) and then the same `_partition_param`
  over the whole data-parallel group, so ds_tensor is laid out as above; accepted, the secondary
  tensor is not read. MiCS (mics_shard_size; deepspeed/runtime/zero/mics.py, MiCS_Init: every
  parameter split over a shard group of `param_shard_size` ranks - `num_partitions`,
  `get_partition_rank` - and replicated across groups, `param.comm` the MiCS_CommGroups) is another
  layout and refused.
- Buffers are never partitioned (Init converts module parameters only): a persistent buffer of
  the checkpoint - HF's router `e_score_correction_bias` of DeepSeek-V3 / Kimi-K2 / GLM-4.5 - is
  whole on every rank and cut to the rank's flat range here. So is any parameter without ZeRO-3's
  attributes (ZeRO stage 1 / 2 keep parameters whole).

Before a byte is copied every parameter is checked against that (check_partition): ds_numel and
ds_shape against the model's HF shape, the partition group's size against `world` and this
process's rank in it against `rank`, ds_tensor 1-D of exactly ceil(n / world) elements; MiCS, a
quantised ds_tensor (zero_quantized_nontrainable_weights) and parameters swapped out to NVMe
(offload_param.device nvme) are refused - ValueError naming the parameter and the setting. A
name the model does not have, a name given twice, or a local tensor of this rank not given raise
KeyError / ValueError, also before copying. Duck-typed: neither deepspeed nor torch is imported
(numpy stand-ins in tests; real torch tensors go through _common's copies, CPU-offloaded
partitions included). Not run against DeepSpeed itself (not installed in CI).
"""

import numbers

from weightbridge.integrations._common import LayoutHook, trainer_name
from weightbridge.layouts import PresetLayout


def _numel(t):
    """Elements of a torch tensor (numel()) or a numpy array (size)."""
    n = getattr(t, "numel", None)
    return int(n()) if callable(n) else int(t.size)


def _shape(t):
    return tuple(int(d) for d in t.shape)


def flat_range(n, world, rank):
    """The preset's (and ZeRO-3's) flat range [lo, hi) of rank `rank` of an n-element tensor, and c."""
    c = -(-n // world)
    return min(n, rank * c), min(n, (rank + 1) * c), c


def _is_zero3(p):
    """A parameter DeepSpeed's Init converted (partition_parameters.is_zero_param looks at ds_id)."""
    return hasattr(p, "ds_id") or hasattr(p, "ds_tensor") or hasattr(p, "ds_numel")


def _group_size_rank(group):
    """(size, rank) of a process group (torch's ProcessGroup.size() / .rank()); None where unknown."""
    size, rank = getattr(group, "size", None), getattr(group, "rank", None)
    return (int(size()) if callable(size) else None), (int(rank()) if callable(rank) else None)


def check_partition(name, p, shape, world, rank):
    """ValueError naming `name` and the setting unless `p` is held as the fsdp_flat preset with
    dp = `world` describes rank `rank`'s part of the HF tensor of `shape`. Returns this rank's
    valid elements as a 1-D tensor (a view where it can be): ds_tensor[:hi - lo] of a ZeRO-3
    parameter (its tail padding left out), flat elements [lo, hi) of a whole tensor otherwise."""
    n = 1
    for d in shape:
        n *= d
    lo, hi, c = flat_range(n, world, rank)
    if not _is_zero3(p):  # whole on every rank: ZeRO-1/2, a buffer, an unconverted parameter
        if _numel(p) != n or _shape(p) != shape:
            raise ValueError("tensor %s: shape %s, the model's (HF) tensor is %s" % (name, _shape(p), shape))
        return p.reshape(-1)[lo:hi]
    comm = getattr(p, "comm", None)
    if comm is not None and hasattr(comm, "param_shard_size"):
        raise ValueError("parameter %s: MiCS partitioning (mics_shard_size=%s: split over a shard group and replicated "
                         "across groups); the fsdp_flat preset describes one split over all %d ranks"
                         % (name, comm.param_shard_size, world))
    ds = getattr(p, "ds_tensor", None)
    if ds is None:
        raise ValueError("parameter %s: a ZeRO-3 parameter without ds_tensor (not partitioned yet)" % name)
    ds_numel, ds_shape = getattr(p, "ds_numel", None), getattr(p, "ds_shape", None)
    if ds_numel != n or ds_shape is None or tuple(int(d) for d in ds_shape) != shape:
        raise ValueError("parameter %s: ds_numel %s, ds_shape %s; the model's (HF) tensor is %s (%d elements)"
                         % (name, ds_numel, None if ds_shape is None else tuple(ds_shape), shape, n))
    size, grank = _group_size_rank(getattr(p, "ds_process_group", None))
    if size is not None and size != world:
        raise ValueError("parameter %s: partitioned over a group of %d ranks (ds_process_group: ZeRO-3's data-parallel "
                         "group), the hook's world is %d" % (name, size, world))
    if grank is not None and grank != rank:
        raise ValueError("parameter %s: this process is rank %d of its partition group (ds_process_group), the hook's "
                         "rank is %d" % (name, grank, rank))
    if hasattr(ds, "ds_quant_scale"):
        raise ValueError("parameter %s: its ds_tensor is quantised (zero_quantized_nontrainable_weights), not the "
                         "model's values" % name)
    where = getattr(ds, "final_location", None)
    if getattr(where, "value", where) == "nvme":
        raise ValueError("parameter %s: its partition lives on NVMe (offload_param.device=nvme); the hook reads "
                         "ds_tensor in memory" % name)
    part = getattr(ds, "ds_numel", c)
    if len(ds.shape) != 1 or _numel(ds) != c or part != c:
        raise ValueError("parameter %s: ds_tensor of shape %s (ds_tensor.ds_numel %s); ZeRO-3 over %d ranks gives "
                         "every rank ceil(%d / %d) = %d elements" % (name, _shape(ds), part, world, n, world, c))
    return ds[:hi - lo]


class DeepSpeedZero3TrainerHook(LayoutHook):
    def __init__(self, socket_path, model, rank, world, worker_id=None, memory="host", gpu=-1, client=None,
                 strip_prefixes=("module.", "_orig_mod.")):
        """`rank`, `world`: this process's rank in ZeRO-3's partition group and its size (DeepSpeed's
        default: every rank, dist.get_rank() / dist.get_world_size()). `strip_prefixes`: leading
        name parts dropped (the DeepSpeed engine's "module.", torch.compile's "_orig_mod."; a
        wrapper holding the HF model under another attribute adds its own)."""
        if not 0 <= rank < world:
            raise ValueError("rank %d outside a world of %d" % (rank, world))
        self.world, self.rank, self.strip_prefixes = world, rank, strip_prefixes
        self.hf_shapes = None
        super().__init__(socket_path, model, worker_id or "trainer/%d" % rank, "trainer",
                         PresetLayout("fsdp_flat", dp=world, rank=rank), memory, gpu, client, shm_prefix="zero3")

    def _register(self):
        # The whole HF shapes, to check ds_shape / ds_numel against: the fsdp preset at dp=1 is
        # every tensor of the model whole (discovery only: nothing registered).
        if self.hf_shapes is None:
            whole = self.client.describe_layout(PresetLayout("fsdp", dp=1, rank=0), model=self.model)
            self.hf_shapes = {n: tuple(int(d) for d in t.shape) for n, t in whole.tensors.items()}
        super()._register()

    def partitions(self, named_parameters, named_buffers=None):
        """[(HF name, this rank's 1-D elements)] of every parameter and of the buffers the model's
        tensors include (others, rotary inv_freq and the like, ignored), checked (check_partition)
        before anything is copied; empty ranges left out. KeyError for a parameter the model does
        not have or a local tensor not given; ValueError for a name given twice."""
        out, origin = [], {}

        def take(given, t, is_buffer):
            name = trainer_name(given, self.strip_prefixes)
            if name not in self.hf_shapes:
                if is_buffer:
                    return
                raise KeyError("parameter %r (given as %r) is not a tensor of model %s (it has %d: %s ...)"
                               % (name, given, self.model.model_id, len(self.hf_shapes), ", ".join(list(self.hf_shapes)[:4])))
            if name in origin:
                if is_buffer:
                    return  # a parameter of that name was given: it wins
                raise ValueError("tensor %r (given as %r and %r) was given twice" % (name, origin[name], given))
            origin[name] = given
            part = check_partition(name, t, self.hf_shapes[name], self.world, self.rank)
            if _numel(part):
                out.append((name, part))

        for given, t in named_parameters:
            take(given, t, False)
        for given, t in (named_buffers or ()):
            take(given, t, True)
        missing = [n for n, t in self.layout.tensors.items() if t.pieces and n not in origin]
        if missing:
            hint = ""
            if named_buffers is None and any(n.endswith("e_score_correction_bias") for n in missing):
                hint = " (the router's e_score_correction_bias is a buffer: pass named_buffers() as well)"
            raise KeyError("%d local tensors of rank %d were not given: %s%s"
                           % (len(missing), self.rank, ", ".join(missing[:8]), hint))
        return out

    def publish(self, version, named_parameters, named_buffers=None, timeout=300.0):
        """Checks every parameter's partitioning and name, copies this rank's part of each tensor
        (the valid elements of its ds_tensor; a whole tensor's flat range) into the buffer,
        publishes `version`. `named_parameters` / `named_buffers`: the DeepSpeed engine's or the
        HF model's (model.named_buffers(): HF keeps the MoE router's e_score_correction_bias as a
        buffer; the others are ignored). Sync mode returns once every rollout holds the version,
        one-step-off / async once the daemon took its snapshot. Returns the daemon's stall (s)."""
        if isinstance(named_buffers, numbers.Number):
            raise TypeError("publish(version, named_parameters, named_buffers=None, timeout=...): got %r for "
                            "named_buffers; pass timeout by keyword" % (named_buffers,))
        parts = self.partitions(named_parameters, named_buffers)
        self.write(parts, strip_prefixes=())
        return self.client.publish(version, timeout).stall_seconds
