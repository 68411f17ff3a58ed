#!/usr/bin/env bash
# Builds the libFuzzer targets with Debian's clang (Bazel's toolchain is gcc, which has no libFuzzer)
# and runs them on the committed seed corpora. See docs/fuzzing.md.
#
#   tests/fuzz/build_and_run.sh                       build, then fuzz every target 60 s
#   tests/fuzz/build_and_run.sh --seconds 600 fuzz_index_probe
#   tests/fuzz/build_and_run.sh --build-only --out DIR           (what the Bazel genrule runs)
#   tests/fuzz/build_and_run.sh --run-only --bin-dir DIR --seconds 3   (what the CI sh_test runs)
#   tests/fuzz/build_and_run.sh --reproduce fuzz_hf_config crash-1234  (run one input, show the stack)
#
# Every run first replays the seed corpus (tests/fuzz/corpus/<target>/) and every saved regression
# input (tests/fuzz/regressions/<target>/), then mutates for --seconds. New interesting inputs go to a
# scratch corpus (--keep-corpus DIR keeps them); a crash leaves <artifacts>/<target>-crash-<sha1>
# and makes the script exit 1 after running the remaining targets.
set -uo pipefail

ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
TARGETS_ALL=(fuzz_validate_layout fuzz_index_probe fuzz_hf_config fuzz_transport_wire fuzz_delta_decode)
CXX=${CXX_FUZZ:-}
if [ -z "$CXX" ]; then
  for c in clang++-14 clang++; do command -v "$c" >/dev/null && { CXX=$c; break; }; done
fi
MODE=all
OUT=""
BIN_DIR=""
SECONDS_PER_TARGET=60
KEEP_CORPUS=""
ARTIFACTS=""
REPRO=()
TARGETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) MODE=build ;;
    --run-only) MODE=run ;;
    --reproduce) MODE=repro; REPRO=("$2" "$3"); shift 2 ;;
    --out) OUT=$2; shift ;;
    --bin-dir) BIN_DIR=$2; shift ;;
    --seconds) SECONDS_PER_TARGET=$2; shift ;;
    --keep-corpus) KEEP_CORPUS=$2; shift ;;
    --artifacts) ARTIFACTS=$2; shift ;;
    --root) ROOT=$(cd "$2" && pwd); shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    fuzz_*) TARGETS+=("$1") ;;
    *) echo "build_and_run.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("${TARGETS_ALL[@]}")
OUT=${OUT:-${TMPDIR:-/tmp}/wb_fuzz_build}
BIN_DIR=${BIN_DIR:-$OUT}
ARTIFACTS=${ARTIFACTS:-${TEST_UNDECLARED_OUTPUTS_DIR:-$OUT/artifacts}}

# Sources each target links (besides its own tests/fuzz/<target>.cc). Keep in sync with the genrule
# srcs in tests/fuzz/BUILD.bazel.
sources_of() {
  case "$1" in
    fuzz_validate_layout) echo planner/validate.cc planner/grid.cc planner/quantized.cc planner/box.cc ;;
    fuzz_index_probe) echo planner/index_probe.cc planner/validate.cc planner/grid.cc planner/quantized.cc planner/box.cc planner/inventory.cc planner/model_config.cc ;;
    fuzz_hf_config) echo planner/model_config.cc planner/inventory.cc planner/box.cc ;;
    fuzz_transport_wire) echo transport/host_shm/host_shm.cc transport/host_tcp/host_tcp.cc transport/host_tcp/channel_auth.cc transport/common.cc transport/registry.cc \
                              base/shm_segment.cc transport/strided.cc transport/testing/peer_process.cc \
                              transport/cpu_affinity.cc transport/host_tcp/nic_list.cc transport/host_tcp/send_pacer.cc transport/host_tcp/parking.cc base/stream_copy.cc ;;
    fuzz_delta_decode) echo daemon/delta/codec.cc daemon/delta/scan.cc daemon/digest/digest.cc base/stream_copy.cc ;;
    *) echo "build_and_run.sh: unknown target $1" >&2; return 1 ;;
  esac
}

# System libraries exactly as //third_party links them: every -l flag of the abseil, xxhash, crypto
# and rt wrappers, read from third_party/BUILD.bazel so that there is one list.
link_flags() {
  grep -oE '"-l(absl_[a-z0-9_]+|xxhash|crypto|rt|pthread)"' "$ROOT/third_party/BUILD.bazel" | tr -d '"' | awk '!seen[$0]++' | tr '\n' ' '
}

build() {
  if [ -z "$CXX" ]; then
    echo "build_and_run.sh: no clang++ found (apt-get install clang-14 libclang-rt-14-dev)" >&2
    return 1
  fi
  mkdir -p "$OUT/obj"
  local common=(-std=c++20 -O1 -g -fno-omit-frame-pointer -I"$ROOT" -fsanitize=address,undefined
                -fno-sanitize-recover=all -DWB_FUZZING=1 -w)
  local srcs=() t s
  for t in "${TARGETS[@]}"; do
    for s in $(sources_of "$t"); do srcs+=("$s"); done
  done
  mapfile -t srcs < <(printf '%s\n' "${srcs[@]}" | sort -u)
  # Library objects: instrumented for coverage, without libFuzzer's main. Two at a time (2 cores).
  printf '%s\n' "${srcs[@]}" | xargs -P 2 -I{} sh -c '
    obj="$1/obj/$(echo "$2" | tr / _).o"
    shift 2
    exec "$@" -fsanitize=fuzzer-no-link -c "'"$ROOT"'/{}" -o "$obj"' _ "$OUT" "{}" "$CXX" "${common[@]}" || return 1
  local libs
  libs=$(link_flags)
  for t in "${TARGETS[@]}"; do
    local objs=()
    for s in $(sources_of "$t"); do objs+=("$OUT/obj/$(echo "$s" | tr / _).o"); done
    echo "build_and_run.sh: linking $t"
    # shellcheck disable=SC2086
    "$CXX" "${common[@]}" -fsanitize=fuzzer "$ROOT/tests/fuzz/$t.cc" "${objs[@]}" $libs -o "$OUT/$t" || return 1
  done
}

run_target() {
  local t=$1 bin="$BIN_DIR/$1"
  local seeds="$ROOT/tests/fuzz/corpus/$t" regress="$ROOT/tests/fuzz/regressions/$t"
  local scratch
  scratch=${KEEP_CORPUS:+$KEEP_CORPUS/$t}
  scratch=${scratch:-$(mktemp -d)}
  mkdir -p "$scratch" "$ARTIFACTS"
  local dirs=("$scratch")
  [ -d "$seeds" ] && dirs+=("$seeds")
  [ -d "$regress" ] && dirs+=("$regress")
  echo "build_and_run.sh: $t for ${SECONDS_PER_TARGET}s (seeds: $(ls "$seeds" 2>/dev/null | wc -l), regressions: $(ls "$regress" 2>/dev/null | wc -l))"
  # -rss_limit_mb: an input that makes the target allocate gigabytes is a bug (limits), not noise.
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1} "$bin" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$ARTIFACTS/$t-" "${dirs[@]}" >"$ARTIFACTS/$t.log" 2>&1
  local rc=$?
  grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb)' "$ARTIFACTS/$t.log" | tr '\n' ' '
  echo
  [ -z "$KEEP_CORPUS" ] && rm -rf "$scratch"
  if [ $rc -ne 0 ]; then
    echo "build_and_run.sh: $t FAILED (rc $rc); log: $ARTIFACTS/$t.log; artifacts:" >&2
    ls "$ARTIFACTS" | grep -E "^$t-(crash|leak|timeout|oom|slow-unit)" >&2
    grep -E 'ERROR: |runtime error|SUMMARY|^ +#[0-9]+ ' "$ARTIFACTS/$t.log" | head -40 >&2
    return 1
  fi
}

case "$MODE" in
  build) build ;;
  repro) "$BIN_DIR/${REPRO[0]}" -runs=1 "${REPRO[1]}" ;;
  run|all)
    if [ "$MODE" = all ]; then build || exit 1; fi
    failed=0
    for t in "${TARGETS[@]}"; do run_target "$t" || failed=1; done
    exit $failed
    ;;
esac
