#!/usr/bin/env bash
# Tenth session (2026-12-03), call 3, ~8 minutes.
# 1. Call 2's pools were all 4 KiB pages: Python's mmap maps shared memory,
#    whose THP follows shmem_enabled ([never]), not MADV_HUGEPAGE; and the
#    hugetlbfs run died (Python 3.12 mmap has no MAP_HUGETLB). No path passed
#    ~0.87 of the ceiling on scattered slots one way or ~68 GB/s both ways,
#    where contiguous copies reach 1.0 and 101. Do 2 MiB pages change that?
#    Private THP pages (as pegaflow's pool maps them) and hugetlbfs pages.
# 2. The gpu-marked server tests (tests/gpu): the kernels' launch lock is now
#    one per stream, and the overlap check takes no sort for rising or
#    one-size destinations.
# 3. transfer.py A/B, the session's start (a7fb6d2, carried as
#    .ab/base_a7fb6d2.tgz) against this tree, sizes 1, 64, 640.
export CALL_S=${CALL_S:-500}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
SITE=$PWD/.site
echo 3300 > /proc/sys/vm/nr_hugepages; grep -i hugepages_ /proc/meminfo

for run in "thp random" "hugetlb random"; do
  set -- $run
  stage "staged rounds, pool $1, slots $2"
  timeout $(within 70) python3 benchmarks/staged_rounds.py --pool $1 --slots $2 \
    --sizes 640 --only gather,scatter,both --budget-s 45 \
    --json "$RES/staged_$1_$2.json" 2>&1 \
    | tee "$RES/staged_$1_$2.log" | grep -v "^[a-z]* *N=" | tail -32
done
echo 0 > /proc/sys/vm/nr_hugepages

stage "gpu-marked server tests"
timeout $(within 170) python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rfE \
  > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -6 "$RES/gpu_tests.log" | cut -c1-300

rm -rf /tmp/treeA && mkdir -p /tmp/treeA && tar -xzf .ab/base_a7fb6d2.tgz -C /tmp/treeA
for v in A B; do
  dir=/tmp/treeA; [ $v = B ] && dir=$PWD
  stage "transfer $v"
  (cd "$dir" && PYTHONPATH=$SITE:$dir timeout $(within 90) python3 benchmarks/transfer.py \
    --shapes llama-3.1-8b --sizes 1,64,640 --min-reps 5 --lat-reps 200 --bringup-gib 0 \
    --tag "$v" --out "$RES" > "$RES/transfer_$v.log" 2>&1; echo "rc=$?")
  grep -E "llama-3.1-8b \| +(64|640) |^(lat_load_p50|lat_save_event_p50|both_total)" "$RES/transfer_$v.log" | cut -c1-200
done
stage done
