"""WorkerClient.status(model_id=...): StatusRequest's filter through a real standalone weightbridged
(its worker socket forwards the request to the coordinator, which narrows the status before its
byte budget). Run by //client/python:status_filter_test."""

import os
import sys
import unittest

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client_test import CANONICAL, Daemon  # noqa: E402

import weightbridge as wb  # noqa: E402


class StatusFilterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def test_status_of_one_model(self):
        clients = []
        for model in ("a", "b"):
            c = self.daemon.client("s" + model)
            c.register_worker(wb.ModelConfig(model_id=model, explicit_tensors=CANONICAL, num_trainer_workers=1,
                                             num_rollout_workers=1, mode="async"), "trainer/0", "trainer")
            clients.append(c)
        try:
            whole = clients[0].status()
            self.assertEqual({m.model_id for m in whole.models}, {"a", "b"})
            only_a = clients[0].status(model_id="a")
            self.assertEqual([m.model_id for m in only_a.models], ["a"])
            self.assertEqual({w.model_id for w in only_a.workers}, {"a"})
            self.assertEqual(len(only_a.nodes), len(whole.nodes), "every node is still listed")
            self.assertFalse(only_a.HasField("trimmed"))
            with self.assertRaises(wb.WeightBridgeError) as e:
                clients[0].status(model_id="nope")
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
            self.assertIn("unknown model 'nope'", str(e.exception))
        finally:
            for c in clients:
                c.close()


if __name__ == "__main__":
    unittest.main()
