"""vLLM rollout engine: receive each version into vLLM's weights through a worker extension
(weightbridge/integrations/vllm.py).

In the rollout driver, one LLM per replica:

    llm = make_llm("/models/qwen2.5-7b", tensor_parallel_size=4)
    init(llm, "/run/wb/w.sock", model_cfg, replica=0, memory="cuda")
    for version in range(1, num_steps + 1):
        update_sync(llm, version)            # sync: generation paused, the trainers publish `version`
        # (one-step-off / async instead, between engine steps: apply(llm, version) or apply(llm))
        outputs = llm.generate(prompts, sampling_params)

`model_cfg` is the weightbridge.ModelConfig every trainer and rollout rank gives (it goes to the
workers by collective_rpc); its num_rollout_workers counts every vLLM worker of every replica.
wb_init reads the engine's tp / dp sizes, expert parallelism and all2all backend from vLLM.
memory="cuda": versions land in a CUDA buffer and each is copied into vLLM's parameters in place,
device to device (vLLM's CUDA graphs keep the addresses they captured); without CUDA graphs
(enforce_eager=True) the parameters are pointed into the buffer once instead (bind=True forces
it). memory="engine": vLLM's own parameter memory is registered, versions land in the parameters
with no copy (refused, naming the tensor, where a parameter is not the preset's local tensor byte
for byte). "host": each version is copied from shared memory into the parameters. Sleep mode:
sleep / wake below (docs/integration.md "Engines that sleep"). The placement comes from the
daemon's layout description (preset "vllm"). Run with numpy stand-ins for vLLM's workers against a
real daemon by client/python/tests/examples_test.py; not run against vLLM itself here (no vLLM /
torch / GPU in CI).
"""

from weightbridge.integrations.vllm import VllmRollout, WeightBridgeWorkerExtension  # noqa: F401 (VllmRollout: without vLLM's LLM)

EXTENSION = WeightBridgeWorkerExtension.__module__ + "." + WeightBridgeWorkerExtension.__name__


def make_llm(model_path, tensor_parallel_size=1, **engine_args):
    """A vLLM engine whose workers carry WeightBridge's extension (wb_init, wb_update, ...)."""
    from vllm import LLM
    return LLM(model=model_path, tensor_parallel_size=tensor_parallel_size, worker_extension_cls=EXTENSION, **engine_args)


def init(llm, socket_path, model_cfg, replica=0, memory="host"):
    """Registers every worker of this engine with its node daemon; returns each one's buffer size."""
    return llm.collective_rpc("wb_init", args=(socket_path, model_cfg), kwargs={"replica": replica, "memory": memory})


def update_sync(llm, version, timeout=300.0):
    """Sync mode, generation paused: returns once every worker's parameters hold `version`."""
    return llm.collective_rpc("wb_update", args=(version, timeout))


def apply(llm, version=0, timeout=300.0):
    """One-step-off / async, between engine steps: a committed version into the parameters.
    version 0: the newest committed, without waiting (nothing newer: the workers keep what they
    hold); version v: waits until v (or a newer one) is committed - a one-step-off engine asking
    for exactly the next version. Returns the version each worker holds (0: none yet)."""
    return llm.collective_rpc("wb_apply", args=(version, timeout))


def sleep(llm, level=1):
    """Colocated RL: vLLM's sleep, then each worker leaves the daemon and frees its buffer."""
    llm.sleep(level=level)
    llm.collective_rpc("wb_sleep")


def wake(llm):
    """The weights back, each worker registered again with an empty buffer. Then: the trainers
    publish (after the engines woke), update_sync / apply lands the version, and
    llm.wake_up(tags=["kv_cache"]) before generating."""
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("wb_wake")
