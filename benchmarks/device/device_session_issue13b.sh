#!/usr/bin/env bash
# Issue 13 on the H200 machine, in one call (~5 min): does a kept --pool-file
# now give back every acknowledged block on a GPU host (the CUDA copy engine's
# start-up warm-up used to overwrite the pool's first 16 bytes)?
#   1. tests/server/test_pool_file.py and tests/unit/test_cuda_warm_up.py (a
#      GPU host: the server builds the CUDA copy engine, so its warm-up runs)
#   2. benchmarks/restart.py --sizes 16gb,64gb (SIGTERM and SIGKILL), JSON in $OUT
# Run from the repo root with .whl carried.
. "$(dirname "$0")/device_prelude.sh"

stage "pool-file tests on a GPU host"
timeout "${TEST_S:-120}" python3 -m pytest tests/server/test_pool_file.py \
  tests/unit/test_cuda_warm_up.py -o addopts="" -p no:cacheprovider -q -rfE \
  --timeout 100 2>&1 | tee "$OUT/pool_file_tests.log" | tail -8

stage "warm restart, 16 and 64 GiB pools"
timeout "${RESTART_S:-330}" python3 benchmarks/restart.py --sizes "${SIZES:-16gb,64gb}" \
  --json "$OUT/restart_h200.json" > "$OUT/restart_h200.log" 2>&1
echo "restart rc=$?"
tail -20 "$OUT/restart_h200.log"
stage done
