#!/usr/bin/env bash
# Ninth session of 2026-12-02, fifth call, ~2.5 minutes: trees A (the
# session's start), B (timer slack 1 us) and C (slack 50 us, the flag read
# without a syscall for 100 us) of device_session_1202i2.sh, alternated
# three times, 1-block round trips untraced (the traced call 4 showed the
# server's side; here the round trip alone, 400 reps a kind).
export CALL_S=${CALL_S:-240}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
SITE=$PWD/.site
for v in A C; do rm -rf "/tmp/tree$v" && mkdir -p "/tmp/tree$v"; done
tar -xzf .ab/base_5b6e19f.tgz -C /tmp/treeA
tar -xzf .ab/treeC.tgz -C /tmp/treeC

for round in 1 2 3; do
  for v in A B C; do
    dir=/tmp/tree$v; [ $v = B ] && dir=$PWD
    stage "round $round: $v"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout $(within 30) python3 benchmarks/transfer.py \
      --shapes llama-3.1-8b --sizes 1 --min-reps 5 --lat-reps 400 --bringup-gib 0 \
      --tag "$v$round" --out "$RES" > "$RES/transfer_$v$round.log" 2>&1; echo "rc=$?")
    grep -E "^lat_(load|save_event|save_synced)_(p50|server|copy)" "$RES/transfer_$v$round.log" | tr '\n' ' '; echo
  done
done
stage done
