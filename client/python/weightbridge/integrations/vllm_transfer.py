"""WeightBridge as a backend of vLLM's weight-transfer API (`vllm.distributed.weight_transfer`):
backend name "weightbridge", for `vllm serve` (HTTP) users and frameworks that drive vLLM's own
weight-sync calls, with no worker extension class.

    from weightbridge.integrations import vllm_transfer
    vllm_transfer.register()            # in EVERY vLLM process (a vllm.general_plugins entry point)
    llm = LLM(model=..., tensor_parallel_size=2, weight_transfer_config=WeightTransferConfig(backend="weightbridge"))
    llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=vllm_transfer.init_info(socket, model)))
    llm.start_weight_update()           # vLLM >= 0.25; no-op here (in-place engine)
    llm.update_weights(WeightTransferUpdateRequest(update_info={"version": v}))
    llm.finish_weight_update()          # no-op here

init_info: `socket_path` (the node daemon's worker socket), `model` (ModelConfig or the dict
ModelConfig(**...) takes), and as WeightBridgeWorkerExtension.wb_init: replica, memory ("host",
"cuda", "engine"), expert_placement, quantization, moe_a2a_backend, bind; `timeout` bounds
shutdown's release. init_transfer_engine registers the rank exactly as wb_init does (the shared
vllm.register_rank): tp / dp sizes, expert parallelism and all2all backend from vLLM's
parallel_config, the tp rank from parallel_config.rank, the GPU from the engine's device.
update_info: `version` (0 = the newest committed, one-step-off / async only), `timeout`,
`method` ("auto": the model's mode decides - sync: RolloutHook.update, which waits for `version`
(published by the trainers meanwhile); one_step_off / async: RolloutHook.apply; or "update" /
"apply" explicitly), `is_checkpoint_format` (must be False: the version is written into the
engine's parameters in place, in vLLM's own layout, never through the model's load_weights).
shutdown leaves the daemon and frees the rank's buffer (RolloutHook.release; memory="engine":
nothing is freed, the memory is vLLM's); a later init_transfer_engine registers again.

vLLM generations (read from vLLM's sources and docs, never run against a real vLLM):
  A (the v0.16 and v0.22.1 docs; v0.23 unverified): WeightTransferEngine(config, parallel_config); receive_weights(update_info,
    load_weights); the worker parses update_info and, with is_checkpoint_format False, hands a
    `load_weights_direct` closure over the model (param.copy_ by name). The engine gets no model:
    it is taken from that closure (its free variable holding the model) at every update, and the
    version is copied in place (memory "host", or "cuda" not bound). memory="engine" and bind=True
    need the parameters at init: refused, naming vLLM 0.25. A loader that gives no model, or the
    model's own load_weights (the update was started in checkpoint format: layerwise reload), is
    refused before anything is landed. A vLLM whose WeightTransferConfig.backend is a Literal of
    the built-in names (one docs snapshot; 0.22.1 and 0.23 take any str) refuses "weightbridge".
  B (v0.25 ..): WeightTransferEngine(config, vllm_config, device, model); start_weight_update /
    finish_weight_update (no-ops here: in-place engine); receive_weights(update_info) into the
    model; update_weights(dict) = parse + receive_weights + device synchronize (vLLM's own).
  C (v0.29 ..): B plus a trainer side (TrainerWeightTransferEngine, WeightTransferTrainerFactory,
    WeightSource, VLLMWeightSyncClient) and draft-model updates (set_weight_update_target):
    this backend registers no trainer engine (trainers publish through WeightBridge's hooks) and
    serves no draft model (supports_draft_weight_update = False).

The module imports without vLLM or torch (the engine then subclasses a stand-in base with the
generation-B signatures, for direct use and tests).
"""

import dataclasses
import sys
from typing import Any, Optional

from weightbridge.client import ModelConfig, WeightBridgeError
from weightbridge.integrations.vllm import register_rank

BACKEND = "weightbridge"
ENGINE_CLASS = "WeightBridgeWeightTransferEngine"
# The first vLLM release we read whose engines receive the model at construction (generation B).
MODEL_RELEASE = "vLLM 0.25"
MEMORIES = ("host", "cuda", "engine")
METHODS = ("auto", "update", "apply")

TRAINER_HOOKS = ("weightbridge trainers publish through WeightBridge's own trainer hooks, each rank its own shards "
                 "(weightbridge.integrations: megatron.MegatronTrainerHook, fsdp2.FSDP2TrainerHook, or a LayoutHook): "
                 "call hook.publish(version, model.named_parameters()) on every trainer rank, or "
                 "trainer_send_weights(model.named_parameters(), {'hook': hook, 'version': version}), which does that")

try:
    from vllm.distributed.weight_transfer import base as _vllm_base
except ImportError:
    _vllm_base = None

_KW_ONLY = {"kw_only": True} if sys.version_info >= (3, 10) else {}

if _vllm_base is not None:
    _InitBase = _vllm_base.WeightTransferInitInfo
    _UpdateBase = _vllm_base.WeightTransferUpdateInfo
    _EngineBase = _vllm_base.WeightTransferEngine
else:
    @dataclasses.dataclass
    class _InitBase:
        """Stands in for vLLM's WeightTransferInitInfo (vLLM not installed)."""

    @dataclasses.dataclass
    class _UpdateBase:
        """Stands in for vLLM's WeightTransferUpdateInfo (vLLM not installed)."""

    class _EngineBase:
        """Stands in for vLLM's WeightTransferEngine where vLLM is not installed: generation B's
        construction (config, vllm_config, device, model) - or A's (config, parallel_config) - and
        update_weights(dict) = parse_update_info + receive_weights."""

        def __init__(self, config, *args):
            self.config = config
            if len(args) == 1:
                self.parallel_config = args[0]
            else:
                vllm_config, self.device, self.model = args
                self.vllm_config = vllm_config
                self.parallel_config = vllm_config.parallel_config
                self.model_config = getattr(vllm_config, "model_config", None)

        def update_weights(self, update_info):
            self.receive_weights(self.parse_update_info(update_info))


def _parse(cls, given, what):
    """`cls` from the dict vLLM hands over (HTTP JSON or offline), unknown keys named."""
    if isinstance(given, cls):
        return given
    if not isinstance(given, dict):
        raise ValueError("weightbridge %s: a dict was expected, got %s" % (what, type(given).__name__))
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        raise ValueError("weightbridge %s: unknown key%s %s; the backend takes %s"
                         % (what, "s" if len(unknown) > 1 else "", ", ".join(repr(k) for k in unknown), ", ".join(known)))
    try:
        return cls(**given)
    except TypeError as e:
        raise ValueError("weightbridge %s: %s" % (what, e)) from e


@dataclasses.dataclass
class WeightBridgeInitInfo(_InitBase):
    """init_info of init_weight_transfer_engine. `model`: a ModelConfig or the dict ModelConfig(**)
    takes (model_id, hf_config_json or explicit_tensors, num_trainer_workers, num_rollout_workers,
    mode, ...); the other fields are WeightBridgeWorkerExtension.wb_init's."""
    socket_path: Optional[str] = None
    model: Any = None
    replica: int = 0
    memory: str = "host"
    expert_placement: str = ""
    quantization: str = ""
    moe_a2a_backend: Optional[str] = None
    bind: Optional[bool] = None
    timeout: float = 300.0

    def __post_init__(self):
        if not isinstance(self.socket_path, str) or not self.socket_path:
            raise ValueError("weightbridge init_info: 'socket_path' (the node daemon's worker socket, weightbridged "
                             "--worker_socket) is required, got %r" % (self.socket_path,))
        if isinstance(self.model, dict):
            try:
                self.model = ModelConfig(**self.model)
            except TypeError as e:
                raise ValueError("weightbridge init_info['model'] (ModelConfig's fields: %s): %s"
                                 % (", ".join(f.name for f in dataclasses.fields(ModelConfig)), e)) from e
        if not isinstance(self.model, ModelConfig):
            raise ValueError("weightbridge init_info: 'model' must be a ModelConfig or the dict ModelConfig(**...) takes, "
                             "got %r" % (self.model,))
        if self.model.lora is not None:
            raise ValueError("weightbridge init_info['model']: a model of LoRA adapters goes into vLLM's adapter slots "
                             "(vllm_lora.WeightBridgeLoraWorkerExtension), not through this backend")
        self.model.to_proto()  # ValueError naming a bad mode, strategy or a missing hf_config_json / explicit_tensors
        if self.memory not in MEMORIES:
            raise ValueError("weightbridge init_info: 'memory' must be one of %s, got %r" % (", ".join(MEMORIES), self.memory))
        if not isinstance(self.replica, int) or isinstance(self.replica, bool) or self.replica < 0:
            raise ValueError("weightbridge init_info: 'replica' must be an int >= 0, got %r" % (self.replica,))
        if self.bind not in (None, True, False):
            raise ValueError("weightbridge init_info: 'bind' must be true, false or null, got %r" % (self.bind,))


@dataclasses.dataclass
class WeightBridgeUpdateInfo(_UpdateBase):
    """update_info of update_weights: the version to land (0 = the newest committed: apply only),
    how long to wait for it, how ("auto": the model's mode; "update": sync, waits for `version`;
    "apply": one-step-off / async). is_checkpoint_format must be False (generation A's field:
    the parameters are written in place, never through load_weights)."""
    version: int = 0
    timeout: float = 300.0
    method: str = "auto"
    is_checkpoint_format: bool = dataclasses.field(default=False, **_KW_ONLY)

    def __post_init__(self):
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0:
            raise ValueError("weightbridge update_info: 'version' must be an int >= 0 (0 = the newest committed), got %r"
                             % (self.version,))
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or not self.timeout > 0:
            raise ValueError("weightbridge update_info: 'timeout' must be a number of seconds > 0, got %r" % (self.timeout,))
        if self.method not in METHODS:
            raise ValueError("weightbridge update_info: 'method' must be one of %s, got %r" % (", ".join(METHODS), self.method))
        if self.is_checkpoint_format is not False:
            raise ValueError("weightbridge update_info: 'is_checkpoint_format' must be false: the backend writes the "
                             "version into the engine's parameters in place, in vLLM's own layout (no checkpoint-format "
                             "load_weights, no layerwise reload)")


def init_info(socket_path, model, **kw):
    """The init_info dict for `model` (ModelConfig), JSON-serialisable for vLLM's HTTP route
    /init_weight_transfer_engine; `kw`: WeightBridgeInitInfo's other fields. Checked here."""
    d = dict(socket_path=socket_path, model=dataclasses.asdict(model) if isinstance(model, ModelConfig) else model, **kw)
    _parse(WeightBridgeInitInfo, dict(d), "init_info")
    return d


def _model_of_loader(load_weights):
    """Generation A: the model behind the `load_weights` vLLM's worker hands receive_weights.
    Returns (model or None, True when it is the model's own checkpoint loader)."""
    owner = getattr(load_weights, "__self__", None)
    if owner is not None and hasattr(owner, "named_parameters"):
        return owner, True
    code, cells = getattr(load_weights, "__code__", None), getattr(load_weights, "__closure__", None) or ()
    found = []
    for name, cell in zip(getattr(code, "co_freevars", ()), cells):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(v, "named_parameters") and all(v is not f for f in found):
            found.append(v)
    return (found[0] if len(found) == 1 else None), False


class WeightBridgeWeightTransferEngine(_EngineBase):
    """One vLLM worker's weight-transfer engine: a WeightBridge rollout rank (VllmRollout)."""

    init_info_cls = WeightBridgeInitInfo
    update_info_cls = WeightBridgeUpdateInfo
    supports_draft_weight_update = False  # generation C: the rank's layout is the main model's

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.rollout = None  # the VllmRollout once init_transfer_engine registered the rank
        self.params = None  # generation B/C: the model's parameters by (normalised) name
        self.init_info = None
        self.version = 0  # the version the last update landed
        self._target = None

    @property
    def generation(self):
        """"A" when vLLM gave this engine no model (config, parallel_config), else "B" (B or C)."""
        return "A" if getattr(self, "model", None) is None else "B"

    def parse_init_info(self, init_dict):
        return _parse(WeightBridgeInitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict):
        return _parse(WeightBridgeUpdateInfo, update_dict, "update_info")

    def _initialized(self, what):
        if self.rollout is None:
            raise RuntimeError("weightbridge backend: %s before init_weight_transfer_engine (the rank is not registered "
                               "with a node daemon%s)" % (what, "; it was shut down" if self.init_info is not None else ""))

    def init_transfer_engine(self, init_info):
        """Registers this rank with its node daemon as WeightBridgeWorkerExtension.wb_init does."""
        info = self.parse_init_info(init_info)
        if self.rollout is not None:
            raise RuntimeError("weightbridge backend: init_weight_transfer_engine again while worker %s of model %s is "
                               "registered (shutdown first)" % (self.rollout.worker_id, self.rollout.model.model_id))
        pc = self.parallel_config
        device = getattr(self, "device", None)
        if self.generation == "A":
            if info.memory == "engine" or info.bind:
                raise ValueError("weightbridge backend: memory=%r%s registers the engine's parameters at init, and this "
                                 "vLLM hands its weight-transfer engines no model (generation A: __init__(config, "
                                 "parallel_config)); use %s or later, or memory 'host' / 'cuda' (copied in place)"
                                 % (info.memory, " with bind" if info.memory == "cuda" else "", MODEL_RELEASE))
            named = None
            if info.memory != "host":
                import torch  # the GPU vLLM set for this worker
                device = torch.device("cuda", torch.cuda.current_device())
        else:
            named = self.model.named_parameters()
            self._target = self.model
        self.rollout, self.params = register_rank(
            info.socket_path, info.model, pc, getattr(pc, "rank", 0), device, named, self, replica=info.replica,
            memory=info.memory, expert_placement=info.expert_placement, quantization=info.quantization,
            moe_a2a_backend=info.moe_a2a_backend, bind=info.bind)
        self.init_info = info
        self.version = 0

    def start_weight_update(self):
        """An in-place engine: nothing to prepare (vLLM >= 0.25 calls it per update session)."""
        self._initialized("start_weight_update")

    def finish_weight_update(self):
        """An in-place engine: nothing to finalise; the version landed in update_weights."""
        self._initialized("finish_weight_update")

    def receive_weights(self, update_info, load_weights=None):
        """Lands update_info.version in the engine's parameters (RolloutHook.update in sync mode,
        apply otherwise; "method" overrides). Generation A passes `load_weights`: the model is
        taken from it. Returns the version landed (0: apply found nothing committed yet)."""
        self._initialized("update_weights")
        info = self.parse_update_info(update_info)
        if self.generation == "A":
            params = self._params_of_loader(load_weights)
        else:
            if self.model is not self._target:
                raise RuntimeError("weightbridge backend: the update targets another model than the one registered at "
                                   "init (a draft model?); this backend serves the main model only")
            params = self.params
        rollout = self.rollout
        mode = rollout.model.mode
        method = info.method if info.method != "auto" else ("update" if mode == "sync" else "apply")
        if method == "update" and info.version <= 0:
            raise ValueError("weightbridge update_info: model %s (mode %s) updates by waiting for a version: give "
                             "'version' > 0 (0 = the newest committed is for apply: one_step_off / async)"
                             % (rollout.model.model_id, mode))
        try:
            if method == "update":
                got = rollout.update(info.version, params, info.timeout)
            else:
                got = rollout.apply(info.version, params, info.timeout)
        except WeightBridgeError as e:
            raise RuntimeError("weightbridge backend: %s of version %d for worker %s of model %s (mode %s) failed: %s"
                               % (method, info.version, rollout.worker_id, rollout.model.model_id, mode, e)) from e
        self.version = got
        return got

    def _params_of_loader(self, load_weights):
        model, checkpoint = _model_of_loader(load_weights)
        if checkpoint:
            raise RuntimeError("weightbridge backend: vLLM handed the model's own checkpoint loader (load_weights): this "
                               "update session runs in checkpoint format (layerwise reload), which the backend never "
                               "uses - start the update with is_checkpoint_format=False")
        if model is None:
            raise RuntimeError("weightbridge backend: this vLLM hands its weight-transfer engines no model (generation A: "
                               "__init__(config, parallel_config), receive_weights(update_info, load_weights)) and the "
                               "load_weights it passed (%r) leads to none; the backend writes the parameters in place: "
                               "use %s or later, or the worker extension (WeightBridgeWorkerExtension, "
                               "collective_rpc('wb_update' / 'wb_apply'))" % (load_weights, MODEL_RELEASE))
        return model.named_parameters()

    def shutdown(self):
        """Leaves the daemon and frees the rank's buffer (RolloutHook.release, then the client is
        closed). Nothing to do when never initialised (vLLM calls it at worker shutdown)."""
        if self.rollout is None:
            return
        self.rollout.release(self.init_info.timeout)
        rollout, self.rollout, self.params, self._target = self.rollout, None, None, None
        rollout.close()

    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        """vLLM's trainer-side call, mapped onto a WeightBridge trainer hook: `trainer_args` =
        {"hook": the rank's MegatronTrainerHook / FSDP2TrainerHook (anything with publish),
        "version": v > 0, optionally "timeout", "named_buffers" (Megatron, FSDP2)}; the iterator is the
        rank's named_parameters(). Called on every trainer rank. Returns the hook's publish result."""
        args = dict(trainer_args) if isinstance(trainer_args, dict) else (
            dataclasses.asdict(trainer_args) if dataclasses.is_dataclass(trainer_args) else None)
        if args is None:
            raise TypeError("weightbridge trainer_send_weights: trainer_args must be a dict, got %s. %s"
                            % (type(trainer_args).__name__, TRAINER_HOOKS))
        unknown = sorted(set(args) - {"hook", "version", "timeout", "named_buffers"})
        if unknown:
            raise ValueError("weightbridge trainer_send_weights: unknown key(s) %s. %s" % (", ".join(unknown), TRAINER_HOOKS))
        hook, version = args.get("hook"), args.get("version")
        if not callable(getattr(hook, "publish", None)):
            raise ValueError("weightbridge trainer_send_weights: trainer_args['hook'] is %r, not a trainer hook. %s"
                             % (hook, TRAINER_HOOKS))
        if not isinstance(version, int) or isinstance(version, bool) or version <= 0:
            raise ValueError("weightbridge trainer_send_weights: trainer_args['version'] must be the version to publish "
                             "(an int > 0), got %r. %s" % (version, TRAINER_HOOKS))
        kw = {"timeout": args.get("timeout", 300.0)}
        if args.get("named_buffers") is not None:
            kw["named_buffers"] = args["named_buffers"]
        return hook.publish(version, iterator, **kw)


def register(factory=None):
    """Registers the backend "weightbridge" with vLLM's WeightTransferEngineFactory (lazily: this
    module's path and the class name; `factory` for tests). Idempotent: returns False when the
    name is registered already. Every vLLM process that creates engines needs it: make it a vLLM
    general plugin (entry point group "vllm.general_plugins",
    "weightbridge = weightbridge.integrations.vllm_transfer:register"), which vLLM loads in each."""
    if factory is None:
        try:
            from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as factory
        except ImportError as e:
            raise ImportError("weightbridge vllm_transfer.register(): needs vLLM with vllm.distributed.weight_transfer "
                              "(vLLM 0.16 or later): %s" % e) from e
    registry = getattr(factory, "_registry", None)
    if isinstance(registry, dict) and BACKEND in registry:
        return False
    try:
        factory.register_engine(BACKEND, __name__, ENGINE_CLASS)
    except ValueError as e:
        if "already registered" in str(e):
            return False
        raise
    return True
