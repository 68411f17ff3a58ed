#!/usr/bin/env bash
# Smoke test of the GPU benchmark programs on EMULATED GPUs (//tests/fake_cuda): they must run to
# the end and print their GPU figures (bench:transport's IPC part, bench:gpu_direct with every byte
# verified). Catches a broken benchmark here instead of in the scarce GPU session; the figures
# themselves mean nothing on the emulation and are not checked.
set -euo pipefail
R="${TEST_SRCDIR:-$(pwd)/..}/${TEST_WORKSPACE:-weightbridge}"
cd "$R"
fail() { echo "FAIL: $*" >&2; exit 1; }
if [ -n "${WB_SANITIZER:-}" ]; then
  # Benchmarks under a sanitizer prove nothing, and bench:transport's batches deliberately copy the
  # same bytes to the same place from two streams (benign on a GPU, a race to TSan's eyes).
  echo "SKIPPED: $WB_SANITIZER build"
  exit 0
fi

out=$(WB_FAKE_CUDA_DEVICES=1 timeout 120 bench/transport_emulated_gpu --gpu_only --json --gpu_bytes=16777216 2>&1 |
      grep '^{' | tail -n 1) || fail "bench:transport_emulated_gpu did not finish"
echo "transport: $out"
echo "$out" | grep -q '"ipc_copy_GBps"' || fail "no ipc_copy_GBps: $out"
echo "$out" | grep -q '"cuda_d2d_GBps"' || fail "no cuda_d2d_GBps: $out"
if echo "$out" | grep -q '"gpu_error"'; then fail "gpu_error: $out"; fi

out=$(timeout 240 bench/gpu_direct --emulated --gpus=2 --versions=2 --json \
      --config=tests/e2e/testdata/qwen2.5-0.5b-2layer.json 2>&1 | grep '^{' | tail -n 1) ||
  fail "bench:gpu_direct did not finish"
echo "gpu_direct: $out"
echo "$out" | grep -q '"verified":true' || fail "gpu_direct did not verify every byte: $out"
echo "$out" | grep -q '"gpu_sync_s"' || fail "no gpu_sync_s: $out"
echo PASS
