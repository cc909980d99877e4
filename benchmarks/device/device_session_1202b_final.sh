#!/usr/bin/env bash
# 2026-12-02, second session, the last H200 call (~8 min): the merged code.
#   1. transfer.py N = 1, 64, 640 first, on a GPU nothing else has touched (the
#      12d call ran it after a gpu-test stage cut by its time limit)
#   2. metaserver.py --entries 1000000 (the numpy table, issue 11)
#   3. the interference mode: auto (contention-aware), dma, kernel (issue 12)
#   4. the gpu-marked tests of tests/gpu, whole, last
# Run from the repo root with .whl carried; JSON and logs in $OUT.
. "$(dirname "$0")/device_prelude.sh"

stage "transfer N = 1, 64, 640"
timeout "${TRANSFER_S:-100}" python3 benchmarks/transfer.py --out "$OUT" \
  --tag final2 --shapes llama-3.1-8b --sizes 1,64,640 --min-reps 5 \
  --bringup-gib 0 > "$OUT/transfer-final2.log" 2>&1
echo "transfer rc=$?"

stage "metaserver, 2M entries"
timeout "${META_S:-90}" python3 benchmarks/metaserver.py --entries 1000000 \
  --json "$OUT/metaserver_final2.json" > "$OUT/metaserver_final2.log" 2>&1
tail -9 "$OUT/metaserver_final2.log"

stage "interference (12e)"
INTERFERENCE_S=${INTERFERENCE_S:-150} bash "$(dirname "$0")/device_session_issue12e.sh" \
  2>&1 | tail -16

stage "gpu tests, whole"
timeout "${TEST_S:-190}" python3 -m pytest -m gpu tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 90 > "$OUT/gpu_tests_final2.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests_final2.log"

stage "transfer summary"
OUT="$OUT" TAGS=final2 python3 benchmarks/issue12c_summary.py
stage done
