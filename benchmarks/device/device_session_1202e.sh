#!/usr/bin/env bash
# Ready for the next device call (written 2026-12-02, fifth session, which had
# no device time left): one H200 call of ~6 min.
#  1. gpu-marked tests of tests/kernels and tests/gpu (this session changed
#     the kernels' descriptor tables to one pair per stream object).
#  2. Write-behind cost, the staged writer path against the tree before it
#     (6b91183, carried as .ab/base_6b91183.tgz: `git archive 6b91183 | gzip >
#     .ab/base_6b91183.tgz`), full size, engine buffers malloc'd (slots 16 B
#     past a page: the staged path) and page-aligned (in place), `none` and
#     `seal`, alternated twice.
#  3. tests/gds on the posix backend.
# Carry .whl as the earlier device scripts do (../shared/GPU.md). Results in
# one $OUT/results.tgz; the table last.
. "$(dirname "$0")/device_prelude.sh"
bundle_results
SITE=$PWD/.site
unpack_base .ab/base_6b91183.tgz
cp benchmarks/ssd_writebehind.py "$BASE/benchmarks/"  # --engine-align is new

stage "gpu tests: kernels and server"
timeout $(within 200) python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout $(within 90) > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$RES/gpu_tests.log"

for round in 1 2; do
  for v in base new; do
    dir=$PWD; [ $v = base ] && dir=$BASE
    stage "write-behind round $round: $v"
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout $(within 150) python3 benchmarks/ssd_writebehind.py \
      --modes none,seal --engine-align malloc,page --reps 1 --dir /var/tmp/wb-$v \
      --json "$RES/wb-$v$round.json" > "$RES/wb-$v$round.log" 2>&1; echo "rc=$?")
  done
done

stage "tests/gds, posix"
PEGAFLOW_TEST_SSD_BACKEND=posix timeout $(within 150) python3 -m pytest tests/gds -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout $(within 60) > "$RES/gds_posix.log" 2>&1
echo "rc=$?"; tail -2 "$RES/gds_posix.log"

stage "summary"
python3 - "$RES" <<'PY'
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
print("run    | align  | none GB/s | seal GB/s | seal vs none | write/dd")
for tag in ["base1", "new1", "base2", "new2"]:
    f = res / f"wb-{tag}.json"
    if not f.exists():
        print(tag, "missing")
        continue
    rows = json.loads(f.read_text())["rows"]
    for align in ("malloc", "page"):
        got = {r["mode"]: r for r in rows if r["engine_align"] == align}
        none, seal = got.get("none"), got.get("seal")
        if not none or not seal:
            print(f"{tag:6} | {align:6} | incomplete")
            continue
        ratio = seal["save_GBps"] / none["save_GBps"] - 1
        print(f"{tag:6} | {align:6} | {none['save_GBps']:9} | {seal['save_GBps']:9} "
              f"| {ratio:+12.1%} | {seal.get('write/dd', '-')}")
PY
stage done
