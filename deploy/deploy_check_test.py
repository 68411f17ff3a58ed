"""Tests of deploy/: the real files must be consistent with the real weightbridged, and the checker must
catch each kind of drift (shown on deliberately broken copies, whose error messages are printed)."""

import os
import shutil
import sys
import tempfile
import unittest

import deploy_check

HERE = os.path.dirname(os.path.abspath(__file__))
BINARY = None  # set from argv in __main__


class RealDeployTest(unittest.TestCase):
    def test_deploy_matches_the_real_binary(self):
        help_text = deploy_check.helpfull_of(BINARY)
        all_flags, daemon_flags = deploy_check.parse_helpfull(help_text)
        # The help text is what everything is checked against: make sure it was read at all.
        self.assertIn("role", daemon_flags, help_text)
        self.assertIn("flagfile", all_flags - daemon_flags)
        errors = deploy_check.check(HERE, help_text, BINARY)
        self.assertEqual(errors, [], "\n".join(errors))


class BrokenCopyTest(unittest.TestCase):
    """Each case breaks one thing in a copy of deploy/ and expects the checker to name it."""

    @classmethod
    def setUpClass(cls):
        cls.help_text = deploy_check.helpfull_of(BINARY)

    def broken(self, rel, old, new, expect, help_text=None):
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, "deploy")
            shutil.copytree(HERE, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__", "BUILD.bazel"))
            path = os.path.join(copy, rel)
            with open(path) as f:
                text = f.read()
            self.assertIn(old, text, f"test setup: {old!r} not in {rel}")
            with open(path, "w") as f:
                f.write(text.replace(old, new, 1))
            errors = deploy_check.check(copy, help_text or self.help_text, BINARY)
        print(f"\n[{self.id().split('.')[-1]}] {rel}: {old!r} -> {new!r}")
        for e in errors:
            print("   " + e)
        self.assertTrue(any(expect in e for e in errors), f"expected an error containing {expect!r}, got {errors}")

    def test_unit_passes_unknown_flag(self):
        self.broken("systemd/weightbridge-node.service", "--listen=${WB_LISTEN}", "--listen_addr=${WB_LISTEN}",
                    "passes --listen_addr, which weightbridged does not have")

    @unittest.skipUnless(shutil.which("systemd-analyze"), "systemd-analyze not installed")
    def test_unit_misspelt_directive(self):
        self.broken("systemd/weightbridge-node.service", "RestartSec=2s", "RestartSecs=2s",
                    "Unknown key 'RestartSecs'")

    def test_env_file_misses_a_flag(self):
        self.broken("systemd/node.env", "WB_LOG_LEVEL=info\n", "",
                    "does not set it")

    def test_new_daemon_flag_without_env_line(self):
        extra = self.help_text.replace("  Flags from daemon/main.cc:\n",
                                       "  Flags from daemon/main.cc:\n    --zz_test_only_flag (invented by the test); default: \"\";\n")
        self.assertNotEqual(extra, self.help_text)
        self.broken("systemd/node.env", "WB_ROLE=node", "WB_ROLE=node", "flag --zz_test_only_flag has no WB_ZZ_TEST_ONLY_FLAG= line",
                    help_text=extra)

    def test_socket_outside_runtime_directory(self):
        self.broken("systemd/node.env", "WB_WORKER_SOCKET=/run/weightbridge/worker.sock",
                    "WB_WORKER_SOCKET=/run/wb/worker.sock", "does not create the socket directory /run/wb")

    def test_daemonset_probe_on_wrong_port(self):
        self.broken("k8s/node-daemonset.yaml", "livenessProbe:\n            grpc:\n              port: 7071",
                    "livenessProbe:\n            grpc:\n              port: 7080", "livenessProbe probes port 7080")

    def test_daemonset_unknown_flag(self):
        self.broken("k8s/node-daemonset.yaml", "--heartbeat_ms=500", "--heartbeat_period_ms=500",
                    "passes --heartbeat_period_ms, which weightbridged does not have")

    def test_daemonset_without_host_ipc(self):
        self.broken("k8s/node-daemonset.yaml", "hostIPC: true", "hostIPC: false", "needs hostIPC: true")

    def test_daemonset_without_host_pid(self):
        self.broken("k8s/node-daemonset.yaml", "hostPID: true", "hostPID: false", "needs hostPID: true")

    def test_sidecar_without_shared_process_namespace(self):
        self.broken("k8s/examples/rollout-with-sidecar.yaml", "shareProcessNamespace: true", "shareProcessNamespace: false",
                    "needs shareProcessNamespace: true")

    def test_daemonset_listens_on_any_address(self):
        self.broken("k8s/node-daemonset.yaml", "--listen=$(HOST_IP):7071", "--listen=0.0.0.0:7071",
                    "is announced to peers as is")

    def test_undefined_env_substitution(self):
        self.broken("k8s/node-daemonset.yaml", "--node_id=$(NODE_NAME)", "--node_id=$(NODENAME)",
                    "uses $(NODENAME) but the container sets no env NODENAME")

    def test_service_port_differs_from_coordinator_flag(self):
        self.broken("k8s/coordinator.yaml", "      port: 7070\n      targetPort: grpc",
                    "      port: 7000\n      targetPort: grpc", "--coordinator port 7070 is not a port of Service")

    def test_coordinator_listens_elsewhere_than_service_targets(self):
        self.broken("k8s/coordinator.yaml", "--listen=0.0.0.0:7070", "--listen=0.0.0.0:7090",
                    "startupProbe probes port 7070")

    def test_sidecar_socket_path_disagrees(self):
        self.broken("k8s/examples/rollout-with-sidecar.yaml",
                    "- name: WEIGHTBRIDGE_SOCKET\n          value: /run/weightbridge/worker.sock",
                    "- name: WEIGHTBRIDGE_SOCKET\n          value: /run/weightbridge/wb.sock",
                    "is not where any weightbridged in this pod creates its --worker_socket")

    def test_rollout_pod_on_other_host_path(self):
        self.broken("k8s/examples/rollout-with-node-daemon.yaml", "path: /run/weightbridge", "path: /var/run/wb",
                    "but the node DaemonSet's socket is /run/weightbridge/worker.sock")

    def test_rollout_pod_without_socket_group(self):
        self.broken("k8s/examples/rollout-with-node-daemon.yaml", "supplementalGroups: [2000]",
                    "supplementalGroups: [3000]", "add supplementalGroups: [2000]")

    def test_daemonset_and_env_file_socket_disagree(self):
        self.broken("k8s/node-daemonset.yaml", "path: /run/weightbridge\n", "path: /run/weightbridge-k8s\n",
                    "socket paths differ")

    def test_manifest_does_not_parse(self):
        self.broken("k8s/coordinator.yaml", "  replicas: 1", "  replicas: [1", "YAML does not parse")

    def test_containerfile_wrong_entrypoint(self):
        self.broken("Containerfile", 'ENTRYPOINT ["/usr/local/bin/weightbridged"]', 'ENTRYPOINT ["/bin/weightbridged"]',
                    "ENTRYPOINT must be")


if __name__ == "__main__":
    BINARY = sys.argv.pop(1)
    unittest.main(verbosity=2)
