"""`pip install client/python` ships the whole client: every module of the `weightbridge` source
tree (the integrations included - before, setup.py listed only the top package, so an installed
client had no weightbridge.integrations), the gRPC stubs built from proto/weightbridge.proto, and
the vLLM general-plugin entry point that registers the `weightbridge` weight-transfer backend.
Runs setup.py's own build (build_py, egg_info) into a temporary directory; installs nothing."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(HERE)  # client/python


def source_modules():
    out = set()
    for dirpath, _, files in os.walk(os.path.join(PKG_ROOT, "weightbridge")):
        if "__pycache__" in dirpath:
            continue
        for f in files:
            if f.endswith(".py"):
                out.add(os.path.relpath(os.path.join(dirpath, f), PKG_ROOT))
    return out


class PackagingTest(unittest.TestCase):
    def setUp(self):
        if shutil.which("protoc") is None or shutil.which("grpc_python_plugin") is None:
            self.skipTest("protoc / grpc_python_plugin not installed (setup.py needs them)")
        self.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        # A copy of the package tree (the runfiles are read-only links): setup.py finds the proto at
        # ../../proto from its own directory, so the copy keeps that shape.
        self.src = os.path.join(self.tmp, "src")
        shutil.copytree(PKG_ROOT, os.path.join(self.src, "client", "python"), symlinks=False,
                        ignore=shutil.ignore_patterns("__pycache__", "tests", "examples"))
        proto = os.path.join(os.path.dirname(os.path.dirname(PKG_ROOT)), "proto", "weightbridge.proto")
        os.makedirs(os.path.join(self.src, "proto"))
        shutil.copy(proto, os.path.join(self.src, "proto", "weightbridge.proto"))
        self.setup_dir = os.path.join(self.src, "client", "python")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_setup(self, *args):
        r = subprocess.run([sys.executable, "setup.py", "-q", *args], cwd=self.setup_dir, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, "setup.py %s failed:\n%s\n%s" % (" ".join(args), r.stdout, r.stderr))

    def test_build_ships_every_module_and_the_stubs(self):
        lib = os.path.join(self.tmp, "lib")
        self.run_setup("build_py", "--build-lib", lib)
        built = set()
        for dirpath, _, files in os.walk(lib):
            for f in files:
                if f.endswith(".py"):
                    built.add(os.path.relpath(os.path.join(dirpath, f), lib))
        missing = sorted(source_modules() - built)
        self.assertEqual(missing, [], "modules of the source tree not in the built package")
        for stub in ("weightbridge/_gen/weightbridge_pb2.py", "weightbridge/_gen/weightbridge_pb2_grpc.py"):
            self.assertIn(stub, built)

    def test_vllm_plugin_entry_point_registers_the_backend(self):
        egg = os.path.join(self.tmp, "egg")
        os.makedirs(egg)
        self.run_setup("egg_info", "--egg-base", egg)
        info = [d for d in os.listdir(egg) if d.endswith(".egg-info")]
        self.assertEqual(len(info), 1, info)
        path = os.path.join(egg, info[0], "entry_points.txt")
        self.assertTrue(os.path.exists(path), "no entry points declared")
        with open(path) as f:
            text = f.read()
        self.assertIn("[vllm.general_plugins]", text)
        self.assertIn("weightbridge = weightbridge.integrations.vllm_transfer:register", text)
        # The target exists and is callable without vLLM installed (it registers lazily).
        sys.path.insert(0, PKG_ROOT)
        from weightbridge.integrations import vllm_transfer
        self.assertTrue(callable(vllm_transfer.register))


if __name__ == "__main__":
    unittest.main()
