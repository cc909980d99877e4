#!/usr/bin/env bash
# Ninth session of 2026-12-02, fourth call, ~3 minutes: why the 1 us timer
# slack made 1-block saves slower in the third call (its flag wait 70 -> 35 us,
# yet the save's other work ~1.5x slower). Four trees, alternated twice,
# 1-block round trips, the server traced:
#   A  the session's start (5b6e19f): slack 50 us, polls sleep(0)
#   B  this tree: slack 1 us, polls sleep(0) (a syscall per read)
#   C  slack 50 us, the flag read without a syscall for its first 100 us
#   D  slack 1 us and that hot read
export CALL_S=${CALL_S:-300}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
SITE=$PWD/.site
for v in A C D; do
  rm -rf "/tmp/tree$v" && mkdir -p "/tmp/tree$v"
done
tar -xzf .ab/base_5b6e19f.tgz -C /tmp/treeA
tar -xzf .ab/treeC.tgz -C /tmp/treeC
tar -xzf .ab/treeD.tgz -C /tmp/treeD

for round in 1 2; do
  for v in A B C D; do
    dir=/tmp/tree$v; [ $v = B ] && dir=$PWD
    stage "round $round: $v"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout $(within 40) python3 benchmarks/transfer.py \
      --shapes llama-3.1-8b --sizes 1 --min-reps 5 --lat-reps 300 --bringup-gib 0 \
      --trace-server "$RES/trace_$v$round.json" --tag "$v$round" --out "$RES" \
      > "$RES/transfer_$v$round.log" 2>&1; echo "rc=$?")
    grep -E "^lat_(load|save_event)_(p50|server)" "$RES/transfer_$v$round.log" | tr '\n' ' '; echo
  done
done

stage "summary"
for f in "$RES"/trace_*.json; do
  python3 benchmarks/phase_trace.py --show "$f" | grep -E "^trace|StreamFlag|gather|_save |Engine.save|_queue|plan " | cut -c1-120
done
stage done
