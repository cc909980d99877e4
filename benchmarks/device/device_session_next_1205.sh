#!/usr/bin/env bash
# Written 2026-12-04 (thirteenth session, no device time left), for the next
# call, ~9 minutes: the host path's write-behind cost with the SSD writers'
# checksums and staged copies in one compiled call per run (commits 81abd55,
# 68234c0: no GIL turn per block) against the tree before them. Dev VM:
# page-aligned buffer 31.8 -> 30.0 % (another set 30.2 -> 24.5 %), malloc'd
# (staged) 45.5 -> 41.5 % (RESULTS.md, thirteenth session). Needs, untracked:
#   .ab/pyhash.tgz   git archive 4687777 | gzip > .ab/pyhash.tgz
#   .whl/xxhash-4.1.0-cp312-*.whl   (what `pip install` gives a user today;
#                    it has xxHash's AVX2 dispatch, 3.6.0 has not)
# `ssd_writebehind.py --bursts 4`, none then seal, the two trees alternated:
# four rounds each of 256 KiB blocks from a page-aligned and a malloc'd
# engine buffer, then 2 MiB rounds while time is left.
# Run: the device tool with carry [".whl", ".ab"], command
#   CALL_S=560 bash benchmarks/device/device_session_next_1205.sh
# Summary: python3 benchmarks/writebehind_summary.py --paired <results dir>
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
python3 -c "import xxhash; print('xxhash', xxhash.VERSION)"
python3 -c "from pegaflow import checksum_rows as c; from pegaflow.gds import io
print('compiled rows:', c.warm(), 'compiled copies:', io.warm_copies())"
unpack_variants pyhash
for round in 1 2 3 4; do
  for align in page malloc; do
    stage "host path write-behind, 256 KiB, $align, one call per run, round $round"
    WB_STAGE_S=40 wb_round main "wb_after-${align}_r$round" --bursts 4 --engine-align $align
    stage "host path write-behind, 256 KiB, $align, a call per block, round $round"
    WB_STAGE_S=40 wb_round pyhash "wb_before-${align}_r$round" --bursts 4 --engine-align $align
  done
done
for round in 1 2 3 4; do
  [ $((CALL_S - (SECONDS - START))) -lt 70 ] && break
  stage "host path write-behind, 2 MiB, page, one call per run, round $round"
  WB_STAGE_S=30 wb_round main "wb_afterL32_r$round" --bursts 4 --layers 32
  stage "host path write-behind, 2 MiB, page, a call per block, round $round"
  WB_STAGE_S=30 wb_round pyhash "wb_beforeL32_r$round" --bursts 4 --layers 32
done
stage done
