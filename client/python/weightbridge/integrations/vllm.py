"""vLLM rollout worker: an extension for vLLM's `worker_extension_cls`.

    llm = LLM(model=..., tensor_parallel_size=4, worker_extension_cls=
              "weightbridge.integrations.vllm.WeightBridgeWorkerExtension")
    llm.collective_rpc("wb_init", args=(socket, model_cfg_dict), kwargs={"replica": 0})
    # sync: pause generation, then
    llm.collective_rpc("wb_update", args=(version,))
    # one-step-off / async, between engine steps:
    llm.collective_rpc("wb_apply")

memory="engine" (recommended on GPUs): zero copy. The rank registers vLLM's OWN parameter memory
with the daemon (each cudaMalloc allocation holding parameters by CUDA IPC of its base; VMM memory
created exportable - torch's expandable segments - by fd; vLLM's sleep-mode pool (enable_sleep_mode)
is created without an exportable handle type and is refused: memory="cuda" there) and versions land
in the parameters themselves:
wb_update / wb_apply copy nothing, the weights are held once, and the parameters' addresses never
change, so the CUDA graphs vLLM captured over them stay valid. Requirement: every local tensor of
the preset is, byte for byte, a parameter as vLLM holds it - same name, contiguous, the same size
and (byte) shape, row-major; a floating dtype other than the preset's, a quantised weight's global
scale in another allocation than its block scales, or any other mismatch is refused at wb_init,
naming the tensor, before anything is registered (use memory="cuda" then). wb_sleep / wb_wake
deregister and register the same parameters again (wb_sleep frees nothing: the memory is vLLM's).
Tested only on emulated GPUs with stand-in parameters (client_cuda_test CudaEngineMemoryTest), not
yet against a real vLLM.

memory="cuda": versions land in a CUDA buffer WeightBridge registers on the rank's GPU. vLLM
captures CUDA graphs over its parameters' addresses at engine start (unless enforce_eager or
cudagraph_mode NONE), so by default each version is copied into the parameters in place, device to
device, by wb_update / wb_apply (the weights are held twice on the GPU: the parameters and the
buffer). Without CUDA graphs wb_init binds instead (bind=None: decided from vLLM's config;
bind=True forces it): the parameters are re-pointed into the buffer and versions land in them with
no copy and no second copy of the weights - with graphs captured that would leave the graphs
reading the old, freed parameter memory: versions would silently not reach generation.

Sleep mode (colocated RL: the trainer gets the GPU memory between rollouts). With memory="cuda"
versions land in our buffer (bound: the weights live there), outside vLLM's sleep-mode allocator,
so llm.sleep does not free it; wb_sleep frees the buffer (leaving the daemon first, whose mapping
would keep it). Call order:
    llm.sleep(level=1)                       # or 2
    llm.collective_rpc("wb_sleep")           # bound: the engine must not run until wb_wake
    ... train ...
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("wb_wake")            # registered again, new empty buffer (bound: re-bound)
    # the trainers publish v (after the engines woke)
    llm.collective_rpc("wb_update", args=(v,))   # or wb_apply: the version lands before generating
    llm.wake_up(tags=["kv_cache"])
After wb_wake the rank holds no version: the next wb_update / wb_apply lands one (a version
another rank still holds is copied from it - catch-up - else the next published one) and copies it
into the parameters (bound: the parameters are the new buffer, zeros until then). After a level-2
sleep the parameters hold garbage until that copy. Bound, the buffer may get another device address
at each wb_wake and bind() re-points the parameters (without CUDA graphs, nothing captured them).

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


def captures_cuda_graphs(worker):
    """Whether vLLM runs `worker`'s model through CUDA graphs captured over the parameters'
    addresses: not with model_config.enforce_eager, nor with compilation_config.cudagraph_mode
    NONE. What cannot be read counts as captured (the safe side: copies in place)."""
    cfg = getattr(worker, "vllm_config", None)
    mc = getattr(worker, "model_config", None) or getattr(cfg, "model_config", None)
    if getattr(mc, "enforce_eager", False) is True:
        return False
    mode = getattr(getattr(cfg, "compilation_config", None), "cudagraph_mode", None)
    return mode is None or getattr(mode, "name", str(mode)) != "NONE"


def register_rank(socket_path, model_cfg, parallel_config, rank, device, named_parameters, graphs, replica=0,
                  memory="host", expert_placement="", quantization="", moe_a2a_backend=None, bind=None):
    """Registers one vLLM rank with its node daemon as WeightBridgeWorkerExtension.wb_init does
    (shared with the weight-transfer backend, vllm_transfer). `parallel_config`: vLLM's
    (tensor / data parallel sizes, data_parallel_rank, enable_expert_parallel, all2all_backend);
    `rank`: the worker's rank (its tp rank is rank % tp); `device`: the rank's torch.device
    (its index is the GPU for memory "cuda" / "engine"); `named_parameters`: the model's
    named_parameters() (LoRA's "base_layer" segment dropped; two collapsing to one name refused
    before anything is registered), or None where they cannot be had yet (then memory="engine"
    and bind=True are refused); `graphs`: what captures_cuda_graphs reads (the worker, or an
    object with vllm_config / model_config) to decide bind=None. Returns (VllmRollout, params)."""
    pc = parallel_config
    if moe_a2a_backend is None:  # vLLM's own setting: --all2all-backend, or the older environment variable
        moe_a2a_backend = getattr(pc, "all2all_backend", None) or os.environ.get("VLLM_ALL2ALL_BACKEND", "")
    tp, dp = pc.tensor_parallel_size, getattr(pc, "data_parallel_size", 1)
    tp_rank = rank % tp
    dp_rank = getattr(pc, "data_parallel_rank", 0)
    model = model_cfg if isinstance(model_cfg, ModelConfig) else ModelConfig(**model_cfg)
    params = engine_params(named_parameters) if named_parameters is not None else None
    bind = bind if bind is not None else not captures_cuda_graphs(graphs)
    if params is None and (memory == "engine" or (memory == "cuda" and bind)):
        raise ValueError("memory=%r%s needs the engine's parameters at registration, and none were given"
                         % (memory, ", bound" if memory == "cuda" else ""))
    on_gpu = memory in ("cuda", "engine")
    rollout = VllmRollout(socket_path, model, tp=tp, tp_rank=tp_rank, dp=dp, dp_rank=dp_rank, replica=replica,
                          expert_parallel=getattr(pc, "enable_expert_parallel", False), expert_placement=expert_placement,
                          moe_a2a_backend=moe_a2a_backend, quantization=quantization, memory=memory,
                          gpu=device.index if on_gpu else -1, params=params if memory == "engine" else None)
    if memory == "cuda" and bind:
        rollout.bind(params)
    return rollout, params


class WeightBridgeWorkerExtension:
    """Mixed into vLLM's GPU worker: `self` has model_runner, device, parallel_config (vLLM >= 0.8)."""

    def wb_init(self, socket_path, model_cfg, replica=0, memory="host", expert_placement="", quantization="",
                moe_a2a_backend=None, bind=None):
        self.wb, self.wb_params = register_rank(
            socket_path, model_cfg, self.parallel_config, getattr(self, "rank", 0), self.device,
            self.model_runner.model.named_parameters(), self, replica=replica, memory=memory,
            expert_placement=expert_placement, quantization=quantization, moe_a2a_backend=moe_a2a_backend, bind=bind)
        # memory="engine": the parameters' own bytes are registered; nothing to size (0).
        return 0 if memory == "engine" else self.wb.layout.buffer_bytes(0)

    def wb_update(self, version, timeout=300.0):
        return self.wb.update(version, self.wb_params, timeout)

    def wb_apply(self, version=0, timeout=300.0):
        return self.wb.apply(version, self.wb_params, timeout)

    def wb_sleep(self, timeout=300.0):
        """After llm.sleep(): leaves the daemon and frees this rank's buffer (RolloutHook.release;
        memory="engine": frees nothing, the daemon lets go of vLLM's memory)."""
        self.wb.release(timeout)

    def wb_wake(self):
        """After llm.wake_up(tags=["weights"]): registers again with a new buffer and, when bound,
        re-binds the parameters into it without copying (RolloutHook.reacquire; memory="engine":
        registers the parameters' memory again, at the same addresses, and returns 0). Returns the
        buffer's size. The weights are written by the next wb_update / wb_apply."""
        self.wb.reacquire(self.wb_params)
        return 0 if self.wb.memory == "engine" else self.wb.layout.buffer_bytes(0)
