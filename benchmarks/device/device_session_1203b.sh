#!/usr/bin/env bash
# Tenth session (2026-12-03), call 2, ~6 minutes. Call 1 found staged rounds
# with batched DMA no faster than the kernel one way (44-46 vs 46-48 GB/s)
# and batches of the two directions not overlapping (44.6 GB/s both ways).
# Two questions: do the pool's pages (4 KiB, THP, hugetlbfs) decide what
# scattered 2 MiB slots reach, and do per-run cuMemcpyAsync rounds overlap
# both ways where batches do not? Then the matmul beside each path (THP pool).
export CALL_S=${CALL_S:-560}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag \
  /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>&1 | tee "$RES/thp.txt"
echo 3300 > /proc/sys/vm/nr_hugepages; grep -i huge /proc/meminfo | tee -a "$RES/thp.txt"

for pool in hugetlb thp plain; do
  stage "staged rounds, pool $pool"
  only=gather,scatter,both
  [ "$pool" = thp ] && only=$only,interference
  timeout $(within 200) python3 benchmarks/staged_rounds.py --pool $pool --sizes 64,640 \
    --only $only --budget-s 150 --json "$RES/staged_$pool.json" 2>&1 \
    | tee "$RES/staged_$pool.log" | grep -v "^[a-z]* *N=" | tail -60
done
stage done
