#!/usr/bin/env bash
# Issue 12, small batches through the server, on the H200 test machine in ONE
# call of the device tool (~5 min, at most ~6: stage limits 170 + 110 + 60 s),
# from the repo root, with the wheels of .whl carried:
#
#   bash benchmarks/device/device_session_issue12c.sh
#
# Stages, each under its own time limit so a hang costs one stage:
#   1. the gpu-marked tests of tests/kernels and tests/gpu (server CUDA path:
#      kernel, copy-engine and auto paths, events, SIGKILLed engines; 67
#      passed in 124 s on 2026-12-02)
#   2. transfer.py --copy-path auto (the default table: copy engines + mapped
#      flag for saves of 1-4 blocks, kernels otherwise), Llama-3.1-8B shape,
#      N = 1, 4, 8, 64, 640 both ways, contiguous and random ids, byte-checked;
#      the 1-block latencies (event-ordered save, synced save, load) and
#      save + load at once at N = 640
#   3. the same with --copy-path kernel for N = 1, 4, 8: the A/B of the small
#      save path (and its 1-block latencies)
# A short table comes last; logs and JSON (transfer-auto.json,
# transfer-kernel.json) land in $OUT.
. "$(dirname "$0")/device_prelude.sh"
python3 -c "import numpy, numba, torch; print('numpy', numpy.__version__, \
'numba', numba.__version__, 'torch', torch.__version__)"

stage "gpu tests: kernels, server CUDA path"
timeout "${TEST_S:-170}" python3 -m pytest -m gpu tests/kernels tests/gpu \
  -o addopts="" -p no:cacheprovider -q -rfE --timeout 100 2>&1 \
  | tee "$OUT/gpu_tests_12c.log" | tail -12

stage "transfer: --copy-path auto, N = ${AUTO_SIZES:-1,4,8,64,640}"
timeout "${AUTO_S:-110}" python3 benchmarks/transfer.py --out "$OUT" --tag auto \
  --shapes llama-3.1-8b --sizes "${AUTO_SIZES:-1,4,8,64,640}" --bringup-gib 0 \
  2>&1 | tee "$OUT/transfer-auto.log" | tail -6

stage "transfer: --copy-path kernel, N = ${KERNEL_SIZES:-1,4,8}"
timeout "${KERNEL_S:-60}" python3 benchmarks/transfer.py --out "$OUT" \
  --tag kernel --copy-path kernel --shapes llama-3.1-8b \
  --sizes "${KERNEL_SIZES:-1,4,8}" --bringup-gib 0 2>&1 \
  | tee "$OUT/transfer-kernel.log" | tail -6

stage "summary"
grep -E "passed|failed|error" "$OUT/gpu_tests_12c.log" | tail -1
OUT="$OUT" python3 benchmarks/issue12c_summary.py
stage done
