"""The conformance suite (conformance.cc) instantiated for one transport."""

def transport_conformance_test(name, src = None, peer = "//transport/testing:transport_peer", deps = [], data = [], env = {}, linkstatic = None, tags = []):
    """A cc_test `name` built from `name`.cc that runs the shared conformance suite.

    The suite spawns //transport/testing:transport_peer processes (or `peer`) as the other side of every transfer, so the
    binary is a data dependency. GPU suites skip at run time when too few devices are visible.

    Args:
      name: target name; the source file is `name`.cc (e.g. host_tcp_conformance_test).
      src: the source file instead of `name`.cc.
      peer: the peer binary (data dependency); its path must match ConformanceParam.peer_binary.
      deps: extra dependencies, e.g. //tests/fake_cuda:fake_cudart for the emulated GPU variants.
      data: extra data dependencies (other helper binaries the test spawns).
      env: environment of the test (the peer processes inherit it), e.g. WB_FAKE_CUDA_DEVICES.
      linkstatic: as cc_test's; True for binaries whose linked-in fakes must preempt shared libs.
      tags: as cc_test's.
    """
    kwargs = {}
    if linkstatic != None:
        kwargs["linkstatic"] = linkstatic
    if env:
        kwargs["env"] = env
    native.cc_test(
        name = name,
        size = "medium",
        srcs = [src if src else name + ".cc"],
        data = [peer] + data,
        tags = tags,
        deps = [
            "//transport/testing:conformance",
            "//third_party:gtest_main",
        ] + deps,
        **kwargs
    )
