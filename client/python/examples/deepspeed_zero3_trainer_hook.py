"""DeepSpeed ZeRO-3 trainer (OpenRLHF, TRL / accelerate GRPO): publish each RL step's weights without
gathering the model (weightbridge/integrations/deepspeed.py).

In every trainer rank, after deepspeed.initialize (ZeRO stage 3, partitioned over every rank -
DeepSpeed's default data-parallel group):

    model_cfg = policy_model(open("config.json").read(), trainer_ranks=dist.get_world_size(),
                             rollout_ranks=n_engine_ranks, mode="one_step_off")
    hook = make_hook("/run/wb/w.sock", model_cfg, rank=dist.get_rank(), world=dist.get_world_size())
    for step in range(1, num_steps + 1):
        loss = engine(batch).loss; engine.backward(loss); engine.step()
        after_optimizer_step(hook, engine, step)
    leave(hook)

The socket is the node daemon's --worker_socket. Every trainer and rollout rank gives the same
ModelConfig (the first creates the model). The hook asks the daemon for the rank's layout (preset
"fsdp_flat": each tensor's flat range [r*c, (r+1)*c), c = ceil(numel / world), under its Hugging
Face name - ZeRO-3's own partitioning, docs/presets.md) and sizes its buffer from the answer;
publish() checks every parameter's ZeRO-3 partitioning (ds_numel / ds_shape against the model,
the partition group's size and this rank in it, the ds_tensor's size; MiCS is refused with a
ValueError naming the parameter), copies the valid elements of each parameter's ds_tensor - what
the optimizer step wrote, no all-gather - and this rank's range of the HF buffers the checkpoint
holds (the MoE router's e_score_correction_bias), and publishes. `engine` is the DeepSpeed engine
(its "module." prefix and torch.compile's "_orig_mod." are dropped) or the Hugging Face model
under it (TRL: accelerator.unwrap_model(model)); a wrapper holding the HF model under another
attribute passes that model's named_parameters() / named_buffers(). memory="cuda" registers a
CUDA IPC buffer on the rank's GPU instead of shared memory (gpu = torch.cuda.current_device()).
Run with numpy stand-ins for ZeRO-3's parameters against a real daemon by
client/python/tests/examples_test.py; not run with DeepSpeed or torch itself here (none in CI).
"""

import logging

import grpc

import weightbridge as wb
from weightbridge.integrations.deepspeed import DeepSpeedZero3TrainerHook


def policy_model(hf_config_json, trainer_ranks, rollout_ranks, mode="one_step_off", model_id="policy"):
    """The model every worker joins: its HF config.json text, how many trainer and rollout ranks
    register, and the update mode ("sync", "one_step_off" or "async")."""
    return wb.ModelConfig(model_id=model_id, hf_config_json=hf_config_json, num_trainer_workers=trainer_ranks,
                          num_rollout_workers=rollout_ranks, mode=mode)


def make_hook(socket_path, model_cfg, rank, world, memory="host", gpu=-1):
    """This rank's hook: layout discovery, registration and a buffer of the discovered size.
    `rank` / `world`: this process in ZeRO-3's partition group (dist.get_rank() / get_world_size())."""
    return DeepSpeedZero3TrainerHook(socket_path, model_cfg, rank=rank, world=world, memory=memory, gpu=gpu)


def after_optimizer_step(hook: DeepSpeedZero3TrainerHook, engine, step, timeout=300.0):
    """Publishes the weights of `step` (> 0, increasing) from engine.named_parameters() (ZeRO-3's
    partitions) and engine.named_buffers() (whole on every rank; those the model's checkpoint
    holds are cut to this rank's range, the others ignored). Returns the trainer's stall in
    seconds (sync: until every rollout holds the version; one-step-off / async: the daemon's
    snapshot of the buffer), or None when a sync version did not reach every rollout."""
    try:
        return hook.publish(step, engine.named_parameters(), engine.named_buffers(), timeout=timeout)
    except wb.WeightBridgeError as e:
        if e.code != grpc.StatusCode.ABORTED:
            raise
        # Sync mode: a rollout left or restarted during the version (the message names the nodes and
        # rollouts lacking it). The step number is used up; the next publish reaches every rollout,
        # and a restarted rollout is caught up meanwhile. Training goes on.
        logging.warning("weightbridge: version %d not everywhere: %s", step, e.message)
        return None


def leave(hook: DeepSpeedZero3TrainerHook):
    """At the end of training: leave the model and free the buffer."""
    hook.client.deregister()
    hook.close()
