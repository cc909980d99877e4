#!/usr/bin/env bash
# Written 2026-12-04 (thirteenth session, no device time left), for the next
# call, ~9 minutes: the host path's write-behind cost with the SSD writers'
# checksums in one compiled call per run (pegaflow.checksum_rows, commit
# 81abd55) against the tree before it (one python-xxhash call per record, a
# GIL turn each). Dev VM: 30.2 -> 24.5 % median loss (RESULTS.md,
# thirteenth session). Needs, both untracked:
#   .ab/pyhash.tgz   git archive 4687777 | gzip > .ab/pyhash.tgz
#   .whl/xxhash-4.1.0-cp312-*.whl   (what `pip install` gives a user today;
#                    it has xxHash's AVX2 dispatch, 3.6.0 has not)
# `ssd_writebehind.py --bursts 4`, none then seal, the two trees alternated:
# six rounds at 256 KiB, then 2 MiB rounds while time is left.
# Summary: python3 benchmarks/writebehind_summary.py --paired <results dir>
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
python3 -c "import xxhash; print('xxhash', xxhash.VERSION)"
python3 -c "from pegaflow import checksum_rows as c; print('compiled rows:', c.warm())"
unpack_variants pyhash
for round in 1 2 3 4 5 6; do
  stage "host path write-behind, 256 KiB, one call per run, round $round"
  WB_STAGE_S=45 wb_round main "wb_rows_r$round" --bursts 4
  stage "host path write-behind, 256 KiB, a call per record, round $round"
  WB_STAGE_S=45 wb_round pyhash "wb_pyhash_r$round" --bursts 4
done
for round in 1 2 3 4; do
  [ $((CALL_S - (SECONDS - START))) -lt 70 ] && break
  stage "host path write-behind, 2 MiB, one call per run, round $round"
  WB_STAGE_S=30 wb_round main "wb_rowsL32_r$round" --bursts 4 --layers 32
  stage "host path write-behind, 2 MiB, a call per record, round $round"
  WB_STAGE_S=30 wb_round pyhash "wb_pyhashL32_r$round" --bursts 4 --layers 32
done
stage done
