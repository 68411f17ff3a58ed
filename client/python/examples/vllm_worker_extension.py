"""vLLM rollout engine: receive each version into vLLM's weights (see
weightbridge/integrations/vllm.py).

    from vllm import LLM
    llm = LLM(model=path, tensor_parallel_size=4,
              worker_extension_cls="weightbridge.integrations.vllm.WeightBridgeWorkerExtension")
    llm.collective_rpc("wb_init", args=(socket_path, model_cfg), kwargs={"replica": 0, "memory": "cuda"})
    ...
    llm.collective_rpc("wb_apply")          # one-step-off / async, between engine steps
    llm.collective_rpc("wb_update", args=(version,))   # sync, generation paused

`model_cfg` is a weightbridge.ModelConfig (or its dict) with the HF config of the served model.
memory="cuda": versions land in a registered CUDA buffer and each is copied into vLLM's parameters
in place, device to device (vLLM's CUDA graphs keep the addresses they captured); with
enforce_eager=True (no graphs) the parameters are pointed into the buffer once instead (no copy
after that; bind=True forces it). "host" copies each version from shared memory into them. Sleep
mode: wb_sleep / wb_wake (docs/integration.md "Engines that sleep"). The placement comes from the daemon's
layout description (preset "vllm"). Tested in CI with numpy parameters (VllmRollout in
client/python/tests/integrations_test.py); not run against vLLM itself here (no vLLM / torch / GPU).
"""

from weightbridge.integrations.vllm import VllmRollout, WeightBridgeWorkerExtension  # noqa: F401
