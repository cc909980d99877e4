#!/usr/bin/env bash
# Twelfth session, call 4 (2026-12-04), ~5 minutes: is the host path's
# write-behind loss the writers holding the GIL, or just their being busy on
# other cores? Writers replaced (each a change to SsdTier._write_batch, in
# .ab/NAME.tgz, for the A/B only), all sleeping for the disk's time at
# 1.4 GB/s and then releasing the slots, as `bare` (call 2: ~3 % loss) does:
#   spin     first burn the writers' CPU time per block (27 us at 256 KiB,
#            dev VM) with the GIL dropped (sha256 of a hot 64 KiB buffer);
#   gilspin  hold the GIL for the writers' Python time per block (7.6 us)
#            in three stretches, with a third of the sleep after each;
# against main and bare. `ssd_writebehind.py --bursts 4`, 256 KiB blocks,
# none then seal, four rounds.
export CALL_S=${CALL_S:-420}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
ROOT=$PWD
for v in bare spin gilspin; do
  rm -rf "/tmp/tree_$v" && mkdir -p "/tmp/tree_$v" && tar -xzf ".ab/$v.tgz" -C "/tmp/tree_$v"
done
one() {  # tree round
  local tree=$1 round=$2 dir=$ROOT name="wb_$1_$2"
  [ "$tree" = main ] || dir=/tmp/tree_$tree
  stage "host path write-behind, $tree, round $round"
  (cd "$dir" && PYTHONPATH=$ROOT/.site:$PWD timeout $(within 60) python3 \
    benchmarks/ssd_writebehind.py --reps 1 --modes none,seal --engine-align page \
    --bursts 4 --dir /var/tmp/pegaflow-wb-bench --json "$RES/$name.json") \
    > "$RES/$name.log" 2>&1
  echo "rc=$?"; grep -E "median save" "$RES/$name.log"
  rm -rf /var/tmp/pegaflow-wb-bench
}
for round in 1 2 3 4; do
  for tree in main bare spin gilspin; do one $tree $round; done
done
stage done
