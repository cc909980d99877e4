#!/usr/bin/env bash
# Twelfth session, call 3 (2026-12-04), ~6 minutes: do shorter writer runs
# cut the host path's write-behind loss? Call 2 put it in the writers'
# bookkeeping (their Python, GIL held): the save path's threads wait out
# whatever stretch a writer is in when they need the GIL, and a writer's
# stretches grow with its run (records, journal entries and header pages of
# up to 64 blocks at a time, the queue's size). run16: this tree with
# RUN_BLOCKS = 16 (.ab/run16.tgz, a one-line change, for the A/B only).
# `ssd_writebehind.py --bursts 4`, none then seal, alternated: six rounds at
# 256 KiB blocks, then three at 2 MiB (--layers 32).
export CALL_S=${CALL_S:-570}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
ROOT=$PWD
rm -rf /tmp/tree_run16 && mkdir -p /tmp/tree_run16 && tar -xzf .ab/run16.tgz -C /tmp/tree_run16
one() {  # tree layers round
  local tree=$1 layers=$2 round=$3 dir=$ROOT name="wb_$1_L$2_$3"
  [ "$tree" = main ] || dir=/tmp/tree_$tree
  stage "host path write-behind, $tree, $layers layers, round $round"
  (cd "$dir" && PYTHONPATH=$ROOT/.site:$PWD timeout $(within 75) python3 \
    benchmarks/ssd_writebehind.py --reps 1 --modes none,seal --engine-align page \
    --bursts 4 --layers "$layers" --dir /var/tmp/pegaflow-wb-bench \
    --json "$RES/$name.json") > "$RES/$name.log" 2>&1
  echo "rc=$?"; grep -E "median save" "$RES/$name.log"
  grep -E "^ +[0-9]+ \| seal" "$RES/$name.log" | cut -c1-200
  rm -rf /var/tmp/pegaflow-wb-bench
}
for round in 1 2 3 4 5 6; do one main 4 $round; one run16 4 $round; done
for round in 1 2 3; do one main 32 $round; one run16 32 $round; done
stage done
