#!/usr/bin/env bash
# 2026-12-02, third session, after the writers' per-run bookkeeping (~6 min):
#   1. the writers' CPU per block on the H200 (benchmarks/ssd_writer_cpu.py,
#      syscall stubbed; 64 and 256 KiB blocks, 3 reps)
#   2. the write-behind cost on the save path: `seal` against `none` on this
#      tree, 3 rounds interleaved, full size (goal: seal within 5 % of none;
#      this morning's tree lost 9-12 %)
# Note: the variant seds of device_session_1202c3.sh (nohash, bookonly) match
# only the staged path now (gather_parts); the aligned path is gather_in_place.
# Run from the repo root with .whl carried; results in one $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}
mkdir -p "$WB_DIR"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT

stage "writer CPU per block"
timeout 120 python3 benchmarks/ssd_writer_cpu.py --reps 3 --dir "$WB_DIR" \
  --json "$RES/writer_cpu.json" > "$RES/writer_cpu.log" 2>&1 || echo "writer cpu failed"
tail -3 "$RES/writer_cpu.log"

stage "write-behind none vs seal, 3 rounds"
for rep in 1 2 3; do
  for mode in none seal; do
    timeout 60 python3 benchmarks/ssd_writebehind.py --reps 1 --modes "$mode" \
      --dir "$WB_DIR" --json "$RES/wb_main_${mode}_$rep.json" \
      > "$RES/wb_main_${mode}_$rep.log" 2>&1 || echo "$mode rep $rep failed"
  done
done

stage "summary"
python3 benchmarks/writebehind_summary.py --cells "$RES"
stage done
