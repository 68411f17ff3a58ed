"""Locates (or generates) the gRPC stubs of proto/weightbridge.proto.

Search order, first hit wins:
  1. stubs bundled in this package (``weightbridge/_gen``; written by ``pip install client/python``);
  2. ``$WB_PROTO_PY_DIR``: a directory holding ``proto/weightbridge_pb2.py`` and
     ``proto/weightbridge_pb2_grpc.py`` (Bazel's ``//proto:weightbridge_proto_py`` output, i.e.
     ``bazel-bin``), or the directory of the Bazel runfiles tree;
  3. ``bazel-bin`` of the source tree this package sits in (``client/python/weightbridge`` ->
     ``<workspace>/bazel-bin``);
  4. generated on the fly with ``protoc`` + ``grpc_python_plugin`` (Debian: protobuf-compiler,
     protobuf-compiler-grpc) from the .proto next to the package, into a per-user cache.

Exposes ``pb`` (messages) and ``pb_grpc`` (stubs).
"""

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKSPACE = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))


def _proto_file():
    for cand in (os.path.join(_HERE, "weightbridge.proto"),
                 os.path.join(_WORKSPACE, "proto", "weightbridge.proto")):
        if os.path.isfile(cand):
            return cand
    return None


def _import_from_root(root):
    """Imports proto.weightbridge_pb2[_grpc] with `root` (holding proto/) first on sys.path."""
    if not os.path.isfile(os.path.join(root, "proto", "weightbridge_pb2_grpc.py")):
        return None
    if root not in sys.path:
        sys.path.insert(0, root)
    pb = importlib.import_module("proto.weightbridge_pb2")
    pb_grpc = importlib.import_module("proto.weightbridge_pb2_grpc")
    return pb, pb_grpc


def _generate(proto):
    """Runs protoc into a cache dir keyed by the .proto's hash; returns the dir holding proto/."""
    with open(proto, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "weightbridge", "stubs-" + digest)
    if os.path.isfile(os.path.join(cache, "proto", "weightbridge_pb2_grpc.py")):
        return cache
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        raise ImportError("weightbridge: no generated stubs found and protoc/grpc_python_plugin are "
                          "not installed (apt-get install protobuf-compiler protobuf-compiler-grpc, "
                          "or bazel build //proto:weightbridge_proto_py, or pip install client/python)")
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
    src = os.path.join(tmp, "src", "proto")
    os.makedirs(src)
    shutil.copy(proto, os.path.join(src, "weightbridge.proto"))
    out = os.path.join(tmp, "out")
    os.makedirs(os.path.join(out, "proto"))
    subprocess.run([protoc, "-I" + os.path.join(tmp, "src"), "--python_out=" + out,
                    "--grpc_python_out=" + out, "--plugin=protoc-gen-grpc_python=" + plugin,
                    "proto/weightbridge.proto"], check=True, timeout=60)
    open(os.path.join(out, "proto", "__init__.py"), "w").close()
    try:
        os.rename(out, cache)  # atomic; a concurrent generator may have won the race
    except OSError:
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return cache


def _load():
    try:
        from weightbridge._gen import weightbridge_pb2 as pb  # noqa: F401  (pip install)
        from weightbridge._gen import weightbridge_pb2_grpc as pb_grpc
        return pb, pb_grpc
    except ImportError:
        pass
    roots = []
    if os.environ.get("WB_PROTO_PY_DIR"):
        roots.append(os.environ["WB_PROTO_PY_DIR"])
    for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
        if os.environ.get(var):
            roots.append(os.path.join(os.environ[var], os.environ.get("TEST_WORKSPACE", "__main__")))
    roots.append(os.path.join(_WORKSPACE, "bazel-bin"))
    for root in roots:
        got = _import_from_root(root)
        if got:
            return got
    proto = _proto_file()
    if proto is None:
        raise ImportError("weightbridge: cannot find generated stubs nor proto/weightbridge.proto")
    return _import_from_root(_generate(proto))


pb, pb_grpc = _load()
