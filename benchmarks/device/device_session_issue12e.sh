#!/usr/bin/env bash
# Issue 12, deliverable 3 with the contention-aware default, on the H200 test
# machine in ONE call of the device tool (about 2 min, at most ~2.5: the stage
# limit is 140 s), from the repo root, with the wheels of .whl carried:
#
#   bash benchmarks/device/device_session_issue12e.sh
#
# transfer.py --interference: a bf16 matmul loop (8192^3) in a second process
# while 640-block saves, loads or both stream (32 layers x 64 KiB pages, random
# ids), for --copy-path auto (the default: kernels, moved to copy engines
# while our own kernel copy times show the GPU shared,
# pegaflow.copiers.contention), dma and kernel (66 CTAs). auto gets two busy
# windows per mode: "from idle" (starts on kernels, pays the switch) and
# "settled" (right after another busy window: its steady choice). Columns:
# copy GB/s with the matmul, its ratio to the pinned ceiling, the matmul's
# slowdown, dma_share (bytes moved by copy engines in the window, from the
# server's /stats) and auto's switches. Byte-checked before and after the
# windows of each server. Settings run auto first: a stage cut short keeps the
# rows of the settings done (JSON checkpointed after each). JSON:
# $OUT/interference-12e.json; the log beside it; the table last.
. "$(dirname "$0")/device_prelude.sh"

stage "interference: auto, dma, kernel x save, load, both (640 blocks)"
timeout "${INTERFERENCE_S:-140}" python3 benchmarks/transfer.py --interference \
  --out "$OUT" --tag 12e --copy-paths "${PATHS_12E:-auto,dma,kernel}" \
  --copy-sm-caps 66 --interference-modes save,load,both \
  --interference-blocks 640 --interference-s "${WINDOW_S:-2}" 2>&1 \
  | tee "$OUT/interference-12e.log" | grep -v "^{" | tail -4

stage "table"
python3 - "$OUT/interference-12e.json" <<'PY'
import json, sys
from benchmarks import interference
from benchmarks.common import table
try:
    doc = json.load(open(sys.argv[1]))
except FileNotFoundError:
    sys.exit("no JSON: the run died before its first setting finished (see log)")
rows = doc["rows"]
print("complete:", doc["complete"], "| bytes_ok:", all(r["bytes_ok"] for r in rows),
      "| after:", [r["bytes_ok_after"] for r in rows if "bytes_ok_after" in r])
print(table(rows, interference.COLUMNS))
PY
stage done
