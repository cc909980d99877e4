#!/usr/bin/env bash
# Issue 3 on the H200 test machine, in one call: the gpu tests of the server's
# CUDA path, then benchmarks/transfer.py; logs and JSON land in $OUT.
#   run from the repo root with the wheels of .whl carried (see GPU.md)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
timeout "${TEST_S:-200}" python3 -m pytest -m gpu tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rA --timeout 90 -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
for f in /tmp/pytest-of-*/pytest-*/gpu-server*/server-*.log; do
  tail -150 "$f"
done > "$OUT/server.log" 2>/dev/null
timeout "${BENCH_S:-260}" python3 benchmarks/transfer.py --out "$OUT" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log" | tail -45
