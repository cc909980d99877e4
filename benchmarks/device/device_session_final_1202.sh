#!/usr/bin/env bash
# The end of 2026-12-02's session on the H200 machine, in one call (~6 min):
# what the day's CPU-side changes did where the product runs.
#   1. gpu tests of the server's CUDA path (tests/gpu)
#   2. transfer.py N = 1, 64, 640 (the save bookkeeping change), byte-checked
#   3. restart.py --sizes 64gb (pool-file checksums: xxh3 instead of blake3)
#   4. ssd_writebehind.py --quick (SSD record checksums: xxh3 instead of blake3)
# Run from the repo root with .whl carried; JSON and logs in $OUT.
. "$(dirname "$0")/device_prelude.sh"

stage "gpu tests: server CUDA path"
timeout "${TEST_S:-100}" python3 -m pytest -m gpu tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 90 2>&1 | tee "$OUT/gpu_tests_final.log" \
  | tail -4

stage "transfer N = 1, 64, 640"
timeout "${TRANSFER_S:-90}" python3 benchmarks/transfer.py --out "$OUT" --tag final \
  --shapes llama-3.1-8b --sizes 1,64,640 --bringup-gib 0 2>&1 \
  | tee "$OUT/transfer-final.log" | tail -12

stage "warm restart 64 GiB"
timeout "${RESTART_S:-150}" python3 benchmarks/restart.py --sizes 64gb \
  --json "$OUT/restart_final.json" > "$OUT/restart_final.log" 2>&1
tail -6 "$OUT/restart_final.log"

stage "write-behind"
timeout "${WB_S:-120}" python3 benchmarks/ssd_writebehind.py --quick \
  --json "$OUT/writebehind_final.json" > "$OUT/writebehind_final.log" 2>&1
tail -12 "$OUT/writebehind_final.log"
stage done
