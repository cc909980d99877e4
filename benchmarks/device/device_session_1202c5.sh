#!/usr/bin/env bash
# 2026-12-02, third session, last H200 call (~5 min):
#   1. ssd_writebehind.py full size, 5 rounds, after the SSD writers' per-run
#      bookkeeping went to numpy (issue 13: write-behind cost, goal <= 5 %)
#   2. remote.py over veth (64 MiB - 1 GiB) after fetches on 4+ cores were
#      cut in ~4 pieces hashed behind the transfer (issue 11: >= 0.8 x raw)
#   3. tests/gds on the kvikio backend and on posix (the writers changed)
#   4. ssd_writer_cpu.py: the writers' CPU per block on this host
# Run from the repo root with .whl carried; results in one $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}
mkdir -p "$WB_DIR"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT

stage "write-behind, full size, 5 rounds"
timeout "${WB_S:-200}" python3 benchmarks/ssd_writebehind.py --reps 5 \
  --dir "$WB_DIR" --json "$RES/writebehind.json" > "$RES/writebehind.log" 2>&1
echo "writebehind rc=$?"

stage "remote tier over veth"
carried_tools
timeout "${REMOTE_S:-200}" python3 benchmarks/remote.py --sizes-mib 64,256,1024 \
  --repeat 3 --json "$RES/remote.json" > "$RES/remote.log" 2>&1
echo "remote rc=$?"
grep -E "^ *[0-9]+ \||^ *MiB|query ->|save of" "$RES/remote.log" | tail -6

for backend in kvikio posix; do
  stage "tests/gds on $backend"
  PEGAFLOW_TEST_SSD_BACKEND=$backend timeout "${TEST_S:-60}" python3 -m pytest \
    tests/gds -o addopts="" -p no:cacheprovider -q -rfE --timeout 50 \
    > "$RES/gds_tests_$backend.log" 2>&1
  echo "tests/gds $backend rc=$?"
  tail -2 "$RES/gds_tests_$backend.log"
done

stage "writer CPU per block"
timeout "${CPU_S:-60}" python3 benchmarks/ssd_writer_cpu.py --reps 3 --dir "$WB_DIR" \
  --json "$RES/writer_cpu.json" > "$RES/writer_cpu.log" 2>&1 || echo "writer cpu failed"
tail -4 "$RES/writer_cpu.log"

stage "summary"
python3 benchmarks/writebehind_summary.py "$RES/writebehind.json"
stage done
