#!/usr/bin/env bash
# Twelfth session, call 5 (2026-12-04), the device budget's last ~100 s:
# more rounds of the host path's write-behind cost at 2 MiB blocks
# (`ssd_writebehind.py --bursts 4 --layers 32`, none then seal), this tree.
export CALL_S=${CALL_S:-100}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
for round in 1 2 3 4 5 6; do
  stage "host path write-behind, 2 MiB blocks, round $round"
  name=wb_main_L32_r$round
  timeout $(within 25) python3 benchmarks/ssd_writebehind.py --reps 1 --modes none,seal \
    --engine-align page --bursts 4 --layers 32 --dir /var/tmp/pegaflow-wb-bench \
    --json "$RES/$name.json" > "$RES/$name.log" 2>&1
  echo "rc=$?"; grep -E "median save" "$RES/$name.log"
  rm -rf /var/tmp/pegaflow-wb-bench
  [ $((CALL_S - (SECONDS - START))) -lt 20 ] && break
done
stage done
