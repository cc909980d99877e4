#!/usr/bin/env bash
# Eleventh session, call 2 (2026-12-04), ~6 minutes.
# 1. Issue 13: the write-behind cost on the GPU path, where the H200's
#    engines save: transfer.py with no SSD tier and with one written behind
#    on seal, alternated three times (the host path's figure is the other
#    stage).
# 2. Issue 12: the copy-wait rule "no loop launch while any stream has two
#    batches" (gpu_state.InFlight.busy), kept until measured: this tree
#    against a copy with the rule taken out (.ab/norule.tgz), alternated
#    twice; save + load at once is the row that could move.
# 3. Issue 13: the host path's write-behind cost, page-aligned engine buffer
#    (GPU engines' memory is), no tier against seal, three rounds.
export CALL_S=${CALL_S:-570}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
T="--shapes llama-3.1-8b --sizes 64,640 --min-reps 10 --lat-reps 50 --bringup-gib 0"

gpu_wb_rounds 1 2 3

ROOT=$PWD; unpack_base .ab/norule.tgz
for round in 1 2; do
  for tree in rule norule; do
    stage "copy-wait rule: $tree, round $round"
    dir=$PWD; [ "$tree" = norule ] && dir=$BASE
    (cd "$dir" && PYTHONPATH=$ROOT/.site:$PWD timeout $(within 60) python3 \
      benchmarks/transfer.py $T --tag "${tree}_$round" --out "$RES") \
      > "$RES/${tree}_$round.log" 2>&1
    echo "rc=$?"; transfer_rows "$RES/${tree}_$round.log"
  done
done

stage "host path write-behind, page-aligned engine buffer"
host_wb 3 200 writebehind_page
stage done
