#!/usr/bin/env bash
# Issue 13's write-behind numbers on the H200 machine, in one call (under 200 s: stage limits 120 + 2 x 35 s):
#   1. ssd_writebehind.py, full size (1 GiB pool, 3 GiB saved per mode),
#      three rounds of none / evict / seal interleaved: save GB/s with and
#      without the SSD tier, SSD write GB/s against a paired dd, queue drops
#      (JSON rewritten after every mode: a cut stage keeps its rounds)
#   2. tests/gds on the kvikio backend, then on posix
# Run from the repo root with .whl carried (kvikio-cu13, libkvikio-cu13,
# rapids-logger); JSON and logs in $OUT, a short table last.
# Stage limits (s): WB_S, TEST_S.
. "$(dirname "$0")/device_prelude.sh"
WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}
mkdir -p "$WB_DIR"
df -h "$WB_DIR" | tail -1
findmnt -no SOURCE,FSTYPE,OPTIONS -T "$WB_DIR" || true

stage "write-behind, full size, 3 rounds"
timeout "${WB_S:-120}" python3 benchmarks/ssd_writebehind.py --reps 3 \
  --dir "$WB_DIR" --json "$OUT/writebehind_13c.json" > "$OUT/writebehind_13c.log" 2>&1
echo "writebehind rc=$?"

for backend in kvikio posix; do
  stage "tests/gds on $backend"
  PEGAFLOW_TEST_SSD_BACKEND=$backend timeout "${TEST_S:-35}" python3 -m pytest \
    tests/gds -o addopts="" -p no:cacheprovider -q -rfE --timeout 30 \
    > "$OUT/gds_tests_$backend.log" 2>&1
  echo "tests/gds $backend rc=$?"
  tail -3 "$OUT/gds_tests_$backend.log"
done

stage "summary"
python3 - "$OUT/writebehind_13c.json" <<'EOF'
import json, statistics, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError) as exc:
    sys.exit(f"no write-behind JSON: {exc}")
base = [r["save_GBps"] for r in rows if r["mode"] == "none"]
none = statistics.median(base) if base else float("nan")
print("mode  | rounds | save GB/s | vs none | SSD write GB/s | dd GB/s | write/dd | drops")
for mode in ("none", "evict", "seal"):
    rs = [r for r in rows if r["mode"] == mode]
    if not rs:
        continue
    med = lambda k: statistics.median([float(r.get(k, 0)) for r in rs])  # noqa: E731
    save = med("save_GBps")
    print(f"{mode:5} | {len(rs):6} | {save:9.3f} | {save / none - 1:+7.1%} | "
          f"{med('ssd_write_GBps'):14.3f} | {med('dd_write_GBps'):7.3f} | "
          f"{med('write/dd'):8.2f} | {med('dropped'):5.0f}")
EOF
grep -hE "passed|failed|error" "$OUT"/gds_tests_*.log | tail -4
stage done
