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
unpack_variants run16
one() {  # tree layers round
  stage "host path write-behind, $1, $2 layers, round $3"
  wb_round "$1" "wb_$1_L$2_$3" --bursts 4 --layers "$2"
}
for round in 1 2 3 4 5 6; do one main 4 $round; one run16 4 $round; done
for round in 1 2 3; do one main 32 $round; one run16 32 $round; done
stage done
