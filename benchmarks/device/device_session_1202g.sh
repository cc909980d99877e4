#!/usr/bin/env bash
# Seventh session of 2026-12-02, first call (issue 12), ~8 minutes:
# 1. the gpu tests on the code since the last GPU run (rates per size class,
#    the any-stream in-flight check, sticky faults, busy-stream small copies);
# 2. where a 1-block load's server time goes: transfer.py's 1-block round
#    trips with the server under benchmarks/phase_trace.py, default and
#    --copy-path dma, and copier_direct.py's bare N = 1 figures beside them;
# 3. --copy-wait loop (rates per size class, not yet measured) against thread,
#    alternated, up to 2560 blocks.
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu tests: kernels and server"
timeout $(within 200) python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 60 -x > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -4 "$RES/gpu_tests.log"

for path in auto dma; do
  stage "1-block round trips traced: --copy-path $path"
  timeout $(within 50) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
    --sizes 1 --min-reps 5 --lat-reps 400 --bringup-gib 0 --copy-path $path \
    --trace-server "$RES/trace_$path.json" --tag "trace_$path" --out "$RES" \
    > "$RES/transfer_trace_$path.log" 2>&1
  echo "rc=$?"; grep -E "^lat_load|^lat_save_event" "$RES/transfer_trace_$path.log"
done

stage "copier alone, N = 1 and 64"
timeout $(within 60) python3 benchmarks/copier_direct.py --sizes 1,64 \
  --pools "server pool" --json "$RES/copier_direct.json" > "$RES/copier.log" 2>&1
echo "rc=$?"; tail -14 "$RES/copier.log"

for round in 1 2 3; do
  for wait in loop thread; do
    stage "transfer round $round: --copy-wait $wait"
    timeout $(within 60) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
      --sizes 64,640,2560 --min-reps 5 --lat-reps 50 --bringup-gib 0 \
      --server-arg=--copy-wait=$wait --tag "$wait$round" --out "$RES" \
      > "$RES/transfer_$wait$round.log" 2>&1
    echo "rc=$?"
  done
done

stage "summary"
python3 benchmarks/phase_trace.py --show "$RES"/trace_*.json
python3 benchmarks/transfer_ab_summary.py "$RES" loop1 thread1 loop2 thread2 loop3 thread3
stage done
