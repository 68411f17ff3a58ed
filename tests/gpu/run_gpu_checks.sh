#!/usr/bin/env bash
# Builds and runs every GPU test and GPU benchmark of the data plane in one call, on a machine with
# (at least) one GPU, e.g. one H200. Prints a summary; exits non-zero if anything failed or is missing.
#
#   tests/gpu/run_gpu_checks.sh
#
# What needs what:
#   - cuda_status_test: any CUDA build (no GPU needed).
#   - cuda_ipc conformance: ONE GPU is enough (two processes, CUDA IPC on the same device).
#   - nccl conformance: needs two GPUs for a real cross-device test; with one GPU NCCL refuses two
#     ranks on the same device ("Duplicate GPU detected") unless NCCL_... workarounds apply, so it is
#     reported as SKIPPED with that reason.
# STATUS (see docs/transport.md): the cuda_ipc and nccl transports are NOT implemented yet, so this
# script reports them as MISSING and exits 2 after running what exists.
set -u
cd "$(dirname "$0")/../.."

declare -a SUMMARY
rc=0
record() { SUMMARY+=("$1"); }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU visible (nvidia-smi -L failed); nothing to check" >&2
  exit 3
fi
ngpu=$(nvidia-smi -L | wc -l)
echo "GPUs visible: $ngpu"; nvidia-smi -L

if bazel test --test_output=errors //transport:cuda_status_test; then
  record "PASS    //transport:cuda_status_test"
else
  record "FAIL    //transport:cuda_status_test"; rc=1
fi

# Host transports on this machine too (more cores than CI): conformance + bench figures.
if bazel test --test_output=errors //transport:host_shm_conformance_test //transport:host_tcp_conformance_test; then
  record "PASS    host_shm / host_tcp conformance"
else
  record "FAIL    host_shm / host_tcp conformance"; rc=1
fi
if out=$(bazel run //bench:transport -- --json 2>/dev/null); then
  record "BENCH   //bench:transport $out"
else
  record "FAIL    //bench:transport"; rc=1
fi

record "MISSING cuda_ipc transport + conformance (not implemented yet)"
if [ "$ngpu" -lt 2 ]; then
  record "SKIPPED nccl conformance: needs 2 GPUs, found $ngpu (and the nccl transport is not implemented yet)"
else
  record "MISSING nccl transport + conformance (not implemented yet)"
fi
[ $rc -eq 0 ] && rc=2

echo
echo "==== GPU check summary ===="
printf '%s\n' "${SUMMARY[@]}"
exit $rc
