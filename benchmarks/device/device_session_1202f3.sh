#!/usr/bin/env bash
# Sixth session, call 4 (issue 12): the copy thread's hand-back. Call 3 found
# the copier as fast as the bare kernel on its own thread and 0.3-0.5 ms
# slower at N = 64 through a copy thread: is it the sleeping waiter's wake-up?
. "$(dirname "$0")/device_prelude.sh"
bundle_results
stage "copier direct: hand-back variants"
timeout $(within 300) python3 benchmarks/copier_direct.py --pools "server pool" \
  --json "$RES/copier_hop.json" > "$RES/copier_hop.log" 2>&1
echo "rc=$?"
grep cpuidle "$RES/copier_hop.log"
stage "summary"
sed -n '/^ *pool |/,$p' "$RES/copier_hop.log"
stage done
