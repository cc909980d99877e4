#!/usr/bin/env bash
# Twelfth session, call 5 (2026-12-04), the device budget's last ~100 s:
# more rounds of the host path's write-behind cost at 2 MiB blocks
# (`ssd_writebehind.py --bursts 4 --layers 32`, none then seal), this tree.
export CALL_S=${CALL_S:-100}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
for round in 1 2 3 4 5 6; do
  stage "host path write-behind, 2 MiB blocks, round $round"
  WB_STAGE_S=25 wb_round main "wb_main_L32_r$round" --bursts 4 --layers 32
  [ $((CALL_S - (SECONDS - START))) -lt 20 ] && break
done
stage done
