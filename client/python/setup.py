"""pip install client/python: the `weightbridge` package with gRPC stubs generated at build time
from proto/weightbridge.proto (protoc + grpc_python_plugin; Debian: protobuf-compiler,
protobuf-compiler-grpc). Runtime deps (grpcio, protobuf, numpy) are left to the system
(Debian's python3-grpcio, python3-protobuf, python3-numpy) so Debian installs are not replaced."""

import os
import shutil
import subprocess
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(HERE, "..", "..", "proto", "weightbridge.proto")


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "weightbridge", "_gen")
        os.makedirs(out, exist_ok=True)
        tmp = tempfile.mkdtemp()
        try:
            # Compile as weightbridge/_gen/weightbridge.proto so the grpc module imports
            # `from weightbridge._gen import weightbridge_pb2`.
            src = os.path.join(tmp, "weightbridge", "_gen")
            os.makedirs(src)
            shutil.copy(PROTO, os.path.join(src, "weightbridge.proto"))
            plugin = shutil.which("grpc_python_plugin")
            if shutil.which("protoc") is None or plugin is None:
                raise SystemExit("pip install weightbridge: needs protoc and grpc_python_plugin "
                                 "(apt-get install protobuf-compiler protobuf-compiler-grpc)")
            subprocess.run(["protoc", "-I" + tmp, "--python_out=" + self.build_lib,
                            "--grpc_python_out=" + self.build_lib, "--plugin=protoc-gen-grpc_python=" + plugin,
                            "weightbridge/_gen/weightbridge.proto"], check=True)
            open(os.path.join(out, "__init__.py"), "w").close()
        finally:
            shutil.rmtree(tmp)


setup(
    name="weightbridge",
    version="0.1.0",
    description="WeightBridge worker client: RL weight transfer between trainers and rollout engines",
    packages=["weightbridge"],
    python_requires=">=3.9",
    cmdclass={"build_py": BuildWithStubs},
)
