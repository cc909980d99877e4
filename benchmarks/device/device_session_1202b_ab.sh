#!/usr/bin/env bash
# 2026-12-02, second session, H200: the merged code's transfer table, and the
# 1-block latency A/B against the session's base (9feb1ec, carried as
# .ab/base_9feb1ec.tgz), alternated; then the server gpu tests.
. "$(dirname "$0")/device_prelude.sh"
BASE=/tmp/base_tree
rm -rf "$BASE" && mkdir -p "$BASE" && tar -xzf .ab/base_9feb1ec.tgz -C "$BASE"

stage "transfer N = 1, 64, 640 (merged code)"
timeout 100 python3 benchmarks/transfer.py --out "$OUT" --tag final3 \
  --shapes llama-3.1-8b --sizes 1,64,640 --min-reps 5 --bringup-gib 0 \
  > "$OUT/transfer-final3.log" 2>&1; echo "rc=$?"

for round in 1 2; do
  stage "N = 1 A/B round $round: base"
  (cd "$BASE" && PYTHONPATH=$OLDPWD/.site:$BASE timeout 40 python3 \
    benchmarks/transfer.py --out "$OUT" --tag "base$round" --shapes llama-3.1-8b \
    --sizes 1 --bringup-gib 0 > "$OUT/transfer-base$round.log" 2>&1; echo "rc=$?")
  stage "N = 1 A/B round $round: merged"
  timeout 40 python3 benchmarks/transfer.py --out "$OUT" --tag "cur$round" \
    --shapes llama-3.1-8b --sizes 1 --bringup-gib 0 \
    > "$OUT/transfer-cur$round.log" 2>&1; echo "rc=$?"
done

stage "gpu tests: server"
timeout 120 python3 -m pytest -m gpu tests/gpu/test_gpu_server.py -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 90 > "$OUT/gpu_tests_server.log" 2>&1
echo "rc=$?"; tail -3 "$OUT/gpu_tests_server.log"

stage "summary"
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
keys = ["lat_save_event_p50_ms", "lat_save_synced_p50_ms", "lat_load_p50_ms",
        "lat_save_synced_server_rpc_mean_ms", "lat_load_server_rpc_mean_ms",
        "lat_load_copy_mean_ms", "both_total_GBps"]
print("tag     " + " | ".join(k.replace("lat_", "")[:22] for k in keys))
for tag in ["final3", "base1", "cur1", "base2", "cur2"]:
    f = out / f"transfer-{tag}.json"
    if not f.exists():
        print(tag, "missing"); continue
    ex = json.loads(f.read_text()).get("extra", {})
    print(f"{tag:7} " + " | ".join(f"{ex.get(k, '-')!s:>22}" for k in keys))
rows = json.loads((out / "transfer-final3.json").read_text())["rows"] if (out / "transfer-final3.json").exists() else []
for r in rows:
    print(r["N"], r["ids"], "save", r["save_ratio"], "load", r["load_ratio"], "rpc", r["save_rpc_ms"], r["load_rpc_ms"], "ok", r["bytes_ok"])
PY
stage done
