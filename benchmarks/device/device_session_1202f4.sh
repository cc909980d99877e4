#!/usr/bin/env bash
# Sixth session, call 6 (issue 12): is the asyncio hand-back's cost a GIL
# wait (the 5 ms switch interval)? Short: N = 1 and 64, server pool.
. "$(dirname "$0")/device_prelude.sh"
bundle_results
stage "copier direct: switch interval"
timeout $(within 200) python3 benchmarks/copier_direct.py --pools "server pool" --sizes 1,64 \
  --paths "copier, this thread;copier, copy thread;asyncio.to_thread (server);to_thread, switch interval 0.1 ms" \
  --json "$RES/copier_switch.json" > "$RES/copier_switch.log" 2>&1
echo "rc=$?"
sed -n '/^ *pool |/,$p' "$RES/copier_switch.log"
stage done
