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
python3 benchmarks/writebehind_summary.py --cells "$RES"
stage done
