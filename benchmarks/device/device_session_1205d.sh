#!/usr/bin/env bash
# Fourteenth session, call 5 (2026-12-04), ~5 minutes: on the H200 the
# writers' staged path (a malloc'd engine buffer: each block copied into the
# writer's aligned buffer, one compiled call per run) lost 10.5 % in call 1,
# the in-place path (page-aligned: O_DIRECT straight from the pool slots)
# 16.3 %, four rounds each. Is writing from the pool slots themselves what
# costs the saves, beside process_vm_readv filling other slots of the same
# pool? Both alignments of this tree, alternated, as many rounds as fit.
# Run: the device tool with carry [".whl"], command
#   CALL_S=330 bash benchmarks/device/device_session_1205d.sh
export CALL_S=${CALL_S:-330}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
python3 -c "from pegaflow import checksum_rows as c; from pegaflow.gds import io
print('compiled rows:', c.warm(), 'compiled copies:', io.warm_copies())"
for round in 1 2 3 4 5 6 7 8 9 10; do
  for align in page malloc; do
    [ $((CALL_S - (SECONDS - START))) -lt 25 ] && break 2
    stage "host path write-behind, 256 KiB, $align, round $round"
    WB_STAGE_S=25 wb_round main "wb_${align}_r$round" --bursts 4 --engine-align $align
  done
done
stage done
