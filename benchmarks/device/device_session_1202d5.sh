#!/usr/bin/env bash
# 2026-12-02, fourth session, fifth H200 call (~4 min): the 1-block fast
# paths (one-item load frames, a load's transfers, the even split) against the
# tree before them (carried as .ab/base_prefast.tgz), transfer.py N = 1 with
# 1,000 round trips of each kind, alternated twice; then the gpu-marked tests
# of tests/kernels and tests/gpu. Results in one $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT
SITE=$PWD/.site
BASE=/tmp/base_tree
rm -rf "$BASE" && mkdir -p "$BASE" && tar -xzf .ab/base_prefast.tgz -C "$BASE"
for round in 1 2; do
  for v in base new; do
    dir=$PWD; [ $v = base ] && dir=$BASE
    stage "N = 1 round $round: $v"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout 60 python3 benchmarks/transfer.py \
      --out "$RES" --tag "$v$round" --shapes llama-3.1-8b --sizes 1 --lat-reps 1000 \
      --bringup-gib 0 > "$RES/transfer-$v$round.log" 2>&1; echo "rc=$?")
  done
done
stage "gpu tests: kernels and server"
timeout 200 python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 90 > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$RES/gpu_tests.log"
stage "summary"
python3 - "$RES" <<'PY'
import json, sys, pathlib
res = pathlib.Path(sys.argv[1])
keys = ["lat_load_p50_ms", "lat_load_server_rpc_mean_ms", "lat_load_copy_mean_ms",
        "lat_save_event_p50_ms", "lat_save_synced_p50_ms"]
print("tag   " + " | ".join(k.replace("lat_", "")[:22] for k in keys))
for tag in ["base1", "new1", "base2", "new2"]:
    f = res / f"transfer-{tag}.json"
    if not f.exists():
        print(tag, "missing"); continue
    ex = json.loads(f.read_text()).get("extra", {})
    print(f"{tag:5} " + " | ".join(f"{ex.get(k, '-')!s:>22}" for k in keys))
PY
stage done
