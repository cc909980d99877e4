#!/usr/bin/env bash
# 2026-12-02, second session, first H200 call (~4 min): baselines before the
# session's changes and a sampled profile of the server during transfers.
#   1. the CUDA modules import after the relative-imports change
#   2. metaserver.py --entries 1000000 (issue 11 baseline on this host)
#   3. transfer.py N = 1 and N = 640 under py-spy (the server's own time, issue 12)
# Run from the repo root with .whl carried (py-spy among the wheels).
. "$(dirname "$0")/device_prelude.sh"

stage "imports"
python3 -c "import pegaflow.kernels.cuda, pegaflow.copiers.cuda_copier, pegaflow.server; print('ok')"

stage "metaserver baseline"
[ -n "${SKIP_META:-}" ] || timeout "${META_S:-90}" python3 benchmarks/metaserver.py --entries 1000000 \
  --json "$OUT/metaserver_base.json" > "$OUT/metaserver_base.log" 2>&1
tail -12 "$OUT/metaserver_base.log"

SPY=$PWD/.site/bin/py-spy
for n in 1 640; do
  stage "transfer N = $n under py-spy (nonblocking, 250 Hz)"
  timeout "${SPY_S:-80}" "$SPY" record --subprocesses --nonblocking --rate 250 \
    --format raw -o "$OUT/spy_$n.raw" -- python3 benchmarks/transfer.py \
    --out "$OUT" --tag "spy$n" --shapes llama-3.1-8b --sizes "$n" --bringup-gib 0 \
    > "$OUT/transfer_spy$n.log" 2>&1
  python3 benchmarks/spy_summary.py "$OUT/spy_$n.raw" > "$OUT/spy_$n.txt"
  rm -f "$OUT/spy_$n.raw"
  head -30 "$OUT/spy_$n.txt"
  grep -E "GBps|_ms" "$OUT/transfer_spy$n.log" | tail -8
done
stage done
