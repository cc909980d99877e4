#!/usr/bin/env bash
# Seventh session of 2026-12-02, last call: the gpu tests on the session's
# final code (the engine-RPC gate on every gRPC call, pegaflow/common/jit.py).
export CALL_S=${CALL_S:-300}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu tests: kernels and server"
timeout $(within 250) python3 -m pytest -m gpu tests/kernels tests/gpu -o addopts="" \
  -p no:cacheprovider -q -rfE --timeout 60 > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$RES/gpu_tests.log"
stage done
