#!/usr/bin/env bash
# Sixth session, call 3 (issue 12): where the server's 64-block copy loses
# against the bare kernel (copier_direct.py), and the server's own time at
# N = 64 under cProfile.
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "copier direct"
timeout $(within 200) python3 benchmarks/copier_direct.py --json "$RES/copier.json" \
  > "$RES/copier.log" 2>&1
echo "rc=$?"

stage "server profile at N=64"
timeout $(within 150) python3 benchmarks/transfer.py --shapes llama-3.1-8b --sizes 64 \
  --min-reps 20 --lat-reps 50 --bringup-gib 0 --profile-server "$RES/server.prof" \
  --out "$RES" > "$RES/transfer_prof.log" 2>&1
echo "rc=$?"
python3 - "$RES/server.prof" > "$RES/server_prof.txt" 2>&1 <<'PY'
import pstats, sys
p = pstats.Stats(sys.argv[1])
p.sort_stats("tottime").print_stats(40)
p.sort_stats("cumulative").print_stats(60)
PY
head -60 "$RES/server_prof.txt" | tail -45

stage "summary"
sed -n '/^ *pool |/,$p' "$RES/copier.log"
stage done
