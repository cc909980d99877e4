#!/usr/bin/env bash
# Eleventh session, call 4 (2026-12-04), ~6 minutes, on the session's final
# code: the gpu-marked tests (the copy-wait rule is gone); two more rounds of
# the GPU path's write-behind cost (call 3 put the evicting row at -5.0 %);
# the host path's write-behind cost with an engine buffer past the CPU
# caches (4,096 blocks: each save reads cold memory, as an engine's does)
# beside the first version's 128 (the same 16 MiB each save, hot in the L3
# unless the writers evict it): is the host path's loss partly that?
export CALL_S=${CALL_S:-570}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu-marked tests"
timeout $(within 230) python3 -m pytest -q -m gpu tests/kernels tests/gpu \
  -p no:cacheprovider -rfE > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$RES/gpu_tests.log"

stage "host path write-behind, hot and cold engine buffers"
host_wb 4 170 writebehind_cold --engine-blocks 128,4096

gpu_wb_rounds 4 5
stage done
