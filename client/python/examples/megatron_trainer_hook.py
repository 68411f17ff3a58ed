"""Megatron-Core trainer: publish each RL step's weights (weightbridge/integrations/megatron.py).

In every trainer rank after torch.distributed and Megatron's parallel state are initialised
(model_chunks: the list of DDP-wrapped model chunks Megatron's train_step gets; one without
virtual pipeline stages):

    model_cfg = policy_model(open("config.json").read(), trainer_ranks=world_size,
                             rollout_ranks=n_engine_ranks, mode="one_step_off")
    hook = make_hook("/run/wb/w.sock", model_cfg, rank=torch.distributed.get_rank(), tp=8, pp=4, dp=2, ep=8)
    for step in range(1, num_steps + 1):
        train_step(...)                      # forward, backward, optimizer.step()
        after_optimizer_step(hook, model_chunks, step)
    hook.client.deregister(); hook.close()

The socket is the node daemon's --worker_socket. The hook sizes its buffer and places every
tensor from the daemon's layout description (layout discovery, preset "megatron"): nothing here
computes an offset. Pass the parallel sizes and options the run uses: vpp
(--virtual-pipeline-model-parallel-size), and as keywords first_stage_layers / last_stage_layers,
make_vocab_size_divisible_by (1 for Megatron-Bridge / verl mcore models), moe_grouped_gemm,
use_tp_pp_dp_mapping. memory="cuda" registers a CUDA IPC buffer on the rank's GPU instead of
shared memory (docs/daemon.md "CUDA buffers"). Run with numpy stand-ins for the parameters against
a real daemon by client/python/tests/examples_test.py; not run against Megatron-LM itself here
(no torch / GPU in CI).
"""

import weightbridge as wb
from weightbridge.integrations.megatron import MegatronTrainerHook


def policy_model(hf_config_json, trainer_ranks, rollout_ranks, mode="one_step_off", model_id="policy"):
    """The model every worker joins: its HF config.json text, how many trainer and rollout ranks
    register, and the update mode ("sync", "one_step_off" or "async")."""
    return wb.ModelConfig(model_id=model_id, hf_config_json=hf_config_json, num_trainer_workers=trainer_ranks,
                          num_rollout_workers=rollout_ranks, mode=mode)


def make_hook(socket_path, model_cfg, rank, tp, pp=1, dp=1, ep=1, vpp=1, memory="host", gpu=-1, **megatron_options):
    """This rank's hook: layout discovery, registration and a buffer of the discovered size.
    megatron_options: MegatronTrainerHook's other arguments, as the run is configured (etp,
    first_stage_layers, last_stage_layers, make_vocab_size_divisible_by, moe_grouped_gemm,
    moe_use_legacy_grouped_gemm, use_tp_pp_dp_mapping)."""
    return MegatronTrainerHook(socket_path, model_cfg, rank=rank, tp=tp, pp=pp, dp=dp, ep=ep, vpp=vpp, memory=memory,
                               gpu=gpu, **megatron_options)


def after_optimizer_step(hook: MegatronTrainerHook, model_chunks, step, timeout=300.0):
    """Publishes the weights of `step` (> 0, increasing). named_buffers() too: MoE routers keep
    their expert_bias in a buffer. model=model_chunks: with --overlap-param-gather the optimizer
    step's all-gather runs only in the next forward, and publish completes it first. Returns how
    long the trainer was held (sync: until every rollout holds the version; one-step-off /
    async: the daemon's snapshot of the buffer)."""
    if hook.vpp == 1:
        chunk = model_chunks[0]
        return hook.publish(step, chunk.named_parameters(), chunk.named_buffers(), timeout=timeout, model=chunk)
    return hook.publish(step, [c.named_parameters() for c in model_chunks], [c.named_buffers() for c in model_chunks],
                        timeout=timeout, model=model_chunks)
