#!/usr/bin/env bash
# Ninth session of 2026-12-02, last call, ~5 minutes: the gpu-marked tests on
# the session's final code (the hot flag read, and the direct SSD -> GPU
# route in the server: tests/gpu/test_gpu_ssd_direct.py, new), then 1-block
# round trips on it, two rounds.
export CALL_S=${CALL_S:-420}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu-marked tests"
timeout $(within 260) python3 -m pytest -q -m gpu tests/kernels tests/gpu \
  -p no:cacheprovider -rfE > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -25 "$RES/gpu_tests.log" | cut -c1-300

for round in 1 2; do
  stage "1-block round trips, round $round"
  timeout $(within 40) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
    --sizes 1 --min-reps 5 --lat-reps 400 --bringup-gib 0 --tag "final$round" \
    --out "$RES" > "$RES/transfer_final$round.log" 2>&1
  echo "rc=$?"; grep -E "^lat_(load|save_event|save_synced)_(p50|server|copy)" \
    "$RES/transfer_final$round.log" | tr '\n' ' '; echo
done
stage done
