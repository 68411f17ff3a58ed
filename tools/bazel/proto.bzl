"""wb_proto_library: C++ messages + gRPC stubs (and Python stubs) from a .proto with system tools.

Generated files live next to the .proto in bazel-bin, so C++ includes read `proto/foo.pb.h`.
"""

def wb_proto_library(name, src, deps = [], python = True, visibility = None):
    base = src[:-len(".proto")]
    pkg = native.package_name()
    prefix = pkg + "/" if pkg else ""
    cc_outs = [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_cc_gen",
        srcs = [src] + [d + "_srcs" for d in deps],
        outs = cc_outs,
        cmd = ("protoc -I. --cpp_out=$(GENDIR) --grpc_out=$(GENDIR) " +
               "--plugin=protoc-gen-grpc=$$(which grpc_cpp_plugin) $(location {src})").format(src = src),
    )
    native.filegroup(
        name = name + "_srcs",
        srcs = [src],
        visibility = ["//visibility:public"],
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb.cc", base + ".grpc.pb.cc"],
        hdrs = [base + ".pb.h", base + ".grpc.pb.h"],
        deps = deps + ["//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )
    if python:
        py_outs = [base + "_pb2.py", base + "_pb2_grpc.py"]
        native.genrule(
            name = name + "_py",
            srcs = [src] + [d + "_srcs" for d in deps],
            outs = py_outs,
            cmd = ("protoc -I. --python_out=$(GENDIR) --grpc_python_out=$(GENDIR) " +
                   "--plugin=protoc-gen-grpc_python=$$(which grpc_python_plugin) $(location {src})").format(src = src),
            visibility = visibility,
        )
