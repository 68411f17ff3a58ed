"""The conformance suite (conformance.cc) instantiated for one transport."""

def transport_conformance_test(name):
    """A cc_test `name` built from `name`.cc that runs the shared conformance suite.

    The suite spawns :transport_peer processes as the other side of every transfer, so the
    binary is a data dependency. GPU suites skip at run time when too few devices are visible.

    Args:
      name: target name; the source file is `name`.cc (e.g. host_tcp_conformance_test).
    """
    native.cc_test(
        name = name,
        size = "medium",
        srcs = [name + ".cc"],
        data = [":transport_peer"],
        deps = [
            ":conformance",
            "//third_party:gtest_main",
        ],
    )
