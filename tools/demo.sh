#!/usr/bin/env bash
# The main job. Until the end-to-end demo lands (issue 6) it builds everything and shows the
# standalone daemon's flags.
set -euo pipefail
BAZEL=${BAZEL:-bazel}
echo "== building //..."
$BAZEL build //...
echo "== weightbridged --help"
# absl's --helpfull exits 1 by design; show the daemon's own flags.
("$($BAZEL info bazel-bin 2>/dev/null)/daemon/weightbridged" --helpfull 2>&1 || true) | grep -A200 'daemon/main.cc' | head -60
