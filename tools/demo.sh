#!/usr/bin/env bash
# The main job (make demo; `make deps` ran first): build what the demo runs, then
# tools/demo/demo.py moves Qwen2.5-0.5B weights megatron tp=2 -> 2 x vllm tp=1 through a standalone
# weightbridged in sync, one-step-off and async, verifies every rollout byte and prints the table,
# then the same with rank0_broadcast. Extra args go to demo.py (--help). Exit != 0 on any failed check.
set -euo pipefail
cd "$(dirname "$0")/.."
BAZEL=${BAZEL:-bazel}
echo "== building daemon, workers, proto stubs (incremental)"
$BAZEL build //daemon:weightbridged //tests/e2e:trainer_worker //tests/e2e:rollout_worker //proto:weightbridge_proto_py //client:wbctl
BIN="$($BAZEL info bazel-bin 2>/dev/null)"
export WB_PROTO_PY_DIR="$BIN"
exec /usr/bin/python3 tools/demo/demo.py --bin "$BIN" "$@"
