#!/usr/bin/env bash
# The one prepared GPU check of the data plane (docs/transport.md "GPU checks"). Two steps, because
# the GPU machine has no Bazel, no Debian absl/xxhash and no network (see
# /work/.library/device/KINDS.md: CUDA 13.0 + driver 580, PyTorch's pip NCCL, nothing to install):
#
#   1. HERE (a machine with Bazel; no GPU needed):
#        tests/gpu/run_gpu_checks.sh --bundle
#      builds the GPU tests, the peer binary and //bench:transport (--dynamic_mode=off: our code is
#      linked in) and copies them with their shared libraries (absl, xxhash, libcudart.so.13; NOT
#      libnccl: 200+ MB, taken from the GPU machine's PyTorch install) into .gpu_bundle/ (~35 MB,
#      git-ignored through .git/info/exclude).
#   2. ON THE GPU MACHINE, one call of the device tool with carry [".gpu_bundle"]:
#        bash tests/gpu/run_gpu_checks.sh
#      runs every check from .gpu_bundle/ (or, where Bazel exists and there is no bundle, builds
#      the bundle first), each under its own timeout and all under one budget (WB_GPU_BUDGET_S,
#      default 420 s, so the call ends well inside 9 minutes), and prints one line per check:
#      PASS / FAIL / SKIPPED with the reason. With $OUT set, writes there (at most 8 files, all at
#      the top level): summary.txt, summary.json, checks.log (every check's full output),
#      bench_transport.json (the JSON line of `transport --json`), bench_gpu_direct.json (the JSON
#      line of bench/gpu_direct), env.txt (nvidia-smi, libraries).
#
# Exit: 0 when everything that can run on this machine ran and passed (checks that need more GPUs
# than visible are SKIPPED and do not fail the run), 1 on any FAIL, 3 when no GPU is visible,
# 2 on a usage / bundle problem. A GPU test that "passes" only by skipping for lack of a GPU is a
# FAIL. Nothing here has run on a GPU yet: the script itself is part of what the first run checks.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
BUNDLE=$ROOT/.gpu_bundle
BAZEL=${WB_BAZEL:-bazel}

# Test binaries (package under transport/ / name; the bundle keeps the name). transport_peer goes
# to bin/transport/testing/ because the conformance suite execs "transport/testing/transport_peer"
# relative to its working directory.
TESTS=(cuda_ipc/cuda_status_test cuda_ipc/cuda_copy_test cuda_ipc/cuda_ipc_conformance_test nccl/nccl_smoke_test
       nccl/nccl_conformance_test host_shm/host_shm_conformance_test host_tcp/host_tcp_conformance_test)

make_bundle() {
  command -v "$BAZEL" >/dev/null 2>&1 || { echo "no bazel ($BAZEL) here: build the bundle on a machine with Bazel" >&2; return 2; }
  local targets=(//transport/testing:transport_peer //bench:transport //transport:gpu_info_test
                 //tests/e2e:e2e_gpu_test //daemon:weightbridged //tests/e2e:trainer_worker //tests/e2e:rollout_worker
                 //bench:gpu_direct)
  for t in "${TESTS[@]}"; do targets+=("//transport/${t%/*}:${t##*/}"); done
  "$BAZEL" build --dynamic_mode=off "${targets[@]}" || return 2
  local bin
  bin=$("$BAZEL" info bazel-bin 2>/dev/null) || return 2
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/bin/transport/testing" "$BUNDLE/bin/daemon" "$BUNDLE/bin/tests/e2e/testdata" "$BUNDLE/lib" \
    "$BUNDLE/lib-fallback" || return 2
  for t in "${TESTS[@]}"; do cp -L "$bin/transport/$t" "$BUNDLE/bin/" || return 2; done
  cp -L "$bin/transport/testing/transport_peer" "$BUNDLE/bin/transport/testing/" || return 2
  cp -L "$bin/bench/transport" "$BUNDLE/bin/bench_transport" || return 2
  cp -L "$bin/transport/gpu_info_test" "$BUNDLE/bin/" || return 2
  # GPU-direct end to end: the e2e test and bench spawn these by their workspace paths, which the
  # harness resolves relative to the working directory (bin/) outside Bazel.
  cp -L "$bin/tests/e2e/e2e_gpu_test" "$BUNDLE/bin/" || return 2
  cp -L "$bin/bench/gpu_direct" "$BUNDLE/bin/bench_gpu_direct" || return 2
  cp -L "$bin/daemon/weightbridged" "$BUNDLE/bin/daemon/" || return 2
  cp -L "$bin/tests/e2e/trainer_worker" "$bin/tests/e2e/rollout_worker" "$BUNDLE/bin/tests/e2e/" || return 2
  cp -L "$ROOT"/tests/e2e/testdata/*.json "$BUNDLE/bin/tests/e2e/testdata/" || return 2
  # Shared libraries: everything but glibc, the driver and NCCL (found on the GPU machine);
  # libstdc++/libgcc_s only as a fallback (the GPU machine's are newer; its NCCL may need them).
  local lib
  for f in "$BUNDLE"/bin/* "$BUNDLE"/bin/transport/testing/* "$BUNDLE"/bin/daemon/* "$BUNDLE"/bin/tests/e2e/*; do
    [ -f "$f" ] && ldd "$f" | awk '/=> \//{print $3}'
  done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libnccl.so*) ;;
      libstdc++.so*|libgcc_s.so*) cp -L "$lib" "$BUNDLE/lib-fallback/" ;;
      *) cp -L "$lib" "$BUNDLE/lib/" ;;
    esac
  done
  chmod -R u+w "$BUNDLE"
  # Symbols are not needed there and the carry limit is 64 MiB: strip (80 MB -> ~30 MB).
  if command -v strip >/dev/null 2>&1; then
    find "$BUNDLE/bin" "$BUNDLE/lib" -type f ! -name '*.json' -exec strip --strip-unneeded {} + 2>/dev/null || true
  fi
  {
    echo "commit $(git -C "$ROOT" rev-parse HEAD 2>/dev/null)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (+ local changes)')"
    echo "built $(date -u +%FT%TZ) on $(uname -m), $(ldd --version | head -1)"
    echo "needs GLIBC <= $(for f in "$BUNDLE"/bin/* "$BUNDLE"/bin/transport/testing/* "$BUNDLE"/lib/*; do
      [ -f "$f" ] && objdump -T "$f" 2>/dev/null; done | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)"
  } >"$BUNDLE/MANIFEST"
  grep -qx '/.gpu_bundle/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpu_bundle/' >>"$ROOT/.git/info/exclude"
  echo "bundle: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1))"; cat "$BUNDLE/MANIFEST"
  echo "next: device run with carry [\".gpu_bundle\"], command: bash tests/gpu/run_gpu_checks.sh"
}

if [ "${1:-}" = "--bundle" ]; then make_bundle; exit $?; fi
if [ $# -gt 0 ]; then echo "usage: $0 [--bundle]" >&2; exit 2; fi

# ---------------------------------------------------------------- run the checks
OUTDIR=${OUT:-/tmp/wb_gpu_checks}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/checks.log
: >"$LOG"
BUDGET=${WB_GPU_BUDGET_S:-420}
START=$SECONDS
declare -a SUMMARY
declare -a JSON_ROWS
rc=0
say() { echo "$*" | tee -a "$LOG"; }
record() {  # record STATUS NAME DETAIL
  SUMMARY+=("$(printf '%-8s %s: %s' "$1" "$2" "$3")")
  local d=${3//\\/\\\\}; d=${d//\"/\\\"}; d=$(echo "$d" | tr -d '\000-\037')
  JSON_ROWS+=("{\"check\": \"$2\", \"status\": \"$1\", \"detail\": \"$d\"}")
  [ "$1" = FAIL ] && rc=1
  say "==> $1 $2: $3"
}
left() { echo $((BUDGET - (SECONDS - START))); }
finish() {
  {
    echo "==== GPU check summary ($(date -u +%FT%TZ), $((SECONDS - START)) s) ===="
    printf '%s\n' "${SUMMARY[@]}"
  } | tee "$OUTDIR/summary.txt" | tee -a "$LOG"
  {
    echo "{\"exit\": $1, \"seconds\": $((SECONDS - START)), \"checks\": ["
    local i n=${#JSON_ROWS[@]}
    for ((i = 0; i < n; i++)); do echo "  ${JSON_ROWS[$i]}$([ $i -lt $((n - 1)) ] && echo ,)"; done
    echo "]}"
  } >"$OUTDIR/summary.json"
  exit "$1"
}

if [ ! -d "$BUNDLE/bin" ]; then
  if command -v "$BAZEL" >/dev/null 2>&1; then
    say "no .gpu_bundle: building it with $BAZEL first"
    make_bundle >>"$LOG" 2>&1 || { record FAIL bundle "building the bundle failed (see checks.log)"; finish 2; }
  else
    say "no .gpu_bundle and no bazel: run 'tests/gpu/run_gpu_checks.sh --bundle' on a machine with Bazel and carry .gpu_bundle"
    record FAIL bundle "missing .gpu_bundle (and no bazel to build it)"
    finish 2
  fi
fi

{
  echo "== MANIFEST"; cat "$BUNDLE/MANIFEST" 2>/dev/null
  echo "== host"; uname -a; ldd --version 2>&1 | head -1; nproc
  echo "== nvidia-smi"; nvidia-smi 2>&1 | head -40
} >"$OUTDIR/env.txt" 2>&1

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  record SKIPPED all "no GPU visible (nvidia-smi -L failed); nothing to check"
  finish 3
fi
ngpu=$(nvidia-smi -L | grep -c '^GPU')
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .); fi
say "GPUs visible: $ngpu"; nvidia-smi -L | tee -a "$LOG"

# Libraries: the bundle's, then NCCL from wherever the machine has it (PyTorch's pip package on the
# H200 image), then the driver's folder.
nccl_dir=""
for d in $(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF}' | xargs -r -n1 dirname) \
         $(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null) \
         /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
  if [ -e "$d/libnccl.so.2" ]; then nccl_dir=$d; break; fi
done
if [ -z "$nccl_dir" ]; then
  nccl_dir=$(timeout 60 find / -xdev -name 'libnccl.so.2' -print -quit 2>/dev/null | xargs -r dirname)
fi
LIBS=$BUNDLE/lib
[ -n "$nccl_dir" ] && LIBS=$LIBS:$nccl_dir
[ -d /usr/local/nvidia/lib64 ] && LIBS=$LIBS:/usr/local/nvidia/lib64
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
say "libnccl.so.2 from: ${nccl_dir:-NOT FOUND}"
# Use the machine's (newer) libstdc++ unless the binaries do not load with it.
if ! "$BUNDLE/bin/cuda_status_test" --gtest_list_tests >/dev/null 2>>"$LOG"; then
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$BUNDLE/lib-fallback
  say "binaries did not load with the system libstdc++; added the bundle's fallback"
fi
{ echo "== LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; ldd "$BUNDLE/bin/cuda_ipc_conformance_test"; } >>"$OUTDIR/env.txt" 2>&1
if ldd "$BUNDLE/bin/cuda_ipc_conformance_test" | grep -q 'not found'; then
  record FAIL libraries "$(ldd "$BUNDLE/bin/cuda_ipc_conformance_test" | grep 'not found' | tr -s ' \t\n' ' ')"
  finish 1
fi
"$BUNDLE/bin/gpu_info_test" >>"$LOG" 2>&1 || true

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
TEST_TMPDIR=$(mktemp -d); export TEST_TMPDIR

# run_gtest NAME TIMEOUT_S MODE: MODE "gpu" = a skip for lack of GPUs is a FAIL; "skip-ok" = must
# pass, skips allowed (reported); "expect-skip" = fewer GPUs than needed: must skip cleanly.
run_gtest() {
  local name=$1 limit=$2 mode=$3 out st
  if [ "$(left)" -lt "$limit" ]; then
    record SKIPPED "$name" "not started: $(left) s of the ${BUDGET} s budget left, it may take ${limit} s"
    return
  fi
  say "---- $name (timeout ${limit} s)"
  local t0=$SECONDS
  out=$(cd "$BUNDLE/bin" && timeout -k 5 "$limit" "./$name" 2>&1); st=$?
  echo "$out" >>"$LOG"
  local secs=$((SECONDS - t0))
  local skipped passed gpu_skip
  passed=$(echo "$out" | grep -c '^\[       OK \]')
  skipped=$(echo "$out" | grep -c '^\[  SKIPPED \]')
  gpu_skip=$(echo "$out" | grep -m1 'visible CUDA device(s), found' | sed 's/^[^:]*: *//')
  if [ $st -eq 124 ] || [ $st -eq 137 ]; then
    record FAIL "$name" "timed out after ${limit} s (last lines in checks.log)"
  elif [ $st -ne 0 ]; then
    record FAIL "$name" "exit $st in ${secs} s: $(echo "$out" | grep -m3 -E '^\[  FAILED  \]|Failure|error' | tr '\n' ' ')"
  elif [ "$mode" = gpu ] && [ -n "$gpu_skip" ]; then
    record FAIL "$name" "passed only by skipping: $gpu_skip"
  elif [ "$mode" = expect-skip ]; then
    if [ -n "$gpu_skip" ] && [ "$passed" -eq 0 ]; then
      record SKIPPED "$name" "skipped cleanly ($skipped tests): $gpu_skip"
    else
      record FAIL "$name" "expected every test to skip for lack of GPUs: $passed passed, $skipped skipped"
    fi
  else
    record PASS "$name" "$passed passed, $skipped skipped (not applicable to this transport) in ${secs} s"
  fi
}

run_gtest cuda_status_test 60 skip-ok
run_gtest cuda_copy_test 60 skip-ok
run_gtest cuda_ipc_conformance_test 240 gpu
# The only NCCL check one GPU allows: a 1-rank communicator sending to itself through the
# transport's own helpers, the init / Connect deadlines and aborts (~30 s expected).
run_gtest nccl_smoke_test 90 gpu
if [ "$ngpu" -ge 2 ]; then
  run_gtest nccl_conformance_test 240 gpu
else
  run_gtest nccl_conformance_test 60 expect-skip
fi
# GPU-direct end to end: real daemons and CUDA workers (weights in cudaMalloc buffers, registered
# by IPC handle), colocated sync / one-step-off / async with GPU staging, host-staging fallback,
# two nodes; every rollout byte checked (the scenarios CI runs on emulated GPUs).
export WB_E2E_GPUS=$ngpu
run_gtest e2e_gpu_test 200 gpu

# //bench:transport --json: GPU figures first (what only this machine can measure), then the full
# run with the host figures if the budget allows.
bench() {  # bench LIMIT ARGS...
  local limit=$1; shift
  local out st line
  out=$(cd "$BUNDLE/bin" && timeout -k 5 "$limit" ./bench_transport "$@" 2>>"$LOG"); st=$?
  echo "$out" >>"$LOG"
  line=$(echo "$out" | grep '^{' | tail -n 1)
  echo "$st|$line"
}
if [ "$(left)" -ge 120 ]; then
  say "---- bench_transport --gpu_only --json"
  res=$(bench 120 --gpu_only --json); st=${res%%|*}; line=${res#*|}
  [ -n "$line" ] && echo "$line" >"$OUTDIR/bench_transport.json"
  if echo "$line" | grep -q '"ipc_copy_GBps"'; then
    record PASS bench_transport_gpu "$line"
  else
    record FAIL bench_transport_gpu "exit $st, no GPU figures: ${line:-no JSON line (see checks.log)}"
  fi
else
  record SKIPPED bench_transport_gpu "out of budget ($(left) s left)"
fi
# GPU-direct vs host staging, measured (bench/gpu_direct.cc): the figure CUDA users care about.
if [ "$(left)" -ge 150 ]; then
  say "---- bench_gpu_direct --json --gpus=$ngpu"
  out=$(cd "$BUNDLE/bin" && timeout -k 5 150 ./bench_gpu_direct --json --gpus="$ngpu" --versions=4 2>>"$LOG"); st=$?
  echo "$out" >>"$LOG"
  line=$(echo "$out" | grep '^{' | tail -n 1)
  [ -n "$line" ] && echo "$line" >"$OUTDIR/bench_gpu_direct.json"
  if [ $st -eq 0 ] && echo "$line" | grep -q '"gpu_sync_s"'; then
    record PASS bench_gpu_direct "$line"
  else
    record FAIL bench_gpu_direct "exit $st: ${line:-no JSON line (see checks.log)}"
  fi
else
  record SKIPPED bench_gpu_direct "out of budget ($(left) s left)"
fi
# Host transports run in CI; here only if time is left.
run_gtest host_shm_conformance_test 120 skip-ok
run_gtest host_tcp_conformance_test 150 skip-ok
if [ "$(left)" -ge 90 ]; then
  say "---- bench_transport --json (host + GPU figures)"
  res=$(bench 90 --json); st=${res%%|*}; line=${res#*|}
  if echo "$line" | grep -q '"ipc_copy_GBps"'; then
    echo "$line" >"$OUTDIR/bench_transport.json"
    record PASS bench_transport "$line"
  else
    record FAIL bench_transport "exit $st: ${line:-no JSON line (see checks.log)}"
  fi
else
  record SKIPPED bench_transport "full run (host figures) not started: $(left) s left"
fi
rm -rf "$TEST_TMPDIR"
finish $rc
