#!/usr/bin/env bash
# 2026-12-02, third session, A/B of the SSD writers' per-run bookkeeping on
# the H200 (~2 min): ssd_writebehind.py full size, `none` and `seal` on this
# tree and `seal` on the tree before it (899e4ac, .ab/base_899e4ac.tgz),
# interleaved round by round (the last call's host ran 20 % slower than the
# earlier ones, so only a same-call A/B can judge the change).
# Run from the repo root with .whl and .ab carried; results in $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT
BASE=$(mktemp -d)
tar xzf .ab/base_899e4ac.tgz -C "$BASE"
SITE=$PWD/.site

stage "write-behind A/B, ${ROUNDS:-3} rounds"
for rep in $(seq "${ROUNDS:-3}"); do
  for v in main:none main:seal base:seal; do
    tree=${v%%:*} mode=${v#*:}
    dir=$PWD; [ "$tree" = base ] && dir=$BASE
    mkdir -p "$WB_DIR"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout 40 python3 benchmarks/ssd_writebehind.py \
      --reps 1 --modes "$mode" --dir "$WB_DIR" --json "$RES/wb_${tree}_${mode}_$rep.json" \
      > "$RES/wb_${tree}_${mode}_$rep.log" 2>&1) || echo "$v rep $rep failed"
  done
done

stage "summary"
python3 - "$RES" <<'PY'
import glob, json, statistics, sys
cells = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/wb_*.json")):
    name = path.rsplit("/", 1)[1][3:].rsplit("_", 1)[0]
    cells.setdefault(name, []).extend(json.load(open(path))["rows"])
base = statistics.median(r["save_GBps"] for r in cells["main_none"])
print("variant    | save GB/s (rounds)   | median | vs none | write/dd")
for name, rows in sorted(cells.items()):
    med = statistics.median(r["save_GBps"] for r in rows)
    each = " ".join(f"{r['save_GBps']:.2f}" for r in rows)
    wd = statistics.median(float(r.get("write/dd", 0)) for r in rows)
    print(f"{name:10} | {each:20} | {med:6.3f} | {med / base - 1:+6.1%} | {wd:.2f}")
PY
stage done
