"""weightbridge.integrations.vllm_transfer (the vLLM weight-transfer backend "weightbridge") against a
real standalone weightbridged, driven through stand-ins of vLLM's weight-transfer modules.

vLLM is not installed here. The stand-ins below (vllm.distributed.weight_transfer.base / factory and a
GPU worker's weight-transfer calls) are written for this test from vLLM's signatures as read in its
sources and docs - generation A (v0.16 .. 0.23: engine(config, parallel_config), receive_weights(
update_info, load_weights), the worker handing a load_weights_direct closure over the model when
is_checkpoint_format is False), generation B (v0.25: engine(config, vllm_config, device, model),
start / finish_weight_update, update_weights(dict) = parse + receive_weights) and C (B plus draft-model
targets) - and are put into sys.modules only inside each test (the backend module is imported afresh
for each generation). Trainers publish with WeightBridge's hooks; every engine parameter is compared,
byte for byte, with vLLM's sharding of the tiny Qwen2 built independently (integrations_test.vllm_tp).
Run by //client/python:vllm_transfer_test.
"""

import abc
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import time
import types
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_test import Daemon, DaemonTestCase, TIMEOUT, TINY_CONFIG  # noqa: E402
from integrations_test import FakeEngineModel, canonical, fsdp2_shard, megatron_tp2, run_all, vllm_tp  # noqa: E402

import weightbridge as wb  # noqa: E402
from weightbridge.integrations import fsdp2, megatron  # noqa: E402

MODULE = "weightbridge.integrations.vllm_transfer"
VLLM_MODULES = ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer", "vllm.distributed.weight_transfer.base",
                "vllm.distributed.weight_transfer.factory")
ns = types.SimpleNamespace


# ---- stand-ins of vLLM's weight-transfer modules, one set per generation ---------------------------

def _base_module(gen):
    """vllm.distributed.weight_transfer.base of generation `gen` ("A", "B" or "C")."""
    m = types.ModuleType("vllm.distributed.weight_transfer.base")

    @dataclasses.dataclass
    class WeightTransferInitInfo(abc.ABC):  # noqa: B024
        pass

    if gen == "A":
        @dataclasses.dataclass
        class WeightTransferUpdateInfo(abc.ABC):  # noqa: B024
            _: dataclasses.KW_ONLY
            is_checkpoint_format: bool = True
    else:
        @dataclasses.dataclass
        class WeightTransferUpdateInfo(abc.ABC):  # noqa: B024
            pass

    class WeightTransferEngine(abc.ABC):
        init_info_cls = None
        update_info_cls = None

        if gen == "A":
            def __init__(self, config, parallel_config):
                self.config, self.parallel_config = config, parallel_config
        else:
            def __init__(self, config, vllm_config, device, model):
                self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
                self.parallel_config = vllm_config.parallel_config
                self.model_config = vllm_config.model_config
                self._default_model = model
                self.synchronized = 0

            @abc.abstractmethod
            def start_weight_update(self):
                raise NotImplementedError

            @abc.abstractmethod
            def finish_weight_update(self):
                raise NotImplementedError

            def update_weights(self, update_info):
                self.receive_weights(self.parse_update_info(update_info))
                self.synchronized += 1  # vLLM: torch.accelerator.synchronize()

        if gen == "C":
            supports_draft_weight_update = True

            def set_weight_update_target(self, model, model_config):
                self.model, self.model_config = model, model_config

            def reset_weight_update_target(self):
                self.model = self._default_model

        def parse_init_info(self, init_dict):
            try:
                return self.init_info_cls(**init_dict)
            except TypeError as e:
                raise ValueError("Invalid init_info for %s: %s" % (type(self).__name__, e)) from e

        def parse_update_info(self, update_dict):
            try:
                return self.update_info_cls(**update_dict)
            except TypeError as e:
                raise ValueError("Invalid update_info for %s: %s" % (type(self).__name__, e)) from e

        @abc.abstractmethod
        def init_transfer_engine(self, init_info):
            raise NotImplementedError

        @abc.abstractmethod
        def receive_weights(self, *args):
            raise NotImplementedError

        @abc.abstractmethod
        def shutdown(self):
            raise NotImplementedError

        @staticmethod
        @abc.abstractmethod
        def trainer_send_weights(iterator, trainer_args):
            raise NotImplementedError

    m.WeightTransferInitInfo, m.WeightTransferUpdateInfo = WeightTransferInitInfo, WeightTransferUpdateInfo
    m.WeightTransferEngine = WeightTransferEngine
    return m


def _factory_module():
    m = types.ModuleType("vllm.distributed.weight_transfer.factory")

    class WeightTransferEngineFactory:
        _registry = {}

        @classmethod
        def register_engine(cls, name, module_path_or_cls, class_name=None):
            if name in cls._registry:
                raise ValueError("Weight transfer engine '%s' is already registered." % name)
            if isinstance(module_path_or_cls, str):
                if class_name is None:
                    raise ValueError("class_name is required when registering with module path")

                def loader():
                    return getattr(importlib.import_module(module_path_or_cls), class_name)
                loader.lazy = (module_path_or_cls, class_name)
            else:
                def loader():
                    return module_path_or_cls
            cls._registry[name] = loader

        @classmethod
        def create_engine(cls, config, *args):
            if config.backend not in cls._registry:
                raise ValueError("Invalid weight transfer backend: %s. Available engines: %s"
                                 % (config.backend, list(cls._registry)))
            return cls._registry[config.backend]()(config, *args)

    WeightTransferEngineFactory._registry = {}
    WeightTransferEngineFactory.register_engine("nccl", "vllm.distributed.weight_transfer.nccl_engine",
                                                "NCCLWeightTransferEngine")  # never loaded here
    m.WeightTransferEngineFactory = WeightTransferEngineFactory
    return m


@dataclasses.dataclass
class WeightTransferConfig:
    backend: str = "nccl"


@contextlib.contextmanager
def fake_vllm(gen):
    """The stand-ins of generation `gen` in sys.modules, the backend imported afresh against them."""
    pkgs = {name: types.ModuleType(name) for name in VLLM_MODULES[:3]}
    base, factory = _base_module(gen), _factory_module()
    mods = dict(pkgs, **{"vllm.distributed.weight_transfer.base": base, "vllm.distributed.weight_transfer.factory": factory})
    pkgs["vllm"].distributed = pkgs["vllm.distributed"]
    pkgs["vllm.distributed"].weight_transfer = pkgs["vllm.distributed.weight_transfer"]
    pkgs["vllm.distributed.weight_transfer"].base, pkgs["vllm.distributed.weight_transfer"].factory = base, factory
    saved = {k: sys.modules.get(k) for k in list(mods) + [MODULE]}
    sys.modules.update(mods)
    sys.modules.pop(MODULE, None)
    try:
        yield ns(gen=gen, base=base, factory=factory.WeightTransferEngineFactory, vt=importlib.import_module(MODULE))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


class LoadableModel(FakeEngineModel):
    """The model as generation A's worker uses it: load_weights (checkpoint format) and get_parameter."""

    def get_parameter(self, name):
        return self.params[name]

    def load_weights(self, weights):
        raise AssertionError("the backend never loads through the model's checkpoint loader")


def vllm_config(tp=1, rank=0):
    return ns(parallel_config=ns(tensor_parallel_size=tp, data_parallel_size=1, data_parallel_rank=0,
                                 enable_expert_parallel=False, all2all_backend="", rank=rank),
              model_config=ns(enforce_eager=False), compilation_config=ns(cudagraph_mode=None),
              weight_transfer_config=WeightTransferConfig(backend="weightbridge"))


class WorkerA:
    """A GPU worker's weight-transfer calls in generation A: the engine gets config and parallel_config;
    update_weights parses update_info and hands receive_weights the model's load_weights (checkpoint
    format) or a load_weights_direct closure over the model. `loader` replaces that closure (a vLLM whose
    loader leads to no model), `checkpoint` forces the model's own loader (an update started in
    checkpoint format)."""

    def __init__(self, env, params, tp=1, rank=0, loader=None, checkpoint=False):
        cfg = vllm_config(tp, rank)
        self.model = LoadableModel(params)
        self.loader, self.checkpoint = loader, checkpoint
        self.engine = env.factory.create_engine(cfg.weight_transfer_config, cfg.parallel_config)

    def init_weight_transfer_engine(self, init_info):
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def update_weights(self, update_info):
        typed = self.engine.parse_update_info(update_info)
        model = self.model
        if typed.is_checkpoint_format or self.checkpoint:
            self.engine.receive_weights(typed, load_weights=model.load_weights)
            return

        def load_weights_direct(weights):
            for name, w in weights:
                model.get_parameter(name)[...] = w
        self.engine.receive_weights(typed, load_weights=self.loader or load_weights_direct)

    def shutdown(self):
        self.engine.shutdown()


class WorkerB:
    """A GPU worker's weight-transfer calls in generations B / C: the engine gets config, vllm_config,
    device and model; a session is start_weight_update, update_weights (engine.update_weights: parse +
    receive_weights), finish_weight_update."""

    def __init__(self, env, params, tp=1, rank=0):
        cfg = vllm_config(tp, rank)
        self.model = FakeEngineModel(params)
        self.engine = env.factory.create_engine(cfg.weight_transfer_config, cfg, ns(index=0), self.model)
        self.active = False

    def init_weight_transfer_engine(self, init_info):
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self):
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.engine.start_weight_update()
        self.active = True

    def update_weights(self, update_info):
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.engine.update_weights(update_info)
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self):
        self.engine.finish_weight_update()
        self.active = False

    def session(self, update_info):
        self.start_weight_update()
        self.update_weights(update_info)
        self.finish_weight_update()

    def shutdown(self):
        self.engine.shutdown()


def zeros(tp, r):
    return {n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), tp, r).items()}


class VllmTransferTest(DaemonTestCase):
    def model(self, model_id, mode, trainers, rollouts):
        return wb.ModelConfig(model_id=model_id, hf_config_json=self.config, num_trainer_workers=trainers,
                              num_rollout_workers=rollouts, mode=mode)

    def init_info(self, env, model, **kw):
        """What a trainer sends to /init_weight_transfer_engine: JSON, so it goes through json."""
        return json.loads(json.dumps(env.vt.init_info(self.daemon.socket, model, **kw)))

    def check(self, params, version, tp=1, r=0, what=""):
        for n, want in vllm_tp(canonical(version), tp, r).items():
            np.testing.assert_array_equal(params[n], want, err_msg="%s rank %d %s v%d" % (what, r, n, version))

    def workers(self, model_id):
        return [w.worker_id for w in self.daemon.client("st").status(model_id=model_id).workers]

    def close(self, hooks):
        for h in hooks:
            h.client.deregister()
            h.client.close()

    def test_factory_creates_the_engine_by_name(self):
        for gen in ("A", "B", "C"):
            with fake_vllm(gen) as env:
                self.assertTrue(env.vt.register())
                self.assertFalse(env.vt.register(), "registering twice is a no-op")
                self.assertEqual(env.factory._registry["weightbridge"].lazy, (MODULE, "WeightBridgeWeightTransferEngine"))
                worker = (WorkerA if gen == "A" else WorkerB)(env, zeros(1, 0))
                self.assertIsInstance(worker.engine, env.base.WeightTransferEngine)
                self.assertIs(type(worker.engine), env.vt.WeightBridgeWeightTransferEngine)
                self.assertEqual(worker.engine.generation, "A" if gen == "A" else "B")
                self.assertTrue(issubclass(env.vt.WeightBridgeUpdateInfo, env.base.WeightTransferUpdateInfo))
                if gen == "C":
                    self.assertFalse(worker.engine.supports_draft_weight_update)
                worker.shutdown()  # never initialised: nothing to do

        class Refusing:  # a factory that keeps its registry elsewhere: "already registered" is no error
            @staticmethod
            def register_engine(name, module_path, class_name):
                raise ValueError("Weight transfer engine '%s' is already registered." % name)
        with fake_vllm("B") as env:
            self.assertFalse(env.vt.register(Refusing))

    def test_generation_b_sync_tp2(self):
        """FSDP2 dp=2 trainers -> two vLLM tp=2 workers, sync: each session's update_weights waits for the
        version the trainers publish meanwhile; every byte of both ranks, three versions."""
        with fake_vllm("B") as env:
            env.vt.register()
            model = self.model("vt_b_sync", "sync", 2, 2)
            trainers = [fsdp2.FSDP2TrainerHook(None, model, rank=r, dp=2, client=self.daemon.client("tbs")) for r in (0, 1)]
            params = [zeros(2, r) for r in (0, 1)]
            workers = [WorkerB(env, params[r], tp=2, rank=r) for r in (0, 1)]
            for w in workers:
                w.init_weight_transfer_engine(self.init_info(env, model))
            self.assertEqual(sorted(self.workers(model.model_id)), ["rollout/0", "rollout/1", "trainer/0", "trainer/1"])
            for version in (1, 2, 3):
                c = canonical(version)
                errors = run_all([lambda w=w: w.session({"version": version, "timeout": TIMEOUT}) for w in workers] +
                                 [lambda t=t, r=r: t.publish(version, fsdp2_shard(c, 2, r).items(), timeout=TIMEOUT)
                                  for r, t in enumerate(trainers)])
                self.assertEqual(errors, [])
                for r, w in enumerate(workers):
                    self.check(params[r], version, 2, r, "B sync")
                    self.assertEqual(w.engine.version, version)
                    self.assertEqual(w.engine.synchronized, version)
            for w in workers:
                w.shutdown()
            self.close(trainers)

    def test_generation_c_one_step_off_and_trainer_send_weights(self):
        """Megatron tp=2 trainers -> a vLLM tp=1 worker, one-step-off: update_weights applies the version
        (explicitly, then 0 = the newest committed); version 2 goes out through trainer_send_weights."""
        with fake_vllm("C") as env:
            env.vt.register()
            model = self.model("vt_c_osf", "one_step_off", 2, 1)
            trainers = [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("tco")) for r in (0, 1)]
            params = zeros(1, 0)
            worker = WorkerB(env, params)
            worker.init_weight_transfer_engine(self.init_info(env, model))
            send = env.vt.WeightBridgeWeightTransferEngine.trainer_send_weights
            for version, update in ((1, {"version": 1}), (2, {"version": 2, "method": "apply"}), (3, {})):
                c = canonical(version)
                for r, t in enumerate(trainers):
                    named = (("module." + n, a) for n, a in megatron_tp2(c, r).items())
                    if version == 2:
                        send(named, {"hook": t, "version": version, "timeout": TIMEOUT})
                    else:
                        t.publish(version, named, timeout=TIMEOUT)
                if not update:  # 0 = the newest committed: wait (server side) until that is `version`
                    trainers[0].client.wait_version(version, timeout=TIMEOUT)
                worker.session(dict(update, timeout=TIMEOUT))
                self.check(params, version, what="C one_step_off")
                self.assertEqual(worker.engine.version, version)
            worker.shutdown()
            self.close(trainers)

    def test_generation_a_takes_the_model_from_its_loader(self):
        """Generation A: the engine gets no model; at each update it finds it behind the load_weights
        closure vLLM's worker passes and copies the version into its parameters (sync: FSDP2 dp=1 ->
        tp=1; one-step-off: Megatron tp=2 -> tp=1), two versions each, every byte."""
        with fake_vllm("A") as env:
            env.vt.register()
            for mode in ("sync", "one_step_off"):
                model = self.model("vt_a_" + mode, mode, 1 if mode == "sync" else 2, 1)
                if mode == "sync":
                    trainers = [fsdp2.FSDP2TrainerHook(None, model, rank=0, dp=1, client=self.daemon.client("tas"))]
                    shards = lambda c: [fsdp2_shard(c, 1, 0).items()]  # noqa: E731
                else:
                    trainers = [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("tao"))
                                for r in (0, 1)]
                    shards = lambda c: [megatron_tp2(c, r).items() for r in (0, 1)]  # noqa: E731
                params = zeros(1, 0)
                worker = WorkerA(env, params)
                worker.init_weight_transfer_engine(self.init_info(env, model))
                for version in (1, 2):
                    publish = [lambda t=t, s=s: t.publish(version, s, timeout=TIMEOUT)
                               for t, s in zip(trainers, shards(canonical(version)))]
                    land = lambda: worker.update_weights({"version": version, "timeout": TIMEOUT})  # noqa: E731
                    if mode == "sync":
                        self.assertEqual(run_all([land] + publish), [])
                    else:
                        self.assertEqual(run_all(publish), [])
                        land()
                    self.check(params, version, what="A " + mode)
                    self.assertEqual(worker.engine.version, version)
                worker.shutdown()
                self.close(trainers)

    def test_generation_a_without_a_reachable_model_is_refused(self):
        """Generation A whose load_weights leads to no model: refused, naming the vLLM release that hands
        engines the model, before anything is landed; likewise memory='engine' at init, and an update
        started in checkpoint format (the model's own load_weights)."""
        with fake_vllm("A") as env:
            env.vt.register()
            model = self.model("vt_a_nomodel", "one_step_off", 2, 1)
            trainers = [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("tan")) for r in (0, 1)]
            sink = []
            params = zeros(1, 0)
            worker = WorkerA(env, params, loader=lambda weights: sink.extend(weights))
            with self.assertRaises(ValueError) as cm:
                worker.init_weight_transfer_engine(self.init_info(env, model, memory="engine"))
            self.assertIn("vLLM 0.25", str(cm.exception))
            self.assertIn("memory='engine'", str(cm.exception))
            self.assertIsNone(worker.engine.rollout)
            self.assertNotIn("rollout/0", self.workers(model.model_id))

            worker.init_weight_transfer_engine(self.init_info(env, model))
            for r, t in enumerate(trainers):
                t.publish(1, megatron_tp2(canonical(1), r).items(), timeout=TIMEOUT)
            with self.assertRaises(RuntimeError) as cm:
                worker.update_weights({"version": 1, "timeout": TIMEOUT})
            self.assertIn("vLLM 0.25", str(cm.exception))
            self.assertIn("no model", str(cm.exception))
            self.assertEqual(worker.engine.version, 0)
            self.assertFalse(any(a.any() for a in params.values()), "nothing landed")

            worker.checkpoint = True
            with self.assertRaises(RuntimeError) as cm:
                worker.update_weights({"version": 1, "timeout": TIMEOUT})
            self.assertIn("is_checkpoint_format=False", str(cm.exception))
            self.assertFalse(any(a.any() for a in params.values()), "nothing landed")

            worker.checkpoint = False
            worker.loader = None  # vLLM's own closure: the same rank now lands version 1
            worker.update_weights({"version": 1, "timeout": TIMEOUT})
            self.check(params, 1, what="A after refusals")
            worker.shutdown()
            self.close(trainers)

    def test_wrong_keys_and_values_are_named(self):
        with fake_vllm("B") as env:
            env.vt.register()
            model = self.model("vt_keys", "one_step_off", 1, 1)
            worker = WorkerB(env, zeros(1, 0))
            good = self.init_info(env, model)
            bad = dict(good)
            bad["socket"] = bad.pop("socket_path")
            for init, names in ((bad, ["'socket'", "socket_path"]),
                                (dict(good, memmory="host"), ["'memmory'", "memory"]),
                                (dict(good, model=dict(good["model"], model_idd="x")), ["model_idd", "model_id"]),
                                (dict(good, memory="gpu"), ["'memory'", "'gpu'"]),
                                ({"model": good["model"]}, ["'socket_path'"]),
                                (dict(good, model=dict(good["model"], mode="sometimes")), ["sometimes"])):
                with self.assertRaises(ValueError) as cm:
                    worker.init_weight_transfer_engine(init)
                for n in names:
                    self.assertIn(n, str(cm.exception))
                self.assertIsNone(worker.engine.rollout)

            worker.init_weight_transfer_engine(good)
            worker.start_weight_update()
            for update, names in (({"versoin": 1}, ["'versoin'", "version"]),
                                  ({"version": -1}, ["'version'"]),
                                  ({"version": 1, "method": "pull"}, ["'method'", "'pull'"]),
                                  ({"version": 1, "timeout": 0}, ["'timeout'"]),
                                  ({"version": 1, "is_checkpoint_format": True}, ["is_checkpoint_format"])):
                with self.assertRaises(ValueError) as cm:
                    worker.engine.update_weights(dict(update, timeout=update.get("timeout", 1.0)))
                for n in names:
                    self.assertIn(n, str(cm.exception))
            with self.assertRaises(RuntimeError) as cm:
                worker.engine.init_transfer_engine(good)
            self.assertIn("shutdown first", str(cm.exception))
            worker.shutdown()

        with fake_vllm("A") as env:  # generation A's own is_checkpoint_format field: ours says False
            env.vt.register()
            info = env.vt.WeightBridgeUpdateInfo(version=3)
            self.assertFalse(info.is_checkpoint_format)
            with self.assertRaises(ValueError) as cm:
                WorkerA(env, zeros(1, 0)).update_weights({"version": 1, "is_checkpoint_format": True})
            self.assertIn("is_checkpoint_format", str(cm.exception))

    def test_update_before_init_is_refused(self):
        with fake_vllm("B") as env:
            env.vt.register()
            worker = WorkerB(env, zeros(1, 0))
            with self.assertRaises(RuntimeError) as cm:
                worker.start_weight_update()
            self.assertIn("start_weight_update before init_weight_transfer_engine", str(cm.exception))
            for call in (lambda: worker.engine.update_weights({"version": 1}), worker.engine.finish_weight_update):
                with self.assertRaises(RuntimeError) as cm:
                    call()
                self.assertIn("before init_weight_transfer_engine", str(cm.exception))
        with fake_vllm("A") as env:
            env.vt.register()
            with self.assertRaises(RuntimeError) as cm:
                WorkerA(env, zeros(1, 0)).update_weights({"version": 1})
            self.assertIn("update_weights before init_weight_transfer_engine", str(cm.exception))

    def test_shutdown_frees_and_init_registers_again(self):
        with fake_vllm("B") as env:
            env.vt.register()
            model = self.model("vt_shutdown", "one_step_off", 2, 1)
            trainers = [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("tsd")) for r in (0, 1)]
            params = zeros(1, 0)
            worker = WorkerB(env, params)
            info = self.init_info(env, model, timeout=TIMEOUT)
            for version in (1, 2):
                worker.init_weight_transfer_engine(info)
                segment = "/dev/shm" + worker.engine.rollout.buffer.name
                self.assertTrue(os.path.exists(segment))
                self.assertIn("rollout/0", self.workers(model.model_id))
                for r, t in enumerate(trainers):
                    t.publish(version, megatron_tp2(canonical(version), r).items(), timeout=TIMEOUT)
                worker.session({"version": version, "timeout": TIMEOUT})
                self.check(params, version, what="before shutdown")
                worker.shutdown()
                self.assertFalse(os.path.exists(segment), "the rank's buffer is freed")
                self.assertNotIn("rollout/0", self.workers(model.model_id))
                self.assertIsNone(worker.engine.rollout)
                with self.assertRaises(RuntimeError) as cm:
                    worker.engine.update_weights({"version": version})
                self.assertIn("shut down", str(cm.exception))
                worker.shutdown()  # again: nothing to do
            self.close(trainers)

    def test_a_version_the_daemon_refuses_is_named(self):
        with fake_vllm("B") as env:
            env.vt.register()
            model = self.model("vt_refused", "one_step_off", 1, 1)
            worker = WorkerB(env, zeros(1, 0))
            worker.init_weight_transfer_engine(self.init_info(env, model))
            worker.start_weight_update()
            t0 = time.monotonic()
            with self.assertRaises(RuntimeError) as cm:
                worker.update_weights({"version": 7, "timeout": 1.0})
            for n in ("apply of version 7", "vt_refused", "DEADLINE_EXCEEDED"):
                self.assertIn(n, str(cm.exception))
            self.assertIsInstance(cm.exception.__cause__, wb.WeightBridgeError)
            self.assertLess(time.monotonic() - t0, TIMEOUT)
            worker.shutdown()

            sync = self.model("vt_refused_sync", "sync", 1, 1)
            worker = WorkerB(env, zeros(1, 0))
            worker.init_weight_transfer_engine(self.init_info(env, sync))
            with self.assertRaises(ValueError) as cm:
                worker.engine.update_weights({"timeout": 2.0})
            self.assertIn("'version' > 0", str(cm.exception))
            worker.shutdown()

    def test_trainer_send_weights_without_a_hook_explains(self):
        with fake_vllm("B") as env:
            send = env.vt.WeightBridgeWeightTransferEngine.trainer_send_weights
            for args, error in (({}, ValueError), ({"hook": object(), "version": 1}, ValueError),
                                ({"group": None, "src": 0}, ValueError), (None, TypeError)):
                with self.assertRaises(error) as cm:
                    send(iter([]), args)
                self.assertIn("trainer hooks", str(cm.exception))

            class Hook:
                def publish(self, version, named, timeout):
                    return version, list(named), timeout
            with self.assertRaises(ValueError) as cm:
                send(iter([]), {"hook": Hook(), "version": 0})
            self.assertIn("'version'", str(cm.exception))
            self.assertEqual(send(iter([("w", 1)]), {"hook": Hook(), "version": 4}), (4, [("w", 1)], 300.0))

    def test_imports_without_vllm_or_torch(self):
        saved = sys.modules.pop(MODULE, None)
        try:
            vt = importlib.import_module(MODULE)
            self.assertNotIn("vllm", sys.modules)
            self.assertNotIn("torch", sys.modules)
            self.assertEqual(vt.WeightBridgeWeightTransferEngine.__mro__[1].__module__, MODULE)  # the stand-in base
            with self.assertRaises(ImportError) as cm:
                vt.register()
            self.assertIn("vLLM", str(cm.exception))
        finally:
            if saved is not None:
                sys.modules[MODULE] = saved


if __name__ == "__main__":
    unittest.main()
