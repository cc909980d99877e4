#!/usr/bin/env bash
# Sixth session, call 2 (issue 12): does one direction split between copy
# engines and the kernel beat either alone (kernel_variants_split.py), and
# the end-to-end figures of the code as it is, in the same call.
. "$(dirname "$0")/device_prelude.sh"
bundle_results

stage "split: kernel + copy engines at once"
timeout $(within 240) python3 benchmarks/kernel_variants_split.py --budget-s 200 \
  --json "$RES/split.json" > "$RES/split.log" 2>&1
echo "rc=$?"

stage "transfer, llama, 1/64/640"
timeout $(within 200) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
  --sizes 1,64,640 --min-reps 5 --bringup-gib 0 --out "$RES" > "$RES/transfer.log" 2>&1
echo "rc=$?"; tail -30 "$RES/transfer.log"

stage "summary"
sed -n '/^gather: GB/,$p' "$RES/split.log"
stage done
