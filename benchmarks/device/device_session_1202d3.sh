#!/usr/bin/env bash
# 2026-12-02, fourth session, third H200 call (~6 min):
#   1. gpu-marked tests of tests/kernels and tests/gpu after the launch change
#   2. launch_profile.py: the 1-block kernel path's host time under cProfile
#   3. remote.py A/B: a fetch read in 16 MiB pieces submitted at once, each
#      hashed as it lands (this tree) against one 256 MiB piece (a copy of
#      this tree with that one constant changed), two rounds alternated
# Run from the repo root with .whl carried; results in one $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT
SITE=$PWD/.site

stage "gpu tests: kernels and server"
timeout 200 python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 90 > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -4 "$RES/gpu_tests.log"

stage "launch profile"
timeout 60 python3 benchmarks/launch_profile.py --reps 3000 > "$RES/launch_profile.log" 2>&1
echo "rc=$?"; grep -A32 "^==" "$RES/launch_profile.log" | cut -c1-150

ONE=$(mktemp -d)
tar --exclude=./.site --exclude=./.whl --exclude=./.git --exclude=./.ab \
  -cf - . | tar -xf - -C "$ONE"
sed -i 's/^_PIECE_BYTES = 16 << 20$/_PIECE_BYTES = 256 << 20  # VARIANT/' \
  "$ONE/pegaflow/remote/fetch.py"
grep -q VARIANT "$ONE/pegaflow/remote/fetch.py" || { echo "variant: sed matched nothing"; exit 1; }
carried_tools
for round in 1 2; do
  for v in pieces one; do
    dir=$PWD; [ $v = one ] && dir=$ONE
    stage "remote round $round: $v"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout 120 python3 benchmarks/remote.py \
      --sizes-mib 64,256 --repeat 3 --json "$RES/remote_${v}_$round.json" \
      > "$RES/remote_${v}_$round.log" 2>&1; echo "rc=$?")
    grep "phases" "$RES/remote_${v}_$round.log" | tail -6 | cut -c1-160
    grep -A3 "^MiB" "$RES/remote_${v}_$round.log" | tail -3
  done
done
stage done
