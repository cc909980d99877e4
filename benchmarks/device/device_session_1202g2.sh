#!/usr/bin/env bash
# Seventh session of 2026-12-02, second call (issue 12), ~7 minutes:
# 1. the gpu tests again (launch() declines batches expected past 8 ms; the
#    copy-wait test no longer assumes every save waits on a thread);
# 2. benchmarks/idle_gap.py: the same work back to back and after idle gaps;
# 3. 1-block round trips, the server traced, its loop busy-polling 0 or
#    2000 us after each event, the client polling its reply 0 or 1000 us
#    (experiments), alternated twice;
# 4. --copy-wait loop against thread once more, with the 8 ms cap.
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu tests: kernels and server"
timeout $(within 200) python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 60 > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -4 "$RES/gpu_tests.log"

stage "idle gaps"
timeout $(within 60) python3 benchmarks/idle_gap.py --json "$RES/idle_gap.json" \
  > "$RES/idle_gap.log" 2>&1
echo "rc=$?"; tail -16 "$RES/idle_gap.log"

for round in 1 2; do
  for poll in 0 2000; do
    for spin in 0 1000; do
      tag="poll${poll}_spin${spin}_$round"
      stage "1-block round trips: $tag"
      timeout $(within 40) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
        --sizes 1 --min-reps 5 --lat-reps 400 --bringup-gib 0 \
        --trace-server "$RES/trace_$tag.json" --busy-poll-us $poll \
        --client-spin-us $spin --tag "$tag" --out "$RES" > "$RES/transfer_$tag.log" 2>&1
      echo "rc=$?"; grep -E "^lat_(load|save_event)_(p50|server)" "$RES/transfer_$tag.log" | tr '\n' ' '; echo
    done
  done
done

for round in 1 2; do
  for wait in loop thread; do
    stage "transfer round $round: --copy-wait $wait"
    timeout $(within 60) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
      --sizes 64,640,2560 --min-reps 5 --lat-reps 20 --bringup-gib 0 \
      --server-arg=--copy-wait=$wait --tag "$wait$round" --out "$RES" \
      > "$RES/transfer_$wait$round.log" 2>&1
    echo "rc=$?"
  done
done

stage "summary"
python3 benchmarks/phase_trace.py --show "$RES"/trace_poll*_1.json | grep -E "^trace|scatter|gather|_load |_save |plan|_queue|_finish"
python3 benchmarks/transfer_ab_summary.py "$RES" loop1 thread1 loop2 thread2
stage done
