#!/usr/bin/env bash
# Smoke test of bench:control_plane: the real coordinator against fake nodes runs to the end on
# small clusters (Qwen2.5-0.5B inventory, 2 and 4 nodes, 2 versions) and prints every field of its
# JSON. The figures themselves are not checked (performance is measured by the bench, not in tests).
set -euo pipefail
R="${TEST_SRCDIR:-$(pwd)/..}/${TEST_WORKSPACE:-weightbridge}"
cd "$R"
fail() { echo "FAIL: $*" >&2; exit 1; }
out=$(timeout 120 bench/control_plane --json --nodes=2,4 --versions=2 --model=planner/testdata/qwen2.5-0.5b.json 2>&1 |
      grep '^{' | tail -n 1) || fail "bench:control_plane did not finish"
echo "control_plane: $out"
for field in '"nodes":2' '"nodes":4' '"version_overhead_ms"' '"heartbeat_p99_ms"' '"plan_ms"' '"rss_bytes"'; do
  echo "$out" | grep -q "$field" || fail "no $field: $out"
done
echo PASS
