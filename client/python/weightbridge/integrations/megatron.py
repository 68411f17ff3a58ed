"""Megatron-Core trainer hook: what a trainer rank calls after each optimizer step.

    hook = MegatronTrainerHook(socket, model, rank=torch.distributed.get_rank(), tp=8, pp=4, dp=2, ep=8)
    ...
    hook.publish(step, model.named_parameters(), model.named_buffers(), model=model)
    # vpp > 1: one iterable per model chunk, for both:
    hook.publish(step, [c.named_parameters() for c in model], [c.named_buffers() for c in model], model=model)
    # model=: with --overlap-param-gather the updated parameters are gathered first (sync_params)

The rank's local tensors are the preset's ("megatron", docs/presets.md): the names
named_parameters() shows under the Transformer Engine layer spec (wrapper prefixes stripped, as
many "module." as there are: DDP's, and DDP(Float16Module(...))'s "module.module." with --bf16 /
--fp16, as Megatron-Bridge and verl wrap too; with virtual pipeline stages each chunk v's names
get "model{v}."), in the layout's buffer at the places layout discovery returned.

Pass named_buffers() too: MoE routers with expert bias (DeepSeek-V3, Kimi-K2, GLM-4.5:
`mlp.router.expert_bias`, float32) hold it in a registered buffer, not a parameter, and a version
without it is refused (require_all). Of the buffers only those the layout has are copied (rotary
inv_freq, token counters and the like are not weights). Multi-Token Prediction parameters
("mtp." after the prefixes, on the last stage) are not in WeightBridge layouts (rollouts do not
load the MTP layer from the trainer) and are skipped; any other name the layout lacks raises
KeyError.

Host memory by default (the copy device -> shm is part of the trainer's publish; one-step-off /
async then snapshot it in the daemon), or memory="cuda" (a CUDA IPC buffer; the daemon reads it on
the GPU). Weights are copied at each publish: Megatron's parameters keep their own storage
(optimizer, distributed optimizer buffers).
"""

import itertools
import numbers

from weightbridge.integrations._common import LayoutHook, trainer_name
from weightbridge.layouts import PresetLayout

# Megatron's Multi-Token Prediction block (GPTModel.mtp): not part of any WeightBridge layout.
MTP_PREFIX = "mtp."


def sync_params(model):
    """Completes the distributed optimizer's parameter all-gather of Megatron's DDP model chunk(s)
    `model` where --overlap-param-gather defers it to the next forward: each such chunk's
    start_param_sync(force_sync=True) (megatron/core/distributed/distributed_data_parallel.py; what
    Megatron's own disable_forward_pre_hook(param_sync=True) does before a checkpoint is saved).
    Chunks without the overlap gathered synchronously in the optimizer step and are left alone.
    Returns the number of chunks synchronized."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    synced = 0
    for chunk in chunks:
        cfg = getattr(chunk, "ddp_config", None)
        if getattr(cfg, "use_distributed_optimizer", False) and getattr(cfg, "overlap_param_gather", False):
            chunk.start_param_sync(force_sync=True)
            synced += 1
    return synced


class MegatronTrainerHook(LayoutHook):
    def __init__(self, socket_path, model, rank, tp=1, pp=1, dp=1, ep=1, etp=0, first_stage_layers=0,
                 last_stage_layers=0, vpp=1, worker_id=None, memory="host", gpu=-1, client=None,
                 make_vocab_size_divisible_by=0, moe_grouped_gemm=False, moe_use_legacy_grouped_gemm=False,
                 use_tp_pp_dp_mapping=False):
        """make_vocab_size_divisible_by: Megatron's --make-vocab-size-divisible-by (0 = 128, its
        default); 1 for Megatron-Bridge / verl mcore models, which build the vocab unpadded.
        moe_grouped_gemm: --moe-grouped-gemm with Transformer Engine (TEGroupedMLP: expert j's
        weights are mlp.experts.linear_fc1.weight<j>), verl's and Megatron-Bridge's default.
        moe_use_legacy_grouped_gemm: --moe-use-legacy-grouped-gemm (with moe_grouped_gemm): the legacy
        GroupedMLP's mlp.experts.weight1 / weight2.
        use_tp_pp_dp_mapping: --use-tp-pp-dp-mapping (rank order tp-pp-dp; `rank` is the global rank)."""
        preset = PresetLayout("megatron", tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, rank=rank,
                              first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers, vpp=vpp,
                              make_vocab_size_divisible_by=make_vocab_size_divisible_by, moe_grouped_gemm=moe_grouped_gemm,
                              moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm,
                              use_tp_pp_dp_mapping=use_tp_pp_dp_mapping)
        self.vpp = vpp
        super().__init__(socket_path, model, worker_id or "trainer/%d" % rank, "trainer", preset, memory, gpu, client,
                         shm_prefix="megatron")

    def named(self, named_tensors):
        """(local name, tensor) pairs: wrapper prefixes ("module.", repeated) stripped, MTP tensors
        left out; with vpp > 1 `named_tensors` is one iterable per model chunk, chunk v's names
        prefixed "model{v}." (after the strip: each chunk is wrapped on its own)."""
        chunks = enumerate(named_tensors) if self.vpp > 1 else [(None, named_tensors)]
        for v, chunk in chunks:
            for name, t in chunk:
                # As write() will name it, so "_orig_mod.module.mtp...." is recognised as MTP too.
                name = trainer_name(name)
                if name.startswith(MTP_PREFIX):
                    continue
                yield (name if v is None else "model%d.%s" % (v, name)), t

    def publish(self, version, named_parameters, named_buffers=None, timeout=300.0, model=None):
        """Copies every local tensor into the buffer, then publishes `version`. `named_buffers`
        (model.named_buffers(), per chunk with vpp > 1): the buffers the layout holds (the router's
        expert_bias) are copied, the others ignored. `model`: Megatron's DDP-wrapped model chunk(s)
        (one, or the list train_step gets): with --use-distributed-optimizer --overlap-param-gather
        the optimizer step updates only this rank's shard of each parameter bucket and the
        all-gather of the others runs in the next forward's pre-hooks, so the parameters still hold
        the previous step's bytes there; given `model`, publish first completes that all-gather
        (sync_params). Sync mode returns once the version is in every rollout; one-step-off /
        async once the daemon took its snapshot. Returns the daemon's stall (seconds)."""
        if isinstance(named_buffers, numbers.Number):  # publish(v, params, 30.0) from before named_buffers
            raise TypeError("publish(version, named_parameters, named_buffers=None, timeout=...): "
                            "got %r for named_buffers; pass timeout by keyword" % (named_buffers,))
        if model is not None:
            sync_params(model)
        tensors = self.named(named_parameters)
        if named_buffers is not None:
            buffers = ((n, t) for n, t in self.named(named_buffers) if n in self.layout.tensors)
            tensors = itertools.chain(tensors, buffers)
        hint = ""
        if named_buffers is None and any(n.endswith("router.expert_bias") for n in self.layout.tensors):
            hint = " (the router's expert_bias is a buffer: pass model.named_buffers() as well)"
        self.write(tensors, missing_hint=hint)
        return self.client.publish(version, timeout).stall_seconds
