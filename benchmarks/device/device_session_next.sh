#!/usr/bin/env bash
# For the next device call (written 2026-12-02, seventh session, when its
# device time was spent), ~4 minutes: 1-block round trips on the H200 back to
# back and at an engine's step cadence (a request every 3 and 10 ms: on the
# dev VM the same round trip took 2.5x as long at 10 ms), alternated twice,
# the server traced; then the metaserver benchmark (issue 11's last figure).
# First the gpu-marked tests: f11e7e6 (the compiled checks behind
# CopyKernels._checked) has not run on a GPU (~2 minutes).
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu-marked tests"
timeout $(within 200) python3 -m pytest -q -m gpu tests/kernels tests/gpu \
  -p no:cacheprovider > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$RES/gpu_tests.log"

for round in 1 2; do
  for gap in 0 3 10; do
    stage "1-block round trips, a request every $gap ms, round $round"
    timeout $(within 60) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
      --sizes 1 --min-reps 5 --lat-reps 200 --lat-gap-ms $gap --bringup-gib 0 \
      --trace-server "$RES/trace_gap${gap}_$round.json" --tag "gap${gap}_$round" \
      --out "$RES" > "$RES/transfer_gap${gap}_$round.log" 2>&1
    echo "rc=$?"; grep -E "^lat_(load|save_event|save_synced)_(p50|server)" \
      "$RES/transfer_gap${gap}_$round.log" | tr '\n' ' '; echo
  done
done

stage "metaserver"
timeout $(within 120) python3 benchmarks/metaserver.py --entries 1000000 \
  --json "$RES/metaserver.json" > "$RES/metaserver.log" 2>&1
echo "rc=$?"; tail -12 "$RES/metaserver.log"
stage done
