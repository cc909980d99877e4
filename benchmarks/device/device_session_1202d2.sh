#!/usr/bin/env bash
# 2026-12-02, fourth session, second H200 call (~5 min): the kernel launch
# change (cuLaunchKernel after the first launch, equal pages split by
# broadcasting) against the tree before it (0882e5f, carried as
# .ab/base_prekernel.tgz), alternated: transfer.py N = 1, 64, 640 then N = 1
# again; and the N = 1 latency cells of kernel_variants.py on the new code.
# Results in one $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT
BASE=/tmp/base_tree
rm -rf "$BASE" && mkdir -p "$BASE" && tar -xzf .ab/base_prekernel.tgz -C "$BASE"

run_transfer() {  # tree tag sizes limit
  (cd "$1" && PYTHONPATH=$SITE:$1 timeout "$4" python3 benchmarks/transfer.py \
    --out "$RES" --tag "$2" --shapes llama-3.1-8b --sizes "$3" --min-reps 5 \
    --bringup-gib 0 > "$RES/transfer-$2.log" 2>&1; echo "$2 rc=$?")
}
SITE=$PWD/.site
for round in 1 2; do
  sizes=1,64,640; [ $round = 2 ] && sizes=1
  stage "transfer round $round: base"; run_transfer "$BASE" "base$round" $sizes 110
  stage "transfer round $round: new"; run_transfer "$PWD" "new$round" $sizes 110
done

stage "N = 1 latency cells, new code"
timeout 100 python3 benchmarks/kernel_variants.py --only latency \
  --json "$RES/kv_latency_new.json" > "$RES/kv_latency_new.log" 2>&1
echo "kernel_variants rc=$?"
grep -E "^lat_|^\{'op': 'gpu_|rror" "$RES/kv_latency_new.log"

stage "summary"
python3 - "$RES" <<'PY'
import json, sys, pathlib
res = pathlib.Path(sys.argv[1])
keys = ["lat_save_event_p50_ms", "lat_save_synced_p50_ms", "lat_load_p50_ms",
        "lat_load_server_rpc_mean_ms", "lat_load_copy_mean_ms", "both_total_GBps"]
print("tag   " + " | ".join(k.replace("lat_", "")[:20] for k in keys))
for tag in ["base1", "new1", "base2", "new2"]:
    f = res / f"transfer-{tag}.json"
    if not f.exists():
        print(tag, "missing"); continue
    d = json.loads(f.read_text()); ex = d.get("extra", {})
    print(f"{tag:5} " + " | ".join(f"{ex.get(k, '-')!s:>20}" for k in keys))
    for r in d.get("rows", []):
        print("   ", r["N"], r["ids"], "save", r["save_ratio"], "load", r["load_ratio"],
              "rpc", r["save_rpc_ms"], r["load_rpc_ms"], "ok", r["bytes_ok"])
PY
stage done
