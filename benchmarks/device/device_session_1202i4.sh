#!/usr/bin/env bash
# Ninth session of 2026-12-02, last call, ~3 minutes (the budget left after
# two refused starts): the server's gpu-marked tests on the session's final
# code: the hot flag read, and the direct SSD -> GPU route in the server
# (tests/gpu/test_gpu_ssd_direct.py, new). tests/kernels passed in call 3 and
# no kernel changed since.
export CALL_S=${CALL_S:-230}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu-marked tests of the server"
timeout $(within 215) python3 -m pytest -q -m gpu tests/gpu \
  -p no:cacheprovider -rfE > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -30 "$RES/gpu_tests.log" | cut -c1-400
stage done
