"""SGLang rollout: the same for an SGLang TP worker (ModelRunner).

    rollout = SglangRollout(socket, model, tp=tp_size, tp_rank=tp_rank,   # in the TP worker process
                            engine_model=model_runner.model)
    params = dict(model_runner.model.named_parameters())
    rollout.update(version, params)        # sync, generation paused
    rollout.apply(0, params)               # one-step-off / async, between batches

Preset "sglang" (docs/presets.md): vLLM's layout with SGLang's names where they differ
(fused_qkv_a_proj_with_mqa for MLA); shared-expert fusion off (--disable-shared-experts-fusion),
memory="cuda" as for vLLM: each version copied into the parameters in place (SGLang captures CUDA
graphs over them by default); bind(params) only with --disable-cuda-graph. memory="engine"
(SglangRollout(..., memory="engine", params=dict(model_runner.model.named_parameters()))): zero
copy - SGLang's own parameter memory is registered and versions land in the parameters, at
addresses CUDA graphs keep (RolloutHook; the parameters must match the preset's local tensors byte
for byte, else refused naming the tensor). Emulated GPUs only so far; refresh_derived still runs
after each version. DP attention (--enable-dp-attention, DeepSeek-V2/V3
and Kimi-K2 only, docs/presets.md): pass SGLang's own numbers and say so -
SglangRollout(..., tp=tp_size, tp_rank=tp_rank, dp=dp_size, enable_dp_attention=True) - and the
hook describes the engine as the preset does (tp = tp_size / dp_size, the attention-TP group;
dp = dp_size; rank = SGLang's tp_rank). Plan specs and wbctl take the preset's numbers directly.
Two server options change that layout and must be passed as the engine runs with them:
`enable_dp_lm_head=server_args.enable_dp_lm_head` (--enable-dp-lm-head: lm_head over the
attention-TP group instead of all tp_size ranks; DP attention only) and
`moe_dense_tp_size=server_args.moe_dense_tp_size` (--moe-dense-tp-size; None = not set, 1: the
dense MLPs whole on every rank) - docs/presets.md. A mismatch gives the engine's parameters other
shapes than the layout's, which read_into / bind refuse.
Memory release (colocated RL: `release_memory_occupation` / `resume_memory_occupation`): with
memory="cuda" versions land in our buffer, which SGLang's release does not free (bound: the
weights themselves live there). After the release call `rollout.release()` (leaves the daemon,
frees the buffer; bound, the engine must not run until reacquire); after resuming (its weights)
`rollout.reacquire(params)` (registered again with a new empty buffer; bound parameters re-bound
into it without a copy), then the trainers publish and
`update` / `apply` lands the version before the engine generates (RolloutHook; docs/integration.md
"Engines that sleep").
With --enable-lora SGLang wraps linear layers keeping the original as `base_layer`
(BaseLayerWithLoRA): read_into / bind drop that segment from the names, as for vLLM
(_common.engine_params).

WeightBridge writes the parameters in place, never through SGLang's load_weights, so what SGLang
derives from them at load time would keep the old version: DeepSeek's MLA `w_kc` / `w_vc` (split
from `kv_b_proj` by post_load_weights, which only load_weights calls) and GLM-4.5's
Glm4MoeGate `_weight_fp32` (a float32 copy of the gate weight cached on the first forward). Give
`engine_model` (model_runner.model) and every update / apply refreshes them once the parameters
hold the version (refresh_derived below); without it, call sglang.refresh_derived(model) yourself.
"""

import inspect
import sys

import numpy as np

from weightbridge.integrations._common import _is_torch
from weightbridge.integrations._rollout import RolloutHook


class SglangRollout(RolloutHook):
    def __init__(self, socket_path, model, engine_model=None, enable_dp_attention=False, enable_dp_lm_head=False,
                 moe_dense_tp_size=None, **kw):
        """`model`: the WeightBridge ModelConfig; `engine_model`: SGLang's model object
        (model_runner.model), whose derived copies are refreshed after each version.
        `enable_dp_attention`: SGLang's flag; `tp`, `tp_rank` and `dp` are then SGLang's
        --tp-size, the worker's tp_rank and --dp-size (dp_rank is derived, not given).
        `enable_dp_lm_head`, `moe_dense_tp_size`: SGLang's --enable-dp-lm-head and
        --moe-dense-tp-size as the server runs with them (server_args; None = not set)."""
        if enable_dp_attention:
            kw = dp_attention_ranks(**kw)
        if moe_dense_tp_size is not None and (isinstance(moe_dense_tp_size, bool) or not isinstance(moe_dense_tp_size, int)
                                              or moe_dense_tp_size < 1):
            raise ValueError("moe_dense_tp_size: SGLang's --moe-dense-tp-size is None or a positive size, got %r" % (moe_dense_tp_size,))
        super().__init__("sglang", socket_path, model, enable_dp_lm_head=bool(enable_dp_lm_head),
                         moe_dense_tp_size=moe_dense_tp_size or 0, **kw)
        self.engine_model = engine_model

    def refresh_derived(self):
        if self.engine_model is not None:
            refresh_derived(self.engine_model)


def dp_attention_ranks(tp=1, tp_rank=0, dp=1, dp_rank=None, **kw):
    """SGLang's DP attention numbers (--tp-size T, tp_rank, --dp-size D) as the preset's: the
    attention-TP group tp = T / D, dp = D, and tp_rank % (T / D), tp_rank // (T / D) within them
    (SGLang's compute_dp_attention_world_info), so the preset's rank is SGLang's tp_rank."""
    if dp_rank is not None:
        raise ValueError("enable_dp_attention: give SGLang's tp_rank, not dp_rank (it is tp_rank // (tp / dp))")
    if dp < 1 or tp < 1 or tp % dp != 0:
        raise ValueError("enable_dp_attention: --dp-size %d must divide --tp-size %d" % (dp, tp))
    if not 0 <= tp_rank < tp:
        raise ValueError("enable_dp_attention: tp_rank %d is outside --tp-size %d" % (tp_rank, tp))
    attn_tp = tp // dp
    return dict(kw, tp=attn_tp, tp_rank=tp_rank % attn_tp, dp=dp, dp_rank=tp_rank // attn_tp)


def refresh_derived(engine_model):
    """Recomputes what SGLang derived from the weights at load time, after they were written in
    place: calls engine_model.post_load_weights() (DeepSeek V2/V3, Kimi-K2: w_kc / w_vc from
    kv_b_proj; it copies into the existing tensors, so captured CUDA graphs see the new values;
    older signatures without defaults get is_nextn=False), and refreshes every module's cached
    `_weight_fp32` (GLM-4.5's router gate). Returns the number of `_weight_fp32` caches refreshed."""
    post = getattr(engine_model, "post_load_weights", None)
    if callable(post):
        try:
            inspect.signature(post).bind()
            no_args = True
        except TypeError:  # a required argument (is_nextn)
            no_args = False
        except ValueError:  # no signature to inspect: try it bare
            no_args = True
        if no_args:
            post()
        else:
            post(is_nextn=False)
    modules = engine_model.modules() if callable(getattr(engine_model, "modules", None)) else [engine_model]
    refreshed = 0
    for m in modules:
        if hasattr(m, "_weight_fp32"):
            refreshed += _refresh_weight_fp32(m)
    # post_load_weights' copies (bind_or_assign: target.copy_(source)) and the _weight_fp32 refreshes
    # read the parameters on the current stream and are only queued (torch's device-to-device
    # copy_); with memory="engine" or a bound buffer the parameters are the registered memory, which
    # the daemon writes with the next version from its own process: finish them first.
    torch = sys.modules.get("torch")  # never imported here: only an engine that has torch
    if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return refreshed


def _refresh_weight_fp32(m):
    """A cached float32 copy of m.weight. None stays None (the next forward computes it from the new
    weight). A tensor is overwritten in place rather than dropped: a CUDA graph captured after the
    first forward reads that tensor's memory, and a replacement made on the next eager forward would
    never reach the graph. Anything else (no weight, another shape) is dropped to None."""
    cached, w = m._weight_fp32, getattr(m, "weight", None)
    if cached is None:
        return 0
    if w is not None and tuple(cached.shape) == tuple(w.shape):
        if _is_torch(cached):
            cached.copy_(w.detach() if hasattr(w, "detach") else w)  # copy_ converts bfloat16 -> float32
        else:
            a = np.asarray(w)
            if a.dtype == np.uint16:  # numpy stand-in for bfloat16: its bits
                a = (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
            cached[...] = a
        return 1
    m._weight_fp32 = None
    return 1
