"""Calls a daemon's gRPC server turned away for want of a thread are sent again (proto/grpc_retry.h),
no daemon needed: WorkerClient against a fake WorkerService on a temp Unix socket that answers
RESOURCE_EXHAUSTED "Server Threadpool Exhausted" (what gRPC's sync server answers when its thread
quota is spent) a given number of times. The daemons' own RESOURCE_EXHAUSTED refusals are not retried.

The C++ side is //proto:grpc_retry_test and //tests/probe:issue15_scale_test. Run by
//client/python:server_busy_test.
"""

import os
import tempfile
import time
import unittest
from concurrent import futures

import grpc

import weightbridge as wb
from weightbridge import pb, pb_grpc
from weightbridge.client import SERVER_THREADPOOL_EXHAUSTED


class BusyWorkerService(pb_grpc.WorkerServiceServicer):
    def __init__(self):
        self.calls = 0
        self.busy = 0  # answer the next `busy` calls with gRPC's thread-pool refusal
        self.error = None  # then (code, message), or OK

    def Status(self, request, context):
        self.calls += 1
        if self.busy > 0:
            self.busy -= 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, SERVER_THREADPOOL_EXHAUSTED)
        if self.error is not None:
            context.abort(self.error[0], self.error[1])
        return pb.StatusResponse()


class ServerBusyTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="wb-busy-")
        self.sock = os.path.join(self.dir, "w.sock")
        self.service = BusyWorkerService()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_WorkerServiceServicer_to_server(self.service, self.server)
        self.server.add_insecure_port("unix:" + self.sock)
        self.server.start()
        self.client = wb.WorkerClient(self.sock, call_timeout=5.0, reconnect=False)

    def tearDown(self):
        self.client.close()
        self.server.stop(None)

    def test_a_call_turned_away_for_want_of_a_thread_is_sent_again(self):
        self.service.busy = 5
        self.client.status()
        self.assertEqual(self.service.calls, 6)
        self.assertEqual(self.client.server_busy_retries, 5)

    def test_the_daemons_own_resource_exhausted_is_answered_at_once(self):
        self.service.error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "4 blocked calls of worker w (limit 4)")
        with self.assertRaises(wb.WeightBridgeError) as e:
            self.client.status()
        self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("limit 4", str(e.exception))
        self.assertEqual(self.service.calls, 1)
        self.assertEqual(self.client.server_busy_retries, 0)

    def test_retries_stop_at_the_calls_deadline(self):
        self.client.call_timeout = 0.3
        self.service.busy = 1 << 30
        start = time.monotonic()
        with self.assertRaises(wb.WeightBridgeError) as e:
            self.client.status()
        self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn(SERVER_THREADPOOL_EXHAUSTED, str(e.exception))
        self.assertLess(time.monotonic() - start, 1.0)
        # 2, 4, ..., 64, 100 ms backoffs: a handful of tries, not a spin.
        self.assertGreater(self.service.calls, 3)
        self.assertLess(self.service.calls, 12)


if __name__ == "__main__":
    unittest.main()
