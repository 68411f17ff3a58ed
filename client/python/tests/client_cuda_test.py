"""The Python client's CUDA buffers (weightbridge.cuda.CudaBuffer) against a real standalone
weightbridged, on EMULATED GPUs: the daemon is the build linked with //tools/fake_cuda and this
process loads the same emulation as a shared library through $WB_CUDART. Checks the client's
CUDA path (cudaMalloc + IPC handle -> BufferSpec.cuda_ipc_handle, the daemon opening it, versions
moving device to device with GPU staging, read back through cudaMemcpy) without a GPU; says nothing
about real GPUs. Run by `bazel test //client/python:client_cuda_test`.
"""

import os
import sys
import threading
import unittest

import numpy as np

R = os.getcwd()  # run_tests.sh runs from the runfiles root
os.environ.setdefault("WB_CUDART", os.path.join(R, "tools/fake_cuda/libwb_fake_cudart.so"))
os.environ.setdefault("WB_FAKE_CUDA_DEVICES", "2")
EMULATED_DAEMON = os.path.join(R, "daemon/weightbridged_emulated_gpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import client_test as ct  # noqa: E402  (helpers: Daemon, row_blocks, canonical weights)
import weightbridge as wb  # noqa: E402
from weightbridge import weights  # noqa: E402


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
        with self.assertRaises(ValueError):
            b.read(0, 1)

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
            errors = []

            def publish(t):
                try:
                    t.client.publish(v, timeout=ct.TIMEOUT)
                except wb.WeightBridgeError as e:
                    errors.append(e)
            threads = [threading.Thread(target=publish, args=(t,)) for t in trainers]
            for th in threads:
                th.start()
            for r in rollouts:
                self.assertGreaterEqual(r.client.wait_version(v, timeout=ct.TIMEOUT), v)
            for th in threads:
                th.join(ct.TIMEOUT)
            self.assertEqual(errors, [])
            for r in rollouts:
                self.assertEqual(r.mismatches(v), 0, "sync v%d" % v)
        self.close(trainers + rollouts)


if __name__ == "__main__":
    unittest.main()
