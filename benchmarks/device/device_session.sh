#!/usr/bin/env bash
# Everything the open issues need from the H200 machine, in two calls of the
# device tool (each < 10 min), run from the repo root with `.whl` carried:
#
#   PART=1 bash benchmarks/device/device_session.sh   # gpu tests + queries + transfer
#   PART=2 bash benchmarks/device/device_session.sh   # SSD: kvikio tests + ssd benches
#
# PART 1 (issues 2, 3, 4): every `gpu` test (server CUDA path, kernels, the
# connector's TP=2 worker test, kvikio round trips are in part 2), the query
# latency benchmark on the host, then benchmarks/transfer.py. Logs and JSON
# land in $OUT; each stage has its own time limit so a hang costs one stage.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$SECONDS
stage() { echo; echo "=== $* (t=$((SECONDS - START)) s)"; }

if [ "${PART:-1}" = 2 ]; then
  exec bash benchmarks/device/ssd_device.sh
fi

stage install
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader

stage "gpu tests: server CUDA path, kernels, connector TP=2"
timeout "${TEST_S:-240}" python3 -m pytest -m gpu tests/gpu tests/kernels \
  tests/connector/test_gpu_connector.py -o addopts="" -p no:cacheprovider -q -rfE \
  --timeout 120 2>&1 | tee "$OUT/gpu_tests.log" | tail -25

stage "query latency on this host (issue 2)"
timeout "${QUERY_S:-90}" python3 benchmarks/host_path.py --queries-only \
  --json "$OUT/host_path_h200_queries.json" 2>&1 | tail -12

stage "transfer benchmark (issue 3)"
timeout "${BENCH_S:-200}" python3 benchmarks/transfer.py --out "$OUT" \
  --bringup-gib 0 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/transfer.log" | tail -45
stage done
