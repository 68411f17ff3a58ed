#!/usr/bin/env bash
# Smoke test of bench:delta: a 4 MB slice of the 2-layer Qwen2.5 config, 2 steps at lr 1e-6 and
# 1e-5, every decoded byte compared; the figures are printed, only their presence is checked.
set -euo pipefail
R="${TEST_SRCDIR:-$(pwd)/..}/${TEST_WORKSPACE:-weightbridge}"
cd "$R"
fail() { echo "FAIL: $*" >&2; exit 1; }
for lr in 1e-6 1e-5; do
  out=$(timeout 60 bench/delta --json --lr=$lr --steps=2 --max_mb=4 --synthetic_mb=2 \
        --config=tests/e2e/testdata/qwen2.5-0.5b-2layer.json 2>&1 | grep '^{' | tail -n 1) ||
    fail "bench:delta --lr=$lr did not finish"
  echo "lr $lr: $out"
  echo "$out" | grep -q '"verified":true' || fail "bench:delta did not verify every byte: $out"
  for key in bytes_full bytes_delta identical_fraction encode_GBps decode_GBps '"lr"'; do
    echo "$out" | grep -q "$key" || fail "no $key: $out"
  done
done
echo PASS
