"""Megatron-Core trainer: publish each RL step's weights (see weightbridge/integrations/megatron.py).

Run inside every trainer rank after torch.distributed is initialised; the daemon socket is the
node daemon's --worker_socket. The hook sizes its buffer and places every tensor from the
daemon's layout description (layout discovery): nothing here computes an offset. Tested in CI with
numpy arrays standing in for the parameters (client/python/tests/integrations_test.py); not run
against Megatron-LM itself here (no torch / GPU in CI). memory="cuda" registers a CUDA IPC buffer
instead of shared memory (docs/daemon.md "CUDA buffers").
"""

import weightbridge as wb
from weightbridge.integrations.megatron import MegatronTrainerHook


def make_hook(socket_path, hf_config_json, rank, tp, pp, dp, ep=1, trainers=None, rollouts=1, mode="one_step_off"):
    model = wb.ModelConfig(model_id="policy", hf_config_json=hf_config_json, num_trainer_workers=trainers or tp * pp * dp,
                           num_rollout_workers=rollouts, mode=mode)
    return MegatronTrainerHook(socket_path, model, rank=rank, tp=tp, pp=pp, dp=dp, ep=ep)


def after_optimizer_step(hook, model_chunks, step):
    # One model chunk (no virtual pipeline): its named_parameters(); with vpp > 1 pass one
    # iterable per chunk. Returns how long the trainer was held (snapshot or sync transfer).
    params = model_chunks[0].named_parameters() if hook.vpp == 1 else [m.named_parameters() for m in model_chunks]
    return hook.publish(step, params)
