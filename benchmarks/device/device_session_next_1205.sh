#!/usr/bin/env bash
# Written 2026-12-04 (thirteenth session, no device time left), for the next
# call, ~9 minutes: does one SSD writer thread cost a host engine's saves less
# than two (the default)? The writers' GIL-held Python per block is what the
# host path loses to (RESULTS.md, twelfth session, call 4); with one writer,
# a save thread waits on at most one of them. The same work per block, fewer
# threads wanting the GIL at once. Checks that one writer still keeps up with
# the disk (write/dd in each seal row). `ssd_writebehind.py --bursts 4`,
# 256 KiB blocks, none then seal, the two settings alternated, six rounds.
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
for round in 1 2 3 4 5 6; do
  stage "host path write-behind, two writers (default), round $round"
  WB_STAGE_S=45 wb_round main "wb_w2_r$round" --bursts 4
  stage "host path write-behind, one writer, round $round"
  WB_STAGE_S=45 wb_round main "wb_w1_r$round" --bursts 4 \
    --tier-arg=--ssd-write-inflight=1
  [ $((CALL_S - (SECONDS - START))) -lt 100 ] && break
done
stage done
