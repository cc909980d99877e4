#!/usr/bin/env bash
# Tenth session (2026-12-03), call 3, ~4 minutes. Call 2: THP never took on
# this host (AnonHugePages 0 kB with MADV_HUGEPAGE), the hugetlbfs run died
# (Python 3.12 mmap has no MAP_HUGETLB), and no path passed ~0.87 of the
# ceiling on scattered slots one way or ~68 GB/s both ways, where contiguous
# copies reach 1.0 and 101. Is it the host side's scatter? hugetlbfs pages,
# and adjacent slots on 4 KiB pages, each against the same run's ceiling.
# Then the gpu-marked server tests (tests/gpu): the kernels' launch lock is
# now one per stream, and the server's copies run through it.
export CALL_S=${CALL_S:-480}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
echo 3300 > /proc/sys/vm/nr_hugepages; grep -i hugepages_ /proc/meminfo

for run in "hugetlb random" "hugetlb contiguous" "plain contiguous"; do
  set -- $run
  stage "staged rounds, pool $1, slots $2"
  timeout $(within 110) python3 benchmarks/staged_rounds.py --pool $1 --slots $2 \
    --sizes 64,640 --only gather,scatter,both --budget-s 70 \
    --json "$RES/staged_$1_$2.json" 2>&1 \
    | tee "$RES/staged_$1_$2.log" | grep -v "^[a-z]* *N=" | tail -40
done
stage "gpu-marked server tests"
timeout $(within 170) python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rfE \
  > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -8 "$RES/gpu_tests.log" | cut -c1-300
stage done
