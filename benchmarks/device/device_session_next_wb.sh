#!/usr/bin/env bash
# For a device call after device_session_next.sh (written 2026-12-02, eighth
# session, with no device time), ~6 minutes: is the write-behind save loss
# (−16 to −23 % on the H200, issue 13) GIL hand-offs? The SSD writers hold
# the GIL for their Python per run (~64 blocks of 256 KiB); a copy thread or
# the loop that wants it back waits until the writer blocks or the switch
# interval makes it drop. 0.5 ms against 5 ms did not tell the two apart
# (RESULTS.md, "Is it the GIL?"); 0.05 ms would: if the loss shrinks there,
# the fix is shorter GIL holds in the writers (or writers outside the
# server's interpreter), not fewer bytes.
export CALL_S=${CALL_S:-420}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}

stage "write-behind, switch interval 5 / 0.05 ms"
timeout $(within 240) python3 benchmarks/ssd_writebehind.py --reps 2 \
  --modes none,seal --switch-ms 5,0.05 --dir "$WB_DIR" \
  --json "$RES/writebehind_switch.json" > "$RES/writebehind_switch.log" 2>&1
echo "rc=$?"; tail -8 "$RES/writebehind_switch.log"

stage "write-behind traced: the copy calls' time off the CPU, with and without"
timeout $(within 120) python3 benchmarks/ssd_writebehind.py --reps 1 \
  --modes none,seal --trace-dir "$RES/traces" --dir "$WB_DIR" \
  --json "$RES/writebehind_traced.json" > "$RES/writebehind_traced.log" 2>&1
echo "rc=$?"; tail -4 "$RES/writebehind_traced.log"
python3 benchmarks/phase_trace.py --show "$RES"/traces/*.json 2>&1 | cut -c1-200
rm -rf "$WB_DIR"
stage done
