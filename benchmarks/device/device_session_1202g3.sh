#!/usr/bin/env bash
# Seventh session of 2026-12-02, third call (issue 12), ~5 minutes: the gpu
# tests on the compiled table planner (pegaflow.kernels.table_jit), then
# 1- and 64-block transfers with the server traced, alternated between the
# tree before the planner (carried as .ab/base_fd_bench.tgz) and this one.
export CALL_S=${CALL_S:-500}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
SITE=$PWD/.site
unpack_base .ab/base_fd_bench.tgz

stage "gpu tests: kernels and server"
timeout $(within 200) python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 60 > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$RES/gpu_tests.log"

for round in 1 2; do
  for v in base new; do
    dir=$PWD; [ $v = base ] && dir=$BASE
    stage "round $round: $v"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout $(within 45) python3 benchmarks/transfer.py \
      --shapes llama-3.1-8b --sizes 1,64 --min-reps 5 --lat-reps 400 --bringup-gib 0 \
      --trace-server "$RES/trace_$v$round.json" --tag "$v$round" --out "$RES" \
      > "$RES/transfer_$v$round.log" 2>&1; echo "rc=$?")
    grep -E "^lat_(load|save_event)_(p50|server)" "$RES/transfer_$v$round.log" | tr '\n' ' '; echo
  done
done

stage "summary"
python3 benchmarks/phase_trace.py --show "$RES"/trace_*.json | grep -E "^trace|scatter|gather|_load |_save |plan|_queue|_finish"
python3 benchmarks/transfer_ab_summary.py "$RES" base1 new1 base2 new2
stage done
