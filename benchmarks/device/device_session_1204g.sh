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
unpack_variants bare spin gilspin
one() {  # tree round
  stage "host path write-behind, $1, round $2"
  WB_STAGE_S=60 wb_round "$1" "wb_$1_$2" --bursts 4
}
for round in 1 2 3 4; do
  for tree in main bare spin gilspin; do one $tree $round; done
done
stage done
