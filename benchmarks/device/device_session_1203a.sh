#!/usr/bin/env bash
# Tenth session (2026-12-03), call 1, ~8 minutes: staged rounds (pack on the
# GPU, batched copy-engine DMA of whole slots on a second stream) against the
# zero-copy kernel and page DMA, one way, both ways, and beside a matmul
# (benchmarks/staged_rounds.py); then the gpu-marked kernel tests, which now
# include the pipelined staged cases (two streams ordered by events).
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu-marked kernel tests"
timeout $(within 120) python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider \
  -rfE > "$RES/kernel_tests.log" 2>&1
echo "rc=$?"; tail -5 "$RES/kernel_tests.log" | cut -c1-300

stage "staged rounds"
timeout $(within 420) python3 benchmarks/staged_rounds.py --budget-s 330 \
  --json "$RES/staged_rounds.json" 2>&1 | tee "$RES/staged_rounds.log" | grep -v "^ *{" | tail -80
stage done
