#!/usr/bin/env bash
# Issue 13 item 4 on the H200 machine, in one call (~2-3 min): SSD -> GPU direct
# loads (kvikio into the engine's GPU blocks, gds/gpu_reads.py) against
# SSD -> L1 -> GPU, byte-checked.
#   1. tests/gpu/test_gds_direct.py (direct loads byte-equal; a corrupted record
#      never loads) and the CPU tests of the planner/executor on this host
#   2. benchmarks/gds_direct.py at 1, 8, 64, 640 blocks (Llama-3.1-8B: 32 layers
#      x 64 KiB a block), JSON in $OUT, its table printed last
# Run from the repo root with .whl carried (kvikio-cu13, libkvikio-cu13,
# rapids-logger).
. "$(dirname "$0")/device_prelude.sh"

stage "gpu tests: direct loads (kvikio), corrupted record"
timeout "${TEST_S:-90}" python3 -m pytest tests/gpu/test_gds_direct.py \
  tests/gds/test_gpu_plan.py tests/gds/test_gpu_reads.py tests/gds/test_gpu_route.py \
  -m "gpu or not gpu" -o addopts="" -p no:cacheprovider -q -rfE --timeout 80 \
  2>&1 | tee "$OUT/gds_direct_tests.log" | tail -8

stage "benchmark: SSD -> GPU direct vs SSD -> L1 -> GPU"
timeout "${BENCH_S:-100}" python3 benchmarks/gds_direct.py --blocks "${BLOCKS:-1,8,64,640}" \
  --reps "${REPS:-3}" --dir "${BENCH_DIR:-$PWD}" --json "$OUT/gds_direct_h200.json" \
  > "$OUT/gds_direct_h200.log" 2>&1
echo "gds_direct rc=$?"
stage done
tail -16 "$OUT/gds_direct_h200.log"
