"""weightbridge Python client against a real standalone weightbridged (temp Unix socket, port 0).

Run by //client/python:client_test (an sh_test calling /usr/bin/python3), or by hand:
  WB_DAEMON=bazel-bin/daemon/weightbridged PYTHONPATH=client/python /usr/bin/python3 -m unittest \
      discover -s client/python/tests -p '*_test.py'
Every rollout byte is checked against tests/common/weight_gen.h values (weightbridge.weights).
"""

import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

import weightbridge as wb
from weightbridge import weights
from weightbridge.layouts import canonical_bases

HERE = os.path.dirname(os.path.abspath(__file__))
WORKSPACE = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
TIMEOUT = 30.0
# A tiny Qwen2-family config (tests/soak/testdata) and its size in bf16: 2,230,528 parameters.
TINY_CONFIG = os.path.join(WORKSPACE, "tests", "soak", "testdata", "qwen2-tiny.json")
TINY_BYTES = 4461056

# A tiny model: 2-D weights, a 1-D bias, separate q/k/v (fused by the "engine" below).
CANONICAL = [("embed", (16, 8)), ("q", (8, 8)), ("k", (4, 8)), ("v", (4, 8)), ("bias", (8,))]
NAMES = [n for n, _ in CANONICAL]
SHAPES = [s for _, s in CANONICAL]
BASES = canonical_bases(SHAPES)
ELEM = 2  # bfloat16


def daemon_binary():
    for cand in (os.environ.get("WB_DAEMON"), os.path.join(WORKSPACE, "bazel-bin", "daemon", "weightbridged")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise unittest.SkipTest("weightbridged not built (bazel build //daemon:weightbridged or set WB_DAEMON)")


class Daemon:
    """A standalone weightbridged on a temp Unix socket and port 0; killed on stop()."""

    def __init__(self, binary=None, extra_flags=()):
        self.dir = tempfile.mkdtemp(prefix="wbpy.")
        self.socket = os.path.join(self.dir, "w.sock")
        self.log = open(os.path.join(self.dir, "daemon.log"), "w")
        self._argv = [binary or daemon_binary(), "--role=standalone", "--worker_socket=" + self.socket,
                      "--listen=127.0.0.1:0", "--port_file=" + os.path.join(self.dir, "port"),
                      "--transfer_timeout_ms=20000"] + list(extra_flags)
        self.proc = subprocess.Popen(self._argv, stdout=self.log, stderr=subprocess.STDOUT)

    def restart(self):
        """Stops this daemon (SIGTERM: it forgets every worker, buffer and fd) and starts a new one with
        the same flags at the same worker socket; clients find it when they reconnect."""
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.write("----- restarted -----\n")
        self.log.flush()
        self.proc = subprocess.Popen(self._argv, stdout=self.log, stderr=subprocess.STDOUT)

    def client(self, prefix):
        # Connect waits (bounded) for the daemon to accept on the socket.
        return wb.WorkerClient(self.socket, connect_timeout=TIMEOUT, call_timeout=TIMEOUT, shm_prefix=prefix)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()
        if os.environ.get("WB_KEEP"):
            print("daemon dir kept:", self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self):
        with open(os.path.join(self.dir, "daemon.log")) as f:
            return f.read()[-3000:]


class DaemonTestCase(unittest.TestCase):
    """Test classes sharing one standalone weightbridged (temp socket, port 0) and the tiny Qwen2
    config (`self.config`, its text)."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        with open(TINY_CONFIG) as f:
            cls.config = f.read()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()


def row_blocks(blocks):
    """Explicit pieces + canonical index map for a buffer holding `blocks` back to back:
    (tensor, r0, r1) = canonical rows [r0, r1) of a 2-D tensor (all columns) or range of a 1-D one."""
    pieces, index, off = [], [], 0
    for name, r0, r1 in blocks:
        t = NAMES.index(name)
        shape = SHAPES[t]
        inner = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        begin = [r0] + [0] * (len(shape) - 1)
        end = [r1] + list(shape[1:])
        pieces.append(wb.Piece(name, begin, end, buffer_id=0, offset_bytes=off * ELEM))
        index.append(np.arange(BASES[t] + r0 * inner, BASES[t] + r1 * inner, dtype=np.int64))
        off += (r1 - r0) * inner
    return wb.ExplicitLayout(pieces), np.concatenate(index)


def publish_all(trainers, v):
    """Every trainer (anything with .client) publishes `v` at once, one thread each (a sync Publish
    returns once the version committed); returns the errors once all returned."""
    errors = []

    def publish(t):
        try:
            t.client.publish(v, timeout=TIMEOUT)
        except wb.WeightBridgeError as e:
            errors.append(e)
    threads = [threading.Thread(target=publish, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    return errors


def fill(buf, index, version):
    buf.array("uint16", (index.size,))[:] = weights.values_for_indices(BASES, version, index, ELEM)


def mismatches(buf, index, version):
    got = buf.array("uint16", (index.size,))
    mask = index >= 0
    return int(np.count_nonzero(got[mask] != weights.values_for_indices(BASES, version, index[mask], ELEM)))


FULL = [(n, 0, s[0]) for n, s in CANONICAL]
HALF = [[(n, r * s[0] // 2, (r + 1) * s[0] // 2) for n, s in CANONICAL] for r in (0, 1)]


class Worker:
    def __init__(self, daemon, model, worker_id, role, blocks, prefix="t"):
        self.client = daemon.client(prefix)
        self.client.register_worker(model, worker_id, role)
        self.layout, self.index = row_blocks(blocks)
        self.buf = self.client.create_buffer(self.index.size * ELEM)
        self.info = self.client.register_layout(self.layout)


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def model(self, model_id, mode, trainers=2, rollouts=2, **kw):
        return wb.ModelConfig(model_id=model_id, explicit_tensors=CANONICAL, num_trainer_workers=trainers,
                              num_rollout_workers=rollouts, mode=mode, **kw)

    def make_workers(self, model):
        trainers = [Worker(self.daemon, model, "trainer/%d" % r, "trainer", HALF[r]) for r in (0, 1)]
        rollouts = [Worker(self.daemon, model, "rollout/%d" % r, "rollout", FULL, prefix="r") for r in (0, 1)]
        return trainers, rollouts

    def close(self, workers):
        for w in workers:
            w.client.deregister()
            w.client.close()

    def test_shm_segment_is_private_and_named_like_the_daemon_expects(self):
        c = self.daemon.client("perm")
        b = c.create_buffer(4096)
        st = os.stat("/dev/shm/" + b.name[1:])
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o600)
        self.assertEqual(st.st_uid, os.getuid())
        self.assertRegex(b.name, r"^/wb-perm-%d-\d+-\d+$" % os.getpid())
        self.assertTrue(np.all(b.array("uint8", (4096,)) == 0))
        c.close()
        self.assertFalse(os.path.exists("/dev/shm/" + b.name[1:]))

    def test_buffer_size_must_be_an_integer(self):
        # int(1.5) made a 1-byte segment; a float size is refused, numpy integers are sizes.
        c = self.daemon.client("size")
        # Only this process's segments (wb-<prefix>-<pid>-...): tests running beside this one
        # create and remove their own meanwhile.
        mine = lambda: {n for n in os.listdir("/dev/shm") if n.startswith("wb-") and "-%d-" % os.getpid() in n}
        before = mine()
        with self.assertRaisesRegex(TypeError, "integer number of bytes, got 1.5"):
            c.create_buffer(1.5)
        with self.assertRaisesRegex(TypeError, "integer number of bytes, got True"):
            c.create_buffer(True)
        with self.assertRaisesRegex(ValueError, "size must be > 0"):
            c.create_buffer(0)
        self.assertEqual(c.create_buffer(np.int64(8192)).size_bytes, 8192)
        self.assertEqual(len(c.buffers), 1)
        c.close()
        self.assertEqual(mine() - before, set())

    def test_one_step_off_every_byte(self):
        model = self.model("py_osp", "one_step_off")
        trainers, rollouts = self.make_workers(model)
        self.assertEqual(rollouts[0].info.num_pieces, len(CANONICAL))
        for v in (1, 2, 3):
            for t in trainers:
                fill(t.buf, t.index, v)
                res = t.client.publish(v, timeout=TIMEOUT)
                self.assertEqual(res.version, v)
            for r in rollouts:
                got = r.client.apply(v, timeout=TIMEOUT)
                self.assertEqual(got.applied_version, v)
                self.assertEqual(mismatches(r.buf, r.index, v), 0, "rollout %s v%d" % (r.client.worker_id, v))
        self.close(trainers + rollouts)

    def test_async_applies_newest(self):
        model = self.model("py_async", "async")
        trainers, rollouts = self.make_workers(model)
        for v in (1, 2):
            for t in trainers:
                fill(t.buf, t.index, v)
                t.client.publish(v, timeout=TIMEOUT)
        self.assertEqual(trainers[0].client.wait_version(2, timeout=TIMEOUT), 2)
        for r in rollouts:
            got = r.client.apply(0, timeout=TIMEOUT)
            self.assertEqual(got.applied_version, 2)  # v1 superseded, never applied
            self.assertEqual(mismatches(r.buf, r.index, 2), 0)
        self.close(trainers + rollouts)

    def test_sync_every_byte(self):
        model = self.model("py_sync", "sync")
        # No wait for the plan: a BeginUpdate that arrives before the daemon planned the model is
        # kept (it used to be dropped, and this test had to wait on Status first).
        trainers, rollouts = self.make_workers(model)
        for v in (1, 2):
            for r in rollouts:
                r.client.begin_update(timeout=TIMEOUT)
            for t in trainers:
                fill(t.buf, t.index, v)
            errors = publish_all(trainers, v)  # sync: returns once v is in
            for r in rollouts:
                self.assertGreaterEqual(r.client.wait_version(v, timeout=TIMEOUT), v)
            self.assertEqual(errors, [])
            for r in rollouts:
                self.assertEqual(mismatches(r.buf, r.index, v), 0, "sync v%d" % v)
        self.close(trainers + rollouts)

    def test_bad_layout_is_rejected_with_the_tensor_named(self):
        model = self.model("py_bad", "one_step_off", trainers=1, rollouts=1)
        c = self.daemon.client("bad")
        c.register_worker(model, "trainer/0", "trainer")
        c.create_buffer(1024)
        with self.assertRaises(wb.WeightBridgeError) as cm:
            c.register_layout(wb.ExplicitLayout([wb.Piece("q", [0, 0], [9, 8])]))  # q has 8 rows
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("q", cm.exception.message)
        c.close()

    def test_preset_layouts_resolved_by_the_daemon_move_a_version(self):
        """Megatron tp=2 trainers -> one vLLM tp=1 rollout, every layout a preset by name that the
        daemon resolves from the HF config (planner MakePresetLayout)."""
        with open(TINY_CONFIG) as f:
            config = f.read()
        model = wb.ModelConfig(model_id="py_preset", hf_config_json=config, num_trainer_workers=2,
                               num_rollout_workers=1, mode="one_step_off")
        clients = []
        for r in (0, 1):
            c = self.daemon.client("pre")
            c.register_worker(model, "trainer/%d" % r, "trainer")
            c.create_buffer(16)
            with self.assertRaises(wb.WeightBridgeError) as cm:  # the buffer is smaller than the preset
                c.register_layout(wb.PresetLayout("megatron", tp=2, rank=r))
            self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT, cm.exception.message)
            c.close()
            c = self.daemon.client("pre")
            c.register_worker(model, "trainer/%d" % r, "trainer")
            buf = c.create_buffer(TINY_BYTES)
            info = c.register_layout(wb.PresetLayout("megatron", tp=2, rank=r))
            self.assertEqual(info.source, "preset")
            self.assertGreater(info.num_pieces, 0)
            buf.array("uint8", (TINY_BYTES,))[:] = np.random.default_rng(r).integers(1, 256, TINY_BYTES, dtype=np.uint8)
            clients.append(c)
        ro = self.daemon.client("pre")
        ro.register_worker(model, "rollout/0", "rollout")
        rbuf = ro.create_buffer(TINY_BYTES)
        info = ro.register_layout(wb.PresetLayout("vllm", tp=1, replicas=1, rank=0))
        self.assertGreater(info.num_pieces, 0)
        for c in clients:
            c.publish(1, timeout=TIMEOUT)
        self.assertEqual(ro.apply(1, timeout=TIMEOUT).applied_version, 1)
        # Trainer bytes were all non-zero: every byte of the rollout's layout was written.
        self.assertEqual(int(np.count_nonzero(rbuf.array("uint8", (TINY_BYTES,)) == 0)), 0)
        for c in clients + [ro]:
            c.deregister()
            c.close()

    def test_infer_layout_from_an_engine_loader(self):
        """A vLLM-like tp=2 engine: vocab-parallel embedding with a padding row, fused [q;k;v]
        split by head rows, split bias. The loader never sees layouts, only checkpoint tensors."""

        def make_loader(rank):
            def load(weights_iter):
                params = {"embed": np.full((9, 8), -1, np.int64), "qkv_proj": np.full((8, 8), -1, np.int64),
                          "bias": np.full((4,), -1, np.int64)}
                qkv_off = {"q": 0, "k": 4, "v": 6}
                for name, w in weights_iter:
                    if name == "embed":
                        params["embed"][:8] = w[rank * 8:(rank + 1) * 8]
                    elif name in qkv_off:
                        rows = w.shape[0] // 2
                        params["qkv_proj"][qkv_off[name]:qkv_off[name] + rows] = w[rank * rows:(rank + 1) * rows]
                    elif name == "bias":
                        params["bias"][:] = w[rank * 4:(rank + 1) * 4]
                return params
            return load

        inferred = [wb.infer_layout(make_loader(r), CANONICAL) for r in (0, 1)]
        # The probe itself: fused rows of q, k, v in order, the padding row unmapped.
        qkv = inferred[1].local("qkv_proj").probe
        self.assertEqual(int(qkv[0, 0]), BASES[1] + 4 * 8)  # q row 4
        self.assertEqual(int(qkv[4, 0]), BASES[2] + 2 * 8)  # k row 2
        self.assertTrue(np.all(inferred[0].local("embed").probe[8] == -1))
        pieces = inferred[0].to_explicit().pieces
        self.assertEqual(sorted((p.tensor, tuple(p.begin), tuple(p.end)) for p in pieces),
                         sorted([("embed", (0, 0), (8, 8)), ("q", (0, 0), (4, 8)), ("k", (0, 0), (2, 8)),
                                 ("v", (0, 0), (2, 8)), ("bias", (0,), (4,))]))

        model = self.model("py_infer", "one_step_off")
        trainers = [Worker(self.daemon, model, "trainer/%d" % r, "trainer", HALF[r]) for r in (0, 1)]
        rollouts = []
        for r in (0, 1):
            c = self.daemon.client("inf")
            c.register_worker(model, "rollout/%d" % r, "rollout")
            buf = c.create_buffer(inferred[r].buffer_bytes)
            info = c.register_layout(inferred[r], weight_buffer=buf, resolve="auto")
            self.assertEqual(info.source, "index_probe")  # the daemon's extractor, not the fallback
            self.assertEqual(info.num_pieces, 5)
            # index map over the weight buffer (elements outside local tensors stay -1)
            index = np.full(buf.size_bytes // ELEM, -1, np.int64)
            for t in inferred[r].tensors:
                o = t.offset_bytes // ELEM
                index[o:o + t.probe.size] = t.probe.reshape(-1)
            rollouts.append((c, buf, index))
        for t in trainers:
            fill(t.buf, t.index, 7)
            t.client.publish(7, timeout=TIMEOUT)
        for c, buf, index in rollouts:
            self.assertEqual(c.apply(7, timeout=TIMEOUT).applied_version, 7)
            self.assertEqual(mismatches(buf, index, 7), 0)
            # padding and gaps untouched
            self.assertTrue(np.all(buf.array("uint16", (index.size,))[index < 0] == 0))
            c.close()
        self.close(trainers)

    def test_infer_layout_transposed_tensor_needs_the_daemon_extractor(self):
        """An engine that stores q transposed: the client-side extractor refuses it, the daemon's
        (planner/index_probe.h) recovers a strided piece; every rollout byte checked."""

        def load(weights_iter):
            out = {}
            for name, w in weights_iter:
                out[name] = np.ascontiguousarray(w.T) if name == "q" else w.copy()
            return out

        inferred = wb.infer_layout(load, CANONICAL)
        with self.assertRaises(NotImplementedError):
            inferred.to_explicit()
        model = self.model("py_transposed", "one_step_off", trainers=1, rollouts=1)
        trainer = Worker(self.daemon, model, "trainer/0", "trainer", FULL)
        c = self.daemon.client("tr")
        c.register_worker(model, "rollout/0", "rollout")
        buf = c.create_buffer(inferred.buffer_bytes)
        info = c.register_layout(inferred, weight_buffer=buf, resolve="auto")
        self.assertEqual(info.source, "index_probe")
        # q (transposed: one strided piece) + the four other tensors. LayoutInfo.bytes is what the
        # pieces cover (every canonical element once), not the buffers' sizes (probe buffer included).
        self.assertEqual(info.num_pieces, len(CANONICAL))
        self.assertEqual(info.bytes, sum(int(np.prod(s)) for s in SHAPES) * ELEM)
        self.assertEqual(info.layout.source, "index_probe")
        self.assertEqual(info.layout.piece_bytes, info.bytes)
        index = np.full(buf.size_bytes // ELEM, -1, np.int64)
        for t in inferred.tensors:
            o = t.offset_bytes // ELEM
            index[o:o + t.probe.size] = t.probe.reshape(-1)
        for v in (1, 2):
            fill(trainer.buf, trainer.index, v)
            trainer.client.publish(v, timeout=TIMEOUT)
            self.assertEqual(c.apply(v, timeout=TIMEOUT).applied_version, v)
            self.assertEqual(mismatches(buf, index, v), 0, "transposed rollout v%d" % v)
        c.deregister()
        c.close()
        self.close([trainer])

    def test_a_second_client_of_the_process_cannot_take_a_worker_id_the_first_holds(self):
        """Two clients of this process, one worker id: each sends its own token
        (RegisterWorkerRequest.client_instance), so the second is refused ALREADY_EXISTS naming the
        worker, the node and the process - before, its request, identical but for the token, was
        answered as a replay of the first's. The first keeps the id: its own replay (what it sends
        after a dropped connection) is answered and versions still reach its memory. Once the first
        deregistered, the second registers."""
        model = self.model("py_two_clients", "one_step_off", rollouts=1)
        trainers = [Worker(self.daemon, model, "trainer/%d" % r, "trainer", HALF[r]) for r in (0, 1)]
        rollout = Worker(self.daemon, model, "rollout/0", "rollout", FULL, prefix="r")
        second = self.daemon.client("r2")
        self.assertEqual(len(rollout.client.client_instance), 32)
        self.assertNotEqual(second.client_instance, rollout.client.client_instance)
        with self.assertRaises(wb.WeightBridgeError) as cm:
            second.register_worker(model, "rollout/0", "rollout")
        self.assertEqual(cm.exception.code, grpc.StatusCode.ALREADY_EXISTS, str(cm.exception))
        self.assertIn("worker rollout/0 of model py_two_clients on node ", str(cm.exception))
        self.assertIn("another client of the same process (pid %d" % os.getpid(), str(cm.exception))
        rollout.client._replay(time.monotonic() + TIMEOUT)
        for v in (1, 2):
            for t in trainers:
                fill(t.buf, t.index, v)
                t.client.publish(v, timeout=TIMEOUT)
            self.assertEqual(rollout.client.apply(v, timeout=TIMEOUT).applied_version, v)
            self.assertEqual(mismatches(rollout.buf, rollout.index, v), 0, "v%d" % v)
        self.close([rollout])
        second.register_worker(model, "rollout/0", "rollout")  # the id is free now
        second.deregister()
        second.close()
        self.close(trainers)

    def test_reconnect_after_unavailable_call_fails_cleanly_without_daemon(self):
        d = tempfile.mkdtemp(prefix="wbpy.")
        with self.assertRaises(wb.WeightBridgeError) as cm:
            wb.WorkerClient(os.path.join(d, "none.sock"), connect_timeout=0.3)
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        shutil.rmtree(d)


def e4m3_reference(x):
    """Nearest float8_e4m3fn code of float32 array `x` (ties to the even code, saturating at 448),
    by search over the format's values: independent of the daemon's bit manipulation."""
    codes = np.arange(0x7F)
    e, m = codes >> 3, codes & 7
    values = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7))
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(values, a), 1, len(values) - 1)
    lo = hi - 1
    dl, dh = a - values[lo], values[hi] - a
    pick = np.where(dl < dh, lo, np.where(dh < dl, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= values[-1], len(values) - 1, pick)
    return (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def e4m3_value(codes):
    """float32 value of float8_e4m3fn codes (no NaN among them)."""
    c = np.asarray(codes, dtype=np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_reference(y):
    """float4_e2m1 codes of float32 array `y`: nearest of the 8 magnitudes (ties to the even code,
    saturating at 6, NaN -> 7), sign bit 8 when y < 0 (so -0.0 -> 0), by search over the values."""
    a = np.abs(y.astype(np.float64))
    d = np.abs(a[..., None] - E2M1_VALUES)  # inf / NaN rows: handled below
    best = d.min(axis=-1, keepdims=True)
    tied = d == best
    # lowest even code among the nearest, else the nearest
    even = np.where(tied & (np.arange(8) % 2 == 0), np.arange(8), 99).min(axis=-1)
    code = np.where(even < 99, even, np.argmin(d, axis=-1))
    code = np.where(np.isnan(a) | (a >= 6.0), 7, code)
    return (code | np.where(y < 0, 8, 0)).astype(np.uint8)


def nvfp4_reference(x, g):
    """NVFP4 of float32 `x` (rows x cols, cols a multiple of 16) with global scale `g` (float32):
    (packed element bytes, e4m3 scale bytes [rows, cols / 16]), float32 arithmetic throughout."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // 16, 16)
    amax = np.abs(blocks).max(axis=-1).astype(np.float32)
    bs = (amax / (np.float32(6.0) * g)).astype(np.float32)
    bs = np.where(bs == 0, np.float32(1.0), bs).astype(np.float32)
    sbytes = e4m3_reference(bs)
    d = (e4m3_value(sbytes) * g).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = (blocks / d[..., None]).astype(np.float32)
    codes = e2m1_reference(y).reshape(rows, cols)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), sbytes


class QuantizedTest(unittest.TestCase):
    """Explicit quantised rollout pieces (fp8 block, MXFP8, int4, NVFP4) through a real daemon."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def test_rollout_holds_fp8_elements_and_block_scales(self):
        rows, cols = 256, 192  # blocks 128 x 128: a 2 x 2 grid, the last column of blocks partial
        model = wb.ModelConfig(model_id="py_fp8", explicit_tensors=[("w", [rows, cols])], num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        tr = self.daemon.client("q")
        tr.register_worker(model, "trainer/0", "trainer")
        tbuf = tr.create_buffer(rows * cols * 2)
        tr.register_layout(wb.ExplicitLayout([wb.Piece("w", [0, 0], [rows, cols])]))
        ro = self.daemon.client("q")
        ro.register_worker(model, "rollout/0", "rollout")
        scale_at = rows * cols  # fp8 elements first, then 4 float32 scales
        rbuf = ro.create_buffer(scale_at + 16)
        bad = wb.Piece("w", [0, 0], [rows, cols], quant=wb.Quantization(block=[128, 128], scale_offset_bytes=scale_at - 4))
        with self.assertRaises(wb.WeightBridgeError) as cm:  # scales overlapping the elements
            ro.register_layout(wb.ExplicitLayout([bad]))
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT, cm.exception.message)
        self.assertIn("scales of", cm.exception.message)
        good = wb.Piece("w", [0, 0], [rows, cols], quant=wb.Quantization(block=[128, 128], scale_offset_bytes=scale_at))
        ro.register_layout(wb.ExplicitLayout([good]))
        rng = np.random.default_rng(5)
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        w[3, 7] = 1.5  # one outlier in block (0, 0)
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 (truncated)
        tbuf.array("uint16", (rows, cols))[:] = bits
        tr.publish(1, timeout=TIMEOUT)
        self.assertEqual(ro.apply(1, timeout=TIMEOUT).applied_version, 1)
        x = (bits.astype(np.uint32) << 16).view(np.float32)
        got_q = rbuf.array("uint8", (scale_at + 16,))[:scale_at].reshape(rows, cols)
        got_s = rbuf.array("uint8", (scale_at + 16,))[scale_at:].view(np.float32).reshape(2, 2)
        for br in range(2):
            for bc in range(2):
                blk = x[br * 128:(br + 1) * 128, bc * 128:(bc + 1) * 128]
                amax = np.float32(max(float(np.abs(blk).max()), 1e-4))
                self.assertEqual(got_s[br, bc], np.float32(amax / np.float32(448.0)))
                want = e4m3_reference(blk * (np.float32(1.0) / np.float32(amax / np.float32(448.0))))  # DeepGEMM: x * (1.0 / sf)
                np.testing.assert_array_equal(got_q[br * 128:(br + 1) * 128, bc * 128:(bc + 1) * 128], want)
        self.assertEqual(int(got_q[3, 7]), 0x7E)  # the outlier is its block's amax: 448
        for c in (tr, ro):
            c.deregister()
            c.close()

    def test_rollout_holds_mxfp8_elements_and_e8m0_scales(self):
        rows, cols = 8, 80  # blocks 1 x 32: an 8 x 3 grid, the last block 16 wide
        model = wb.ModelConfig(model_id="py_mxfp8", explicit_tensors=[("w", [rows, cols])], num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        tr = self.daemon.client("mx")
        tr.register_worker(model, "trainer/0", "trainer")
        tbuf = tr.create_buffer(rows * cols * 2)
        tr.register_layout(wb.ExplicitLayout([wb.Piece("w", [0, 0], [rows, cols])]))
        ro = self.daemon.client("mx")
        ro.register_worker(model, "rollout/0", "rollout")
        scale_at = rows * cols + 1  # one byte per block: no alignment needed
        rbuf = ro.create_buffer(scale_at + rows * 3)
        quant = wb.Quantization(block=[1, 32], scale_offset_bytes=scale_at, scale_dtype="float8_e8m0")
        ro.register_layout(wb.ExplicitLayout([wb.Piece("w", [0, 0], [rows, cols], quant=quant)]))
        rng = np.random.default_rng(6)
        w = (rng.standard_normal((rows, cols)) * 2.0 ** np.arange(-12, 12, 3)[:, None]).astype(np.float32)
        w[1, 32:64] = 0  # an all-zero block: scale byte 0, elements 0
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        tbuf.array("uint16", (rows, cols))[:] = bits
        tr.publish(1, timeout=TIMEOUT)
        self.assertEqual(ro.apply(1, timeout=TIMEOUT).applied_version, 1)
        x = (bits.astype(np.uint32) << 16).view(np.float32)
        mem = rbuf.array("uint8", (scale_at + rows * 3,))
        got_q = mem[:rows * cols].reshape(rows, cols)
        got_s = mem[scale_at:].reshape(rows, 3)
        for r in range(rows):
            for b in range(3):
                blk = x[r, b * 32:(b + 1) * 32].astype(np.float64)
                amax = float(np.abs(blk).max())
                e = -127 if amax == 0 else max(-127, min(127, int(np.floor(np.log2(amax))) - 8))
                self.assertEqual(int(got_s[r, b]), e + 127, (r, b))
                want = e4m3_reference((blk * 2.0 ** -e).astype(np.float32))
                np.testing.assert_array_equal(got_q[r, b * 32:(b + 1) * 32], want)
        self.assertEqual(int(got_s[1, 1]), 0)
        for c in (tr, ro):
            c.deregister()
            c.close()

    def test_rollout_holds_nvfp4_pieces_sharing_one_global_scale(self):
        rows, cols = 12, 64  # blocks 1 x 16: 4 per row; pieces: rows [0, 4) and [4, 12)
        split = 4
        model = wb.ModelConfig(model_id="py_nvfp4", explicit_tensors=[("w", [rows, cols])], num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        tr = self.daemon.client("f4")
        tr.register_worker(model, "trainer/0", "trainer")
        tbuf = tr.create_buffer(rows * cols * 2)
        tr.register_layout(wb.ExplicitLayout([wb.Piece("w", [0, 0], [rows, cols])]))
        ro = self.daemon.client("f4")
        ro.register_worker(model, "rollout/0", "rollout")
        b_at = split * cols // 2                    # packed pairs of piece A, then of piece B
        sa_at = rows * cols // 2                    # e4m3 scale bytes of A, then of B
        sb_at = sa_at + split * cols // 16
        g_at = sb_at + (rows - split) * cols // 16  # the shared float32 global scale (a multiple of 4)
        self.assertEqual(g_at % 4, 0)
        size = g_at + 4
        rbuf = ro.create_buffer(size)

        def pieces(global_at):
            qa = wb.Quantization(block=[1, 16], scale_offset_bytes=sa_at, dtype="float4_e2m1",
                                 scale_dtype="float8_e4m3", global_scale_offset_bytes=global_at)
            qb = wb.Quantization(block=[1, 16], scale_offset_bytes=sb_at, dtype="float4_e2m1",
                                 scale_dtype="float8_e4m3", global_scale_offset_bytes=global_at)
            return wb.ExplicitLayout([wb.Piece("w", [0, 0], [split, cols], quant=qa),
                                      wb.Piece("w", [split, 0], [rows, cols], offset_bytes=b_at, quant=qb)])

        with self.assertRaises(wb.WeightBridgeError) as cm:  # the global scale not on a multiple of 4
            ro.register_layout(pieces(g_at - 2))
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT, cm.exception.message)
        self.assertIn("float4_e2m1", cm.exception.message)
        ro.register_layout(pieces(g_at))

        rng = np.random.default_rng(8)
        # Row magnitudes 2^0 .. 2^-30: normal, subnormal and zero e4m3 block scales (a scale byte 0
        # divides by zero: +-inf -> code 7 / 15, 0 / 0 -> 7).
        exps = np.array([0, -3, -6, -9, -1, -12, -15, -18, -21, 0, -24, -30])
        w = (np.clip(rng.standard_normal((rows, cols)), -2.5, 2.5) * 2.0 ** exps[:, None]).astype(np.float32)
        w[9, 5] = 2.625  # the group's amax, in piece B: g = 2.625 / 2688 = 2^-10 exactly
        w[0, 16:32] = 0  # an all-zero block: scale 1.0 (byte 0x38), codes 0
        # Block (1, 1): amax 6 * 2^-10, so its scale is exactly 1 and x / d = these values: the
        # round-half-to-even ties, saturation, a negative that rounds to 0 (code 8) and -0.0 (code 0).
        ties = np.array([0.75, 1.75, 3.5, 0.25, 1.25, 2.5, 5.0, 6.0, -0.75, -1.75, -3.5, -0.25, -0.1, -0.0, 0.0, -6.0])
        w[1, 16:32] = (ties * 2.0 ** -10).astype(np.float32)
        w[2, 48:64] = -w[2, 48:64]
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 (truncated)
        tbuf.array("uint16", (rows, cols))[:] = bits
        tr.publish(1, timeout=TIMEOUT)
        self.assertEqual(ro.apply(1, timeout=TIMEOUT).applied_version, 1)

        x = (bits.astype(np.uint32) << 16).view(np.float32)
        amax = np.float32(np.abs(x).max())  # over BOTH pieces: they share the global scale
        g = np.float32(amax / np.float32(2688.0))
        g = np.float32(1.0) if g == 0 else g
        self.assertEqual(g, np.float32(2.0 ** -10))
        amax_a = np.float32(np.abs(x[:split]).max())
        self.assertLess(amax_a, amax)  # piece A alone would have had another global scale
        mem = rbuf.array("uint8", (size,))
        got_g = mem[g_at:g_at + 4].view(np.float32)[0]
        self.assertEqual(got_g, g)
        want_q, want_s = nvfp4_reference(x, g)
        got_q = np.concatenate([mem[:b_at].reshape(split, cols // 2), mem[b_at:sa_at].reshape(rows - split, cols // 2)])
        got_s = np.concatenate([mem[sa_at:sb_at].reshape(split, cols // 16), mem[sb_at:g_at].reshape(rows - split, cols // 16)])
        np.testing.assert_array_equal(got_s, want_s)
        np.testing.assert_array_equal(got_q, want_q)
        # Hand-checked anchors, independent of the reference.
        self.assertEqual(int(got_s[0, 1]), 0x38)  # all-zero block: scale 1.0
        self.assertTrue(np.all(got_q[0, 8:16] == 0))
        self.assertEqual(int(got_s[1, 1]), 0x38)
        codes = np.stack([got_q[1, 8:16] & 0xF, got_q[1, 8:16] >> 4], axis=-1).reshape(16)
        self.assertEqual(codes.tolist(), [2, 4, 6, 0, 2, 4, 6, 7, 10, 12, 14, 8, 8, 0, 0, 15])
        self.assertEqual(int(got_q[9, 2]) >> 4, 7)  # the outlier (odd: high nibble): 2.625 / (448 * 2^-10) = 6
        self.assertEqual(int(got_s[9, 0]), 0x7E)
        self.assertTrue(np.any((got_s[6:8] > 0) & (got_s[6:8] < 8)))  # subnormal e4m3 scales
        self.assertTrue(np.all(got_s[10:] == 0))  # too small for e4m3: scale byte 0
        # The A-only global scale would give other scale bytes: the daemon used the shared one.
        g_a = np.float32(amax_a / np.float32(2688.0))
        self.assertFalse(np.array_equal(nvfp4_reference(x[:split], g_a)[1], got_s[:split]))
        self.assertGreater(len(np.unique(np.concatenate([got_q & 0xF, got_q >> 4]))), 12)

        # Version 2: the amax now in piece A, and not a multiple of 2688 (g inexact); every byte again.
        w2 = (rng.standard_normal((rows, cols)) * 2.0 ** exps[:, None] * 0.37).astype(np.float32)
        w2[2, 40] = -3.1
        bits2 = (w2.view(np.uint32) >> 16).astype(np.uint16)
        tbuf.array("uint16", (rows, cols))[:] = bits2
        tr.publish(2, timeout=TIMEOUT)
        self.assertEqual(ro.apply(2, timeout=TIMEOUT).applied_version, 2)
        x2 = (bits2.astype(np.uint32) << 16).view(np.float32)
        g2 = np.float32(np.float32(np.abs(x2).max()) / np.float32(2688.0))
        self.assertLess(np.abs(x2[split:]).max(), np.abs(x2).max())  # piece B alone: another global scale
        self.assertEqual(mem[g_at:g_at + 4].view(np.float32)[0], g2)
        want_q2, want_s2 = nvfp4_reference(x2, g2)
        got_q2 = np.concatenate([mem[:b_at].reshape(split, cols // 2), mem[b_at:sa_at].reshape(rows - split, cols // 2)])
        got_s2 = np.concatenate([mem[sa_at:sb_at].reshape(split, cols // 16), mem[sb_at:g_at].reshape(rows - split, cols // 16)])
        np.testing.assert_array_equal(got_s2, want_s2)
        np.testing.assert_array_equal(got_q2, want_q2)
        for c in (tr, ro):
            c.deregister()
            c.close()

    def test_nvfp4_quantization_to_proto(self):
        q = wb.Quantization(block=[1, 16], scale_offset_bytes=64, dtype="float4_e2m1", scale_dtype="float8_e4m3",
                            global_scale_offset_bytes=96)
        p = wb.Piece("w", [0, 0], [4, 32], offset_bytes=8, quant=q).to_proto()
        self.assertEqual(p.quant_dtype, wb.pb.DTYPE_F4_E2M1)
        self.assertEqual(p.quant_scale_dtype, wb.pb.DTYPE_F8_E4M3)
        self.assertEqual(list(p.quant_block), [1, 16])
        self.assertEqual(p.scale_offset_bytes, 64)
        self.assertTrue(p.HasField("quant_global_scale_offset"))
        self.assertEqual(p.quant_global_scale_offset, 96)
        q0 = wb.Quantization(block=[1, 16], dtype="float4_e2m1", scale_dtype="float8_e4m3", global_scale_offset_bytes=0)
        p0 = wb.Piece("w", [0, 0], [4, 32], quant=q0).to_proto()
        self.assertTrue(p0.HasField("quant_global_scale_offset"))  # offset 0 is set, not "absent"
        # fp8 / int4 pieces carry no global scale (unchanged).
        fp8 = wb.Piece("w", [0, 0], [4, 32], quant=wb.Quantization(block=[128, 128])).to_proto()
        self.assertEqual(fp8.quant_dtype, wb.pb.DTYPE_F8_E4M3)
        self.assertFalse(fp8.HasField("quant_global_scale_offset"))
        with self.assertRaises(ValueError) as cm:  # NVFP4 without its global scale: the tensor named
            wb.Piece("w_nvfp4", [0, 0], [4, 32], quant=wb.Quantization(block=[1, 16], dtype="float4_e2m1",
                                                                       scale_dtype="float8_e4m3")).to_proto()
        self.assertIn("w_nvfp4", str(cm.exception))
        self.assertIn("global_scale_offset_bytes", str(cm.exception))
        with self.assertRaises(ValueError):  # NVFP4 takes e4m3 scales, not e8m0
            wb.Piece("w", [0, 0], [4, 32], quant=wb.Quantization(block=[1, 16], dtype="float4_e2m1", scale_dtype="float8_e8m0",
                                                                 global_scale_offset_bytes=0)).to_proto()
        with self.assertRaises(ValueError):  # ... nor the float32 default
            wb.Piece("w", [0, 0], [4, 32], quant=wb.Quantization(block=[1, 16], dtype="float4_e2m1",
                                                                 global_scale_offset_bytes=0)).to_proto()
        for other in (wb.Quantization(block=[128, 128], global_scale_offset_bytes=0),
                      wb.Quantization(block=[1, 32], dtype="int4", scale_dtype="bfloat16", global_scale_offset_bytes=0)):
            with self.assertRaises(ValueError) as cm:  # a global scale is NVFP4's only
                wb.Piece("w", [0, 0], [4, 32], quant=other).to_proto()
            self.assertIn("float4_e2m1", str(cm.exception))

    def test_rollout_holds_int4_groups_with_bf16_scales(self):
        rows, cols = 6, 64  # groups 1 x 32: a 6 x 2 grid
        model = wb.ModelConfig(model_id="py_int4", explicit_tensors=[("w", [rows, cols])], num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        tr = self.daemon.client("i4")
        tr.register_worker(model, "trainer/0", "trainer")
        tbuf = tr.create_buffer(rows * cols * 2)
        tr.register_layout(wb.ExplicitLayout([wb.Piece("w", [0, 0], [rows, cols])]))
        ro = self.daemon.client("i4")
        ro.register_worker(model, "rollout/0", "rollout")
        scale_at = rows * cols // 2  # packed pairs, then bf16 scales
        rbuf = ro.create_buffer(scale_at + rows * 2 * 2)
        with self.assertRaises(ValueError):  # int4 takes bf16/f16/f32 scales, not e8m0
            wb.Piece("w", [0, 0], [rows, cols],
                     quant=wb.Quantization(block=[1, 32], dtype="int4", scale_dtype="float8_e8m0")).to_proto()
        quant = wb.Quantization(block=[1, 32], scale_offset_bytes=scale_at, dtype="int4", scale_dtype="bfloat16")
        ro.register_layout(wb.ExplicitLayout([wb.Piece("w", [0, 0], [rows, cols], quant=quant)]))
        rng = np.random.default_rng(7)
        w = (rng.standard_normal((rows, cols)) * 0.03).astype(np.float32)
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        tbuf.array("uint16", (rows, cols))[:] = bits
        tr.publish(1, timeout=TIMEOUT)
        self.assertEqual(ro.apply(1, timeout=TIMEOUT).applied_version, 1)
        x = (bits.astype(np.uint32) << 16).view(np.float32)
        mem = rbuf.array("uint8", (scale_at + rows * 4,))
        packed = mem[:scale_at].reshape(rows, cols // 2)
        nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, cols).astype(np.int32) - 8
        scales = (mem[scale_at:].view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, 2)
        for r in range(rows):
            for g in range(2):
                blk = x[r, g * 32:(g + 1) * 32]
                s = np.float32(max(np.float32(np.abs(blk).max()) / np.float32(7.5), np.float32(1.1920929e-07)))
                b = int(s.view(np.uint32))  # to bfloat16, round to nearest even
                s_bf16 = np.uint32(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).view(np.float32)
                self.assertEqual(scales[r, g], s_bf16, (r, g))
                # compressed-tensors: bf16 x / bf16 scale is a bf16 quotient, then torch.round
                qb = (blk / s_bf16).astype(np.float32).view(np.uint32).astype(np.uint64)
                q_bf16 = (((qb + 0x7FFF + ((qb >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
                want = np.clip(np.rint(q_bf16), -8, 7).astype(np.int32)
                np.testing.assert_array_equal(nibbles[r, g * 32:(g + 1) * 32], want)
        self.assertGreater(len(np.unique(nibbles)), 6)
        for c in (tr, ro):
            c.deregister()
            c.close()


class WeightsTest(unittest.TestCase):
    def test_known_values(self):
        # splitmix64 reference values computed independently (C++ WeightBits(0, 0, 0) == 0 mix).
        bits = weights.weight_bits(0, 0, np.array([0], dtype=np.uint64))
        self.assertEqual(int(bits[0]), 0)
        b1 = int(weights.weight_bits(3, 5, np.array([7], dtype=np.uint64))[0])
        x = (7 * 0x9E3779B97F4A7C15) & (2**64 - 1)
        x ^= 3 << 40
        x ^= (5 * 0xD1B54A32D192ED03) & (2**64 - 1)
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & (2**64 - 1)
        x ^= x >> 31
        self.assertEqual(b1, x)


if __name__ == "__main__":
    unittest.main()
