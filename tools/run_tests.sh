#!/usr/bin/env bash
# Builds //... and runs every test; prints a one-line summary last ("N passed, N failed, N skipped")
# and exits non-zero when anything fails to build or any test fails.
set -uo pipefail
BAZEL=${BAZEL:-bazel}
log=$(mktemp)
start=$(date +%s)
$BAZEL test --keep_going "$@" //... 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
end=$(date +%s)
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FLAKY)' "$log")
skipped=$(grep -cE '^//[^ ]+ +(\(cached\) )?SKIPPED' "$log")
# --test_summary=terse lists only non-passing tests; count passes from bazel's own line instead.
executed=$(grep -oE 'Executed [0-9]+ out of [0-9]+ tests?: [0-9]+ tests? pass' "$log" | tail -1)
if [ -n "$executed" ]; then
  passed=$(echo "$executed" | grep -oE '[0-9]+ tests? pass' | grep -oE '^[0-9]+')
fi
fail_line=$(grep -oE '[0-9]+ fails? locally' "$log" | tail -1 | grep -oE '^[0-9]+')
[ -n "$fail_line" ] && failed=$fail_line
rm -f "$log"
echo "tests took $((end - start)) s"
if [ "$rc" -ne 0 ] && [ "${failed:-0}" -eq 0 ]; then
  # Build failure or no test ran: make that visible as a failure.
  failed=1
fi
echo "${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
exit "$rc"
