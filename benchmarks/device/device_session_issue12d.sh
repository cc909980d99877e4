#!/usr/bin/env bash
# Issue 12, the server's time around the GPU copy (2026-12-02, second session),
# on the H200 test machine in ONE call of the device tool (~4 min; stage limits
# 110 + 90 + 45 s), from the repo root, with the wheels of .whl carried:
#
#   bash benchmarks/device/device_session_issue12d.sh
#
#   1. the gpu-marked tests of tests/gpu (the server's CUDA path; 16 passed in
#      ~100 s on 2026-12-02)
#   2. transfer.py, Llama-3.1-8B shape, N = 1, 64, 640, contiguous and random
#      ids, >= 5 timed reps each, byte-checked; the 1-block latencies and save +
#      load at once at N = 640 (tag issue12d)
#   3. the same for N = 1, 64 with the server under cProfile (tag profiled):
#      where the event loop's time goes on the GPU path; top functions printed,
#      the stats file kept ($OUT/server.prof). Its timings are slowed by the
#      profiler: read them for shares, not speed.
# A short table comes last; logs and JSON (transfer-issue12d.json,
# transfer-profiled.json) land in $OUT.
. "$(dirname "$0")/device_prelude.sh"

stage "gpu tests: server CUDA path"
timeout "${TEST_S:-110}" python3 -m pytest -m gpu tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 90 2>&1 | tee "$OUT/gpu_tests_12d.log" \
  | tail -4

stage "transfer N = ${SIZES:-1,64,640}"
timeout "${TRANSFER_S:-90}" python3 benchmarks/transfer.py --out "$OUT" \
  --tag issue12d --shapes llama-3.1-8b --sizes "${SIZES:-1,64,640}" \
  --min-reps 5 --bringup-gib 0 2>&1 | tee "$OUT/transfer-issue12d.log" | tail -4

stage "transfer N = 1, 64, server under cProfile"
timeout "${PROFILE_S:-45}" python3 benchmarks/transfer.py --out "$OUT" \
  --tag profiled --shapes llama-3.1-8b --sizes 1,64 --min-reps 5 \
  --bringup-gib 0 --profile-server "$OUT/server.prof" 2>&1 \
  | tee "$OUT/transfer-profiled.log" | tail -2
if [ -s "$OUT/server.prof" ]; then
  python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime')\
.print_stats(30)" "$OUT/server.prof" > "$OUT/server_prof_top.txt" 2>&1
fi

stage "summary"
grep -E "passed|failed|error" "$OUT/gpu_tests_12d.log" | tail -1
if [ -s "$OUT/server_prof_top.txt" ]; then
  echo "server under cProfile, top by own time (N = 1, 64):"
  grep -E "ncalls|pegaflow|kernels|numba|cuda|select|lock|socket" \
    "$OUT/server_prof_top.txt" | head -18 | cut -c1-150
fi
OUT="$OUT" TAGS=issue12d python3 benchmarks/issue12c_summary.py
stage done
