#!/usr/bin/env bash
# Eleventh session, call 6 (2026-12-04), ~3 minutes. Call 5 found the host
# path's write-behind loss the same without the writers' checksum pass. Is
# it the writes themselves (O_DIRECT: pages pinned, the disk's DMA) or the
# rest of the writers' work (Python, wake-ups, GIL turns)? This tree against
# a copy whose writers sleep for as long as the disk would take (1.4 GB/s)
# instead of writing (.ab/sleepio.tgz; nothing reaches the disk: an A/B
# only), alternated four times.
export CALL_S=${CALL_S:-200}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
ROOT=$PWD; unpack_base .ab/sleepio.tgz
for round in 1 2 3 4; do
  for tree in main sleepio; do
    stage "host path write-behind, $tree, round $round"
    dir=$ROOT; [ "$tree" = sleepio ] && dir=$BASE
    (cd "$dir" && PYTHONPATH=$ROOT/.site:$PWD timeout $(within 80) python3 \
      benchmarks/ssd_writebehind.py --reps 1 --modes none,seal --engine-align page \
      --dir /var/tmp/pegaflow-wb-bench --json "$RES/wb_${tree}_$round.json") \
      > "$RES/wb_${tree}_$round.log" 2>&1
    echo "rc=$?"; grep -E "median save" "$RES/wb_${tree}_$round.log"
    rm -rf /var/tmp/pegaflow-wb-bench
  done
done
stage done
