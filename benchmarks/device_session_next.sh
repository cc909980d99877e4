#!/usr/bin/env bash
# For the next device call (written 2026-12-02, sixth session, when its
# device time was spent): the gpu tests on the code that
# launches GPU copies on the event loop (pegaflow/copy_wait.py), then
# transfer.py with --copy-wait loop (rates per size class since the last
# H200 A/B) against thread,
# alternated three times, up to 2560 blocks. About 6 minutes.
export CALL_S=${CALL_S:-540}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu tests: kernels and server"
timeout $(within 200) python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 60 -x > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -4 "$RES/gpu_tests.log"

for round in 1 2 3; do
  for wait in loop thread; do
    stage "transfer round $round: --copy-wait $wait"
    timeout $(within 60) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
      --sizes 1,64,640,2560 --min-reps 5 --lat-reps 200 --bringup-gib 0 \
      --server-arg=--copy-wait=$wait --tag "$wait$round" --out "$RES" \
      > "$RES/transfer_$wait$round.log" 2>&1
    echo "rc=$?"
  done
done

stage "summary"
python3 benchmarks/transfer_ab_summary.py "$RES" loop1 thread1 loop2 thread2 loop3 thread3
stage done
