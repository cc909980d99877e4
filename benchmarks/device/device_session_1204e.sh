#!/usr/bin/env bash
# Twelfth session, call 2 (2026-12-04), ~7 minutes: the host path's
# write-behind loss taken apart again, with steadier rows: each server
# saves four bursts of 3 GiB (`ssd_writebehind.py --bursts 4`: a row is the
# median of bursts 2-4, pool full, SSD queue drained before each). Trees,
# one round of each after another (none then seal in each), five rounds:
#   main     this tree;
#   nohash   writers that skip the xxh3 pass (records carry checksum 0);
#   sleepio  writers that sleep for the disk's time at 1.4 GB/s instead of
#            the O_DIRECT write (nothing pinned, nothing on disk);
#   bare     writers that do none of their work: they sleep for the disk's
#            time and release the slots (no records, journal, header pages,
#            checksums, writes or index);
# (.ab/NAME.tgz, each a one-line change to this tree, for the A/B only), at
# 256 KiB blocks; then main at 2 MiB blocks (--layers 32), three rounds.
export CALL_S=${CALL_S:-570}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
lscpu > "$RES/lscpu.txt" 2>&1; grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA)" "$RES/lscpu.txt"
unpack_variants nohash sleepio bare
one() {  # tree layers round
  stage "host path write-behind, $1, $2 layers, round $3"
  wb_round "$1" "wb_$1_L$2_$3" --bursts 4 --layers "$2"
}
for round in 1 2 3 4 5; do
  for tree in main nohash sleepio bare; do one $tree 4 $round; done
done
for round in 1 2 3; do one main 32 $round; done
stage done
