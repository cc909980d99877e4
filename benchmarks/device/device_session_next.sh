#!/usr/bin/env bash
# For the next device call (written 2026-12-03, tenth session), ~5 minutes.
# The tenth session's traced 640-block run put ~4 ms of a 640-block save in
# BlockStore.reserve_save on the H200 host (P90; 1.0-1.6 ms on the dev VM),
# with a full pool, so every such save also evicted 640 blocks. Is it the
# eviction or the reservation itself? The same traced run into a 16 GiB pool
# (full after a dozen saves) and a 96 GiB one (room for all), alternated
# twice; then the gpu-marked tests on whatever changed since.
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

for round in 1 2; do
  for pool in 16gb 96gb; do
    stage "640-block transfers, pool $pool, round $round"
    timeout $(within 90) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
      --sizes 64,640 --min-reps 10 --lat-reps 20 --bringup-gib 0 \
      --server-arg=--pool-size=$pool --trace-server "$RES/trace_${pool}_$round.json" \
      --tag "${pool}_$round" --out "$RES" > "$RES/transfer_${pool}_$round.log" 2>&1
    echo "rc=$?"; grep -E "llama-3.1-8b \| +(64|640) " "$RES/transfer_${pool}_$round.log"
    python3 benchmarks/phase_trace.py --show "$RES/trace_${pool}_$round.json" 2>&1 \
      | grep -E "reserve_save|finish_save|Engine.save|_SocketProtocol._save" | cut -c1-110
  done
done

stage "gpu-marked tests"
timeout $(within 230) python3 -m pytest -q -m gpu tests/kernels tests/gpu \
  -p no:cacheprovider -rfE > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$RES/gpu_tests.log"
stage done
