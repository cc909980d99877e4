#!/usr/bin/env bash
# Issue 12 on the H200 test machine, in ONE call of the device tool (< 10 min),
# from the repo root, with the wheels of .whl carried (grpcio-health-checking
# 1.84.0, to match the grpcio of the image):
#
#   bash benchmarks/device/device_session_issue12.sh
#
# Stages, each under its own time limit so a hang costs one stage:
#   1. every gpu test (server CUDA path incl. the copy-engine path, kernels,
#      connector TP=2)
#   2. transfer.py, both shapes, random and contiguous ids, the concurrent and
#      1-block latency rows, --copy-path auto (the default table)
#   3. transfer.py, Llama shape, --copy-path dma: copy engines at every N
#   4. transfer.py --interference: bf16 matmul in a second process while saves,
#      loads and both stream, kernels at several SM caps and copy engines
# then a short table of all three. Logs and JSON land in $OUT.
# numpy 2.5 vs numba-cuda (row_stack) is handled in kernels/cuda.py itself.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$SECONDS
stage() { echo; echo "=== $* (t=$((SECONDS - START)) s)"; }

stage install
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
fi
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import numpy, numba, torch; print('numpy', numpy.__version__, \
'numba', numba.__version__, 'torch', torch.__version__)"

stage "gpu tests: server CUDA path (kernel and copy-engine), kernels, TP=2"
timeout "${TEST_S:-150}" python3 -m pytest -m gpu tests/gpu tests/kernels \
  tests/connector/test_gpu_connector.py -o addopts="" -p no:cacheprovider -q -rfE \
  --timeout 120 2>&1 | tee "$OUT/gpu_tests.log" | tail -15

stage "transfer: both shapes, --copy-path auto"
timeout "${BENCH_S:-170}" python3 benchmarks/transfer.py --out "$OUT" \
  --bringup-gib 0 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/transfer.log" | tail -8

stage "transfer: Llama shape, --copy-path dma"
timeout "${DMA_S:-90}" python3 benchmarks/transfer.py --out "$OUT" --tag dma \
  --copy-path dma --shapes llama-3.1-8b --bringup-gib 0 2>&1 \
  | tee "$OUT/transfer-dma.log" | tail -8

stage "interference: matmul slowdown per setting"
timeout "${INTERFERENCE_S:-150}" python3 benchmarks/transfer.py --out "$OUT" \
  --interference --copy-paths kernel,dma --copy-sm-caps 16,33,66,132 \
  --interference-s 1.5 2>&1 | tee "$OUT/interference.log" | tail -4

stage summary
OUT="$OUT" python3 - <<'EOF'
import json, os
from pathlib import Path
from benchmarks.common import table

out = Path(os.environ["OUT"])
def load(name):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None

auto, dma, intf = load("transfer"), load("transfer-dma"), load("interference")
by = {}
for tag, run in (("auto", auto), ("dma", dma)):
    for r in (run or {}).get("rows", []):
        key = (r["shape"], r["N"], r["ids"])
        row = by.setdefault(key, dict(shape=r["shape"], N=r["N"], ids=r["ids"]))
        row[f"{tag}_save"], row[f"{tag}_load"] = r["save_ratio"], r["load_ratio"]
        row[f"{tag}_ok"] = r["bytes_ok"]
rows = [by[k] for k in sorted(by)]
cols = ["shape", "N", "ids", "auto_save", "auto_load", "dma_save", "dma_load"]
if rows:
    for r in rows:
        for c in cols:
            r.setdefault(c, "-")
    print("ratios to the pinned ceiling (auto = default table, dma = copy engines)")
    print(table(rows, cols))
    bad = [r for r in rows if False in (r.get("auto_ok"), r.get("dma_ok"))]
    print("bytes_ok: all" if not bad else f"bytes_ok FAILED: {bad}")
for key, value in ((auto or {}).get("extra") or {}).items():
    if key.startswith(("lat_", "both_")) and "p90" not in key:
        print(f"{key}: {value}")
if intf:
    cols = ["setting", "mode", "copy_GBps", "copy_ratio", "slowdown_pct"]
    note = "" if intf.get("complete") else " (cut short)"
    print(f"interference, {intf['blocks']} blocks{note}")
    print(table(intf["rows"], cols))
EOF
stage done
