#!/usr/bin/env bash
# Tenth session (2026-12-03), call 5, ~5 minutes, on the session's final code.
# 1. Every gpu-marked test (tests/kernels, tests/gpu), kvikio carried (call 3
#    ran tests/gpu without it: the two direct-route tests could not start).
# 2. Where a 640-block save's ~3-4 ms outside the copy go (call 3-4: save RPC
#    29-31 ms against a 25.5 ms copy; loads lose ~1.5 ms): transfer.py with
#    the server traced, now also the store's reserve/finish, the transfers'
#    build and the table check.
# 3. The 1-block save question of calls 3-4 (B slower in three rounds by
#    0.05-0.12 ms): A (a7fb6d2) and B alternated twice, 400 round trips each.
export CALL_S=${CALL_S:-420}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
SITE=$PWD/.site

stage "gpu-marked tests"
timeout $(within 230) python3 -m pytest -q -m gpu tests/kernels tests/gpu \
  -p no:cacheprovider -rfE > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -6 "$RES/gpu_tests.log" | cut -c1-300

stage "traced 640-block transfers"
timeout $(within 60) python3 benchmarks/transfer.py --shapes llama-3.1-8b --sizes 640 \
  --min-reps 10 --lat-reps 50 --bringup-gib 0 --tag traced --out "$RES" \
  --trace-server "$RES/trace_640.json" > "$RES/transfer_traced.log" 2>&1; echo "rc=$?"
python3 benchmarks/phase_trace.py --show "$RES/trace_640.json" 2>&1 | cut -c1-160 | head -40

rm -rf /tmp/treeA && mkdir -p /tmp/treeA && tar -xzf .ab/base_a7fb6d2.tgz -C /tmp/treeA
for r in 1 2; do
  for v in A B; do
    dir=/tmp/treeA; [ $v = B ] && dir=$PWD
    stage "1-block $v$r"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout $(within 40) python3 benchmarks/transfer.py \
      --shapes llama-3.1-8b --sizes 1 --min-reps 5 --lat-reps 400 --bringup-gib 0 \
      --tag "$v$r" --out "$RES" > "$RES/transfer_$v$r.log" 2>&1; echo "rc=$?")
    grep -E "^lat_(load|save_event|save_synced)_p50" "$RES/transfer_$v$r.log" | tr '\n' ' '; echo
  done
done
stage done
