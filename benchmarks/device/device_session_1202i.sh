#!/usr/bin/env bash
# Ninth session of 2026-12-02, third call, ~8 minutes: A/B against the
# session's start (5b6e19f, carried as .ab/base_5b6e19f.tgz), alternated
# twice: (1) 1-, 64- and 640-block transfers, the server traced (the 1 us
# timer slack: a flag wait's sleep(0) slept 50 us); (2) the metaserver
# benchmark (its lookup and plan compiled: issue 11's last figure); then the
# gpu-marked tests on this tree.
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
SITE=$PWD/.site
unpack_base .ab/base_5b6e19f.tgz

for round in 1 2; do
  for v in base new; do
    dir=$PWD; [ $v = base ] && dir=$BASE
    stage "transfers, round $round: $v"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout $(within 70) python3 benchmarks/transfer.py \
      --shapes llama-3.1-8b --sizes 1,64,640 --min-reps 5 --lat-reps 300 --bringup-gib 0 \
      --trace-server "$RES/trace_$v$round.json" --tag "$v$round" --out "$RES" \
      > "$RES/transfer_$v$round.log" 2>&1; echo "rc=$?")
    grep -E "^lat_(load|save_event)_(p50|server)" "$RES/transfer_$v$round.log" | tr '\n' ' '; echo
  done
done

for round in 1 2; do
  for v in base new; do
    dir=$PWD; [ $v = base ] && dir=$BASE
    stage "metaserver, round $round: $v"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout $(within 60) python3 benchmarks/metaserver.py \
      --entries 1000000 --json "$RES/metaserver_$v$round.json" \
      > "$RES/metaserver_$v$round.log" 2>&1; echo "rc=$?")
    grep -E "^  1000 |spread|empty" "$RES/metaserver_$v$round.log"
  done
done

stage "summary"
python3 benchmarks/phase_trace.py --show "$RES"/trace_*.json | grep -E "^trace|StreamFlag|_finish|gather|scatter|_load |_save "
python3 benchmarks/transfer_ab_summary.py "$RES" base1 new1 base2 new2

stage "gpu-marked tests"
timeout $(within 200) python3 -m pytest -q -m gpu tests/kernels tests/gpu \
  -p no:cacheprovider > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$RES/gpu_tests.log"
stage done
