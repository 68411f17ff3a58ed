#!/usr/bin/env bash
# Runs the Python client tests under Bazel (sh_test) with Debian's /usr/bin/python3 against the
# weightbridged and proto stubs from the runfiles. Args: test file names under tests/.
set -euo pipefail
R="${TEST_SRCDIR:-$(pwd)/..}/${TEST_WORKSPACE:-weightbridge}"
export PYTHONPATH="$R/client/python"
export WB_PROTO_PY_DIR="$R"
export WB_DAEMON="$R/daemon/weightbridged"
export XDG_CACHE_HOME="${TEST_TMPDIR:-/tmp}"
cd "$R"
status=0
for t in "$@"; do
  # Run the file itself (unittest.main): `-m unittest` would need an importable dotted module name.
  /usr/bin/python3 "client/python/tests/${t%.py}.py" -v 2>&1 || status=1
done
exit $status
