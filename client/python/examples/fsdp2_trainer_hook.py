"""torch FSDP2 (fully_shard) trainer: publish each RL step's weights (weightbridge/integrations/fsdp2.py).

In every trainer rank, after torch.distributed is initialised and the model is wrapped with
fully_shard (FSDP2's default placement, Shard(0) on a 1-D mesh of dp ranks; HSDP: replicas = the
replicate dim of a (replicate, shard) mesh, rank = replica * dp + shard rank):

    model_cfg = policy_model(open("config.json").read(), trainer_ranks=dist.get_world_size(),
                             rollout_ranks=n_engine_ranks, mode="one_step_off")
    hook = make_hook("/run/wb/w.sock", model_cfg, rank=dist.get_rank(), dp=dist.get_world_size())
    for step in range(1, num_steps + 1):
        loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        after_optimizer_step(hook, model, step)
    leave(hook)

The socket is the node daemon's --worker_socket. Every trainer and rollout rank gives the same
ModelConfig (the first creates the model). The hook asks the daemon for the rank's layout (preset
"fsdp": each parameter's dim-0 shard under its Hugging Face name, docs/presets.md) and sizes its
buffer from the answer; publish() checks every DTensor's placements (a shard_placement_fn with
Shard(k != 0), or FSDP2 + TP, is refused with a ValueError naming the parameter), copies each
local shard (DTensor.to_local()) into the buffer, and publishes. Names: torch.compile's
"_orig_mod" and checkpoint_wrapper's "_checkpoint_wrapped_module" segments and a leading "module."
are dropped. memory="cuda" registers a CUDA IPC buffer on the rank's GPU instead of shared memory
(gpu = torch.cuda.current_device()). Run with numpy stand-ins for the DTensors against a real
daemon by client/python/tests/examples_test.py; not run with torch itself here (none in CI).
"""

import logging

import grpc

import weightbridge as wb
from weightbridge.integrations.fsdp2 import FSDP2TrainerHook


def policy_model(hf_config_json, trainer_ranks, rollout_ranks, mode="one_step_off", model_id="policy"):
    """The model every worker joins: its HF config.json text, how many trainer and rollout ranks
    register, and the update mode ("sync", "one_step_off" or "async")."""
    return wb.ModelConfig(model_id=model_id, hf_config_json=hf_config_json, num_trainer_workers=trainer_ranks,
                          num_rollout_workers=rollout_ranks, mode=mode)


def make_hook(socket_path, model_cfg, rank, dp, replicas=1, memory="host", gpu=-1):
    """This rank's hook: layout discovery, registration and a buffer of the discovered size."""
    return FSDP2TrainerHook(socket_path, model_cfg, rank=rank, dp=dp, replicas=replicas, memory=memory, gpu=gpu)


def after_optimizer_step(hook: FSDP2TrainerHook, model, step, timeout=300.0):
    """Publishes the weights of `step` (> 0, increasing) from model.named_parameters() and the
    persistent buffers FSDP2 leaves whole (model.named_buffers(): the MoE router's
    e_score_correction_bias of DeepSeek-V3 / Kimi-K2 / GLM-4.5 in HF transformers; others are
    ignored). Returns the
    trainer's stall in seconds (sync: until every rollout holds the version; one-step-off / async:
    the daemon's snapshot of the buffer), or None when a sync version did not reach every rollout."""
    try:
        return hook.publish(step, model.named_parameters(), model.named_buffers(), timeout=timeout)
    except wb.WeightBridgeError as e:
        if e.code != grpc.StatusCode.ABORTED:
            raise
        # Sync mode: a rollout left or restarted during the version (the message names the nodes and
        # rollouts lacking it). The step number is used up; the next publish reaches every rollout,
        # and a restarted rollout is caught up meanwhile. Training goes on.
        logging.warning("weightbridge: version %d not everywhere: %s", step, e.message)
        return None


def leave(hook: FSDP2TrainerHook):
    """At the end of training: leave the model and free the buffer."""
    hook.client.deregister()
    hook.close()
