#!/usr/bin/env bash
# The host path's write-behind loss, this tree against a variant of it
# carried as a tarball: `bash device_session_wb_variant.sh .ab/X.tgz LABEL`,
# `ssd_writebehind.py --reps 1 --modes none,seal --engine-align page` in
# each, alternated four times (~2 minutes). Eleventh session (2026-12-04):
# call 5 ran it with writers that skip the xxh3 pass (.ab/nohash.tgz,
# `nohash`), call 6 with writers that sleep for the disk's time at 1.4 GB/s
# instead of writing (.ab/sleepio.tgz, `sleepio`); both variants were a
# one-line change to this tree (gds/records._xxh3_each, gds/store.write_run),
# for the A/B only. (Call 5 named this tree `hash` in its files, not `main`.)
export CALL_S=${CALL_S:-200}
VARIANT=${1:?the variant tree: .ab/NAME.tgz} LABEL=${2:?a label for it}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
rm -rf "/tmp/tree_$LABEL" && mkdir -p "/tmp/tree_$LABEL" && tar -xzf "$VARIANT" -C "/tmp/tree_$LABEL"
for round in 1 2 3 4; do
  for tree in main "$LABEL"; do
    stage "host path write-behind, $tree, round $round"
    WB_STAGE_S=80 wb_round "$tree" "wb_${tree}_$round"
  done
done
stage done
