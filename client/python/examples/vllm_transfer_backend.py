"""vLLM's own weight-transfer API with WeightBridge as its backend "weightbridge"
(weightbridge/integrations/vllm_transfer.py): no worker extension class; for `vllm serve` (HTTP)
users and RL frameworks that already drive vLLM's init_weight_transfer_engine / update_weights.

Offline (an LLM object in the rollout driver):

    register_backend()                       # or `pip install client/python`: a vLLM general plugin
    llm = make_llm("/models/qwen2.5-7b", tensor_parallel_size=2)
    init_engine(llm, "/run/wb/w.sock", model_cfg)
    for version in range(1, num_steps + 1):
        update(llm, version)                 # sync: while the trainers publish `version`
        outputs = llm.generate(prompts, sampling_params)

Online (`VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "weightbridge"}'`
on a machine where client/python is pip-installed, so every vLLM process registers the backend):

    http_init("http://localhost:8000", "/run/wb/w.sock", model_cfg)
    http_update("http://localhost:8000", version)

Trainers publish through WeightBridge's hooks, as always (megatron_trainer_hook.py,
fsdp2_trainer_hook.py); a framework that calls vLLM's trainer-side trainer_send_weights gets the
same (trainer_publish below). `model_cfg` is the weightbridge.ModelConfig every trainer and rollout
rank gives; its num_rollout_workers counts every vLLM worker (tp x dp of every replica).

update_info: "version" (0 = the newest committed, one-step-off / async only), "timeout", "method"
("auto": sync models wait for the version, the others apply it). The version is written into the
parameters in place, never through load_weights; a daemon's refusal (e.g. the version not
committed in time) is a RuntimeError naming version, worker and model. init_info also takes
replica, memory ("host", "cuda", "engine"), expert_placement, quantization, moe_a2a_backend, bind
(as WeightBridgeWorkerExtension.wb_init). vLLM releases before 0.25 have no start_weight_update /
finish_weight_update (sessions=False below). Run against stand-ins of vLLM's weight-transfer
modules (generation B, docs/integration.md) and a real daemon by
client/python/tests/examples_test.py; never against a real vLLM here (no vLLM / torch in CI).
"""

import json
import urllib.request

from weightbridge.integrations import vllm_transfer
from weightbridge.integrations.vllm_transfer import WeightBridgeWeightTransferEngine


def register_backend():
    """Adds "weightbridge" to vLLM's WeightTransferEngineFactory (idempotent: False when it is
    there already). Needed in every vLLM process; the package's vLLM plugin entry point does it."""
    return vllm_transfer.register()


def make_llm(model_path, tensor_parallel_size=1):
    """A vLLM engine whose weight-transfer engine is WeightBridge's."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    return LLM(model=model_path, tensor_parallel_size=tensor_parallel_size,
               weight_transfer_config=WeightTransferConfig(backend=vllm_transfer.BACKEND))


def init_engine(llm, socket_path, model_cfg, replica=0, memory="host"):
    """Registers every vLLM worker of this engine with its node daemon (one rollout rank each)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
    info = vllm_transfer.init_info(socket_path, model_cfg, replica=replica, memory=memory)
    llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))


def update(llm, version, timeout=300.0, sessions=True):
    """Lands `version` in the engine's weights (sync: waits until the trainers published it and it
    is committed; one-step-off / async: applies it, or the newest committed with version 0)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
    if sessions:
        llm.start_weight_update()  # vLLM >= 0.25; nothing to prepare for this in-place backend
    llm.update_weights(WeightTransferUpdateRequest(update_info={"version": version, "timeout": timeout}))
    if sessions:
        llm.finish_weight_update()


def shutdown(llm):
    """Leaves the daemon and frees each worker's buffer (vLLM also does it at worker exit); a later
    init_engine registers again, e.g. after llm.sleep() / wake_up()."""
    llm.shutdown_weight_transfer_engine()


def trainer_publish(hook, model, version, timeout=300.0):
    """vLLM's trainer-side call on one trainer rank: the same as hook.publish(version,
    model.named_parameters(), model.named_buffers()) with a WeightBridge trainer hook
    (MegatronTrainerHook, FSDP2TrainerHook; the buffers the layout holds, e.g. a MoE router's bias,
    are copied, the others ignored)."""
    return WeightBridgeWeightTransferEngine.trainer_send_weights(
        model.named_parameters(),
        {"hook": hook, "version": version, "timeout": timeout, "named_buffers": list(model.named_buffers())})


# ---- `vllm serve`: the same over vLLM's RLHF routes (VLLM_SERVER_DEV_MODE=1) ---------------------

def _post(base_url, route, body, timeout):
    req = urllib.request.Request(base_url.rstrip("/") + route, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # raises HTTPError on a refusal
        return resp.read()


def http_init(base_url, socket_path, model_cfg, replica=0, memory="host", timeout=60.0):
    """POST /init_weight_transfer_engine: init_info is plain JSON (the ModelConfig's fields)."""
    info = vllm_transfer.init_info(socket_path, model_cfg, replica=replica, memory=memory)
    _post(base_url, "/init_weight_transfer_engine", {"init_info": info}, timeout)


def http_update(base_url, version, timeout=300.0, sessions=True):
    """POST /start_weight_update, /update_weights, /finish_weight_update for one version."""
    if sessions:
        _post(base_url, "/start_weight_update", None, 60.0)
    _post(base_url, "/update_weights", {"update_info": {"version": version, "timeout": timeout}}, timeout + 30.0)
    if sessions:
        _post(base_url, "/finish_weight_update", None, 60.0)
