#!/usr/bin/env bash
# 2026-12-02, fourth session, fourth H200 call (~4 min):
#   1. transfer.py N = 1 with 4,000 1-block round trips of each kind under
#      py-spy (nonblocking, 1 kHz): where the server's time inside a 1-block
#      load and save goes (stacks through the socket handlers only)
#   2. remote.py 64 MiB - 1 GiB with the fetch piece rule as landed
# Run from the repo root with .whl carried; results in one $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT
SPY=$PWD/.site/bin/py-spy

stage "1-block round trips under py-spy"
timeout 150 "$SPY" record --subprocesses --nonblocking --rate 1000 --format raw \
  -o "$RES/spy_lat.raw" -- python3 benchmarks/transfer.py --out "$RES" --tag spylat \
  --shapes llama-3.1-8b --sizes 1 --lat-reps 4000 --bringup-gib 0 \
  > "$RES/transfer_spylat.log" 2>&1
echo "rc=$?"
for h in _load _save; do
  python3 benchmarks/spy_summary.py "$RES/spy_lat.raw" --top 40 \
    --within "_SocketProtocol.$h" > "$RES/spy_lat$h.txt"
  echo "--- $h"; sed -n '1,44p' "$RES/spy_lat$h.txt" | cut -c1-140
  grep -A30 "inclusive" "$RES/spy_lat$h.txt" | cut -c1-140
done
rm -f "$RES/spy_lat.raw"
grep -o '"lat_[a-z_0-9]*": [0-9.]*' "$RES/transfer-spylat.json" 2>/dev/null

stage "remote tier, pieces as landed"
( carried_tools
  timeout 200 python3 benchmarks/remote.py --sizes-mib 64,256,1024 --repeat 3 \
    --json "$RES/remote_final.json" > "$RES/remote_final.log" 2>&1
  echo "remote rc=$?" )
grep phases "$RES/remote_final.log" | tail -9 | cut -c1-160
tail -9 "$RES/remote_final.log"
stage done
