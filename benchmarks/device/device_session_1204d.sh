#!/usr/bin/env bash
# Twelfth session, call 1 (2026-12-04), ~6 minutes: where the host path's
# write-behind loss comes from, and what it is at a real model's block size.
# `ssd_writebehind.py --reps 1 --modes none,seal --engine-align page`, one
# round of each tree and block size after another, four rounds:
#   main   this tree;
#   bare   writers that do none of their bookkeeping (no records, journal,
#          header pages, checksums or index: they sleep for the disk's time
#          at 1.4 GB/s, then release the slots) -- .ab/bare.tgz, an A/B only;
#   refuse every spill refused at the link (the save path's own share of
#          the tier: SsdLink, refuse_many; writers idle) -- .ab/refuse.tgz;
# at 256 KiB blocks (--layers 4, the writers' worst case) and, main and bare,
# 2 MiB (--layers 32: transfer.py's Llama geometry); then two more rounds of
# main at 2 MiB.
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
unpack_variants bare refuse
one() {  # tree layers round
  stage "host path write-behind, $1, $2 layers, round $3"
  WB_STAGE_S=60 wb_round "$1" "wb_$1_L$2_$3" --layers "$2"
}
for round in 1 2 3 4; do
  one main 4 $round; one bare 4 $round; one refuse 4 $round
  one main 32 $round; one bare 32 $round
done
for round in 5 6; do one main 32 $round; done
stage done
