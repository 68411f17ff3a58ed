"""SGLang rollout: the same for an SGLang TP worker (ModelRunner).

    rollout = SglangRollout(socket, model, tp=tp_size, tp_rank=tp_rank)   # in the TP worker process
    params = dict(model_runner.model.named_parameters())
    rollout.update(version, params)        # sync, generation paused
    rollout.apply(0, params)               # one-step-off / async, between batches

Preset "sglang" (docs/presets.md): vLLM's layout with SGLang's names where they differ
(fused_qkv_a_proj_with_mqa for MLA); shared-expert fusion off (--disable-shared-experts-fusion),
dp = 1 (SGLang DP attention is refused by the preset). memory="cuda" with bind(params) as for vLLM.
"""

from weightbridge.integrations._rollout import RolloutHook


class SglangRollout(RolloutHook):
    def __init__(self, socket_path, model, **kw):
        super().__init__("sglang", socket_path, model, **kw)
