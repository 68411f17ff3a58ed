"""vLLM rollout worker: an extension for vLLM's `worker_extension_cls`.

    llm = LLM(model=..., tensor_parallel_size=4, worker_extension_cls=
              "weightbridge.integrations.vllm.WeightBridgeWorkerExtension")
    llm.collective_rpc("wb_init", args=(socket, model_cfg_dict), kwargs={"replica": 0})
    # sync: pause generation, then
    llm.collective_rpc("wb_update", args=(version,))
    # one-step-off / async, between engine steps:
    llm.collective_rpc("wb_apply")

Sleep mode (colocated RL: the trainer gets the GPU memory between rollouts). With memory="cuda" the
weights live in our buffer, outside vLLM's sleep-mode allocator, so llm.sleep frees only what vLLM
allocated (the KV cache); wb_sleep frees the buffer (leaving the daemon first, whose mapping would
keep it). Call order:
    llm.sleep(level=1)                       # or 2
    llm.collective_rpc("wb_sleep")           # the engine must not run until wb_wake
    ... train ...
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("wb_wake")            # registered again, new empty buffer, parameters re-bound
    # the trainers publish v (after the engines woke)
    llm.collective_rpc("wb_update", args=(v,))   # or wb_apply: the version lands before generating
    llm.wake_up(tags=["kv_cache"])
After wb_wake the rank holds no version: with memory="cuda" the parameters point at the new buffer,
zeros until wb_update / wb_apply lands a version (a version another rank still holds is copied from
it - catch-up - else the next published one). Host memory: the new shm buffer is empty and the
parameters are vLLM's (after level 2, garbage until written): the next wb_update / wb_apply copies
the version into them. The buffer may get another device address at each wb_wake, and bind()
re-points parameters: CUDA graphs captured over the old addresses are not updated (not handled
here).

The preset "vllm" (docs/presets.md) names the rank's local tensors as vLLM's
model.named_parameters() does (fused qkv_proj = [q; k; v], gate_up_proj, FusedMoE
experts.w13_weight / w2_weight, fp8 weight + weight_scale_inv). Host memory: each update is
copied from the shm buffer into the parameters. memory="cuda": the parameters are re-pointed into
the registered CUDA buffer once (bind), and versions land in them directly. The logic lives in
VllmRollout (tested in CI with numpy parameters); the extension only reads vLLM's worker state.

With --enable-lora, vLLM wraps every linear layer (`*WithLoRA`, the original kept as `base_layer`),
so named_parameters() shows "...qkv_proj.base_layer.weight": the parameters are addressed with that
segment dropped (_common.engine_params; two parameters collapsing to one name are refused). The
adapters themselves (lora_a_stacked / lora_b_stacked) are not parameters and not written here
(vllm_lora.WeightBridgeLoraWorkerExtension writes them into the adapter's slot).
"""

import os

from weightbridge.client import ModelConfig
from weightbridge.integrations._common import engine_params
from weightbridge.integrations._rollout import RolloutHook


class VllmRollout(RolloutHook):
    def __init__(self, socket_path, model, **kw):
        super().__init__("vllm", socket_path, model, **kw)


class WeightBridgeWorkerExtension:
    """Mixed into vLLM's GPU worker: `self` has model_runner, device, parallel_config (vLLM >= 0.8)."""

    def wb_init(self, socket_path, model_cfg, replica=0, memory="host", expert_placement="", quantization="",
                moe_a2a_backend=None):
        pc = self.parallel_config
        if moe_a2a_backend is None:  # vLLM's own setting: --all2all-backend, or the older environment variable
            moe_a2a_backend = getattr(pc, "all2all_backend", None) or os.environ.get("VLLM_ALL2ALL_BACKEND", "")
        tp, dp = pc.tensor_parallel_size, getattr(pc, "data_parallel_size", 1)
        tp_rank = self.rank % tp if hasattr(self, "rank") else 0
        dp_rank = getattr(pc, "data_parallel_rank", 0)
        model = model_cfg if isinstance(model_cfg, ModelConfig) else ModelConfig(**model_cfg)
        # LoRA's "base_layer" segment dropped from the names; two parameters collapsing to one name
        # are refused here, before anything is registered.
        params = engine_params(self.model_runner.model.named_parameters())
        self.wb = VllmRollout(socket_path, model, tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank, replica=replica,
                              expert_parallel=getattr(pc, "enable_expert_parallel", False), expert_placement=expert_placement,
                              moe_a2a_backend=moe_a2a_backend, quantization=quantization, memory=memory, gpu=self.device.index if memory == "cuda" else -1)
        self.wb_params = params
        if memory == "cuda":
            self.wb.bind(self.wb_params)
        return self.wb.layout.buffer_bytes(0)

    def wb_update(self, version, timeout=300.0):
        return self.wb.update(version, self.wb_params, timeout)

    def wb_apply(self, version=0, timeout=300.0):
        return self.wb.apply(version, self.wb_params, timeout)

    def wb_sleep(self, timeout=300.0):
        """After llm.sleep(): leaves the daemon and frees this rank's buffer (RolloutHook.release)."""
        self.wb.release(timeout)

    def wb_wake(self):
        """After llm.wake_up(tags=["weights"]): registers again with a new buffer and, memory="cuda",
        re-binds the parameters into it without copying (RolloutHook.reacquire). Returns the buffer's
        size. The weights are written by the next wb_update / wb_apply."""
        self.wb.reacquire(self.wb_params)
        return self.wb.layout.buffer_bytes(0)
