"""SGLang rollout engine: receive each version into SGLang's weights (weightbridge/integrations/sglang.py).

In each SGLang TP worker process (where its ModelRunner lives: model_runner.model, its tp_rank and
the server_args it was started with), once the model is loaded:

    rollout = make_rollout("/run/wb/w.sock", model_cfg, server_args, tp_rank, model_runner)
    # sync: generation paused, the trainers publish `version` meanwhile
    update_sync(rollout, model_runner, version)
    # one-step-off / async: between batches (the newest committed, or wait for `version`)
    apply_between_batches(rollout, model_runner)
    apply_between_batches(rollout, model_runner, version)

`model_cfg` is the weightbridge.ModelConfig every trainer and rollout rank gives (see
fsdp2_trainer_hook.policy_model); its num_rollout_workers counts every TP rank of every replica.
Several SGLang servers: one replica each (replica=i, replicas=n).

Preset "sglang" (docs/presets.md): vLLM's layout with SGLang's parameter names (fused qkv_proj,
gate_up_proj, fused_qkv_a_proj_with_mqa for MLA); run SGLang with --disable-shared-experts-fusion.
DP attention: SGLang's own --tp-size / --dp-size / tp_rank are passed with
enable_dp_attention=True, and --enable-dp-lm-head / --moe-dense-tp-size as the server runs with
them (they change which rows of lm_head and of the dense MLPs a rank holds).
memory="host" (default): versions land in shared memory and update / apply copy them into the
parameters. memory="cuda" (gpu = the worker's GPU): a CUDA buffer, each version copied into the
parameters in place, device to device (SGLang's CUDA graphs keep their addresses).
engine_model=model_runner.model: after each version what SGLang derived from its weights at load
time is recomputed (DeepSeek's MLA w_kc / w_vc via post_load_weights, GLM-4.5's gate _weight_fp32);
SGLang's load_weights is never called. Colocated RL with release_memory_occupation /
resume_memory_occupation: release_memory / resume_memory below (docs/integration.md "Engines that
sleep"). Run with numpy stand-ins for the parameters against a real daemon by
client/python/tests/examples_test.py; not run against SGLang itself here (no SGLang / torch in CI).
"""

from weightbridge.integrations.sglang import SglangRollout, refresh_derived  # noqa: F401 (refresh_derived: without engine_model)


def make_rollout(socket_path, model_cfg, server_args, tp_rank, model_runner, replica=0, replicas=1, memory="host", gpu=-1):
    """This TP rank as a rollout worker: layout discovery, registration, a buffer of the discovered size."""
    dp_attention = bool(getattr(server_args, "enable_dp_attention", False))
    return SglangRollout(socket_path, model_cfg, tp=server_args.tp_size, tp_rank=tp_rank,
                         dp=server_args.dp_size if dp_attention else 1, enable_dp_attention=dp_attention,
                         enable_dp_lm_head=getattr(server_args, "enable_dp_lm_head", False),
                         moe_dense_tp_size=getattr(server_args, "moe_dense_tp_size", None),
                         moe_a2a_backend=getattr(server_args, "moe_a2a_backend", None) or "",
                         replica=replica, replicas=replicas, memory=memory, gpu=gpu,
                         engine_model=model_runner.model)


def update_sync(rollout: SglangRollout, model_runner, version, timeout=300.0):
    """Sync mode, generation paused: returns once `version` is in the parameters. If the wait fails
    the update is ended (end_update) before the error is raised, so the engine may resume on the
    weights it has."""
    return rollout.update(version, dict(model_runner.model.named_parameters()), timeout=timeout)


def apply_between_batches(rollout: SglangRollout, model_runner, version=0, timeout=300.0):
    """One-step-off / async, between batches: a committed version into the parameters. version 0:
    the newest committed, without waiting (nothing newer: the parameters keep what they hold);
    version v: waits until v (or a newer one) is committed - a one-step-off engine asking for
    exactly the next version. Returns the version the parameters hold (0: none yet)."""
    return rollout.apply(version, dict(model_runner.model.named_parameters()), timeout=timeout)


def release_memory(rollout: SglangRollout, timeout=300.0):
    """After SGLang's release_memory_occupation: leave the daemon and free this rank's buffer."""
    rollout.release(timeout)


def resume_memory(rollout: SglangRollout, model_runner):
    """After resume_memory_occupation (weights): register again; the next update / apply lands a
    version (the trainers should publish after the engines woke)."""
    rollout.reacquire(dict(model_runner.model.named_parameters()))


def leave(rollout: SglangRollout):
    """At engine shutdown: leave the model and free the buffer."""
    rollout.client.deregister()
    rollout.close()
