#!/usr/bin/env bash
# 2026-12-02, fourth session, first H200 call (~8 min):
#   1. N = 1 launch breakdown (kernel_variants.py --only latency, with the
#      planned-once, cuLaunchKernel, graph-replay-planned-once cells and the
#      kernel's own GPU time): where a 1-block copy's 160-210 us go (issue 12)
#   2. remote.py over veth, 64 and 256 MiB, after splitting the slot hashing
#      over threads (issue 11: fetch / raw >= 0.8 at 64 MiB)
#   3. write-behind, `none` and `seal`, the server under py-spy --native
#      (issue 13: what the host copy threads do while the writers run)
# Run from the repo root with .whl carried; results in one $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT
SPY=$PWD/.site/bin/py-spy

stage "N = 1 launch breakdown"
timeout "${KV_S:-150}" python3 benchmarks/kernel_variants.py --only latency \
  --json "$RES/kv_latency.json" > "$RES/kv_latency.log" 2>&1
echo "kernel_variants rc=$?"
grep -E "^lat_|^\{'op': 'gpu_|rror" "$RES/kv_latency.log"

[ -n "${SKIP_REMOTE:-}" ] || {
stage "remote tier over veth, hashing split over threads"
( carried_tools
  timeout "${REMOTE_S:-200}" python3 benchmarks/remote.py --sizes-mib 64,256 \
    --repeat 3 --json "$RES/remote.json" > "$RES/remote.log" 2>&1
  echo "remote rc=$?" )
grep "phases" "$RES/remote.log" | tail -6
tail -9 "$RES/remote.log"
}

WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}
mkdir -p "$WB_DIR"
for mode in none seal; do
  stage "write-behind $mode under py-spy --native"
  timeout 90 python3 benchmarks/ssd_writebehind.py --reps 1 --modes "$mode" \
    --dir "$WB_DIR" --json "$RES/wb_spy_$mode.json" > "$RES/wb_spy_$mode.log" 2>&1 &
  bench=$!
  pid=""
  for _ in $(seq 1 100); do
    pid=$(pgrep -n -f -- "-m pegaflow.cli") && break
    sleep 0.1
  done
  if [ -n "$pid" ]; then
    timeout 80 "$SPY" record --native --threads --idle --rate 100 --format raw \
      -o "$RES/spy_$mode.raw" -p "$pid" > "$RES/spy_$mode.log" 2>&1
    python3 benchmarks/spy_summary.py --match "" --top 60 "$RES/spy_$mode.raw" \
      > "$RES/spy_$mode.txt" 2>&1
    rm -f "$RES/spy_$mode.raw"
    head -70 "$RES/spy_$mode.txt"
  else
    echo "no server process found"
  fi
  wait "$bench"; echo "write-behind $mode rc=$?"
  tail -5 "$RES/wb_spy_$mode.log"
done
rm -rf "$WB_DIR"
stage done
