#!/usr/bin/env bash
# Issue 12, kernel variants, on the H200 test machine in ONE call of the device
# tool (~5 min, at most ~8), from the repo root, with the wheels of .whl carried:
#
#   bash benchmarks/device/device_session_issue12b.sh
#
# Stages, each under its own time limit so a hang costs one stage:
#   1. the gpu-marked tests of tests/kernels (block and warp kernels, one-launch
#      pairs, against the reference and the CPU twin) and tests/gpu (server
#      CUDA path)
#   2. benchmarks/kernel_variants.py: every copy strategy per direction and N,
#      save + load at once, N = 1 latency; byte-checked; JSON in $OUT
# The variants' table is printed last. numpy 2.5 vs numba-cuda (row_stack) is
# handled in kernels/cuda.py itself.
. "$(dirname "$0")/device_prelude.sh"
python3 -c "import numpy, numba, torch; print('numpy', numpy.__version__, \
'numba', numba.__version__, 'torch', torch.__version__)"

stage "gpu tests: kernels (block + warp, pairs), server CUDA path"
timeout "${TEST_S:-150}" python3 -m pytest -m gpu tests/kernels tests/gpu \
  -o addopts="" -p no:cacheprovider -q -rfE --timeout 120 2>&1 \
  | tee "$OUT/gpu_tests_12b.log" | tail -12

stage "kernel variants (budget ${VARIANTS_BUDGET_S:-240} s)"
timeout "${VARIANTS_S:-300}" python3 benchmarks/kernel_variants.py \
  --json "$OUT/kernel_variants.json" --budget-s "${VARIANTS_BUDGET_S:-240}" \
  ${VARIANTS_ARGS:-} > "$OUT/kernel_variants.log" 2>&1
rc=$?
grep -c " ok=True" "$OUT/kernel_variants.log" | sed 's/^/cells checked ok: /'
grep -E "ERROR|ok=False|Traceback" "$OUT/kernel_variants.log" | head -20
stage "done, kernel_variants rc=$rc; the table:"
# the table: everything after the per-cell progress lines
sed -n '/^gather (save/,$p' "$OUT/kernel_variants.log"
if ! grep -q '^gather (save' "$OUT/kernel_variants.log"; then
  tail -40 "$OUT/kernel_variants.log"
fi
