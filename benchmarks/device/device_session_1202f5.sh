#!/usr/bin/env bash
# Sixth session, last call (issue 12): the gpu tests on the code that
# launches GPU copies on the event loop (pegaflow/copiers/copy_wait.py), then
# transfer.py with --copy-wait loop (the new default) against thread,
# alternated twice. Fits the session's last ~300 s of device time.
export CALL_S=${CALL_S:-270}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu tests: kernels and server"
timeout $(within 150) python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 60 -x > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -4 "$RES/gpu_tests.log"

for round in 1 2; do
  for wait in loop thread; do
    stage "transfer round $round: --copy-wait $wait"
    timeout $(within 40) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
      --sizes 1,64,640 --min-reps 5 --lat-reps 200 --bringup-gib 0 \
      --server-arg=--copy-wait=$wait --tag "$wait$round" --out "$RES" \
      > "$RES/transfer_$wait$round.log" 2>&1
    echo "rc=$?"
  done
done

stage "summary"
python3 benchmarks/transfer_ab_summary.py "$RES" loop1 thread1 loop2 thread2
stage done
