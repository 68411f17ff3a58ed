"""The Python client's CUDA buffers (weightbridge.cuda.CudaBuffer) against a real standalone
weightbridged, on EMULATED GPUs: the daemon is the build linked with //tests/fake_cuda and this
process loads the same emulation as a shared library through $WB_CUDART. Checks the client's
CUDA path (cudaMalloc + IPC handle -> BufferSpec.cuda_ipc_handle, the daemon opening it, versions
moving device to device with GPU staging, read back through cudaMemcpy) and its CUDA VMM path
(cuMemCreate memory: the allocation found from a pointer, its fd sent once over the daemon's fd
channel, several buffers in it -> BufferSpec.cuda_vmm_key/offset), and the rollout hooks' release /
reacquire for engines that sleep (CudaRolloutSleepTest), without a GPU; says nothing about real
GPUs. Run by `bazel test //client/python:client_cuda_test`.
"""

import ctypes
import dataclasses
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import unittest
from unittest import mock

import numpy as np

R = os.getcwd()  # run_tests.sh runs from the runfiles root
os.environ.setdefault("WB_CUDART", os.path.join(R, "tests/fake_cuda/libwb_fake_cudart.so"))
os.environ.setdefault("WB_FAKE_CUDA_DEVICES", "2")
EMULATED_DAEMON = os.path.join(R, "daemon/weightbridged_emulated_gpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import client_test as ct  # noqa: E402  (helpers: Daemon, row_blocks, canonical weights)
from integrations_test import TINY_CONFIG, canonical, fake_vllm_worker, megatron_tp2, run_all, vllm_tp  # noqa: E402  (the tiny Qwen2's frameworks' tensors)
import weightbridge as wb  # noqa: E402
from weightbridge import cuda, weights  # noqa: E402
from weightbridge.integrations import megatron, vllm  # noqa: E402


class CudaWorker:
    """A worker whose one buffer is a CudaBuffer on `gpu`, filled / checked through a host copy."""

    def __init__(self, daemon, model, worker_id, role, blocks, gpu):
        self.client = daemon.client("c")
        self.client.register_worker(model, worker_id, role, gpu=gpu)
        self.layout, self.index = ct.row_blocks(blocks)
        self.buf = self.client.create_cuda_buffer(self.index.size * ct.ELEM, gpu)
        self.info = self.client.register_layout(self.layout)

    def fill(self, version):
        values = weights.values_for_indices(ct.BASES, version, self.index, ct.ELEM).astype(np.uint16)
        self.buf.write(0, values.tobytes())

    def mismatches(self, version):
        got = np.frombuffer(self.buf.read(0, self.index.size * ct.ELEM), dtype=np.uint16)
        want = weights.values_for_indices(ct.BASES, version, self.index, ct.ELEM).astype(np.uint16)
        return int(np.count_nonzero(got != want))


@unittest.skipUnless(os.access(EMULATED_DAEMON, os.X_OK) and os.path.exists(os.environ["WB_CUDART"]),
                     "emulated-GPU builds not present (built only with CUDA headers)")
@unittest.skipIf(os.environ.get("WB_SANITIZER"),
                 "sanitizer build: the instrumented emulated runtime cannot be loaded into the uninstrumented python3")
class CudaClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = ct.Daemon(EMULATED_DAEMON, ["--transports=host_shm,host_tcp,cuda_ipc", "--gpu_staging_bytes=268435456"])

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def workers(self, model):
        trainers = [CudaWorker(self.daemon, model, "trainer/%d" % r, "trainer", ct.HALF[r], gpu=r) for r in (0, 1)]
        rollouts = [CudaWorker(self.daemon, model, "rollout/%d" % r, "rollout", ct.FULL, gpu=r) for r in (0, 1)]
        return trainers, rollouts

    def close(self, workers):
        for w in workers:
            w.client.deregister()
            w.client.close()
            w.buf.close()

    def test_buffer_bounds_and_roundtrip(self):
        from weightbridge.cuda import CudaBuffer
        b = CudaBuffer(64, 1)
        self.assertEqual(len(b.ipc_handle), 64)
        from weightbridge.cuda import gpu_uuid
        self.assertEqual(len(b.gpu_uuid), 16)
        self.assertEqual(b.gpu_uuid, gpu_uuid(1))
        self.assertNotEqual(gpu_uuid(0), gpu_uuid(1), "each GPU has its own UUID")
        self.assertEqual(b.read(0, 64), bytes(64))  # zero-filled
        b.write(3, b"abc")
        self.assertEqual(b.read(2, 5), b"\x00abc\x00")
        with self.assertRaises(ValueError):
            b.write(62, b"abc")
        b.close()
        with self.assertRaisesRegex(TypeError, "integer number of bytes, got 1.5"):
            CudaBuffer(1.5, 1)  # int() made a 1-byte buffer
        with self.assertRaisesRegex(ValueError, "must be > 0"):
            CudaBuffer(0, 1)
        with self.assertRaises(ValueError):
            b.read(0, 1)

    def test_layout_description_gives_device_pointers_into_a_cuda_buffer(self):
        """Layout discovery over a CUDA buffer: no host view, the device address of each local
        tensor is the buffer's base + its described offset, and the bytes a version delivers are
        there."""
        model = wb.ModelConfig(model_id="py_cuda_describe", explicit_tensors=ct.CANONICAL, num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        trainer = ct.Worker(self.daemon, model, "trainer/0", "trainer", ct.FULL)
        layout, index = ct.row_blocks(ct.FULL)
        c = self.daemon.client("cdsc")
        desc = c.describe_layout(layout, model=model)
        c.register_worker(model, "rollout/0", "rollout", gpu=1)
        buf = c.create_cuda_buffer(desc.buffer_bytes(0), 1)
        info = c.register_layout(layout)
        self.assertEqual(info.layout.buffers, desc.buffers)
        self.assertEqual(info.layout.views(c.buffers), {})  # nothing in host memory
        with self.assertRaises(ValueError):
            info.layout.view(c.buffers, "q")
        fill = ct.fill
        fill(trainer.buf, trainer.index, 4)
        trainer.client.publish(4, timeout=ct.TIMEOUT)
        self.assertEqual(c.apply(4, timeout=ct.TIMEOUT).applied_version, 4)
        for name in ("embed", "q", "bias"):
            t = info.layout[name]
            self.assertEqual(info.layout.device_pointer(c.buffers, name), buf.ptr + t.offset_bytes)
            got = np.frombuffer(buf.read(t.offset_bytes, t.size_bytes), np.uint16)
            o = t.offset_bytes // ct.ELEM
            want = weights.values_for_indices(ct.BASES, 4, index[o:o + got.size], ct.ELEM)
            np.testing.assert_array_equal(got, want, err_msg=name)
        c.deregister()
        c.close()
        buf.close()
        trainer.client.deregister()
        trainer.client.close()

    def test_one_step_off_every_byte(self):
        model = wb.ModelConfig(model_id="py_cuda_osp", explicit_tensors=ct.CANONICAL, num_trainer_workers=2,
                               num_rollout_workers=2, mode="one_step_off")
        trainers, rollouts = self.workers(model)
        for r in rollouts:  # nothing applied yet: the device buffers are still zero
            self.assertEqual(r.buf.read(0, r.buf.size_bytes), bytes(r.buf.size_bytes))
        for v in (1, 2, 3):
            for t in trainers:
                t.fill(v)
                self.assertEqual(t.client.publish(v, timeout=ct.TIMEOUT).version, v)
            for r in rollouts:
                self.assertEqual(r.client.apply(v, timeout=ct.TIMEOUT).applied_version, v)
                self.assertEqual(r.mismatches(v), 0, "rollout %s v%d\n%s" % (r.client.worker_id, v, self.daemon.log_tail()))
        self.close(trainers + rollouts)

    def test_sync_every_byte(self):
        model = wb.ModelConfig(model_id="py_cuda_sync", explicit_tensors=ct.CANONICAL, num_trainer_workers=2,
                               num_rollout_workers=2, mode="sync")
        trainers, rollouts = self.workers(model)
        for v in (1, 2):
            for r in rollouts:
                r.client.begin_update(timeout=ct.TIMEOUT)
            for t in trainers:
                t.fill(v)
            errors = ct.publish_all(trainers, v)
            for r in rollouts:
                self.assertGreaterEqual(r.client.wait_version(v, timeout=ct.TIMEOUT), v)
            self.assertEqual(errors, [])
            for r in rollouts:
                self.assertEqual(r.mismatches(v), 0, "sync v%d" % v)
        self.close(trainers + rollouts)


class EmulatedCluster:
    """A coordinator and `nodes` node daemons (the emulated-GPU build) on loopback, port 0 each, a
    temp Unix worker socket per node; `client(i, prefix)` connects to node i. Each daemon's address
    is read from its own "listening on" line (select with a deadline), its output then kept in a log."""

    def __init__(self, nodes, node_flags=()):
        self.dir = tempfile.mkdtemp(prefix="wbpyc.")
        self.procs, self.logs, self.sockets, self.drains = [], [], [], []
        common = ["--heartbeat_ms=300", "--lease_ms=10000", "--transfer_timeout_ms=20000"]  # lease: slack for a loaded CI host
        port = self._start("coordinator", [EMULATED_DAEMON, "--role=coordinator", "--listen=127.0.0.1:0"] + common)
        for i in range(nodes):
            sock = os.path.join(self.dir, "n%d.sock" % i)
            self.sockets.append(sock)
            self._start("n%d" % i, [EMULATED_DAEMON, "--role=node", "--listen=127.0.0.1:0", "--data_listen=127.0.0.1:0",
                                    "--worker_socket=" + sock, "--coordinator=127.0.0.1:%d" % port, "--node_id=n%d" % i]
                        + common + list(node_flags))

    def _start(self, name, argv):
        log = os.path.join(self.dir, name + ".log")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.logs.append(log)
        # Raw reads of the pipe (a buffered readline could hold the line select() waits for).
        fd = proc.stdout.fileno()
        out, deadline, seen, port = open(log, "wb"), time.monotonic() + ct.TIMEOUT, b"", None
        while port is None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                out.close()
                raise AssertionError("%s did not start listening in %.0f s" % (name, ct.TIMEOUT))
            chunk = os.read(fd, 65536)
            if not chunk:
                out.close()
                with open(log) as f:
                    raise AssertionError("%s exited before listening:\n%s" % (name, f.read()))
            out.write(chunk)
            out.flush()
            seen += chunk
            m = re.search(rb"listening on \S+ port (\d+)", seen)
            if m:
                port = int(m.group(1))

        def drain():
            for rest in iter(lambda: os.read(fd, 65536), b""):
                out.write(rest)
                out.flush()
            out.close()
        self.drains.append(threading.Thread(target=drain, daemon=True))
        self.drains[-1].start()
        return port

    def client(self, node, prefix):
        return wb.WorkerClient(self.sockets[node], connect_timeout=ct.TIMEOUT, call_timeout=ct.TIMEOUT, shm_prefix=prefix)

    def log_tail(self):
        parts = []
        for p in self.logs:
            with open(p, errors="replace") as f:
                parts.append("== %s ==\n%s" % (os.path.basename(p), f.read()[-2000:]))
        return "\n".join(parts)

    def stop(self):
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for th in self.drains:  # each ends at its daemon's EOF
            th.join(10)
        for proc in self.procs:
            proc.stdout.close()
        if not os.environ.get("WB_KEEP"):
            shutil.rmtree(self.dir, ignore_errors=True)


@unittest.skipUnless(os.access(EMULATED_DAEMON, os.X_OK) and os.path.exists(os.environ["WB_CUDART"]),
                     "emulated-GPU builds not present (built only with CUDA headers)")
@unittest.skipIf(os.environ.get("WB_SANITIZER"),
                 "sanitizer build: the instrumented emulated runtime cannot be loaded into the uninstrumented python3")
class CudaCatchUpTest(unittest.TestCase):
    """A rollout whose weights live in CUDA memory restarts after a commit (a new registration with
    new, zeroed device memory) and is caught up to the committed version from the other rollout's
    CUDA copy (docs/daemon.md "Catch-up"), not from the trainers: their buffers hold other bytes by
    then, so bytes taken from them would show. On one standalone daemon (the source read on the GPU
    through cuda_ipc) and across two node daemons (the source on n0 copied to host once and sent
    over host_tcp to n1, which commits it into the late rollout's device memory). Before CUDA
    rollouts could serve as sources the restarted rollout was told there was no source and waited
    for the next version."""

    FLAGS = ["--transports=host_shm,host_tcp,cuda_ipc", "--gpu_staging_bytes=268435456"]

    def deliver(self, mode, v, trainers, rollouts, logs):
        if mode == "sync":
            for r in rollouts:
                r.client.begin_update(timeout=ct.TIMEOUT)
        for t in trainers:
            t.fill(v)
        self.assertEqual(ct.publish_all(trainers, v), [], logs())
        for r in rollouts:
            self.receive(mode, r, v, logs)

    def receive(self, mode, r, v, logs):
        if mode == "sync":
            self.assertGreaterEqual(r.client.wait_version(v, timeout=ct.TIMEOUT), v)
            r.client.end_update(timeout=ct.TIMEOUT)
        else:
            self.assertEqual(r.client.apply(v, timeout=ct.TIMEOUT).applied_version, v)
        self.assertEqual(r.mismatches(v), 0, "rollout %s v%d\n%s" % (r.client.worker_id, v, logs()))

    def run_mode(self, mode, across_nodes):
        if across_nodes:
            daemons = EmulatedCluster(2, self.FLAGS)
            at = lambda node: types.SimpleNamespace(client=lambda prefix: daemons.client(node, prefix))  # noqa: E731
        else:
            daemons = ct.Daemon(EMULATED_DAEMON, self.FLAGS)
            at = lambda node: daemons  # noqa: E731
        try:
            model = wb.ModelConfig(model_id="py_cuda_catch_up_" + mode, explicit_tensors=ct.CANONICAL, num_trainer_workers=2,
                                   num_rollout_workers=2, mode=mode)
            late_node = 1 if across_nodes else 0
            trainers = [CudaWorker(at(0), model, "trainer/%d" % r, "trainer", ct.HALF[r], gpu=r) for r in (0, 1)]
            rollouts = [CudaWorker(at(0), model, "rollout/0", "rollout", ct.FULL, gpu=0),
                        CudaWorker(at(late_node), model, "rollout/1", "rollout", ct.FULL, gpu=1)]
            self.deliver(mode, 1, trainers, rollouts, daemons.log_tail)
            for t in trainers:  # the trainers move on: a catch-up that read them would land version 9's bytes
                t.fill(9)
            old = rollouts[1]
            old.client.deregister()
            old.client.close()
            old.buf.close()
            late = CudaWorker(at(late_node), model, "rollout/1", "rollout", ct.FULL, gpu=1)
            self.assertEqual(late.buf.read(0, late.buf.size_bytes), bytes(late.buf.size_bytes))
            if mode == "sync":
                late.client.begin_update(timeout=ct.TIMEOUT)
            self.receive(mode, late, 1, daemons.log_tail)
            self.assertIn("catch-up", daemons.log_tail())
            rollouts[1] = late
            self.deliver(mode, 2, trainers, rollouts, daemons.log_tail)
            for w in trainers + rollouts:
                w.client.deregister()
                w.client.close()
                w.buf.close()
        finally:
            daemons.stop()

    def test_sync(self):
        self.run_mode("sync", across_nodes=False)

    def test_one_step_off(self):
        self.run_mode("one_step_off", across_nodes=False)

    def test_async(self):
        self.run_mode("async", across_nodes=False)

    def test_sync_across_nodes(self):
        self.run_mode("sync", across_nodes=True)

    def test_one_step_off_across_nodes(self):
        self.run_mode("one_step_off", across_nodes=True)


class QuantWorker:
    """fp8_block128 catch-up test's workers: tensor w [256, 256]. A trainer holds rows [r0, r1) in
    host memory (bf16 drawn per version: whole 128-row blocks, so its node quantises on send); a
    rollout holds w whole as float8_e4m3 with 128 x 128 blocks (its 2 x 2 float32 scales after the
    elements) in a CUDA buffer on `gpu`."""

    ROWS = COLS = 256
    SCALES_AT = ROWS * COLS

    def __init__(self, at, model, worker_id, role, rows=(0, 256), gpu=0):
        self.client = at.client("q")
        self.rows = rows
        if role == "trainer":
            self.client.register_worker(model, worker_id, role)
            self.buf = self.client.create_buffer((rows[1] - rows[0]) * self.COLS * 2)
            self.client.register_layout(wb.ExplicitLayout([wb.Piece("w", [rows[0], 0], [rows[1], self.COLS])]))
        else:
            self.client.register_worker(model, worker_id, role, gpu=gpu)
            self.buf = self.client.create_cuda_buffer(self.SCALES_AT + 16, gpu)
            quant = wb.Quantization(block=[128, 128], scale_offset_bytes=self.SCALES_AT)
            self.client.register_layout(wb.ExplicitLayout([wb.Piece("w", [0, 0], [self.ROWS, self.COLS], quant=quant)]))

    def fill(self, version):
        x = (np.random.default_rng(version).standard_normal((self.ROWS, self.COLS)) * 0.02).astype(np.float32)
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)[self.rows[0]:self.rows[1]]
        self.buf.array("uint16", bits.shape)[:] = bits

    def held(self):
        return self.buf.read(0, self.SCALES_AT + 16)

    def close(self):
        self.client.deregister()
        self.client.close()
        self.buf.close()


@unittest.skipUnless(os.access(EMULATED_DAEMON, os.X_OK) and os.path.exists(os.environ["WB_CUDART"]),
                     "emulated-GPU builds not present (built only with CUDA headers)")
@unittest.skipIf(os.environ.get("WB_SANITIZER"),
                 "sanitizer build: the instrumented emulated runtime cannot be loaded into the uninstrumented python3")
class CudaQuantCatchUpTest(unittest.TestCase):
    """A quantised rollout (fp8_block128) whose weights live in CUDA memory restarts after a commit
    and is caught up from the other fp8 rollout's copy: its fp8 elements and scales, read from that
    rollout's device memory once Apply / the sync commit dropped its staging, copied as they are
    (docs/daemon.md "Catch-up"); the late rollout then holds the other's bytes exactly, before
    wait_version / apply report the version. One standalone daemon (cuda_ipc on the node) and two
    node daemons (copied to host on n0, host_tcp to n1). Before quantised rollouts could serve, the
    restarted rollout was told there was no source."""

    def run_mode(self, mode, across_nodes):
        flags = CudaCatchUpTest.FLAGS
        if across_nodes:
            daemons = EmulatedCluster(2, flags)
            at = lambda node: types.SimpleNamespace(client=lambda prefix: daemons.client(node, prefix))  # noqa: E731
        else:
            daemons = ct.Daemon(EMULATED_DAEMON, flags)
            at = lambda node: daemons  # noqa: E731
        try:
            model = wb.ModelConfig(model_id="py_cuda_quant_catch_up_" + mode, explicit_tensors=[("w", [256, 256])],
                                   num_trainer_workers=2, num_rollout_workers=2, mode=mode)
            late_node = 1 if across_nodes else 0
            trainers = [QuantWorker(at(0), model, "trainer/%d" % r, "trainer", rows=(128 * r, 128 * (r + 1))) for r in (0, 1)]
            rollouts = [QuantWorker(at(0), model, "rollout/0", "rollout", gpu=0),
                        QuantWorker(at(late_node), model, "rollout/1", "rollout", gpu=1)]

            def deliver(v):
                if mode == "sync":
                    for r in rollouts:
                        r.client.begin_update(timeout=ct.TIMEOUT)
                for t in trainers:
                    t.fill(v)
                self.assertEqual(ct.publish_all(trainers, v), [], daemons.log_tail())
                for r in rollouts:
                    self.receive(mode, r, v)
                self.assertEqual(rollouts[0].held(), rollouts[1].held(), daemons.log_tail())

            deliver(1)
            v1 = rollouts[0].held()
            self.assertNotEqual(v1, bytes(len(v1)))
            for t in trainers:
                t.fill(9)
            rollouts[1].close()
            late = QuantWorker(at(late_node), model, "rollout/1", "rollout", gpu=1)
            self.assertEqual(late.held(), bytes(len(v1)))
            if mode == "sync":
                late.client.begin_update(timeout=ct.TIMEOUT)
            self.receive(mode, late, 1)
            # (The trainers hold version 9 by now and are never sources: version 1's bytes can only
            # have come from the other rollout. Not checked in the logs: their tails may have moved
            # past the catch-up's lines.)
            self.assertEqual(late.held(), v1, "the late fp8 rollout does not hold the other's version 1\n" + daemons.log_tail())
            rollouts[1] = late
            deliver(2)
            self.assertNotEqual(rollouts[0].held(), v1)
            for w in trainers + rollouts:
                w.close()
        finally:
            daemons.stop()

    def receive(self, mode, r, v):
        if mode == "sync":
            self.assertGreaterEqual(r.client.wait_version(v, timeout=ct.TIMEOUT), v)
            r.client.end_update(timeout=ct.TIMEOUT)
        else:
            self.assertEqual(r.client.apply(v, timeout=ct.TIMEOUT).applied_version, v)

    def test_sync(self):
        self.run_mode("sync", across_nodes=False)

    def test_one_step_off(self):
        self.run_mode("one_step_off", across_nodes=False)

    def test_async_across_nodes(self):
        self.run_mode("async", across_nodes=True)

    def test_sync_across_nodes(self):
        self.run_mode("sync", across_nodes=True)


def shm_segment_of(buf):
    """The file behind emulated CUDA buffer `buf`: the shm name its IPC handle carries (the
    emulation's handle: magic, pid, device, size, then the name; tests/fake_cuda/fake_cudart.cc)."""
    return "/dev/shm" + buf.ipc_handle[24:64].split(b"\0")[0].decode()


def maps_file(pid, path):
    """Whether process `pid` maps file `path` (an unlinked one shows as "<path> (deleted)")."""
    with open("/proc/%d/maps" % pid) as f:
        return any(len(parts) > 5 and parts[5] == path for parts in (line.split() for line in f))


class _PointerAttributes(ctypes.Structure):  # cudaPointerAttributes (CUDA 13's driver_types.h)
    # `reserved` too: the runtime clears the whole struct (a shorter one here would be overrun).
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 8)]


def is_device_memory(ptr):
    """cudaPointerGetAttributes says `ptr` is live device memory (cudaMemoryTypeDevice)."""
    from weightbridge import cuda
    a = _PointerAttributes()
    err = cuda._rt().cudaPointerGetAttributes(ctypes.byref(a), ctypes.c_void_p(ptr))
    if err != 0:
        raise AssertionError("cudaPointerGetAttributes: cudaError %d" % err)
    return a.type == 2


class DeviceView:
    """A stand-in for the torch CUDA view bind() puts in param.data (torch is not installed here):
    local tensor `place` of emulated CudaBuffer `buf`. copy_ reads its source through the runtime,
    so copying from a view of a freed buffer fails as reading freed memory would."""

    def __init__(self, buf, place):
        self.buf, self.offset, self.nbytes = buf, place.offset_bytes, int(np.prod(place.shape)) * ct.ELEM

    def bytes(self):
        return self.buf.read(self.offset, self.nbytes)

    def copy_(self, src):
        self.buf.write(self.offset, src.bytes() if isinstance(src, DeviceView) else np.ascontiguousarray(src).tobytes())


class LiveViews:
    """A stand-in for a CUDA hook's views when the parameters are numpy arrays: local tensor
    `name` read from the emulated buffer at the moment it is looked up (what a device-to-device
    copy would read then)."""

    def __init__(self, hook):
        self.hook = hook

    def __getitem__(self, name):
        t = self.hook.layout.tensors[name]
        n = int(np.prod(t.shape)) * ct.ELEM
        return np.frombuffer(self.hook.buffer.read(t.offset_bytes, n), np.uint16).reshape(t.shape)


def live_views(hook):
    hook._np_views = LiveViews(hook)


class Param:
    def __init__(self, data):
        self.data = data


@unittest.skipUnless(os.access(EMULATED_DAEMON, os.X_OK) and os.path.exists(os.environ["WB_CUDART"]),
                     "emulated-GPU builds not present (built only with CUDA headers)")
@unittest.skipIf(os.environ.get("WB_SANITIZER"),
                 "sanitizer build: the instrumented emulated runtime cannot be loaded into the uninstrumented python3")
class CudaRolloutSleepTest(unittest.TestCase):
    """An engine that sleeps between rollouts (vLLM sleep mode, SGLang release_memory_occupation):
    RolloutHook.release leaves the daemon and frees the rank's CUDA buffer, reacquire registers it
    again with a new, empty buffer, and versions land as before. Megatron tp=2 trainers (host
    memory) -> vLLM tp=1 rollouts in emulated CUDA memory; the rollout's buffer is read back at
    each local tensor's place and compared with vLLM's tensors of the version, built in
    integrations_test independently of the daemon. Emulated GPUs and numpy stand-ins only."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = ct.Daemon(EMULATED_DAEMON, CudaCatchUpTest.FLAGS)
        with open(TINY_CONFIG) as f:
            cls.config = f.read()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def model(self, model_id, mode, rollouts):
        return wb.ModelConfig(model_id=model_id, hf_config_json=self.config, num_trainer_workers=2,
                              num_rollout_workers=rollouts, mode=mode)

    def trainers(self, model):
        return [megatron.MegatronTrainerHook(None, model, rank=r, tp=2, client=self.daemon.client("meg")) for r in (0, 1)]

    def rollout(self, model, replica=0, replicas=1, memory="cuda"):
        return vllm.VllmRollout(None, model, tp=1, replica=replica, replicas=replicas, memory=memory,
                                gpu=replica if memory == "cuda" else -1, client=self.daemon.client("vsl"))

    def deliver(self, mode, v, trainers, rollouts, params=None):
        """Version v from the trainers into `rollouts` (sync: their updates and the publishes at once)."""
        c = canonical(v)
        params = params or [None] * len(rollouts)
        publishes = [lambda t=t, r=r: t.publish(v, megatron_tp2(c, r).items(), timeout=ct.TIMEOUT)
                     for r, t in enumerate(trainers)]
        if mode == "sync":
            updates = [lambda h=h, p=p: h.update(v, p, timeout=ct.TIMEOUT) for h, p in zip(rollouts, params)]
            self.assertEqual(run_all(updates + publishes), [], self.daemon.log_tail())
        else:
            self.assertEqual(run_all(publishes), [], self.daemon.log_tail())
            for h, p in zip(rollouts, params):
                self.assertEqual(h.apply(v, p, timeout=ct.TIMEOUT), v)

    def assert_holds(self, hook, v):
        """The rollout's CUDA buffer holds vLLM's tensors of version v, byte for byte."""
        want = vllm_tp(canonical(v), 1, 0)
        self.assertEqual(set(hook.layout.tensors), set(want))
        for name, t in hook.layout.tensors.items():
            n = int(np.prod(t.shape)) * ct.ELEM
            got = np.frombuffer(hook.buffer.read(t.offset_bytes, n), np.uint16).reshape(t.shape)
            np.testing.assert_array_equal(got, want[name], err_msg="%s %s v%d" % (hook.worker_id, name, v))

    def assert_empty(self, hook):
        self.assertEqual([b.id for b in hook.client.buffers], [0], "buffer ids start at 0 again")
        self.assertIs(hook.client.buffers[0], hook.buffer)
        self.assertEqual(hook.buffer.read(0, hook.buffer.size_bytes), bytes(hook.buffer.size_bytes))

    def registered(self, model):
        c = self.daemon.client("st")
        try:
            return sorted(w.worker_id for w in c.status(model_id=model.model_id).workers)
        finally:
            c.close()

    def close(self, hooks):
        for h in hooks:
            h.client.deregister()
            h.client.close()

    def sleep_and_wake(self, mode):
        """One rollout holding v1 sleeps: it leaves the daemon, its device memory is freed (no
        longer device memory here, mapped by neither process); after waking its new buffer is
        empty, and version 2 lands byte for byte."""
        model = self.model("py_sleep_" + mode, mode, 1)
        trainers = self.trainers(model)
        rollout = self.rollout(model)
        self.deliver(mode, 1, trainers, [rollout])
        self.assert_holds(rollout, 1)
        ptr, segment = rollout.buffer.ptr, shm_segment_of(rollout.buffer)
        self.assertTrue(maps_file(self.daemon.proc.pid, segment), "the daemon maps the rollout's buffer while registered")
        self.assertTrue(is_device_memory(ptr))
        rollout.release(timeout=ct.TIMEOUT)
        self.assertEqual(self.registered(model), ["trainer/0", "trainer/1"])
        self.assertEqual(rollout.client.buffers, [])
        self.assertFalse(is_device_memory(ptr), "the rollout's buffer was not freed")
        self.assertFalse(maps_file(self.daemon.proc.pid, segment), "the daemon still maps the freed buffer")
        self.assertFalse(maps_file(os.getpid(), segment))
        rollout.reacquire()
        self.assertEqual(self.registered(model), ["rollout/0", "trainer/0", "trainer/1"])
        self.assert_empty(rollout)
        self.deliver(mode, 2, trainers, [rollout])
        self.assert_holds(rollout, 2)
        self.close(trainers + [rollout])

    def one_sleeps_one_holds(self, mode):
        """Two replicas hold v1; one sleeps and wakes while the other keeps v1: the woken one is
        caught up to v1 (from the other's copy: the trainers' buffers hold other bytes by then)
        before version 2 reaches both."""
        model = self.model("py_sleep_two_" + mode, mode, 2)
        trainers = self.trainers(model)
        rollouts = [self.rollout(model, replica=r, replicas=2) for r in (0, 1)]
        self.deliver(mode, 1, trainers, rollouts)
        for h in rollouts:
            self.assert_holds(h, 1)
        woken = rollouts[1]
        woken.release(timeout=ct.TIMEOUT)
        self.assertEqual(self.registered(model), ["rollout/0", "trainer/0", "trainer/1"])
        for r, t in enumerate(trainers):
            t.write(megatron_tp2(canonical(9), r).items())  # not published: a catch-up that read them would show
        woken.reacquire()
        self.assert_empty(woken)
        if mode == "sync":
            self.assertGreaterEqual(woken.update(1, timeout=ct.TIMEOUT), 1)
        else:
            self.assertEqual(woken.apply(1, timeout=ct.TIMEOUT), 1)
        self.assert_holds(woken, 1)
        self.deliver(mode, 2, trainers, rollouts)
        for h in rollouts:
            self.assert_holds(h, 2)
        self.close(trainers + rollouts)

    def test_sleep_and_wake_sync(self):
        self.sleep_and_wake("sync")

    def test_sleep_and_wake_one_step_off(self):
        self.sleep_and_wake("one_step_off")

    def test_one_sleeps_while_the_other_holds_sync(self):
        self.one_sleeps_one_holds("sync")

    def test_one_sleeps_while_the_other_holds_one_step_off(self):
        self.one_sleeps_one_holds("one_step_off")

    def test_reacquire_binds_parameters_without_reading_the_freed_buffer(self):
        """bind() after loading copies the engine's weights into the buffer; reacquire(params)
        re-points the same parameters into the new buffer without a copy (their views address the
        freed one). torch views are stood in for by DeviceView over the emulated buffers."""
        model = self.model("py_sleep_bind", "one_step_off", 1)
        rollout = self.rollout(model)
        rollout._torch = lambda: {n: DeviceView(rollout.buffer, t) for n, t in rollout.layout.tensors.items()}
        loaded = vllm_tp(canonical(5), 1, 0)
        params = {n: Param(a) for n, a in loaded.items()}
        rollout.bind(params)
        for n, p in params.items():
            self.assertIsInstance(p.data, DeviceView)
            np.testing.assert_array_equal(np.frombuffer(p.data.bytes(), np.uint16).reshape(loaded[n].shape), loaded[n])
        self.assert_holds(rollout, 5)
        rollout.release(timeout=ct.TIMEOUT)
        rollout.reacquire(params)
        self.assert_empty(rollout)
        for n, p in params.items():
            self.assertIs(p.data.buf, rollout.buffer, n)
            self.assertEqual(p.data.bytes(), bytes(p.data.nbytes), n)
        self.close([rollout])

    def test_unbound_cuda_rollout_copies_each_version_into_the_parameters(self):
        """memory="cuda" without bind (the default of the vLLM extension when CUDA graphs are
        captured over the parameters): update / apply copy each landed version into the engine's
        parameters in place, so their addresses - which captured graphs hold - never change; across
        release / reacquire as well. The device views are stood in for by arrays read from the
        emulated buffer when they are read (no torch here); the parameters are numpy arrays."""
        for mode in ("sync", "one_step_off"):
            model = self.model("py_cuda_copy_" + mode, mode, 1)
            trainers = self.trainers(model)
            rollout = self.rollout(model)
            live_views(rollout)
            self.assertFalse(rollout.bound)
            params = {n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}
            addresses = {n: a.__array_interface__["data"][0] for n, a in params.items()}
            for v in (1, 2):
                if v == 2:
                    rollout.release(timeout=ct.TIMEOUT)
                    rollout.reacquire(params)
                    live_views(rollout)
                self.deliver(mode, v, trainers, [rollout], [params])
                for n, want in vllm_tp(canonical(v), 1, 0).items():
                    np.testing.assert_array_equal(params[n], want, err_msg="%s %s v%d" % (mode, n, v))
                    self.assertEqual(params[n].__array_interface__["data"][0], addresses[n], n)
            self.close(trainers + [rollout])

    def test_host_memory_release_and_reacquire(self):
        """memory="host": release frees the shm buffer too (unlinked, mapped by neither process);
        after reacquire the next apply copies the version into the engine's parameters."""
        model = self.model("py_sleep_host", "one_step_off", 1)
        trainers = self.trainers(model)
        rollout = self.rollout(model, memory="host")
        params = [{n: np.zeros_like(a) for n, a in vllm_tp(canonical(0), 1, 0).items()}]
        self.deliver("one_step_off", 1, trainers, [rollout], params)
        segment = "/dev/shm" + rollout.buffer.name
        self.assertTrue(maps_file(self.daemon.proc.pid, segment))
        rollout.release(timeout=ct.TIMEOUT)
        self.assertFalse(os.path.exists(segment))
        self.assertFalse(maps_file(self.daemon.proc.pid, segment), "the daemon still maps the freed shm buffer")
        self.assertFalse(maps_file(os.getpid(), segment), "a view of the hook still maps the freed shm buffer")
        rollout.reacquire(params[0])
        self.deliver("one_step_off", 2, trainers, [rollout], params)
        for n, want in vllm_tp(canonical(2), 1, 0).items():
            np.testing.assert_array_equal(params[0][n], want, err_msg=n)
        self.close(trainers + [rollout])

    def test_refusals_name_the_state(self):
        model = self.model("py_sleep_refusals", "one_step_off", 1)
        rollout = self.rollout(model)
        with self.assertRaisesRegex(RuntimeError, "rollout/0 .*holds its buffer \\(not released\\)"):
            rollout.reacquire()
        with self.assertRaises(wb.WeightBridgeError) as e:
            rollout.client.free_buffers()
        self.assertEqual(e.exception.code.name, "FAILED_PRECONDITION")
        self.assertIn("deregister first", e.exception.message)
        self.assertEqual(rollout.client.buffers, [rollout.buffer], "nothing freed while registered")
        self.assertTrue(is_device_memory(rollout.buffer.ptr))
        rollout.release(timeout=ct.TIMEOUT)
        with self.assertRaisesRegex(RuntimeError, "release: worker rollout/0 .*released its buffer"):
            rollout.release(timeout=ct.TIMEOUT)
        with self.assertRaisesRegex(RuntimeError, "apply\\(1\\): worker rollout/0 .*reacquire\\(\\) first"):
            rollout.apply(1, timeout=ct.TIMEOUT)
        with self.assertRaisesRegex(RuntimeError, "update\\(1\\): worker rollout/0 .*reacquire\\(\\) first"):
            rollout.update(1, timeout=ct.TIMEOUT)
        rollout.reacquire()
        self.assert_empty(rollout)
        self.close([rollout])


class EngineParam:
    """A stand-in for an engine's torch CUDA parameter (torch is not installed here): the
    `shape` tensor of `elem`-byte elements at byte `offset` of emulated device memory `mem` (a
    CudaBuffer or VmmAllocation), with the duck-typed attributes memory="engine" uses."""

    def __init__(self, mem, offset, shape, dtype="torch.bfloat16", elem=2, contiguous=True):
        self.mem, self.offset, self.shape, self.dtype, self.elem = mem, offset, tuple(shape), dtype, elem
        self.contiguous = contiguous
        self.device = types.SimpleNamespace(index=mem.gpu)

    def data_ptr(self):
        return self.mem.ptr + self.offset

    def is_contiguous(self):
        return self.contiguous

    def element_size(self):
        return self.elem

    def nelement(self):
        return int(np.prod(self.shape))

    def nbytes(self):
        return self.nelement() * self.elem

    def value(self):
        return np.frombuffer(self.mem.read(self.offset, self.nbytes()), np.uint16).reshape(self.shape)


GAP = 384  # bytes between the engine's parameters (never written by a version)
GARBAGE = 0xAB


def scatter(shapes, allocations, gpu, kind="cuda"):
    """The engine's parameters laid out NOT like the packed preset buffer: in reverse order, dealt
    round-robin over `allocations` allocations (CudaBuffer, or kind="vmm": ONE VmmAllocation made of
    that many allocations mapped back to back, parameters crossing their boundaries), each after a
    GAP-byte gap. Every byte is GARBAGE first. Returns (memories, {name: EngineParam})."""
    from weightbridge.cuda import CudaBuffer, VmmAllocation
    names = list(reversed(list(shapes)))
    slots = 1 if kind == "vmm" else allocations
    placed, ends = {}, [0] * slots
    for i, n in enumerate(names):
        k = i % slots
        placed[n] = (k, ends[k] + GAP)
        ends[k] += GAP + int(np.prod(shapes[n])) * ct.ELEM
    if kind == "vmm":
        mems = [VmmAllocation(ends[0] + GAP, gpu, allocations=allocations)]
    else:
        mems = [CudaBuffer(e + GAP, gpu) for e in ends]
    for m in mems:
        m.write(0, bytes([GARBAGE]) * m.size_bytes)
    return mems, {n: EngineParam(mems[k], off, shapes[n]) for n, (k, off) in placed.items()}


_TORCH_DTYPES = {"bfloat16": "torch.bfloat16", "float16": "torch.float16", "float32": "torch.float32",
                 "float8_e4m3": "torch.float8_e4m3fn", "float8_e8m0": "torch.uint8"}


def scatter_places(places, allocations, gpu):
    """scatter() for local tensors of any dtype: `places` (LayoutDescription.tensors) gives each
    parameter's shape, dtype and bytes; dealt in reverse order over `allocations` CudaBuffers after
    GAP-byte gaps, every byte GARBAGE first. Returns (memories, {name: EngineParam})."""
    from weightbridge.cuda import CudaBuffer
    names = [n for n, t in reversed(list(places.items())) if t.pieces or t.scales_of]
    placed, ends = {}, [0] * allocations
    for i, n in enumerate(names):
        k = i % allocations
        placed[n] = (k, ends[k] + GAP)
        ends[k] += GAP + places[n].size_bytes
    mems = [CudaBuffer(e + GAP, gpu) for e in ends]
    for m in mems:
        m.write(0, bytes([GARBAGE]) * m.size_bytes)
    params = {}
    for n, (k, off) in placed.items():
        t = places[n]
        elem = t.size_bytes // max(1, int(np.prod(t.shape)))
        params[n] = EngineParam(mems[k], off, t.shape, dtype=_TORCH_DTYPES[t.dtype], elem=elem)
    return mems, params


def gaps_untouched(mems, params):
    """Whether every byte outside the parameters still holds GARBAGE."""
    for m in mems:
        raw = bytearray(m.read(0, m.size_bytes))
        for p in params.values():
            if p.mem is m:
                raw[p.offset:p.offset + p.nbytes()] = bytes([GARBAGE]) * p.nbytes()
        if raw != bytes([GARBAGE]) * m.size_bytes:
            return False
    return True


class CuMemAllocatorMemory:
    """Device memory allocated as vLLM's sleep-mode allocator allocates it (vllm-project/vllm
    csrc/cumem_allocator.cpp, my_malloc + create_and_map, read at commit
    0035e224f4bb39065187bddf4b5ae20ffe1bf945): `CUmemAllocationProp prop = {}` with type PINNED and
    the device as location - requestedHandleTypes left 0, CU_MEM_HANDLE_TYPE_NONE - then
    cuMemAddressReserve, cuMemCreate, cuMemMap and cuMemSetAccess. No process but this one can
    map it: cuMemExportToShareableHandle refuses it."""

    def __init__(self, size_bytes, gpu):
        from weightbridge import cuda
        self.gpu = gpu
        cuda._check(cuda._rt().cudaSetDevice(gpu), "cudaSetDevice")
        prop = cuda._AllocProp(type=cuda._CU_MEM_ALLOCATION_TYPE_PINNED,
                               location=cuda._Location(cuda._CU_MEM_LOCATION_TYPE_DEVICE, gpu))
        g = ctypes.c_size_t()
        cuda._cu("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop), cuda._CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.size_bytes = (size_bytes + g.value - 1) // g.value * g.value
        va, self.handle = cuda._CU_DEVICEPTR(), cuda._CU_HANDLE()
        cuda._cu("cuMemAddressReserve", ctypes.byref(va), self.size_bytes, 0, cuda._CU_DEVICEPTR(0), 0)
        cuda._cu("cuMemCreate", ctypes.byref(self.handle), self.size_bytes, ctypes.byref(prop), 0)
        cuda._cu("cuMemMap", va, self.size_bytes, 0, self.handle, 0)
        access = cuda._AccessDesc(location=cuda._Location(cuda._CU_MEM_LOCATION_TYPE_DEVICE, gpu),
                                  flags=cuda._CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        cuda._cu("cuMemSetAccess", va, self.size_bytes, ctypes.byref(access), 1)
        self.ptr = va.value

    def close(self):
        from weightbridge import cuda
        cuda._cu("cuMemUnmap", cuda._CU_DEVICEPTR(self.ptr), self.size_bytes)
        cuda._cu("cuMemAddressFree", cuda._CU_DEVICEPTR(self.ptr), self.size_bytes)
        cuda._cu("cuMemRelease", self.handle)


class PoolMemory(cuda._DeviceBytes):
    """`size_bytes` of stream-ordered memory-pool memory on `gpu`, as torch's
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync allocates it: cudaMallocAsync on the legacy
    stream, from the device's default pool (cudaDeviceGetDefaultMemPool: `pool`). Legacy CUDA IPC
    cannot export it. close() frees it with cudaFreeAsync."""

    def __init__(self, size_bytes, gpu):
        self.gpu, self.size_bytes = gpu, size_bytes
        rt = cuda._rt()
        cuda._check(rt.cudaSetDevice(gpu), "cudaSetDevice")
        p, pool = ctypes.c_void_p(), ctypes.c_void_p()
        cuda._check(rt.cudaMallocAsync(ctypes.byref(p), ctypes.c_size_t(size_bytes), None), "cudaMallocAsync")
        cuda._check(rt.cudaStreamSynchronize(None), "cudaStreamSynchronize")
        cuda._check(rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), gpu), "cudaDeviceGetDefaultMemPool")
        self.ptr, self.pool = p.value, pool.value

    def close(self):
        rt = cuda._rt()
        cuda._check(rt.cudaFreeAsync(ctypes.c_void_p(self.ptr), None), "cudaFreeAsync")
        cuda._check(rt.cudaStreamSynchronize(None), "cudaStreamSynchronize")
        self.ptr = 0


def pool_refusal(mem):
    """The ValueError message for stream-ordered pool memory `mem` (cuda.not_ipc_capable): the
    range, the reason, and both ways out."""
    return (r"\[0x%x, \+%d\) on GPU %d is stream-ordered memory-pool memory \(pool 0x%x; cudaMallocAsync.*"
            r"backend:cudaMallocAsync.*cannot export it.*native caching allocator.*expandable_segments:True.*"
            r"memory='cuda' \(WeightBridge owns the buffer and copies" % (mem.ptr, mem.size_bytes, mem.gpu, mem.pool))


@unittest.skipUnless(os.access(EMULATED_DAEMON, os.X_OK) and os.path.exists(os.environ["WB_CUDART"]),
                     "emulated-GPU builds not present (built only with CUDA headers)")
@unittest.skipIf(os.environ.get("WB_SANITIZER"),
                 "sanitizer build: the instrumented emulated runtime cannot be loaded into the uninstrumented python3")
class CudaEngineMemoryTest(unittest.TestCase):
    """memory="engine": the engine's OWN parameter memory is registered (cudaMalloc memory by CUDA
    IPC of each allocation's base, VMM memory by fd) and versions land in the parameters
    themselves, at their addresses, with nothing copied by the hook. Megatron tp=2 trainers (host
    memory) -> a vLLM tp=1 rollout whose parameters are emulated device memory laid out unlike
    the preset's packed buffer (reverse order, gaps, spread over allocations); every parameter is
    read back through the runtime and compared with vLLM's tensors of the version, built in
    integrations_test independently of the daemon. Emulated GPUs and duck-typed stand-ins for
    torch parameters only: says nothing about a real vLLM or a real GPU."""

    setUpClass = classmethod(CudaRolloutSleepTest.setUpClass.__func__)
    tearDownClass = classmethod(CudaRolloutSleepTest.tearDownClass.__func__)
    model = CudaRolloutSleepTest.model
    trainers = CudaRolloutSleepTest.trainers
    deliver = CudaRolloutSleepTest.deliver
    registered = CudaRolloutSleepTest.registered
    close = CudaRolloutSleepTest.close

    def shapes(self):
        return {n: a.shape for n, a in vllm_tp(canonical(0), 1, 0).items()}

    def engine_rollout(self, model, params, gpu=0):
        return vllm.VllmRollout(None, model, tp=1, memory="engine", params=params, gpu=gpu,
                                client=self.daemon.client("veng"))

    def assert_params_hold(self, params, v, what):
        want = vllm_tp(canonical(v), 1, 0)
        self.assertEqual(set(params), set(want))
        for n, p in params.items():
            np.testing.assert_array_equal(p.value(), want[n], err_msg="%s %s v%d" % (what, n, v))

    def run_engine(self, mode, allocations, kind="cuda"):
        model = self.model("py_engine_%s_%d_%s" % (kind, allocations, mode), mode, 1)
        trainers = self.trainers(model)
        mems, params = scatter(self.shapes(), allocations, 0, kind)
        addresses = {n: p.data_ptr() for n, p in params.items()}
        rollout = self.engine_rollout(model, params)
        bufs = rollout.client.buffers
        # One buffer per allocation (VMM: per run of allocations mapped back to back), not per tensor.
        self.assertEqual(len(bufs), 1 if kind == "vmm" else allocations, [b.id for b in bufs])
        if kind == "vmm":
            self.assertEqual(len(bufs[0].vmm_next_keys), allocations - 1)
        else:
            self.assertEqual(sorted(b.ptr for b in bufs), sorted(m.ptr for m in mems))
        self.assertEqual(self.registered(model), ["rollout/0", "trainer/0", "trainer/1"])
        what = "%s %s x%d" % (mode, kind, allocations)
        for v in (1, 2, 3):
            if v == 3:
                rollout.release(timeout=ct.TIMEOUT)
                self.assertEqual(rollout.client.buffers, [])
                for m in mems:  # never freed: the engine's memory, still holding v2
                    self.assertTrue(is_device_memory(m.ptr))
                self.assert_params_hold(params, 2, what + " released")
                with self.assertRaisesRegex(RuntimeError, "reacquire\(\) first"):
                    rollout.apply(3, timeout=ct.TIMEOUT)
                rollout.reacquire()
                self.assertEqual(len(rollout.client.buffers), len(bufs))
                self.assertEqual(self.registered(model), ["rollout/0", "trainer/0", "trainer/1"])
            self.deliver(mode, v, trainers, [rollout], [params])
            self.assert_params_hold(params, v, what)
            self.assertTrue(gaps_untouched(mems, params), "%s v%d: a version wrote outside the parameters" % (what, v))
            self.assertEqual({n: p.data_ptr() for n, p in params.items()}, addresses)
            self.assertIs(rollout.view("model.embed_tokens.weight"), params["model.embed_tokens.weight"])
        self.close(trainers + [rollout])
        for m in mems:
            self.assertTrue(is_device_memory(m.ptr), "the hook freed the engine's memory")
            m.close()

    def test_sync_two_allocations(self):
        self.run_engine("sync", 2)

    def test_one_step_off_two_allocations(self):
        self.run_engine("one_step_off", 2)

    def test_one_step_off_one_allocation_per_parameter(self):
        self.run_engine("one_step_off", len(self.shapes()))

    def test_sync_vmm_segment_of_three_allocations(self):
        self.run_engine("sync", 3, kind="vmm")

    def test_vllm_extension_engine_memory(self):
        """wb_init(memory="engine") on a stand-in vLLM worker registers the named parameters'
        memory; wb_apply lands versions in them; wb_sleep / wb_wake deregister and register the
        same memory again."""
        model = self.model("py_engine_ext", "one_step_off", 1)
        trainers = self.trainers(model)
        mems, params = scatter(self.shapes(), 2, 0)
        worker = fake_vllm_worker(params)
        self.assertEqual(worker.wb_init(self.daemon.socket, model, memory="engine"), 0)
        self.assertEqual(worker.wb.memory, "engine")
        self.assertEqual(len(worker.wb.client.buffers), 2)
        for v in (1, 2):
            if v == 2:
                worker.wb_sleep(timeout=ct.TIMEOUT)
                self.assertEqual(worker.wb_wake(), 0)
            self.assertEqual(run_all([lambda t=t, r=r: t.publish(v, megatron_tp2(canonical(v), r).items(), timeout=ct.TIMEOUT)
                                      for r, t in enumerate(trainers)]), [])
            self.assertEqual(worker.wb_apply(v, timeout=ct.TIMEOUT), v)
            self.assert_params_hold(params, v, "extension")
            self.assertTrue(gaps_untouched(mems, params))
        self.close(trainers + [worker.wb])
        for m in mems:
            m.close()

    def test_fp8_block128_engine_memory_holds_what_a_cuda_buffer_holds(self):
        """Quantised preset (fp8_block128: float8_e4m3 weights and their float32 "_scale_inv"
        tensors): the engine's fp8 parameters and scale parameters, scattered over two allocations
        in reverse order with gaps, receive exactly the bytes replica 0 - the same preset in a
        memory="cuda" buffer, the path the quantised end-to-end tests check - holds at each local
        tensor's place (the pieces' and their scales' offsets re-based through two parameters)."""
        model = wb.ModelConfig(model_id="py_engine_fp8", hf_config_json=self.config, num_trainer_workers=2,
                               num_rollout_workers=2, mode="one_step_off")
        trainers = self.trainers(model)
        ref = vllm.VllmRollout(None, model, tp=1, replica=0, replicas=2, memory="cuda", gpu=0, quantization="fp8_block128",
                               client=self.daemon.client("vq0"))
        places = ref.layout.tensors
        self.assertTrue(any(t.dtype == "float8_e4m3" for t in places.values()))
        self.assertTrue(any(t.scales_of for t in places.values()))
        mems, params = scatter_places(places, 2, 1)
        engine = vllm.VllmRollout(None, model, tp=1, replica=1, replicas=2, memory="engine", params=params, gpu=1,
                                  quantization="fp8_block128", client=self.daemon.client("vq1"))
        for v in (1, 2):
            self.deliver("one_step_off", v, trainers, [ref, engine])
            for n, t in places.items():
                want = ref.buffer.read(t.offset_bytes, t.size_bytes)
                got = params[n].mem.read(params[n].offset, params[n].nbytes())
                self.assertEqual(got, want, "%s v%d" % (n, v))
                self.assertNotEqual(want, bytes(len(want)), "%s v%d: nothing landed" % (n, v))
            self.assertTrue(gaps_untouched(mems, params), "v%d: a version wrote outside the parameters" % v)
        self.close(trainers + [ref, engine])
        for m in mems:
            m.close()

    def test_mismatched_parameters_refused_before_anything_is_registered(self):
        model = self.model("py_engine_refused", "one_step_off", 1)
        shapes = self.shapes()
        victim = "model.layers.0.self_attn.qkv_proj.weight"
        self.assertIn(victim, shapes)
        cases = []
        short = dict(shapes)
        short[victim] = (shapes[victim][0] - 1,) + tuple(shapes[victim][1:])
        cases.append((short, None, ValueError, "engine parameter %s \(shape %s.*sizes differ" % (re.escape(victim),
                                                                                                 re.escape(str(short[victim])))))
        flat = dict(shapes)
        flat[victim] = (shapes[victim][1], shapes[victim][0])  # same bytes, transposed shape
        cases.append((flat, None, ValueError, "engine parameter %s .*shapes differ" % re.escape(victim)))
        cases.append((shapes, "noncontiguous", ValueError, "engine parameter %s .*not contiguous" % re.escape(victim)))
        cases.append((shapes, "float32", ValueError, "engine parameter %s .*(sizes|dtypes) differ" % re.escape(victim)))
        cases.append((shapes, "missing", KeyError, "no parameter for 1 local tensors: %s" % re.escape(victim)))
        for shp, twist, err, pattern in cases:
            mems, params = scatter(shp, 2, 0)
            if twist == "noncontiguous":
                params[victim].contiguous = False
            elif twist == "float32":
                params[victim].dtype = "torch.float32"
            elif twist == "missing":
                del params[victim]
            client = self.daemon.client("vref")
            with self.assertRaisesRegex(err, pattern):
                vllm.VllmRollout(None, model, tp=1, memory="engine", params=params, gpu=0, client=client)
            self.assertEqual(client.buffers, [], twist)
            with self.assertRaisesRegex(wb.WeightBridgeError, "NOT_FOUND: status filter: unknown model"):
                self.registered(model)  # nobody registered: the model was never even created
            client.close()
            for m in mems:
                m.close()
        with self.assertRaisesRegex(ValueError, "needs params"):
            vllm.VllmRollout(None, model, tp=1, memory="engine", gpu=0, client=self.daemon.client("vref"))

    def test_vllm_sleep_mode_memory_refused_before_anything_is_registered(self):
        """vLLM's sleep-mode allocator creates VMM memory without a POSIX fd handle type
        (CuMemAllocatorMemory): the daemon could never map it, so memory="engine" refuses it -
        naming the parameter and memory='cuda' - before the worker registers, and
        add_cuda_vmm_buffer refuses it before anything is offered."""
        model = self.model("py_engine_cumem", "one_step_off", 1)
        shapes = self.shapes()
        mem = CuMemAllocatorMemory(sum(int(np.prod(s)) * ct.ELEM + GAP for s in shapes.values()), 0)
        params, off = {}, 0
        for n, s in shapes.items():
            params[n] = EngineParam(mem, off, s)
            off += int(np.prod(s)) * ct.ELEM + GAP
        client = self.daemon.client("vcumem")
        with self.assertRaisesRegex(ValueError, "memory='engine': engine parameter .*CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
                                                ".*sleep-mode CuMemAllocator.*use memory='cuda'"):
            vllm.VllmRollout(None, model, tp=1, memory="engine", params=params, gpu=0, client=client)
        self.assertEqual(client.buffers, [])
        with self.assertRaisesRegex(wb.WeightBridgeError, "NOT_FOUND: status filter: unknown model"):
            self.registered(model)  # nobody registered: the model was never even created
        client.register_worker(model, "rollout/0", "rollout", gpu=0)
        with self.assertRaisesRegex(ValueError, "add_cuda_vmm_buffer: CUDA VMM allocation .*CU_MEM_HANDLE_TYPE_POSIX"):
            client.add_cuda_vmm_buffer(mem.ptr, 256, 0)
        self.assertEqual((client.buffers, client._vmm), ([], {}))
        client.deregister()
        client.close()
        mem.close()

    def test_stream_ordered_pool_memory_refused_before_anything_is_registered(self):
        """Memory from cudaMallocAsync (torch's backend:cudaMallocAsync) cannot be exported by legacy
        CUDA IPC: the driver says so (CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE /
        IS_LEGACY_CUDA_IPC_CAPABLE), and add_cuda_ipc_buffer and memory="engine" refuse it with a
        ValueError naming the range, the reason and what to use instead - before cudaIpcGetMemHandle,
        and before anything reaches the daemon - while cudaMalloc memory of the same worker
        still registers and receives versions."""
        from weightbridge.cuda import CudaBuffer
        pool = PoolMemory(8192, 0)
        alloc = cuda.device_allocation_of(pool.ptr + 100, shareable=False)
        self.assertEqual((alloc.base, alloc.size, alloc.gpu, alloc.vmm, alloc.legacy_ipc, alloc.mempool),
                         (pool.ptr, 8192, 0, False, False, pool.pool))
        with self.assertRaisesRegex(ValueError, pool_refusal(pool)):
            cuda.device_allocation_of(pool.ptr + 100)
        # memory="engine" over pool memory: refused before the worker registers.
        model = self.model("py_engine_pool", "one_step_off", 1)
        shapes = self.shapes()
        params, off = {}, 0
        engine_mem = PoolMemory(sum(int(np.prod(sh)) * ct.ELEM + GAP for sh in shapes.values()), 0)
        for n, sh in shapes.items():
            params[n] = EngineParam(engine_mem, off, sh)
            off += int(np.prod(sh)) * ct.ELEM + GAP
        client = self.daemon.client("vpool")
        with self.assertRaisesRegex(ValueError, "memory='engine': engine parameter [^:]+: " + pool_refusal(engine_mem)):
            vllm.VllmRollout(None, model, tp=1, memory="engine", params=params, gpu=0, client=client)
        self.assertEqual(client.buffers, [])
        with self.assertRaisesRegex(wb.WeightBridgeError, "NOT_FOUND: status filter: unknown model"):
            self.registered(model)  # nobody registered: the model was never even created
        client.close()
        # add_cuda_ipc_buffer: the worker's cudaMalloc memory registers, its pool memory is refused
        # and nothing of it reaches the daemon; versions land in the cudaMalloc buffer.
        model = wb.ModelConfig(model_id="py_engine_ipc_pool", explicit_tensors=ct.CANONICAL, num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        trainer = ct.Worker(self.daemon, model, "trainer/0", "trainer", ct.FULL)
        layout, index = ct.row_blocks(ct.FULL)
        mem = CudaBuffer(index.size * ct.ELEM, 0)
        c = self.daemon.client("vipcpool")
        c.register_worker(model, "rollout/0", "rollout", gpu=0)
        with self.assertRaisesRegex(ValueError, pool_refusal(pool)):
            c.add_cuda_ipc_buffer(pool.ptr, 64, 0)
        self.assertEqual(c.buffers, [])
        b = c.add_cuda_ipc_buffer(mem.ptr, mem.size_bytes, 0)
        with self.assertRaisesRegex(ValueError, pool_refusal(pool)):
            c.add_cuda_ipc_buffer(pool.ptr + 4096, 16, 0)
        self.assertEqual(c.buffers, [b])
        info = c.register_layout(layout)
        self.assertEqual(len(info.layout.buffers), 1)
        self.assertTrue(maps_file(self.daemon.proc.pid, shm_segment_of(b)), "the daemon maps the cudaMalloc buffer")
        self.assertEqual(self.registered(model), ["rollout/0", "trainer/0"])
        ct.fill(trainer.buf, trainer.index, 2)
        trainer.client.publish(2, timeout=ct.TIMEOUT)
        self.assertEqual(c.apply(2, timeout=ct.TIMEOUT).applied_version, 2)
        got = np.frombuffer(mem.read(0, mem.size_bytes), np.uint16)
        np.testing.assert_array_equal(got, weights.values_for_indices(ct.BASES, 2, index, ct.ELEM))
        for w in (c, trainer.client):
            w.deregister()
            w.close()
        for m in (mem, pool, engine_mem):
            m.close()

    def test_pool_memory_left_to_cuda_ipc_where_the_driver_cannot_tell(self):
        """A driver that cannot answer cuPointerGetAttribute (an old one: no entry point, or the
        attribute unknown): nothing is refused up front, cudaIpcGetMemHandle decides as before -
        RuntimeError for pool memory, cudaMalloc memory exported as usual."""
        from weightbridge.cuda import CudaBuffer
        pool = PoolMemory(4096, 1)
        mem = CudaBuffer(4096, 1)
        real = cuda._driver

        def without(name):
            if name == "cuPointerGetAttribute":
                raise RuntimeError("CUDA driver call cuPointerGetAttribute not found")
            return real(name)

        def unknown_attribute(name):
            if name == "cuPointerGetAttribute":
                return lambda *args: 1  # CUDA_ERROR_INVALID_VALUE: a driver older than the attribute
            return real(name)

        for driver in (without, unknown_attribute):
            with mock.patch.object(cuda, "_driver", side_effect=driver):
                alloc = cuda.device_allocation_of(pool.ptr + 8)
                self.assertEqual((alloc.base, alloc.legacy_ipc, alloc.mempool), (pool.ptr, None, 0), driver.__name__)
                c = self.daemon.client("vold")
                with self.assertRaisesRegex(RuntimeError, "cudaIpcGetMemHandle failed: invalid argument"):
                    c.add_cuda_ipc_buffer(pool.ptr, 16, 1)
                self.assertEqual(c.buffers, [])
                b = c.add_cuda_ipc_buffer(mem.ptr + 8, 16, 1)
                self.assertEqual((b.base, b.size_bytes, len(b.ipc_handle)), (mem.ptr, 4096, 64))
                c.close()
        self.assertTrue(cuda.device_allocation_of(mem.ptr).legacy_ipc, "the driver says cudaMalloc memory is capable")
        mem.close()
        pool.close()

    def test_ipc_buffer_over_memory_we_did_not_allocate(self):
        """add_cuda_ipc_buffer: the whole cudaMalloc allocation holding a pointer, one buffer per
        allocation, never freed by close(); VMM memory refused (it has its own path)."""
        from weightbridge.cuda import CudaBuffer, VmmAllocation
        model = wb.ModelConfig(model_id="py_engine_ipc", explicit_tensors=ct.CANONICAL, num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        mem = CudaBuffer(4096, 1)
        c = self.daemon.client("vipc")
        c.register_worker(model, "rollout/0", "rollout", gpu=1)
        b = c.add_cuda_ipc_buffer(mem.ptr + 1000, 100, 1)
        self.assertEqual((b.id, b.ptr, b.base, b.size_bytes, b.gpu), (0, mem.ptr, mem.ptr, 4096, 1))
        self.assertIs(c.add_cuda_ipc_buffer(mem.ptr + 3000, 16), b, "one buffer per allocation")
        self.assertEqual(len(c.buffers), 1)
        with self.assertRaisesRegex(ValueError, "run past the end"):
            c.add_cuda_ipc_buffer(mem.ptr + 4000, 100)
        with self.assertRaisesRegex(ValueError, "lives on GPU 1, not GPU 0"):
            c.add_cuda_ipc_buffer(mem.ptr, 16, 0)
        v = VmmAllocation(1, 1)
        with self.assertRaisesRegex(ValueError, "CUDA VMM memory"):
            c.add_cuda_ipc_buffer(v.ptr, 16)
        c.deregister()
        c.free_buffers()
        self.assertTrue(is_device_memory(mem.ptr), "free_buffers freed memory that is not the client's")
        c.close()
        v.close()
        mem.close()


# Buffer j of a VMM worker sits at VMM_OFFSETS[j] of its one allocation: neither offset is 0, so a
# daemon that ignored them would put bytes in the wrong place.
VMM_OFFSETS = (4096, (1 << 20) + 256)


class VmmWorker:
    """A worker whose weights live in ONE weightbridge.cuda.VmmAllocation on `gpu`, registered as two
    buffers (the first two row blocks, then the rest) at VMM_OFFSETS inside it."""

    def __init__(self, daemon, model, worker_id, role, blocks, gpu):
        from weightbridge.cuda import VmmAllocation
        self.client = daemon.client("v")
        self.client.register_worker(model, worker_id, role, gpu=gpu)
        self.alloc = VmmAllocation(1, gpu)  # rounded up to the 2 MiB granularity
        l0, i0 = ct.row_blocks(blocks[:2])
        l1, i1 = ct.row_blocks(blocks[2:])
        self.index = (i0, i1)
        self.bufs = [self.client.add_cuda_vmm_buffer(self.alloc.ptr + off, i.size * ct.ELEM)
                     for off, i in zip(VMM_OFFSETS, self.index)]
        pieces = l0.pieces + [dataclasses.replace(p, buffer_id=1) for p in l1.pieces]
        self.layout = wb.ExplicitLayout(pieces)
        self.info = self.client.register_layout(self.layout)

    def fill(self, version):
        for off, index in zip(VMM_OFFSETS, self.index):
            self.alloc.write(off, weights.values_for_indices(ct.BASES, version, index, ct.ELEM).astype(np.uint16).tobytes())

    def mismatches(self, version):
        n = 0
        for off, index in zip(VMM_OFFSETS, self.index):
            got = np.frombuffer(self.alloc.read(off, index.size * ct.ELEM), dtype=np.uint16)
            n += int(np.count_nonzero(got != weights.values_for_indices(ct.BASES, version, index, ct.ELEM).astype(np.uint16)))
        return n

    def close(self):
        self.client.deregister()
        self.client.close()
        self.alloc.close()


G = 2 << 20  # the emulated allocation granularity
# A "tensor" in the middle of a three-allocation segment: [G - 200, 2G + 200) of it, crossing both
# boundaries; the first two row blocks straddle the first boundary, the rest the second.
SPAN_START, SPAN_BYTES = G - 200, G + 400
SPAN_PIECE_OFFSETS = (50, G + 170)


class SegmentWorker:
    """A worker whose weights sit in one buffer that spans three allocations mapped back to back
    (weightbridge.cuda.VmmAllocation(..., allocations=3): what torch's expandable segments do, one
    allocation per page), at a pointer in the middle of the segment, with pieces across the
    allocation boundaries."""

    def __init__(self, daemon, model, worker_id, role, blocks, gpu):
        from weightbridge.cuda import VmmAllocation
        self.client = daemon.client("s")
        self.client.register_worker(model, worker_id, role, gpu=gpu)
        self.seg = VmmAllocation(3 * G, gpu, allocations=3)
        l0, i0 = ct.row_blocks(blocks[:2])
        l1, i1 = ct.row_blocks(blocks[2:])
        self.index = (i0, i1)
        self.buf = self.client.add_cuda_vmm_buffer(self.seg.ptr + SPAN_START, SPAN_BYTES)
        pieces = ([dataclasses.replace(p, offset_bytes=p.offset_bytes + SPAN_PIECE_OFFSETS[0]) for p in l0.pieces]
                  + [dataclasses.replace(p, offset_bytes=p.offset_bytes + SPAN_PIECE_OFFSETS[1]) for p in l1.pieces])
        self.info = self.client.register_layout(wb.ExplicitLayout(pieces))

    def spans(self):
        """(first piece bytes, last piece bytes) in segment coordinates, for the boundary checks."""
        return [(SPAN_START + off, SPAN_START + off + i.size * ct.ELEM) for off, i in zip(SPAN_PIECE_OFFSETS, self.index)]

    def fill(self, version):
        for (start, _), index in zip(self.spans(), self.index):
            self.seg.write(start, weights.values_for_indices(ct.BASES, version, index, ct.ELEM).astype(np.uint16).tobytes())

    def mismatches(self, version):
        n = 0
        for (start, end), index in zip(self.spans(), self.index):
            got = np.frombuffer(self.seg.read(start, end - start), dtype=np.uint16)
            n += int(np.count_nonzero(got != weights.values_for_indices(ct.BASES, version, index, ct.ELEM).astype(np.uint16)))
        return n

    def close(self):
        self.client.deregister()
        self.client.close()
        self.seg.close()


@unittest.skipUnless(os.access(EMULATED_DAEMON, os.X_OK) and os.path.exists(os.environ["WB_CUDART"]),
                     "emulated-GPU builds not present (built only with CUDA headers)")
@unittest.skipIf(os.environ.get("WB_SANITIZER"),
                 "sanitizer build: the instrumented emulated runtime cannot be loaded into the uninstrumented python3")
class CudaVmmReplayTest(unittest.TestCase):
    """Replays of VMM workers (docs/status.md next steps 11 (f)). First to the SAME daemon (a dropped
    connection, no restart: RegisterWorker answers ALREADY_EXISTS, the fd channel takes each fd again
    in place of the one it holds, RegisterLayout names the same keys), then to a restarted daemon that
    holds none of their fds. Each time every allocation is offered once (not per buffer) and versions
    keep landing in the same VMM memory, every byte checked, a rollout whose buffer spans three
    allocations included."""

    def test_vmm_fds_offered_again_to_the_same_daemon_and_to_a_restarted_one(self):
        import weightbridge.client as wc
        daemon = ct.Daemon(EMULATED_DAEMON, ["--transports=host_shm,host_tcp,cuda_ipc", "--gpu_staging_bytes=268435456"])
        real_offer, offered = wc.offer_vmm_fd, []

        ids = {}  # (worker, key) -> allocation id of every offer

        def counting_offer(channel_path, model_id, worker_id, key, allocation_bytes, fd, timeout=30.0, allocation_id=0):
            offered.append((worker_id, key))
            ids.setdefault((worker_id, key), set()).add(allocation_id)
            return real_offer(channel_path, model_id, worker_id, key, allocation_bytes, fd, timeout=timeout,
                              allocation_id=allocation_id)

        try:
            model = wb.ModelConfig(model_id="py_vmm_replay", explicit_tensors=ct.CANONICAL, num_trainer_workers=2,
                                   num_rollout_workers=1, mode="one_step_off")
            trainers = [VmmWorker(daemon, model, "trainer/%d" % r, "trainer", ct.HALF[r], gpu=r) for r in (0, 1)]
            rollout = SegmentWorker(daemon, model, "rollout/0", "rollout", ct.FULL, gpu=1)
            workers = trainers + [rollout]
            want = sorted([(w.client.worker_id, k) for w in workers for k in w.client._vmm])
            self.assertEqual(len(want), 5, "one allocation per VMM trainer, three for the segment")

            def versions(vs, when):
                for v in vs:
                    for t in trainers:
                        t.fill(v)
                        self.assertEqual(t.client.publish(v, timeout=ct.TIMEOUT).version, v)
                    self.assertEqual(rollout.client.apply(v, timeout=ct.TIMEOUT).applied_version, v)
                    self.assertEqual(rollout.mismatches(v), 0, "v%d %s\n%s" % (v, when, daemon.log_tail()))

            versions((1,), "before any replay")
            wc.offer_vmm_fd = counting_offer
            # A dropped connection to a daemon that did not restart (what the channel watch records).
            for w in workers:
                w.client._dropped = True
                w.client.status()  # the next call replays first
            self.assertEqual(sorted(offered), want)
            versions((2, 3), "after a replay to the same daemon")
            # A restarted daemon: real workers run side by side; here each one's next call (a status)
            # makes it reconnect and replay before the trainers publish (a plan needs every worker).
            offered.clear()
            daemon.restart()
            for w in workers:
                w.client.status()
            self.assertEqual(sorted(offered), want)
            versions((4, 5), "after a restart")
            for w in workers:
                self.assertEqual(w.client.reconnects, 2, w.client.worker_id)
            # Every offer of an allocation carried its one id (the daemon takes a replay as the same
            # memory only so), and no two allocations shared one.
            for w in workers:
                for key, (_, _, alloc) in w.client._vmm.items():
                    self.assertEqual(ids[(w.client.worker_id, key)], {alloc.allocation_id}, key)
            self.assertEqual(len({a for s in ids.values() for a in s}), len(ids))
            self.assertNotIn(0, {a for s in ids.values() for a in s})
            for w in workers:
                w.close()
        finally:
            wc.offer_vmm_fd = real_offer
            daemon.stop()


# Another process offering an fd to the daemon's fd channel: prints the daemon's answer.
FOREIGN_OFFER = textwrap.dedent("""
    import os, sys
    from weightbridge.client import WeightBridgeError, offer_vmm_fd
    fd = os.memfd_create("not-the-workers-memory")
    os.ftruncate(fd, 2 << 20)
    try:
        offer_vmm_fd(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], 2 << 20, fd, timeout=10)
        print("OK")
    except WeightBridgeError as e:
        print(e.code.name)
        print(e.message)
""")


@unittest.skipUnless(os.access(EMULATED_DAEMON, os.X_OK) and os.path.exists(os.environ["WB_CUDART"]),
                     "emulated-GPU builds not present (built only with CUDA headers)")
@unittest.skipIf(os.environ.get("WB_SANITIZER"),
                 "sanitizer build: the instrumented emulated runtime cannot be loaded into the uninstrumented python3")
class CudaVmmClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = ct.Daemon(EMULATED_DAEMON, ["--transports=host_shm,host_tcp,cuda_ipc", "--gpu_staging_bytes=268435456"])

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def test_allocation_lookup_from_a_pointer_inside(self):
        from weightbridge.cuda import CudaBuffer, VmmAllocation, vmm_allocation_of
        a = VmmAllocation(100, 1)
        self.assertEqual(a.size_bytes, 2 << 20)
        self.assertEqual(a.read(0, 8), bytes(8))  # zero-filled (cuMemCreate memory is not)
        a.write(5000, b"vmm")
        self.assertEqual(a.read(4999, 5), b"\x00vmm\x00")
        r = vmm_allocation_of(a.ptr + 12345)
        self.assertEqual((r.base, r.size, r.gpu), (a.ptr, 2 << 20, 1))
        fd = r.export_fd()
        self.assertGreaterEqual(fd, 0)
        os.close(fd)
        r.close()
        b = CudaBuffer(64, 0)
        with self.assertRaisesRegex(ValueError, "not CUDA VMM memory"):
            vmm_allocation_of(b.ptr)
        b.close()
        a.close()
        with self.assertRaisesRegex(ValueError, "not device memory"):
            vmm_allocation_of(a.ptr)

    def test_refused_before_anything_is_shared(self):
        from weightbridge.cuda import VmmAllocation
        model = wb.ModelConfig(model_id="py_vmm_refused", explicit_tensors=ct.CANONICAL, num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        c = self.daemon.client("v")
        a = VmmAllocation(1, 0)
        with self.assertRaises(wb.WeightBridgeError) as e:
            c.add_cuda_vmm_buffer(a.ptr, 64)
        self.assertEqual(e.exception.code.name, "FAILED_PRECONDITION")
        c.register_worker(model, "trainer/0", "trainer", gpu=0)
        with self.assertRaisesRegex(ValueError, "past the end of their CUDA VMM allocation"):
            c.add_cuda_vmm_buffer(a.ptr + a.size_bytes - 64, 128)
        with self.assertRaisesRegex(ValueError, "size_bytes must be > 0"):
            c.add_cuda_vmm_buffer(a.ptr, 0)
        self.assertEqual(c.buffers, [])
        c.deregister()
        c.close()
        a.close()

    def test_one_step_off_every_byte_one_fd_per_worker(self):
        model = wb.ModelConfig(model_id="py_vmm_osp", explicit_tensors=ct.CANONICAL, num_trainer_workers=2,
                               num_rollout_workers=2, mode="one_step_off")
        trainers = [VmmWorker(self.daemon, model, "trainer/%d" % r, "trainer", ct.HALF[r], gpu=r) for r in (0, 1)]
        rollouts = [VmmWorker(self.daemon, model, "rollout/%d" % r, "rollout", ct.FULL, gpu=r) for r in (0, 1)]
        for w in trainers + rollouts:
            self.assertEqual(len(w.bufs), 2)
            self.assertEqual(w.bufs[0].vmm_key, w.bufs[1].vmm_key, "one allocation, one key")
            self.assertEqual([b.vmm_offset for b in w.bufs], list(VMM_OFFSETS))
            self.assertEqual(len(w.client._vmm), 1, "one fd per allocation, however many buffers")
        # Another process offers an fd as trainer/0 under its key: refused, naming why; nothing changes.
        t0 = trainers[0]
        out = subprocess.run([sys.executable, "-c", FOREIGN_OFFER, self.daemon.socket + ".fd", model.model_id,
                              "trainer/0", t0.bufs[0].vmm_key], capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)
        code, message = out.stdout.split("\n", 1)
        self.assertEqual(code, "PERMISSION_DENIED", out.stdout)
        self.assertIn("refused", message)
        self.assertIn("belongs to process %d" % os.getpid(), message)
        for v in (1, 2, 3):
            for t in trainers:
                t.fill(v)
                self.assertEqual(t.client.publish(v, timeout=ct.TIMEOUT).version, v)
            for r in rollouts:
                self.assertEqual(r.client.apply(v, timeout=ct.TIMEOUT).applied_version, v)
                self.assertEqual(r.mismatches(v), 0, "rollout %s v%d\n%s" % (r.client.worker_id, v, self.daemon.log_tail()))
        # The gaps around the buffers were never written.
        r = rollouts[0]
        self.assertEqual(r.alloc.read(0, VMM_OFFSETS[0]), bytes(VMM_OFFSETS[0]))
        for w in trainers + rollouts:
            w.close()

    def test_a_new_allocation_offered_under_a_key_used_before_is_mapped_anew(self):
        """A rollout's weights move to another allocation B, which its client offers under the key
        of the old allocation A (a key names an allocation in the worker's own terms: a client whose
        keys repeat once an allocation was freed, or one of another language, can do this). Its
        RegisterLayout is then byte for byte the one before, which the daemon used to answer as a
        replay with A still mapped: later versions landed in A and B stayed zero. The offer's new
        allocation id makes the daemon map B; A keeps what it held."""
        from weightbridge.cuda import VmmAllocation, vmm_allocation_of
        model = wb.ModelConfig(model_id="py_vmm_key_reused", explicit_tensors=ct.CANONICAL, num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        trainer = VmmWorker(self.daemon, model, "trainer/0", "trainer", ct.FULL, gpu=0)
        rollout = VmmWorker(self.daemon, model, "rollout/0", "rollout", ct.FULL, gpu=1)
        trainer.fill(1)
        trainer.client.publish(1, timeout=ct.TIMEOUT)
        self.assertEqual(rollout.client.apply(1, timeout=ct.TIMEOUT).applied_version, 1)
        self.assertEqual(rollout.mismatches(1), 0)
        key = rollout.bufs[0].vmm_key
        old_fd, size, old_range = rollout.client._vmm[key]
        a, b = rollout.alloc, VmmAllocation(1, 1)
        self.assertEqual(b.size_bytes, a.size_bytes)
        new_range = vmm_allocation_of(b.ptr)
        self.assertNotEqual(new_range.allocation_id, old_range.allocation_id)
        # The client now stands for B under A's key: offered at once (and again on any replay).
        rollout.client._vmm[key] = (new_range.export_fd(), size, new_range)
        rollout.client._offer_vmm(key, time.monotonic() + ct.TIMEOUT)
        os.close(old_fd)
        old_range.close()
        rollout.client.register_layout(rollout.layout)  # the very request of before
        rollout.alloc = b
        for v in (2, 3):
            trainer.fill(v)
            trainer.client.publish(v, timeout=ct.TIMEOUT)
            self.assertEqual(rollout.client.apply(v, timeout=ct.TIMEOUT).applied_version, v)
            self.assertEqual(rollout.mismatches(v), 0, "v%d did not land in the new allocation\n%s" % (v, self.daemon.log_tail()))
        rollout.alloc = a
        self.assertEqual(rollout.mismatches(1), 0, "the old allocation was written after the move")
        rollout.alloc = b
        trainer.close()
        rollout.close()
        a.close()

    def test_allocations_under_a_range_of_a_segment(self):
        from weightbridge.cuda import VmmAllocation, vmm_allocations_of
        seg = VmmAllocation(5 << 20, 1, allocations=3)  # 5 MiB in three allocations: 2 MiB each (rounded up)
        self.assertEqual((seg.size_bytes, seg.allocation_bytes), (6 << 20, G))
        self.assertEqual(seg.read(G - 4, 8), bytes(8))
        seg.write(G - 3, b"across")  # one write over the first boundary
        self.assertEqual(seg.read(G - 4, 8), b"\x00across\x00")
        rs = vmm_allocations_of(seg.ptr + 1000, 2 * G)
        self.assertEqual([(r.base, r.size, r.gpu) for r in rs], [(seg.ptr + i * G, G, 1) for i in range(3)])
        self.assertEqual(len({r.key for r in rs}), 3)
        for r in rs:
            r.close()
        one = vmm_allocations_of(seg.ptr + G + 5, 100)  # inside the middle one
        self.assertEqual([r.base for r in one], [seg.ptr + G])
        one[0].close()
        with self.assertRaisesRegex(ValueError, "run 100 bytes past the end of their CUDA VMM allocations: nothing is mapped"):
            vmm_allocations_of(seg.ptr + 3 * G - 100, 200)
        seg.close()

    def test_one_step_off_every_byte_buffers_spanning_three_allocations(self):
        model = wb.ModelConfig(model_id="py_vmm_span", explicit_tensors=ct.CANONICAL, num_trainer_workers=2,
                               num_rollout_workers=2, mode="one_step_off")
        trainers = [SegmentWorker(self.daemon, model, "trainer/%d" % r, "trainer", ct.HALF[r], gpu=r) for r in (0, 1)]
        rollouts = [SegmentWorker(self.daemon, model, "rollout/%d" % r, "rollout", ct.FULL, gpu=r) for r in (0, 1)]
        for w in trainers + rollouts:
            b = w.buf
            self.assertEqual(len(w.client._vmm), 3, "one fd per allocation of the segment")
            self.assertEqual(b.vmm_offset, G - 200, "the pointer's offset in the FIRST allocation")
            self.assertEqual(len(b.vmm_next_keys), 2)
            self.assertEqual([b.vmm_key] + b.vmm_next_keys, list(w.client._vmm), "address order")
            # The pieces really straddle the boundaries at G and 2G of the segment.
            (s0, e0), (s1, e1) = w.spans()
            self.assertTrue(s0 < G < e0 and s1 < 2 * G < e1, w.spans())
        for v in (1, 2, 3):
            for t in trainers:
                t.fill(v)
                self.assertEqual(t.client.publish(v, timeout=ct.TIMEOUT).version, v)
            for r in rollouts:
                self.assertEqual(r.client.apply(v, timeout=ct.TIMEOUT).applied_version, v)
                self.assertEqual(r.mismatches(v), 0, "rollout %s v%d\n%s" % (r.client.worker_id, v, self.daemon.log_tail()))
        # Bytes of the segment outside the pieces were never written.
        r = rollouts[0]
        (s0, _), _ = r.spans()
        self.assertEqual(r.seg.read(0, s0), bytes(s0))
        for w in trainers + rollouts:
            w.close()

    def test_spanning_buffer_naming_an_allocation_never_sent_is_not_found(self):
        from weightbridge.cuda import VmmAllocation
        model = wb.ModelConfig(model_id="py_vmm_span_bad", explicit_tensors=ct.CANONICAL, num_trainer_workers=1,
                               num_rollout_workers=1, mode="one_step_off")
        c = self.daemon.client("s")
        c.register_worker(model, "trainer/0", "trainer", gpu=0)
        seg = VmmAllocation(2 * G, 0, allocations=2)
        with self.assertRaisesRegex(ValueError, "past the end of their CUDA VMM allocations"):
            c.add_cuda_vmm_buffer(seg.ptr + G, G + 1)
        self.assertEqual((c.buffers, c._vmm), ([], {}), "nothing shared for a refused range")
        b = c.add_cuda_vmm_buffer(seg.ptr + 100, G)
        layout, _ = ct.row_blocks(ct.FULL)
        b.vmm_next_keys = ["vmm-never-sent"]  # as a client that forgot to share it would send
        with self.assertRaises(wb.WeightBridgeError) as e:
            c.register_layout(layout)
        self.assertEqual(e.exception.code.name, "NOT_FOUND")
        self.assertIn("(CUDA VMM, gpu 0)", e.exception.message)
        self.assertIn("sent no CUDA VMM fd under key 'vmm-never-sent'", e.exception.message)
        c.deregister()
        c.close()
        seg.close()

    def test_fds_are_sent_again_to_a_restarted_daemon(self):
        d = ct.Daemon(EMULATED_DAEMON, ["--transports=host_shm,host_tcp,cuda_ipc", "--gpu_staging_bytes=268435456"])
        workers = []
        try:
            model = wb.ModelConfig(model_id="py_vmm_restart", explicit_tensors=ct.CANONICAL, num_trainer_workers=1,
                                   num_rollout_workers=1, mode="one_step_off")
            t = VmmWorker(d, model, "trainer/0", "trainer", ct.FULL, gpu=0)
            workers.append(t)
            r = VmmWorker(d, model, "rollout/0", "rollout", ct.FULL, gpu=1)
            workers.append(r)
            t.fill(1)
            t.client.publish(1, timeout=ct.TIMEOUT)
            self.assertEqual(r.client.apply(1, timeout=ct.TIMEOUT).applied_version, 1)
            self.assertEqual(r.mismatches(1), 0)
            # A new daemon process (no fds, no workers) on the same socket: each client's next call
            # reconnects and replays RegisterWorker, its VMM fd, then RegisterLayout naming that fd's
            # key (which the new daemon refuses unless the fd came first).
            d.restart()
            t.fill(2)
            errors = []

            def publish():
                try:
                    t.client.publish(2, timeout=ct.TIMEOUT)
                except wb.WeightBridgeError as e:
                    errors.append(e)
            th = threading.Thread(target=publish)
            th.start()
            applied = r.client.apply(2, timeout=ct.TIMEOUT).applied_version
            th.join(ct.TIMEOUT)
            self.assertEqual(errors, [])
            self.assertEqual(applied, 2)
            self.assertEqual((t.client.reconnects, r.client.reconnects), (1, 1))
            self.assertEqual(r.mismatches(2), 0, d.log_tail())
        finally:
            for w in workers:
                w.client.close()
                w.alloc.close()
            d.stop()


if __name__ == "__main__":
    unittest.main()
