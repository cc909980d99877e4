#!/usr/bin/env bash
# 2026-12-02, third session, first H200 call (~7 min):
#   1. ssd_writebehind.py full size, 3 rounds, after eviction spills went to
#      the tier as one job per eviction round (issue 13: write-behind cost)
#   2. the server under py-spy --gil (which thread holds the GIL) in a
#      `none` and a `seal` run: what is left of the write-behind cost
#   3. metaserver.py --entries 1000000 on main (dicts) and on the numpy table
#      (.ab/table_e07c5ef_parent.tgz, its own tree): the spread-prefix row
#   4. remote.py over veth (64 MiB - 1 GiB): fetch vs raw TCP where 16 cores
#      serve both nodes (the dev VM's 2 vCPU cap Mooncake at 0.72-0.81 of raw)
# Run from the repo root with .whl and .ab carried; a short table last.
. "$(dirname "$0")/device_prelude.sh"
WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}
mkdir -p "$WB_DIR"

stage "write-behind, full size, 3 rounds"
timeout "${WB_S:-150}" python3 benchmarks/ssd_writebehind.py --reps 3 \
  --dir "$WB_DIR" --json "$OUT/writebehind.json" > "$OUT/writebehind.log" 2>&1
echo "writebehind rc=$?"
tail -4 "$OUT/writebehind.log"

SPY=$PWD/.site/bin/py-spy
for mode in none seal; do
  stage "write-behind $mode under py-spy --gil"
  timeout "${SPY_S:-60}" "$SPY" record --gil --subprocesses --nonblocking --rate 500 \
    --format raw -o "$OUT/wb_spy_$mode.raw" -- python3 benchmarks/ssd_writebehind.py \
    --reps 1 --modes "$mode" --dir "$WB_DIR" --json "$OUT/wb_spy_$mode.json" \
    > "$OUT/wb_spy_$mode.log" 2>&1
  python3 benchmarks/spy_summary.py "$OUT/wb_spy_$mode.raw" > "$OUT/wb_spy_$mode.txt"
  rm -f "$OUT/wb_spy_$mode.raw"
  head -25 "$OUT/wb_spy_$mode.txt"
done

stage "metaserver, dicts (main)"
timeout "${META_S:-120}" python3 benchmarks/metaserver.py --entries 1000000 \
  --json "$OUT/metaserver_dicts.json" > "$OUT/metaserver_dicts.log" 2>&1
tail -10 "$OUT/metaserver_dicts.log"
stage "metaserver, numpy table"
TBL=$(mktemp -d)
tar xzf .ab/table_e07c5ef_parent.tgz -C "$TBL"
(cd "$TBL" && PYTHONPATH=$OLDPWD/.site:$TBL timeout "${META_S:-120}" python3 \
  benchmarks/metaserver.py --entries 1000000 --json "$OUT/metaserver_table.json" \
  > "$OUT/metaserver_table.log" 2>&1)
tail -10 "$OUT/metaserver_table.log"

stage "remote tier over veth (issue 11: fetch vs raw TCP on a 16-core host)"
# Mooncake needs libibverbs, libnuma (and libnl) at load time: the carried
# copies in .whl/lib stand in for the ones this host lacks.
carried_tools
python3 -c "import mooncake.engine; print('mooncake ok')" 2>&1 | tail -2
(ip netns add pfprobe && ip netns del pfprobe && echo "netns ok") 2>&1 | tail -1
nproc
timeout "${REMOTE_S:-200}" python3 benchmarks/remote.py --sizes-mib 64,256,1024 \
  --repeat 3 --json "$OUT/remote.json" > "$OUT/remote.log" 2>&1
echo "remote rc=$?"
tail -22 "$OUT/remote.log"

stage "summary"
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
try:
    rows = json.load(open(f"{out}/writebehind.json"))["rows"]
    none = statistics.median(r["save_GBps"] for r in rows if r["mode"] == "none")
    print("mode  | save GB/s (rounds) | median | vs none | write/dd | drops")
    for mode in ("none", "evict", "seal"):
        rs = [r for r in rows if r["mode"] == mode]
        med = statistics.median(r["save_GBps"] for r in rs)
        wd = statistics.median(float(r.get("write/dd", 0)) for r in rs)
        dr = statistics.median(r["dropped"] for r in rs)
        each = " ".join(f"{r['save_GBps']:.2f}" for r in rs)
        print(f"{mode:5} | {each:18} | {med:6.3f} | {med / none - 1:+6.1%} | {wd:8.2f} | {dr:5.0f}")
except (OSError, ValueError, KeyError) as exc:
    print(f"no write-behind JSON: {exc}")
for name in ("dicts", "table"):
    try:
        m = json.load(open(f"{out}/metaserver_{name}.json"))
    except (OSError, ValueError) as exc:
        print(f"metaserver {name}: {exc}")
        continue
    q = {(r["hashes"], r["segments"]): r["p50_ms"] for r in m["query"]}
    print(f"metaserver {name}: 1000/1 {q.get((1000, 1))}  1000/5 {q.get((1000, 5))}  "
          f"100 {q.get((100, 1))}  spread {m['query_spread_1000']['p50_ms']}  "
          f"empty {m['heartbeat_p50_ms']}  rss/M {m['rss_mib_per_million_entries']}")
PY
stage done
