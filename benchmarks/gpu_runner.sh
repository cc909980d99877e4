#!/usr/bin/env bash
# One call on a GPU machine with no network (the project's H200 test machine, or
# yours): the gpu-marked tests and the transfer table, optionally beside another
# tree of the project in the same run (an A/B).
#
#   bash benchmarks/gpu_runner.sh [tests] [gds] [transfer] [quick] [multi]
#
#   tests     pytest -m gpu over tests/kernels tests/gpu tests/connector
#   gds       tests/gds (the SSD tier) on the kvikio backend, gpu tests too
#   transfer  benchmarks/transfer.py (all shapes, 1..2560 blocks); with
#             BASE_TGZ set, the same run in that tree (`git archive REV | gzip`)
#             first, then this one, then both again on the Llama shape
#   quick     transfer.py --quick instead (a smoke run)
#   multi     with every visible GPU: tests/gpu/test_multi_gpu.py (TP 2/4/8
#             ranks on their own GPUs, MLA, a rank SIGKILLed, --devices
#             subsets; each skips naming the GPUs it lacks), then
#             transfer_gpus.py --gpus N (aggregate save/load GB/s for 1, 2,
#             4 .. N GPUs against their pinned ceilings and host memcpy)
#
# A multi-GPU machine (issue 32), one call for everything multi-GPU:
#   OUT=$OUT bash benchmarks/gpu_runner.sh multi
#
# Environment: OUT (default /tmp/out) gets one JSON per transfer run, each
# step's log and results.tgz of everything; CALL_S (default 570) bounds the
# whole call so the results are bundled before the machine's limit.
# Packages missing on the machine travel as wheels in .whl/ (xxhash, blake3,
# grpcio-health-checking matching its grpcio; kvikio-cu13, libkvikio-cu13 and
# rapids-logger for the gds step): they are installed into .site first.
set -u
OUT=${OUT:-/tmp/out}
CALL_S=${CALL_S:-570}
mkdir -p "$OUT"
START=$SECONDS
ROOT=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
fi
export PYTHONPATH=$ROOT/.site:$ROOT PYTHONUNBUFFERED=1
trap 'tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . 2>/dev/null' EXIT

# Seconds a step may take: its own bound, cut so the call ends in time.
within() {
  local left=$((CALL_S - (SECONDS - START)))
  [ "$left" -lt 5 ] && left=5
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
# A step cut by its timeout leaves its servers running: reap them first.
step() {
  pkill -f -- "-m pegaflow.cli" 2>/dev/null; pkill -f -- "tests/engine_worker" 2>/dev/null
  sleep 0.2; pkill -9 -f -- "-m pegaflow.cli" 2>/dev/null
  echo; echo "=== $* (t=$((SECONDS - START)) s)"
}
# transfer.py in tree $1 (a directory), tagged $2; more transfer.py args after.
transfer_in() {
  local tree=$1 tag=$2; shift 2
  (cd "$tree" && PYTHONPATH=$ROOT/.site:$tree timeout "$(within 200)" \
    python3 benchmarks/transfer.py --bringup-gib 0 --tag "$tag" --out "$OUT" "$@") \
    > "$OUT/transfer-$tag.log" 2>&1
  echo "rc=$?"
  grep -E " \| |p50|both" "$OUT/transfer-$tag.log" | cut -c1-150  # table rows
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
for what in "$@"; do
  case "$what" in
    tests)
      step "gpu-marked tests"
      timeout "$(within 300)" python3 -m pytest -q -m gpu -rs -p no:cacheprovider \
        tests/kernels tests/gpu tests/connector > "$OUT/gpu_tests.log" 2>&1
      echo "rc=$?"; tail -n 15 "$OUT/gpu_tests.log"
      ;;
    gds)
      step "tests/gds on kvikio"
      PEGAFLOW_TEST_SSD_BACKEND=kvikio timeout "$(within 240)" python3 -m pytest -q \
        -m "gpu or not gpu" -rs -p no:cacheprovider tests/gds > "$OUT/gds_tests.log" 2>&1
      echo "rc=$?"; tail -n 8 "$OUT/gds_tests.log"
      ;;
    transfer | quick)
      extra=()
      [ "$what" = quick ] && extra=(--quick)
      if [ -n "${BASE_TGZ:-}" ]; then
        base=/tmp/base_tree
        rm -rf "$base" && mkdir -p "$base" && tar -xzf "$BASE_TGZ" -C "$base"
        step "transfer, base tree"; transfer_in "$base" base "${extra[@]}"
        step "transfer, this tree"; transfer_in "$ROOT" this "${extra[@]}"
        for round in 2 3; do
          [ $((CALL_S - (SECONDS - START))) -lt 120 ] && break
          step "transfer, base tree, Llama, round $round"
          transfer_in "$base" "base_r$round" --shapes llama-3.1-8b --sizes 1,64,640,2560
          step "transfer, this tree, Llama, round $round"
          transfer_in "$ROOT" "this_r$round" --shapes llama-3.1-8b --sizes 1,64,640,2560
        done
      else
        step "transfer"; transfer_in "$ROOT" run "${extra[@]}"
      fi
      ;;
    multi)
      ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
      step "multi-GPU tests, ${ngpu:-0} GPU(s) visible"
      timeout "$(within 300)" python3 -m pytest -q -m gpu -rs -p no:cacheprovider \
        tests/gpu/test_multi_gpu.py > "$OUT/multi_gpu_tests.log" 2>&1
      echo "rc=$?"; tail -n 15 "$OUT/multi_gpu_tests.log"
      step "transfer, ${ngpu:-0} GPU(s) at once"
      if [ "${ngpu:-0}" -ge 1 ]; then
        timeout "$(within 240)" python3 benchmarks/transfer_gpus.py --gpus "$ngpu" \
          --out "$OUT" > "$OUT/transfer-gpus.log" 2>&1
        echo "rc=$?"; tail -n 14 "$OUT/transfer-gpus.log" | cut -c1-220
      else
        echo "no GPU visible: skipped"
      fi
      ;;
    *) echo "unknown step: $what (tests, gds, transfer, quick, multi)" >&2; exit 2 ;;
  esac
done
step "done"
