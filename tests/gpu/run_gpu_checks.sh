#!/usr/bin/env bash
# Builds and runs every GPU test and the GPU benchmark of the data plane in one call, on a machine
# with at least one GPU (e.g. one H200). Prints a summary; exits 0 only if everything that can run
# on this machine ran and passed (tests that need more GPUs than visible are reported SKIPPED with
# the reason and do not fail the run), 1 on any failure, 3 when no GPU is visible at all.
#
#   tests/gpu/run_gpu_checks.sh            # WB_BAZEL=/path/to/bazel to use another bazel
#
# What runs, and what it needs:
#   cuda_status_test, cuda_copy_test       CUDA build (no GPU needed)
#   cuda_ipc_conformance_test              ONE GPU: this process and a child process both on GPU 0,
#                                          each opening the other's buffer through CUDA IPC
#   nccl_conformance_test                  TWO GPUs: test process on GPU 0, peer process on GPU 1.
#                                          NCCL refuses two ranks of one communicator on the same
#                                          GPU ("Duplicate GPU detected"), so with one GPU it is
#                                          SKIPPED (the test itself also skips, saying so).
#   host_shm / host_tcp conformance        no GPU; run here too because this machine has more cores
#   //bench:transport --json               host figures + cuda_ipc copy GB/s vs in-process
#                                          cudaMemcpy D2D (ipc_copy_GBps, cuda_d2d_GBps, ipc_vs_d2d)
# A GPU conformance test that "passes" only because it skipped for lack of a GPU counts as FAIL.
set -u
cd "$(dirname "$0")/../.."
BAZEL=${WB_BAZEL:-bazel}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

declare -a SUMMARY
rc=0
pass() { SUMMARY+=("PASS    $1"); }
fail() { SUMMARY+=("FAIL    $1"); rc=1; }
skip() { SUMMARY+=("SKIPPED $1"); }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU visible (nvidia-smi -L failed); nothing to check" >&2
  exit 3
fi
ngpu=$(nvidia-smi -L | grep -c '^GPU')
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
fi
echo "GPUs visible: $ngpu"; nvidia-smi -L

testlog() { echo "bazel-testlogs/transport/$1/test.log"; }

# Runs one bazel test target; $2 = 1 if it must not have skipped for lack of GPUs.
run_test() {
  local target=$1 gpu_required=$2 name=${1#//transport:}
  if "$BAZEL" test --nocache_test_results --test_output=errors --test_env=NCCL_DEBUG --test_env=CUDA_VISIBLE_DEVICES "$target"; then
    if [ "$gpu_required" = 1 ] && grep -q "visible CUDA device(s), found" "$(testlog "$name")" 2>/dev/null; then
      fail "$target passed only by skipping: $(grep -m1 'visible CUDA device(s), found' "$(testlog "$name")")"
    else
      local skipped
      skipped=$(grep -c '\[  SKIPPED \]' "$(testlog "$name")" 2>/dev/null || true)
      pass "$target (${skipped:-0} test(s) skipped as not applicable to this transport)"
    fi
  else
    fail "$target (log: $(testlog "$name"))"
  fi
}

run_test //transport:cuda_status_test 0
run_test //transport:cuda_copy_test 0
run_test //transport:cuda_ipc_conformance_test 1
if [ "$ngpu" -ge 2 ]; then
  run_test //transport:nccl_conformance_test 1
else
  skip "//transport:nccl_conformance_test: needs 2 GPUs (NCCL will not put two ranks of one communicator on one GPU), found $ngpu"
fi
run_test //transport:host_shm_conformance_test 0
run_test //transport:host_tcp_conformance_test 0

if out=$("$BAZEL" run //bench:transport -- --json 2>/tmp/wb_bench_transport.err | tail -n 1); then
  if echo "$out" | grep -q '"ipc_copy_GBps"'; then
    pass "//bench:transport $out"
  else
    fail "//bench:transport: no GPU figures: $out"
  fi
else
  fail "//bench:transport exited non-zero: ${out:-} $(tail -n 5 /tmp/wb_bench_transport.err)"
fi

echo
echo "==== GPU check summary ===="
printf '%s\n' "${SUMMARY[@]}"
exit $rc
