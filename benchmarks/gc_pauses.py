"""Full-GC pauses of a large block index, with and without pegaflow.server.gc_freeze.

The real BlockStore + LRU policy (no copies), filled to --blocks resident
blocks by saves of --batch fresh blocks, then churned (every save evicts as
many). Every generation-2 collection is timed through gc.callbacks: that is
how long the server's event loop would stall.

    python benchmarks/gc_pauses.py [--blocks 1000000] [--churn 400]
"""

from __future__ import annotations

import argparse
import gc
import secrets
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table, write_json  # noqa: E402
from pegaflow.cache.block_store import BlockStore  # noqa: E402
from pegaflow.cache.eviction import LRUPolicy  # noqa: E402
from pegaflow.cache.slabs import SlabAllocator  # noqa: E402
from pegaflow.common.keys import Namespace  # noqa: E402
from pegaflow.server import gc_freeze as gcpolicy  # noqa: E402

SLOT = 256


def run(blocks: int, batch: int, churn: int, freeze: bool) -> dict[str, object]:
    gc.collect()
    gc.unfreeze()
    if freeze:
        gcpolicy.install()
    pauses: list[float] = []
    started = [0.0]

    def timer(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - started[0])

    gc.callbacks.insert(0, timer)  # before the policy's freeze: time the walk
    ns = Namespace("bench", 1, 1, 1, SLOT, (1, SLOT))
    slab = 1 << 20
    store = BlockStore(SlabAllocator(1 << 40, blocks * SLOT, slab), LRUPolicy())
    layers = np.arange(1)
    fill = -(-blocks // batch)
    steady_from = 0
    try:
        for i in tqdm(range(fill + churn), desc=f"freeze={freeze}", unit="save"):
            if i == fill:
                steady_from = len(pauses)
                t0 = time.perf_counter()
            hashes = [secrets.token_bytes(32) for _ in range(batch)]
            store.finish_save(store.reserve_save(ns, 0, hashes, layers), True)
        seconds = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(timer)
        gcpolicy.uninstall()
        gc.unfreeze()
    steady = np.array(pauses[steady_from:]) * 1e3
    return {
        "freeze_after_full_gc": freeze,
        "resident_blocks": len(store.entries),
        "churn_saves": churn,
        "churn_seconds": round(seconds, 2),
        "full_gcs": len(steady),
        "max_pause_ms": round(float(steady.max()), 1) if len(steady) else 0.0,
        "median_pause_ms": round(float(np.median(steady)), 1) if len(steady) else 0.0,
        "total_pause_ms": round(float(steady.sum()), 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=2560)
    p.add_argument("--churn", type=int, default=400, help="saves after the fill")
    p.add_argument("--json", help="output path (default benchmarks/results/)")
    args = p.parse_args()
    rows = [run(args.blocks, args.batch, args.churn, f) for f in (False, True)]
    out = write_json(
        "gc_pauses", {"command": " ".join(sys.argv), "rows": rows}, args.json
    )
    print(table(rows, list(rows[0])))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
