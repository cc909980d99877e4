#!/usr/bin/env bash
# 2026-12-02, third session, second H200 call (~8 min):
#   1. ssd_writebehind.py full size, 5 rounds (the first call's 3 rounds read
#      -0.8 % for seal after the batched eviction spills: confirm)
#   2. remote.py over veth (64 MiB - 1 GiB) on the 16-core host: the host has
#      no iproute2, so `ip` (and its libraries, and Mooncake's) are carried
#      in .whl/bin and .whl/lib, used only where the host lacks them
#   3. tests/gpu (the gpu-marked tests) on this session's code
# Run from the repo root with .whl carried; every result ends in one
# $OUT/results.tgz (the device tool returns a bounded number of files).
. "$(dirname "$0")/device_prelude.sh"
WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}
mkdir -p "$WB_DIR"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT

stage "write-behind, full size, 5 rounds"
timeout "${WB_S:-200}" python3 benchmarks/ssd_writebehind.py --reps 5 \
  --dir "$WB_DIR" --json "$RES/writebehind.json" > "$RES/writebehind.log" 2>&1
echo "writebehind rc=$?"
tail -4 "$RES/writebehind.log"

stage "remote tier over veth"
carried_tools
ip -V 2>&1 | head -1
(ip netns add pfprobe && ip netns del pfprobe && echo "netns ok") 2>&1 | tail -1
(ip link add pfprobe0 type bridge && ip link del pfprobe0 && echo "bridge ok") 2>&1 | tail -1
timeout "${REMOTE_S:-220}" python3 benchmarks/remote.py --sizes-mib 64,256,1024 \
  --repeat 3 --json "$RES/remote.json" > "$RES/remote.log" 2>&1
echo "remote rc=$?"
tail -14 "$RES/remote.log"

stage "gpu-marked tests"
timeout "${GPU_S:-150}" python3 -m pytest tests/gpu -o addopts="" -p no:cacheprovider \
  -q -rfE --timeout 120 > "$RES/gpu_tests.log" 2>&1
echo "tests/gpu rc=$?"
tail -4 "$RES/gpu_tests.log"

stage "summary"
python3 benchmarks/writebehind_summary.py "$RES/writebehind.json"
grep -E "^ *[0-9]+ \|" "$RES/remote.log" | tail -4
stage done
