#!/usr/bin/env bash
# Fourteenth session, call 2 (2026-12-04), ~9 minutes, on the final code of
# the twelfth and thirteenth sessions (the SSD writers' compiled checksum and
# copy loops, the refused-stream drain): every gpu-marked test; tests/gds on
# the kvikio backend (gpu-marked ones included) and on posix; then the host
# path's write-behind cost at 2 MiB blocks (Llama-8B geometry, main only)
# for as many rounds as time leaves, to firm up that figure.
# Run: the device tool with carry [".whl"], command
#   CALL_S=540 bash benchmarks/device/device_session_1205b.sh
export CALL_S=${CALL_S:-540}
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "gpu-marked tests (kernels, server, connector)"
timeout $(within 200) python3 -m pytest -q -m gpu tests/kernels tests/gpu tests/connector \
  -p no:cacheprovider -rfE --timeout 120 > "$RES/gpu_tests.log" 2>&1
echo "rc=$?"; tail -4 "$RES/gpu_tests.log"

gds_tests 110

for round in 1 2 3 4 5 6 7 8 9 10; do
  [ $((CALL_S - (SECONDS - START))) -lt 40 ] && break
  stage "host path write-behind, 2 MiB, page, round $round"
  WB_STAGE_S=30 wb_round main "wb_L32_r$round" --bursts 4 --layers 32
done
stage done
