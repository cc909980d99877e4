#!/usr/bin/env bash
# Fourteenth session, call 3 (2026-12-04), ~5 minutes, on the code whose SSD
# readers, pool-file sealer and restart check hash in one compiled call
# (commit 88556eb): tests/gds on kvikio and posix and tests/gpu, skip reasons
# listed; then a warm restart's check pass (benchmarks/pool_check.py, 8
# threads) this tree against the one before (.ab/before_rows.tgz =
# `git archive c2349ec`), 16 KiB and 2 MiB slots, alternated.
# Run: the device tool with carry [".whl", ".ab"], command
#   CALL_S=400 bash benchmarks/device/device_session_1205c.sh
export CALL_S=${CALL_S:-400}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
unpack_base .ab/before_rows.tgz
cp benchmarks/pool_check.py "$BASE/benchmarks/"

gds_tests 90

stage "gpu-marked server tests (tests/gpu), skip reasons"
timeout $(within 150) python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rfEs \
  --timeout 120 > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "SKIPPED|passed|failed" "$RES/gpu_tests.log" | tail -8

for round in 1 2; do
  for slot in 16kb 2mb; do
    for tree in after before; do
      [ $((CALL_S - (SECONDS - START))) -lt 30 ] && break 3
      stage "restart check pass, $slot slots, $tree, round $round"
      dir=$PWD; [ "$tree" = before ] && dir=$BASE
      (cd "$dir" && PYTHONPATH=$OLDPWD/.site:$PWD timeout $(within 60) python3 \
        benchmarks/pool_check.py --size 4gb --slot $slot --reps 3 \
        --json "$RES/pool_check_${tree}_${slot}_r$round.json") 2>&1 | grep "checked in"
    done
  done
done
stage done
