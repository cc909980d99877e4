#!/usr/bin/env bash
# Eleventh session, call 5 (2026-12-04), ~3 minutes. Is the host path's
# write-behind loss (9-11 %, calls 2-4) the writers' checksum pass over
# every byte they write? This tree against a copy whose writers skip the
# xxh3 pass (.ab/nohash.tgz: records written with checksum 0, for this A/B
# only), `ssd_writebehind.py --modes none,seal`, page-aligned engine
# buffer, alternated four times.
export CALL_S=${CALL_S:-300}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
ROOT=$PWD; unpack_base .ab/nohash.tgz
for round in 1 2 3 4; do
  for tree in hash nohash; do
    stage "host path write-behind, $tree, round $round"
    dir=$ROOT; [ "$tree" = nohash ] && dir=$BASE
    (cd "$dir" && PYTHONPATH=$ROOT/.site:$PWD timeout $(within 80) python3 \
      benchmarks/ssd_writebehind.py --reps 1 --modes none,seal --engine-align page \
      --dir /var/tmp/pegaflow-wb-bench --json "$RES/wb_${tree}_$round.json") \
      > "$RES/wb_${tree}_$round.log" 2>&1
    echo "rc=$?"; grep -E "median save" "$RES/wb_${tree}_$round.log"
    rm -rf /var/tmp/pegaflow-wb-bench
  done
done
stage done
