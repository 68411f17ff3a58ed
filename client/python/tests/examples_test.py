"""client/python/examples against a real standalone weightbridged. Run by //client/python:examples_test.

- quickstart.py runs as a user runs it (a subprocess starting its own daemon) in every mode, with
  tensor-parallel rollouts, and with its default config; it must exit 0 and report every byte its
  rollouts receive as checked, the count equal to what the model's tensors hold (computed here from
  the HF config). With --flip_one_bit (one received bit damaged) it must exit 1 naming the element;
  stopped by SIGTERM mid-run it must leave no shared memory, temp dir or daemon behind.
- Every example imports without torch, vLLM or SGLang; every weightbridge name it (or a usage line
  of its docstrings) uses exists, and every call to one binds to its signature (a static check of
  the source; the checker is shown to catch a misspelt method and keyword).
- The framework examples run end to end with numpy stand-ins for the frameworks (the tensors built
  by integrations_test, independently of the daemon): FSDP2 trainers -> SGLang rollouts (sync, with
  release / resume), Megatron trainers -> vLLM worker extension (one-step-off, with sleep / wake),
  and trainers -> vLLM's weight-transfer API with the "weightbridge" backend (sync, through the
  offline calls, and one-step-off over HTTP routes), DeepSpeed ZeRO-3 trainers over 3 ranks (their
  partitions built as deepspeed.zero.Init builds them) -> vLLM worker extension tp=2 (sync); every
  engine parameter compared.
"""

import ast
import dataclasses
import http.server
import importlib.util
import inspect
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
sys.path.insert(0, HERE)
from client_test import TIMEOUT, TINY_CONFIG, Daemon, daemon_binary  # noqa: E402
from integrations_test import FakeEngineModel, canonical, fake_vllm_worker, fsdp2_shard, megatron_tp2, run_all, vllm_tp  # noqa: E402
from vllm_transfer_test import WorkerB, fake_vllm, zeros  # noqa: E402

import weightbridge as wb  # noqa: E402
from weightbridge.integrations.vllm import WeightBridgeWorkerExtension  # noqa: E402

QUICKSTART = os.path.join(EXAMPLES, "quickstart.py")
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
DEFAULT_CONFIG = os.path.join(REPO, "tests", "e2e", "testdata", "qwen2.5-0.5b-2layer.json")  # quickstart's default
EXAMPLE_FILES = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
RUN_TIMEOUT = 240  # seconds one quickstart run may take on a loaded 2-core machine
ns = types.SimpleNamespace


def load_example(name):
    """Imports client/python/examples/<name>.py as a module (the folder is no package)."""
    spec = importlib.util.spec_from_file_location("wb_example_" + name, os.path.join(EXAMPLES, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def qwen2_bf16_bytes(config_path):
    """Bytes of a Qwen2 model's HF tensors in bf16, from its config.json (tied embeddings, q/k/v
    biases): what a rollout holding the whole model receives per version."""
    with open(config_path) as f:
        c = json.load(f)
    h, i, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    layer = 2 * h * h + h + 2 * (kv * h + kv) + 3 * h * i + 2 * h  # q, o, q bias, k, v (+ biases), mlp, 2 norms
    params = v * h * (1 if c.get("tie_word_embeddings") else 2) + n * layer + h
    return 2 * params


# ---------------------------------------------------------------------------------------------------
# quickstart.py, as a user runs it
# ---------------------------------------------------------------------------------------------------
class QuickstartRun:
    """One `python3 quickstart.py ...` with its own daemon; output lines read as they come."""

    def __init__(self, *args, config=TINY_CONFIG):
        argv = [sys.executable, QUICKSTART, "--daemon_bin", daemon_binary(), "--timeout", str(TIMEOUT)]
        if config is not None:
            argv += ["--config", config]
        self.proc = subprocess.Popen(argv + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out = ""

    def read_until(self, pattern, timeout):
        """Reads stdout (waiting on the pipe, bounded by `timeout`) until a line matches `pattern`."""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise AssertionError("no line matching %r in %s s; output so far:\n%s" % (pattern, timeout, self.out))
                line = self.proc.stdout.readline()
                if not line:
                    raise AssertionError("quickstart ended before printing %r:\n%s" % (pattern, self.out))
                self.out += line
                if re.search(pattern, line):
                    return line
        finally:
            sel.close()

    def finish(self, timeout=RUN_TIMEOUT):
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError("quickstart did not finish in %d s:\n%s\n%s" % (timeout, self.out + out, err))
        self.out += out
        self.err = err
        return self.proc.returncode

    def daemon_line(self):
        m = re.search(r"^daemon: .*, pid (\d+), socket (\S+)/w\.sock,", self.out, re.M)
        assert m, "no daemon line in:\n" + self.out
        return int(m.group(1)), m.group(2)

    def leftovers(self):
        """Shared memory segments of the run still in /dev/shm, its temp dir if still there."""
        pid = self.proc.pid
        shm = [f for f in os.listdir("/dev/shm") if re.match(r"wb-qs[tr]-%d-" % pid, f)]
        _, workdir = self.daemon_line()
        return shm, os.path.exists(workdir)


class QuickstartTest(unittest.TestCase):
    def run_ok(self, *args, config=TINY_CONFIG, versions=2, rollouts=2, mode="sync"):
        run = QuickstartRun("--versions", str(versions), "--mode", mode, *args, config=config)
        rc = run.finish()
        self.assertEqual(rc, 0, "quickstart %s failed:\n%s\n%s" % (" ".join(args), run.out, run.err))
        m = re.search(r"^quickstart: OK - every byte verified: (\d+) versions x (\d+) rollouts, (\d+) of (\d+) bytes "
                      r"\(mode (\w+)\)$", run.out, re.M)
        self.assertIsNotNone(m, run.out)
        self.assertEqual((int(m.group(1)), int(m.group(2)), m.group(5)), (versions, rollouts, mode))
        checked, expected = int(m.group(3)), int(m.group(4))
        self.assertEqual(checked, expected)
        rows = re.findall(r"^\s*(\d+)\s+\S.*\s(ok|MISMATCH)$", run.out, re.M)
        self.assertEqual(rows, [(str(v), "ok") for v in range(1, versions + 1)], run.out)
        self.assertEqual(run.leftovers(), ([], False))
        return checked, run

    def test_every_mode_every_byte(self):
        whole = qwen2_bf16_bytes(TINY_CONFIG)  # each vLLM tp=1 replica holds the whole model
        for mode in ("sync", "one_step_off", "async"):
            with self.subTest(mode=mode):
                checked, _ = self.run_ok(mode=mode)
                self.assertEqual(checked, 2 * 2 * whole)  # 2 versions x 2 replicas

    def test_tensor_parallel_rollouts(self):
        checked, run = self.run_ok("--replicas", "1", "--rollout_tp", "2", mode="one_step_off")
        # Two tp ranks hold every tensor once between them, norms (1-D, replicated) twice.
        self.assertGreater(checked, 2 * qwen2_bf16_bytes(TINY_CONFIG))
        self.assertIn("model.layers.0.self_attn.qkv_proj.weight [256, 256] = 3 pieces", run.out)

    def test_default_config(self):
        self.assertTrue(os.path.isfile(DEFAULT_CONFIG), DEFAULT_CONFIG)
        checked, _ = self.run_ok(config=None, versions=1)
        self.assertEqual(checked, 2 * qwen2_bf16_bytes(DEFAULT_CONFIG))

    def test_a_damaged_byte_fails_the_run(self):
        run = QuickstartRun("--versions", "2", "--mode", "one_step_off", "--flip_one_bit")
        rc = run.finish()
        self.assertEqual(rc, 1, run.out + run.err)
        flipped = re.search(r"--flip_one_bit: rollout/0: flipped bit 0 of (\S+)\[", run.out)
        self.assertIsNotNone(flipped, run.out)
        self.assertRegex(run.out, r"(?m)^\s*1\s.*\sok$")
        self.assertRegex(run.out, r"(?m)^\s*2\s.*\sMISMATCH$")
        self.assertRegex(run.out, r"v2 rollout/0: local tensor %s, .*: 1 of \d+ elements differ" % re.escape(flipped.group(1)))
        self.assertIn("quickstart: FAILED", run.out)
        self.assertNotIn("every byte verified", run.out)
        self.assertEqual(run.leftovers(), ([], False))

    def test_sigterm_mid_run_cleans_up(self):
        run = QuickstartRun("--versions", "1000000", "--mode", "one_step_off")
        row = run.read_until(r"^\s*1\s.*\s(ok|MISMATCH)$", RUN_TIMEOUT)  # inside the version loop
        self.assertTrue(row.rstrip().endswith(" ok"), run.out)
        daemon_pid, _ = run.daemon_line()
        run.proc.send_signal(signal.SIGTERM)
        rc = run.finish(timeout=60)
        self.assertEqual(rc, 130, run.out + run.err)
        self.assertIn("interrupted; cleaning up", run.err)
        self.assertEqual(run.leftovers(), ([], False))
        with self.assertRaises(ProcessLookupError):  # the daemon it started is gone (and was reaped)
            os.kill(daemon_pid, 0)

    def test_bad_options_and_a_daemon_that_does_not_start_are_reported(self):
        run = QuickstartRun("--versions", "0")
        self.assertEqual(run.finish(), 2)
        self.assertIn("--versions", run.err)
        run = QuickstartRun(config="/nonexistent/config.json")
        self.assertEqual(run.finish(), 2)
        self.assertIn("no such file", run.err)
        # A daemon that exits at start: reported at once with its log (not after --timeout).
        fake = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "wb_examples_exiting_daemon_%d.sh" % os.getpid())
        with open(fake, "w") as f:
            f.write("#!/bin/sh\necho 'unknown flag --bogus' >&2\nexit 3\n")
        os.chmod(fake, 0o700)
        try:
            run = QuickstartRun("--daemon_bin", fake)
            self.assertEqual(run.finish(timeout=60), 2)
        finally:
            os.unlink(fake)
        self.assertIn("weightbridged exited with status 3 at start", run.err)
        self.assertIn("unknown flag --bogus", run.err)
        self.assertEqual(run.leftovers(), ([], False))


# ---------------------------------------------------------------------------------------------------
# The examples name only what exists
# ---------------------------------------------------------------------------------------------------
class Instance:
    """A value of a known class in an example (an annotated parameter)."""

    def __init__(self, cls):
        self.cls = cls


# Instance attributes of the hooks that examples reach through (not class attributes).
INSTANCE_ATTRS = {"client": wb.WorkerClient}
IMPORT_RE = re.compile(r"from\s+(weightbridge[\w.]*)\s+import\s+([\w, ]+)")


def _bind(fn, npos, keywords, starred, with_self):
    """None when a call with `npos` positional arguments and `keywords` can bind to `fn`, else why not."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: not checked
    args = [None] * (npos + (1 if with_self else 0))
    try:
        if starred:
            sig.bind_partial(**{k: None for k in keywords})
        else:
            sig.bind(*args, **{k: None for k in keywords})
    except TypeError as e:
        return "%s%s: %s" % (getattr(fn, "__qualname__", fn), sig, e)
    return None


class NameChecker:
    """Checks one example's source: weightbridge imports (also in docstrings) exist; calls to
    weightbridge callables, to methods of annotated hook parameters, to the example's own
    functions (also in its docstrings' usage lines: each docstring line that parses as Python) and
    vLLM collective_rpc("wb_...") calls bind."""

    def __init__(self, module, source):
        self.module, self.problems = module, []
        self.tree = ast.parse(source)
        self.globals = {}
        for name, obj in vars(module).items():
            origin = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
            if isinstance(obj, types.ModuleType):
                origin = obj.__name__
            if origin.startswith("weightbridge") or origin == module.__name__:
                self.globals[name] = obj

    def check(self):
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("weightbridge"):
                self.check_import(node.module, [a.name for a in node.names], "import")
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc:
                    self.check_docstring(doc)
            if isinstance(node, ast.FunctionDef):
                env = dict(self.globals)
                for a in node.args.args + node.args.kwonlyargs:
                    if a.annotation is not None:
                        cls = self.resolve(a.annotation, env)
                        if inspect.isclass(cls):
                            env[a.arg] = Instance(cls)
                for call in ast.walk(node):
                    if isinstance(call, ast.Call):
                        self.check_call(call, env, "%s()" % node.name)
        return self.problems

    def check_import(self, module_name, names, where):
        try:
            mod = importlib.import_module(module_name)
        except ImportError as e:
            self.problems.append("%s: from %s import ...: %s" % (where, module_name, e))
            return
        for n in names:
            if not hasattr(mod, n):
                self.problems.append("%s: %s has no %s" % (where, module_name, n))

    def check_docstring(self, doc):
        for m in IMPORT_RE.finditer(doc):
            self.check_import(m.group(1), [n.strip() for n in m.group(2).split(",") if n.strip()], "docstring")
        for line in doc.splitlines():  # usage lines parse as Python; prose does not (skipped)
            try:
                tree = ast.parse(line.split("  #")[0].strip())
            except SyntaxError:
                continue
            for call in ast.walk(tree):
                if isinstance(call, ast.Call):
                    self.check_call(call, self.globals, "docstring line %r" % line.strip())

    def resolve(self, node, env):
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value, env)
            if base is None:
                return None
            if isinstance(base, Instance):
                if node.attr in INSTANCE_ATTRS:
                    return Instance(INSTANCE_ATTRS[node.attr])
                if not hasattr(base.cls, node.attr):
                    self.problems.append("%s has no attribute %s" % (base.cls.__name__, node.attr))
                    return None
                return (base.cls, node.attr)  # a method of an instance
            if not hasattr(base, node.attr):
                self.problems.append("%s has no attribute %s" % (getattr(base, "__name__", base), node.attr))
                return None
            return getattr(base, node.attr)
        return None

    def check_call(self, call, env, where):
        npos = len([a for a in call.args if not isinstance(a, ast.Starred)])
        starred = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
        keywords = [k.arg for k in call.keywords if k.arg is not None]
        if isinstance(call.func, ast.Attribute) and call.func.attr == "collective_rpc":
            self.check_collective_rpc(call, where)
            return
        target = self.resolve(call.func, env)
        if target is None or isinstance(target, Instance):
            return
        if isinstance(target, tuple):  # (class, method name) of an instance
            cls, name = target
            static = isinstance(inspect.getattr_static(cls, name), (staticmethod, classmethod))
            why = _bind(getattr(cls, name), npos, keywords, starred, with_self=not static)
        elif callable(target):
            why = _bind(target, npos, keywords, starred, with_self=False)
        else:
            why = "%s is not callable" % target
        if why:
            self.problems.append("%s: %s" % (where, why))

    def check_collective_rpc(self, call, where):
        """llm.collective_rpc("wb_x", args=(...), kwargs={...}) against WeightBridgeWorkerExtension."""
        if not call.args or not isinstance(call.args[0], ast.Constant):
            return
        name = call.args[0].value
        if not hasattr(WeightBridgeWorkerExtension, name):
            self.problems.append("%s: collective_rpc(%r): WeightBridgeWorkerExtension has no %s" % (where, name, name))
            return
        kw = {k.arg: k.value for k in call.keywords}
        npos = len(kw["args"].elts) if isinstance(kw.get("args"), ast.Tuple) else 0
        keys = [k.value for k in kw["kwargs"].keys] if isinstance(kw.get("kwargs"), ast.Dict) else []
        why = _bind(getattr(WeightBridgeWorkerExtension, name), npos, keys, False, with_self=True)
        if why:
            self.problems.append("%s: collective_rpc(%r): %s" % (where, name, why))


class ExamplesNameTest(unittest.TestCase):
    def test_examples_import_without_torch_vllm_or_sglang(self):
        code = ("import importlib.util, sys\n"
                "for f in sys.argv[1:]:\n"
                "    spec = importlib.util.spec_from_file_location('ex', f)\n"
                "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
                "print(sorted(m for m in ('torch', 'vllm', 'sglang') if m in sys.modules))\n")
        files = [os.path.join(EXAMPLES, f) for f in EXAMPLE_FILES]
        p = subprocess.run([sys.executable, "-c", code] + files, capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.strip(), "[]")
        self.assertEqual(set(EXAMPLE_FILES), {"quickstart.py", "megatron_trainer_hook.py", "fsdp2_trainer_hook.py",
                                              "vllm_worker_extension.py", "vllm_transfer_backend.py", "sglang_rollout.py",
                                              "deepspeed_zero3_trainer_hook.py"})

    def test_examples_name_only_what_exists(self):
        for f in EXAMPLE_FILES:
            with self.subTest(example=f):
                mod = load_example(f[:-3])
                with open(os.path.join(EXAMPLES, f)) as src:
                    problems = NameChecker(mod, src.read()).check()
                self.assertEqual(problems, [])

    def test_the_checker_catches_wrong_names(self):
        mod = load_example("fsdp2_trainer_hook")
        bad = textwrap.dedent('''
            """Usage (prose lines are skipped: make_hook takes rank and dp).

                from weightbridge.integrations.fsdp2 import FSDP2TrainerHook, NoSuchHook
                hook = make_hook("/s", cfg, rank=0, dp=2, tp=2)
            """
            def f(hook: FSDP2TrainerHook, model):
                hook.publsh(1, model.named_parameters())
                hook.publish(1, model.named_parameters(), timeuot=3)
                hook.client.deregistr()
                FSDP2TrainerHook("/s", None, rnak=0, dp=1)
                vllm_transfer.init_infoo("/s", None)
                llm.collective_rpc("wb_updat", args=(1,))
                llm.collective_rpc("wb_init", args=("/s", None), kwargs={"replca": 0})
            ''')
        mod.vllm_transfer = load_example("vllm_transfer_backend").vllm_transfer
        problems = "\n".join(NameChecker(mod, bad).check())
        for wrong in ("NoSuchHook", "argument 'tp'", "publsh", "timeuot", "deregistr", "required argument: 'rank'",
                      "init_infoo", "wb_updat", "replca"):
            self.assertIn(wrong, problems)
        self.assertEqual(len(problems.splitlines()), 9, problems)  # the prose line is not read as code


# ---------------------------------------------------------------------------------------------------
# The framework examples, end to end, with numpy stand-ins for the frameworks
# ---------------------------------------------------------------------------------------------------
class FakeFsdpModel:
    """An FSDP2-wrapped model as the example sees it: named_parameters() of DTensor shards."""

    def __init__(self, shards):
        self.shards = shards

    def named_parameters(self):
        return iter(list(self.shards.items()))

    def named_buffers(self):
        """The tiny Qwen2 has no persistent buffers; rotary's inv_freq is one the layout lacks."""
        return iter([("model.rotary_emb.inv_freq", np.ones((32,), np.float32))])


class FakeMegatronChunk:
    """A DDP-wrapped Megatron model chunk (no --overlap-param-gather): "module." names, no buffers."""

    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return (("module." + n, a) for n, a in self.params.items())

    def named_buffers(self):
        return iter([])


class FakeZero3Param:
    """A parameter as deepspeed.zero.Init leaves it on rank `rank` of `world`
    (deepspeed/runtime/zero/partition_parameters.py, _partition_param): ds_tensor holds flat
    elements [rank * c, +c), c = ceil(n / world), the end's rank padded (0xDEAD here), param.data
    freed."""

    def __init__(self, whole, world, rank):
        flat = whole.reshape(-1)
        n, c = flat.size, -(-flat.size // world)
        self.ds_tensor = np.full(c, 0xDEAD, flat.dtype)
        valid = max(0, min(c, n - rank * c))
        self.ds_tensor[:valid] = flat[rank * c:rank * c + valid]
        self.ds_id, self.ds_numel, self.ds_shape, self.ds_persist = 0, n, tuple(whole.shape), False
        self.ds_process_group = ns(size=lambda: world, rank=lambda: rank)
        self.data = np.empty((0,), flat.dtype)


class FakeZero3Engine:
    """A DeepSpeed ZeRO-3 engine as the example sees it: "module." names, partitioned parameters,
    whole buffers (rotary inv_freq: not a weight)."""

    def __init__(self, c, world, rank):
        self.params = [("module." + n, FakeZero3Param(a, world, rank)) for n, a in c.items()]

    def named_parameters(self):
        return iter(self.params)

    def named_buffers(self):
        return iter([("module.model.rotary_emb.inv_freq", np.ones((32,), np.float32))])


def parallel(fns, what):
    """Calls each fn in its own thread (engine workers and trainer ranks run at once); raises the
    first error; returns the results in order."""
    results = [None] * len(fns)

    def slot(i, fn):
        return lambda: results.__setitem__(i, fn())
    errors = run_all([slot(i, fn) for i, fn in enumerate(fns)])
    if errors:
        raise AssertionError("%s: %s" % (what, errors))
    return results


class FakeLLM:
    """vLLM's LLM as the worker-extension example drives it: collective_rpc on every worker at once
    (as vLLM runs them), sleep / wake_up recorded."""

    def __init__(self, workers):
        self.workers, self.calls = workers, []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return parallel([lambda w=w: getattr(w, method)(*args, **(kwargs or {})) for w in self.workers], method)

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


@dataclasses.dataclass
class WeightTransferInitRequest:  # vllm.distributed.weight_transfer.base's, as its docs show it
    init_info: dict


@dataclasses.dataclass
class WeightTransferUpdateRequest:
    update_info: dict


class FakeTransferLLM:
    """vLLM's LLM with a weight-transfer engine per worker (vllm_transfer_test.WorkerB, generation
    B): every call runs on all workers at once."""

    def __init__(self, workers):
        self.workers = workers

    def _all(self, what, fn):
        return parallel([lambda w=w: fn(w) for w in self.workers], what)

    def init_weight_transfer_engine(self, request):
        self._all("init", lambda w: w.init_weight_transfer_engine(request.init_info))

    def start_weight_update(self):
        self._all("start", lambda w: w.start_weight_update())

    def update_weights(self, request):
        self._all("update", lambda w: w.update_weights(request.update_info))

    def finish_weight_update(self):
        self._all("finish", lambda w: w.finish_weight_update())

    def shutdown_weight_transfer_engine(self):
        self._all("shutdown", lambda w: w.shutdown())


class RlhfRoutes(http.server.BaseHTTPRequestHandler):
    """vLLM's RLHF routes (VLLM_SERVER_DEV_MODE=1) in front of a FakeTransferLLM: JSON in, 200 or 500."""

    llm = None

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        routes = {"/init_weight_transfer_engine": lambda: self.llm.init_weight_transfer_engine(
                      WeightTransferInitRequest(init_info=body["init_info"])),
                  "/start_weight_update": self.llm.start_weight_update,
                  "/update_weights": lambda: self.llm.update_weights(WeightTransferUpdateRequest(update_info=body["update_info"])),
                  "/finish_weight_update": self.llm.finish_weight_update}
        try:
            routes[self.path]()
            self.send_response(200)
        except Exception as e:  # reported to the client as vLLM would: an error status
            self.send_response(500)
            self.server.errors.append(e)
        self.end_headers()

    def log_message(self, *args):
        pass


class ExamplesRunTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        with open(TINY_CONFIG) as f:
            cls.config = f.read()
        cls.fsdp2 = load_example("fsdp2_trainer_hook")
        cls.megatron = load_example("megatron_trainer_hook")
        cls.sglang = load_example("sglang_rollout")
        cls.vllm_ext = load_example("vllm_worker_extension")
        cls.vllm_transfer = load_example("vllm_transfer_backend")
        cls.zero3 = load_example("deepspeed_zero3_trainer_hook")

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def closing(self, hook):
        """`hook` (a trainer or rollout hook) is closed - its shm buffer unlinked - when the test
        ends, also when it fails midway (closing twice is harmless)."""
        self.addCleanup(hook.close)
        return hook

    def check(self, params, version, tp, r, what):
        for n, want in vllm_tp(canonical(version), tp, r).items():
            np.testing.assert_array_equal(params[n], want, err_msg="%s: %s v%d" % (what, n, version))

    def test_fsdp2_trainers_to_sglang_rollouts_sync(self):
        model = self.fsdp2.policy_model(self.config, trainer_ranks=2, rollout_ranks=2, mode="sync", model_id="ex_fsdp2_sglang")
        hooks = [self.closing(self.fsdp2.make_hook(self.daemon.socket, model, rank=r, dp=2)) for r in (0, 1)]
        server_args = ns(tp_size=2, dp_size=1, enable_dp_attention=False, enable_dp_lm_head=False, moe_dense_tp_size=None,
                         moe_a2a_backend="none")
        runners = [ns(model=FakeEngineModel(zeros(2, r))) for r in (0, 1)]
        rollouts = [self.closing(self.sglang.make_rollout(self.daemon.socket, model, server_args, r, runners[r])) for r in (0, 1)]

        def step(v):
            c = canonical(v)
            got = parallel([lambda h=h, r=r: self.fsdp2.after_optimizer_step(h, FakeFsdpModel(fsdp2_shard(c, 2, r)), v, TIMEOUT)
                            for r, h in enumerate(hooks)] +
                           [lambda k=k, r=r: self.sglang.update_sync(k, runners[r], v, TIMEOUT) for r, k in enumerate(rollouts)],
                           "version %d" % v)
            self.assertEqual(got[2:], [v, v])
            for r in (0, 1):
                self.check(runners[r].model.params, v, 2, r, "sglang rank %d" % r)

        step(1)
        step(2)
        # Colocated RL: the engines release their memory, resume, and the next version lands.
        for k in rollouts:
            self.sglang.release_memory(k, TIMEOUT)
        for r, k in enumerate(rollouts):
            self.sglang.resume_memory(k, runners[r])
        step(3)
        for h in hooks:
            self.fsdp2.leave(h)
        for k in rollouts:
            self.sglang.leave(k)

    def test_megatron_trainers_to_vllm_worker_extension_one_step_off(self):
        model = self.megatron.policy_model(self.config, trainer_ranks=2, rollout_ranks=1, model_id="ex_megatron_vllm")
        self.assertEqual(model.mode, "one_step_off")
        hooks = [self.closing(self.megatron.make_hook(self.daemon.socket, model, rank=r, tp=2)) for r in (0, 1)]
        params = zeros(1, 0)
        llm = FakeLLM([fake_vllm_worker(params)])
        sizes = self.vllm_ext.init(llm, self.daemon.socket, model)
        self.closing(llm.workers[0].wb)
        self.assertEqual(len(sizes), 1)
        self.assertGreater(sizes[0], 0)

        def step(v):
            c = canonical(v)
            for r, h in enumerate(hooks):
                self.megatron.after_optimizer_step(h, [FakeMegatronChunk(megatron_tp2(c, r))], v, TIMEOUT)
            self.assertEqual(self.vllm_ext.apply(llm, v, TIMEOUT), [v])
            self.check(params, v, 1, 0, "vllm")

        step(1)
        step(2)
        self.vllm_ext.sleep(llm)
        self.vllm_ext.wake(llm)
        self.assertEqual(llm.calls, [("sleep", 1), ("wake_up", ["weights"])])
        step(3)
        for h in hooks:
            h.client.deregister()
            h.close()
        for w in llm.workers:
            w.wb.client.deregister()
            w.wb.close()

    def test_deepspeed_zero3_trainers_to_vllm_worker_extension_sync(self):
        """ZeRO-3 over 3 ranks (uneven: the embedding's 1048576 elements in 349526, 349526 and
        349524) -> a vLLM tp=2 engine's two workers, sync, three versions."""
        model = self.zero3.policy_model(self.config, trainer_ranks=3, rollout_ranks=2, mode="sync", model_id="ex_zero3_vllm")
        hooks = [self.closing(self.zero3.make_hook(self.daemon.socket, model, rank=r, world=3)) for r in range(3)]
        params = [zeros(2, r) for r in (0, 1)]
        llm = FakeLLM([fake_vllm_worker(params[r], tp=2, rank=r) for r in (0, 1)])
        self.assertEqual(len(self.vllm_ext.init(llm, self.daemon.socket, model)), 2)
        for w in llm.workers:
            self.closing(w.wb)
        for v in (1, 2, 3):
            c = canonical(v)
            got = parallel([lambda: self.vllm_ext.update_sync(llm, v, TIMEOUT)] +
                           [lambda h=h, r=r: self.zero3.after_optimizer_step(h, FakeZero3Engine(c, 3, r), v, TIMEOUT)
                            for r, h in enumerate(hooks)], "version %d" % v)
            self.assertEqual(got[0], [v, v])
            for r in (0, 1):
                self.check(params[r], v, 2, r, "vllm rank %d" % r)
        for h in hooks:
            self.zero3.leave(h)
        for w in llm.workers:
            w.wb.client.deregister()
            w.wb.close()

    def test_trainers_to_vllm_weight_transfer_backend(self):
        with fake_vllm("B") as env:
            env.base.WeightTransferInitRequest = WeightTransferInitRequest
            env.base.WeightTransferUpdateRequest = WeightTransferUpdateRequest
            self.assertTrue(self.vllm_transfer.register_backend())  # into the stand-in factory
            self.assertFalse(self.vllm_transfer.register_backend())

            # Offline, sync: FSDP2 trainers through vLLM's trainer-side call -> a tp=2 engine.
            model = self.fsdp2.policy_model(self.config, trainer_ranks=2, rollout_ranks=2, mode="sync",
                                            model_id="ex_vllm_transfer")
            hooks = [self.closing(self.fsdp2.make_hook(self.daemon.socket, model, rank=r, dp=2)) for r in (0, 1)]
            workers = [WorkerB(env, zeros(2, r), tp=2, rank=r) for r in (0, 1)]
            llm = FakeTransferLLM(workers)
            self.vllm_transfer.init_engine(llm, self.daemon.socket, model)
            for w in workers:
                self.closing(w.engine.rollout)
            for v in (1, 2):
                c = canonical(v)
                parallel([lambda: self.vllm_transfer.update(llm, v, TIMEOUT)] +
                         [lambda h=h, r=r: self.vllm_transfer.trainer_publish(h, FakeFsdpModel(fsdp2_shard(c, 2, r)), v, TIMEOUT)
                          for r, h in enumerate(hooks)], "version %d" % v)
                for r, w in enumerate(workers):
                    self.check(w.model.params, v, 2, r, "vllm rank %d" % r)
            self.vllm_transfer.shutdown(llm)
            for h in hooks:
                self.fsdp2.leave(h)

            # `vllm serve`, one-step-off: Megatron trainers -> a tp=1 engine over the HTTP routes.
            model = self.megatron.policy_model(self.config, trainer_ranks=2, rollout_ranks=1, model_id="ex_vllm_http")
            hooks = [self.closing(self.megatron.make_hook(self.daemon.socket, model, rank=r, tp=2)) for r in (0, 1)]
            worker = WorkerB(env, zeros(1, 0))
            handler = type("Routes", (RlhfRoutes,), {"llm": FakeTransferLLM([worker])})
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            server.errors = []
            threading.Thread(target=server.serve_forever, daemon=True).start()
            url = "http://127.0.0.1:%d" % server.server_address[1]
            try:
                self.vllm_transfer.http_init(url, self.daemon.socket, model)
                self.closing(worker.engine.rollout)
                for v in (1, 2):
                    for r, h in enumerate(hooks):
                        self.megatron.after_optimizer_step(h, [FakeMegatronChunk(megatron_tp2(canonical(v), r))], v, TIMEOUT)
                    self.vllm_transfer.http_update(url, v, TIMEOUT)
                    self.check(worker.model.params, v, 1, 0, "vllm serve")
                self.assertEqual(worker.engine.version, 2)
            finally:
                server.shutdown()
                server.server_close()
            self.assertEqual(server.errors, [])
            worker.shutdown()
            for h in hooks:
                h.client.deregister()
                h.close()


if __name__ == "__main__":
    unittest.main()
