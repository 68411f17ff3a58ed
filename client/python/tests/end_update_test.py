"""Sync EndUpdate on the Python side (docs/status.md next steps 11 (b)), no daemon needed:

- WorkerClient.end_update against a fake WorkerService on a temp Unix socket (request fields, the
  timeout sent as timeout_ms, the answer, the daemon's error code kept);
- RolloutHook.update (weightbridge.integrations._rollout, what the vLLM / SGLang hooks call in sync
  mode) calls end_update when wait_version fails, before re-raising, and not otherwise.

The daemon side is //daemon:end_update_test. Run by //client/python:end_update_test.
"""

import os
import sys
import tempfile
import unittest
from concurrent import futures

import grpc

import weightbridge as wb
from weightbridge import pb, pb_grpc
from weightbridge.integrations._rollout import RolloutHook


class FakeWorkerService(pb_grpc.WorkerServiceServicer):
    def __init__(self):
        self.requests = []
        self.calls = []  # method names, in order
        self.error = None  # (grpc.StatusCode, message) to answer with

    def RegisterWorker(self, request, context):
        self.calls.append("RegisterWorker")
        return pb.RegisterWorkerResponse()

    def BeginUpdate(self, request, context):
        self.calls.append("BeginUpdate")
        return pb.BeginUpdateResponse()

    def EndUpdate(self, request, context):
        self.calls.append("EndUpdate")
        self.requests.append(request)
        if self.error is not None:
            context.abort(self.error[0], self.error[1])
        return pb.EndUpdateResponse(applied_version=4, committed_version=5)


class EndUpdateClientTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="wb-endupdate-")
        self.sock = os.path.join(self.dir, "w.sock")
        self.service = FakeWorkerService()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_WorkerServiceServicer_to_server(self.service, self.server)
        self.server.add_insecure_port("unix:" + self.sock)
        self.server.start()
        self.client = wb.WorkerClient(self.sock, call_timeout=5.0, reconnect=False)
        # As register_worker leaves them (the fake serves EndUpdate only).
        self.client.model_id, self.client.worker_id = "m", "rollout/0"

    def tearDown(self):
        self.client.close()
        self.server.stop(None)

    def test_end_update_sends_its_timeout_and_answers_what_live_weights_hold(self):
        got = self.client.end_update(timeout=2.5)
        self.assertEqual(got, wb.EndUpdateResult(applied_version=4, committed_version=5))
        req = self.service.requests[-1]
        self.assertEqual((req.model_id, req.worker_id), ("m", "rollout/0"))
        self.assertGreater(req.timeout_ms, 2000)
        self.assertLessEqual(req.timeout_ms, 2500)

    def test_end_update_keeps_the_daemons_code_and_message(self):
        self.service.error = (grpc.StatusCode.DEADLINE_EXCEEDED,
                              "EndUpdate: worker rollout/0 of model m on node n0: a copy of version 5 is still running")
        with self.assertRaises(wb.WeightBridgeError) as e:
            self.client.end_update(timeout=1.0)
        self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertIn("still running", str(e.exception))
        self.assertIn("EndUpdate of rollout/0", str(e.exception))


    def test_a_replay_ends_the_update_again_until_the_next_begin_update(self):
        # What a reconnect to a restarted daemon replays (it counts every rollout as paused).
        import time
        self.client._register_req = pb.RegisterWorkerRequest(model_id="m", worker_id="rollout/0")
        self.client.end_update(timeout=1.0)
        self.service.calls.clear()
        self.client._replay(time.monotonic() + 5.0)
        self.assertEqual(self.service.calls, ["RegisterWorker", "EndUpdate"])
        self.assertEqual(self.service.requests[-1].worker_id, "rollout/0")
        self.client.begin_update(timeout=1.0)
        self.service.calls.clear()
        self.client._replay(time.monotonic() + 5.0)
        self.assertEqual(self.service.calls, ["RegisterWorker"])


class FakeClient:
    """What RolloutHook.update calls, recorded; wait_version answers or raises `wait_error`."""

    def __init__(self, wait_error=None, end_error=None, begin_error=None):
        self.calls = []
        self.begin_error = begin_error
        self.wait_error = wait_error
        self.end_error = end_error

    def begin_update(self, timeout):
        self.calls.append(("begin_update", timeout))
        if self.begin_error is not None:
            raise self.begin_error

    def wait_version(self, version, timeout):
        self.calls.append(("wait_version", version, timeout))
        if self.wait_error is not None:
            raise self.wait_error
        return version

    def end_update(self, timeout):
        self.calls.append(("end_update", timeout))
        if self.end_error is not None:
            raise self.end_error
        return wb.EndUpdateResult(applied_version=1, committed_version=1)


def hook_with(client):
    """A RolloutHook around `client` without registering anything (update() needs only these)."""
    hook = RolloutHook.__new__(RolloutHook)
    hook.client = client
    hook.memory = "cuda"  # nothing to copy out; the engine's parameters are the buffer (bound)
    hook.bound = True
    hook.buffer = object()  # held: update() refuses a hook whose buffer was released
    hook.refresh_derived = lambda: None
    return hook


class RolloutUpdateTest(unittest.TestCase):
    def test_a_wait_that_times_out_ends_the_update_before_it_is_raised(self):
        timed_out = wb.WeightBridgeError("WaitVersion v3 of m", grpc.StatusCode.DEADLINE_EXCEEDED, "version 3 not committed")
        client = FakeClient(wait_error=timed_out)
        with self.assertRaises(wb.WeightBridgeError) as e:
            hook_with(client).update(3, timeout=7.0)
        self.assertIs(e.exception, timed_out)
        self.assertEqual(client.calls, [("begin_update", 7.0), ("wait_version", 3, 7.0), ("end_update", 7.0)])
        # Its own bound for the wait for a running copy.
        client = FakeClient(wait_error=timed_out)
        with self.assertRaises(wb.WeightBridgeError):
            hook_with(client).update(3, timeout=7.0, end_update_timeout=2.0)
        self.assertEqual(client.calls[-1], ("end_update", 2.0))

    def test_any_failed_wait_ends_the_update(self):
        aborted = wb.WeightBridgeError("WaitVersion v3 of m", grpc.StatusCode.ABORTED, "version 3 aborted")
        client = FakeClient(wait_error=aborted)
        with self.assertRaises(wb.WeightBridgeError) as e:
            hook_with(client).update(3, timeout=7.0)
        self.assertEqual(e.exception.code, grpc.StatusCode.ABORTED)
        self.assertEqual(client.calls[-1], ("end_update", 7.0))

    def test_a_failed_begin_update_ends_the_update_too(self):
        # The node marks the rollout paused before it asks the coordinator; the engine resumes.
        late = wb.WeightBridgeError("BeginUpdate of rollout/0", grpc.StatusCode.DEADLINE_EXCEEDED, "coordinator unreachable")
        client = FakeClient(begin_error=late)
        with self.assertRaises(wb.WeightBridgeError) as e:
            hook_with(client).update(3, timeout=7.0)
        self.assertIs(e.exception, late)
        self.assertEqual(client.calls, [("begin_update", 7.0), ("end_update", 7.0)])

    def test_a_failed_end_update_is_raised_chained_to_the_wait(self):
        timed_out = wb.WeightBridgeError("WaitVersion v3 of m", grpc.StatusCode.DEADLINE_EXCEEDED, "not committed")
        still = wb.WeightBridgeError("EndUpdate of rollout/0", grpc.StatusCode.DEADLINE_EXCEEDED, "a copy is still running")
        with self.assertRaises(wb.WeightBridgeError) as e:
            hook_with(FakeClient(wait_error=timed_out, end_error=still)).update(3, timeout=7.0)
        self.assertIs(e.exception, still)
        self.assertIs(e.exception.__context__, timed_out)

    def test_a_wait_that_succeeds_does_not_end_the_update(self):
        client = FakeClient()
        self.assertEqual(hook_with(client).update(3, timeout=7.0), 3)
        self.assertEqual(client.calls, [("begin_update", 7.0), ("wait_version", 3, 7.0)])


if __name__ == "__main__":
    unittest.main()
