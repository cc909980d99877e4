"""What the hit-rate ceiling costs: HyperLogLog update and error, and the query
path with and without the miss/ceiling tracker (pegaflow.cache.miss_reasons).

    python benchmarks/hll_cost.py        # prints; benchmarks/sharing.py embeds it
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pegaflow.cache.block_store import BlockStore  # noqa: E402
from pegaflow.cache.eviction import LRUPolicy  # noqa: E402
from pegaflow.cache.hll import WindowSet  # noqa: E402
from pegaflow.cache.miss_reasons import HitRateTracker, RecordingPolicy  # noqa: E402
from pegaflow.cache.slabs import SlabAllocator  # noqa: E402
from pegaflow.common.hash64 import hash64, hash64_batches  # noqa: E402
from pegaflow.common.keys import Namespace  # noqa: E402
from pegaflow.common.settings import HitRateConfig  # noqa: E402

WINDOWS = (900.0, 3600.0, 86400.0)


def update_cost(n: int = 1 << 20, batch: int = 1 << 14) -> dict[str, float]:
    """ns per hash, in the tracker's flush batches of 16K (6 queries of 2560
    hashes): 32-byte hashes -> uint64, and the registers of 3 windows."""
    raw = np.random.default_rng(1).integers(0, 256, (n, 32), np.uint8)
    hashes = [bytes(row) for row in raw]
    queries = [hashes[i : i + 2560] for i in range(0, n, 2560)]
    per = batch // 2560
    flushes = [queries[i : i + per] for i in range(0, len(queries), per)]
    windows = WindowSet(WINDOWS, HitRateConfig().bucket_bits)
    windows.add(hash64(hashes, 32), 0, 0.0)  # warm: first allocations, page faults
    convert, update = [], []
    for rep in range(3):
        t = time.perf_counter()
        h64s = [hash64_batches(f, 32) for f in flushes]
        convert.append(time.perf_counter() - t)
        t = time.perf_counter()
        for h64 in h64s:
            windows.add(h64, 0, 1.0 + rep)
        update.append(time.perf_counter() - t)
    return {
        "bytes_to_uint64_ns_per_hash": round(min(convert) / n * 1e9, 2),
        "update_3_windows_ns_per_hash": round(min(update) / n * 1e9, 2),
        "window_bytes": windows.nbytes // len(WINDOWS),
    }


def error(runs: int, n: int = 10_000_000) -> dict[int, dict[str, float]]:
    """|estimate / exact - 1| over `runs` seeds of n random 64-bit hashes."""
    out = {}
    for bits in (14, 16):
        errs = []
        for seed in range(runs):
            h = np.random.default_rng(seed).integers(0, 2**64, n, np.uint64)
            w = WindowSet((60.0,), bits)
            w.add(h, 0, 0.0)
            errs.append(abs(w.stats(0.0)[0].unique / n - 1))
        out[bits] = {
            "runs": runs,
            "mean_abs_pct": round(100 * float(np.mean(errs)), 3),
            "max_abs_pct": round(100 * float(np.max(errs)), 3),
        }
    return out


def query_overhead(hashes: int = 2560, queries: int = 400) -> dict[str, float]:
    """µs per prefix query of `hashes` blocks (all resident, and half), bare
    BlockStore.lookup vs lookup + tracker log + its share of the flushes."""
    tracker = HitRateTracker(HitRateConfig(), ghost_bits=20)
    store = BlockStore(
        SlabAllocator(1 << 40, 8192 * 4096, 64 * 4096),
        RecordingPolicy(LRUPolicy(), tracker),
    )
    ns = Namespace("bench", 1, 1, 1, 4096, (1, 4096))
    resident = [secrets.token_bytes(32) for _ in range(hashes)]
    layers = np.arange(1)
    store.finish_save(store.reserve_save(ns, 0, resident, layers), True)
    half = resident[: hashes // 2] + [
        secrets.token_bytes(32) for _ in range(hashes // 2)
    ]
    out = {}
    for name, q in (("all_hit", resident), ("half_miss", half)):
        best_bare = best_full = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(queries):
                store.lookup(ns, q)
            best_bare = min(best_bare, time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(queries):
                hits, rest = store.lookup(ns, q)
                tracker.query(ns, q, len(hits), rest, 32)
            tracker.flush()
            best_full = min(best_full, time.perf_counter() - t)
        out[f"{name}_lookup_us"] = round(best_bare / queries * 1e6, 1)
        out[f"{name}_with_tracker_us"] = round(best_full / queries * 1e6, 1)
    return out


def scrape_cost(namespaces: int = 200, batch: int = 256) -> dict[str, float]:
    """What one /metrics scrape spends in the windows' stats (on the event
    loop), every namespace having seen one batch a minute ago: the first
    scrape, the next one (nothing new), one after every namespace saw one
    more batch (the kept merge raised by it: eighth session), and one
    recomputing from scratch (as before the stats were kept). ms."""
    sets = [WindowSet(WINDOWS, HitRateConfig().bucket_bits) for _ in range(namespaces)]
    rng = np.random.default_rng(0)
    for ws in sets:
        ws.add(rng.integers(0, 2**64, batch, np.uint64), 0, now=1000.0)

    def scrape(forget: bool = False) -> float:
        t = time.perf_counter()
        for ws in sets:
            if forget:
                for w in ws.windows:
                    w._memo = None
            ws.stats(1060.0)
        return round((time.perf_counter() - t) * 1e3, 2)

    first, again = scrape(), scrape()
    for ws in sets:  # every namespace queried again since, in the same sub-windows
        ws.add(rng.integers(0, 2**64, batch, np.uint64), 0, now=1010.0)
    return {
        "namespaces": namespaces,
        "first_ms": first,
        "again_ms": again,
        "after_a_batch_each_ms": scrape(),
        "recomputed_ms": scrape(forget=True),
    }


def measure(error_runs: int = 1) -> dict[str, object]:
    return {
        "update": update_cost(),
        "error_10M_hashes": error(error_runs),
        "query_2560": query_overhead(),
        "scrape_200_namespaces": scrape_cost(),
    }


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--error-runs", type=int, default=5, help="HLL error trials")
    args = p.parse_args()
    print(json.dumps(measure(error_runs=args.error_runs), indent=2))
