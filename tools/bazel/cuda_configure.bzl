"""Detects the CUDA toolkit and NCCL and exposes them as @local_cuda.

CUDA_HOME (default /usr/local/cuda) is probed for cuda_runtime.h, nccl.h, libcudart and libnccl.
When found, @local_cuda//:cudart and @local_cuda//:nccl wrap them and
@local_cuda//:defs.bzl sets HAVE_CUDA = True; otherwise the targets are empty and GPU targets
are skipped (tagged manual / excluded with target_compatible_with-like select on HAVE_CUDA).
"""

def _find(rctx, home, candidates):
    for c in candidates:
        p = rctx.path(home + "/" + c)
        if p.exists:
            return c
    return None

def _local_cuda_impl(rctx):
    home = rctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
    have = rctx.path(home).exists
    cudart_h = _find(rctx, home, ["include/cuda_runtime.h"]) if have else None
    nccl_h = _find(rctx, home, ["include/nccl.h"]) if have else None
    cudart_so = _find(rctx, home, ["lib64/libcudart.so", "lib/libcudart.so", "targets/x86_64-linux/lib/libcudart.so"]) if have else None
    nccl_so = _find(rctx, home, ["lib64/libnccl.so", "lib/libnccl.so"]) if have else None
    have_cuda = bool(cudart_h and cudart_so)
    have_nccl = bool(have_cuda and nccl_h and nccl_so)
    if have_cuda:
        rctx.symlink(home + "/include", "include")
        libdir = home + "/" + cudart_so.rsplit("/", 1)[0]
        rctx.symlink(libdir, "lib")
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    if have_cuda:
        build.append("""
cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

cc_library(
    name = "cudart",
    deps = [":cuda_headers"],
    linkopts = ["-L{libdir}", "-Wl,-rpath,{libdir}", "-lcudart", "-ldl", "-lpthread", "-lrt"],
)
""".format(libdir = libdir))
    else:
        build.append('cc_library(name = "cuda_headers")\ncc_library(name = "cudart")\n')
    if have_nccl:
        nccl_dir = home + "/" + nccl_so.rsplit("/", 1)[0]
        build.append("""
cc_library(
    name = "nccl",
    deps = [":cudart"],
    linkopts = ["-L{d}", "-Wl,-rpath,{d}", "-lnccl"],
)
""".format(d = nccl_dir))
    else:
        build.append('cc_library(name = "nccl")\n')
    rctx.file("BUILD.bazel", "\n".join(build))
    rctx.file("defs.bzl", "HAVE_CUDA = {}\nHAVE_NCCL = {}\nCUDA_HOME = \"{}\"\n".format(have_cuda, have_nccl, home))
    rctx.file("WORKSPACE", 'workspace(name = "local_cuda")\n')

local_cuda_configure = repository_rule(
    implementation = _local_cuda_impl,
    environ = ["CUDA_HOME"],
    local = True,
)
