#!/usr/bin/env bash
# Ninth session of 2026-12-02, last call, ~2 minutes (the budget left after
# four refused starts): on the session's final code, the direct SSD -> GPU
# route in the server (tests/gpu/test_gpu_ssd_direct.py, new) and the round
# trips of every layout and both copy paths (the hot flag read). The rest of
# tests/gpu and tests/kernels passed in call 3; no kernel changed since.
export CALL_S=${CALL_S:-170}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu-marked tests of the server"
timeout $(within 160) python3 -m pytest -q -m gpu tests/gpu/test_gpu_ssd_direct.py \
  tests/gpu/test_gpu_server.py -k "ssd or round_trip or copy_paths" \
  -p no:cacheprovider -rfE > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -30 "$RES/gpu_tests.log" | cut -c1-400
stage done
