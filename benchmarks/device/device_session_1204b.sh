#!/usr/bin/env bash
# Eleventh session, call 3 (2026-12-04), ~6 minutes. Issue 13's write-behind
# cost on the GPU path after spills past the queue's room stopped building
# slot tables (SsdTier.queue_room / refuse_many). Call 2 found saves 6-15 %
# slower with a tier written behind on seal, the time outside the copy.
# 1. transfer.py with no tier and with one, alternated three times;
# 2. one traced round of each, the SSD bookkeeping and the writers timed
#    (their time off the CPU: GIL waits);
# 3. the host path's write-behind cost (page-aligned engine buffer), 2 rounds.
export CALL_S=${CALL_S:-570}
. "$(dirname "$0")/device_prelude.sh"
bundle_results
TRACED=(pegaflow.tiers.ssd_tier:SsdLink.sealed pegaflow.tiers.ssd_tier:SsdLink.evicted
  pegaflow.tiers.ssd_tier:SsdLink._written pegaflow.gds.tier:SsdTier.spill_many
  pegaflow.gds.tier:SsdTier.refuse_many pegaflow.cache.block_store:BlockStore._allocate
  pegaflow.cache.block_store:BlockStore._remove pegaflow.gds.tier:SsdTier._write_batch
  pegaflow.gds.store:SsdStore.write_run pegaflow.gds.store:gather)

gpu_wb_rounds 1 2 3
targets=(); for t in "${TRACED[@]}"; do targets+=(--trace-target "$t"); done
for tier in none seal; do
  stage "GPU path, SSD tier $tier, traced"
  gpu_wb_round $tier traced --trace-server "$RES/trace_$tier.json" "${targets[@]}"
  python3 benchmarks/phase_trace.py --show "$RES/trace_$tier.json" 2>&1 | cut -c1-150
done

stage "host path write-behind, page-aligned engine buffer"
host_wb 2 150 writebehind_page
stage done
