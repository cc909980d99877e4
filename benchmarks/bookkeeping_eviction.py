"""What prefix-aware eviction costs the block store: saves into a full pool
(each block evicts one) and queries back, LRU against prefix-aware, rounds
interleaved because load on a shared VM drifts. The block store and policy
alone (a fake slab base, as benchmarks/sharing.py): no engine, no RPC, so the
difference is the policy's.

    python benchmarks/bookkeeping_eviction.py --blocks 64 640 2560 --rounds 9
    python benchmarks/bookkeeping_eviction.py --leased-pool 1000000
                        # saves into a pool leased but for 10 blocks

benchmarks/bookkeeping.py --eviction lru prefix runs the whole engine instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table, write_json  # noqa: E402
from pegaflow.cache.block_store import BlockStore  # noqa: E402
from pegaflow.cache.prefix_eviction import make_policy  # noqa: E402
from pegaflow.cache.slabs import SlabAllocator  # noqa: E402
from pegaflow.common.keys import Namespace  # noqa: E402
from pegaflow.common.settings import EVICTION_SETTINGS, EvictionSetting  # noqa: E402

HASH_LEN = 32


def store_eviction_us(
    n: int, eviction: EvictionSetting, reps: int, seed: int = 0
) -> tuple[float, float]:
    """The block store alone (fake slab base, as benchmarks/sharing.py): a pool
    of 8n blocks filled, then saves of n fresh blocks (one chain), each
    evicting n, each queried back. Median us per block of the save, and of the
    query (with the deferred touches it owes the policy)."""
    slot = 4096
    ns = Namespace("bench", 1, 1, 1, slot, (1, slot))
    layers = np.arange(1)
    store = BlockStore(
        SlabAllocator(1 << 40, 8 * n * slot, 16 * slot), make_policy(eviction)
    )
    rng = np.random.default_rng(seed)

    def fresh() -> list[bytes]:
        raw = rng.bytes(n * HASH_LEN)
        return [raw[i : i + HASH_LEN] for i in range(0, len(raw), HASH_LEN)]

    saves, queries = [], []
    for i in range(10 + reps):
        hashes = fresh()
        t = time.perf_counter()
        store.finish_save(store.reserve_save(ns, 0, hashes, layers), True)
        s = time.perf_counter() - t
        t = time.perf_counter()
        assert len(store.lookup(ns, hashes)[0]) == n
        store.apply_touches()
        q = time.perf_counter() - t
        if i >= 10:  # the first 8 fill the pool
            saves.append(s)
            queries.append(q)
    assert store.counters.evictions >= reps * n
    med = statistics.median
    return med(saves) * 1e6 / n, med(queries) * 1e6 / n


def _bench_pool(
    resident: int, eviction: EvictionSetting
) -> tuple[BlockStore, Namespace, list[bytes]]:
    """An empty store whose pool holds `resident` one-layer blocks (rounded up
    to whole slabs, at a fake base), and as many random hashes."""
    slot, per_slab = 4096, 16
    slabs = -(-resident // per_slab)
    store = BlockStore(
        SlabAllocator(1 << 40, slabs * per_slab * slot, per_slab * slot),
        make_policy(eviction),
    )
    raw = np.random.default_rng(1).bytes(slabs * per_slab * HASH_LEN)
    hashes = [raw[i : i + HASH_LEN] for i in range(0, len(raw), HASH_LEN)]
    return store, Namespace("bench", 1, 1, 1, slot, (1, slot)), hashes


def leased_pool_save_ms(
    resident: int, eviction: EvictionSetting
) -> tuple[float, float, float, float, float]:
    """A pool of `resident` blocks, all but the 10 most recent leased, then
    saves of 64: ms of the first (it stores 10, leased in turn), the worst
    case of eviction's pass over the LRU order, which passes the leased
    blocks one by one (LRU parks them: later passes skip them); of the next
    (it stores none); of the one after (nothing published or unpinned since:
    no pass); of a save once the newest 64 leased blocks are unpinned (it
    evicts them: LRU's pass meets only those, the prefix policy's passes
    every leased block again); and ms of the server's once-a-second sweep
    for stale partial blocks there."""
    from pegaflow.cache.leases import LeaseTable

    store, ns, hashes = _bench_pool(resident, eviction)
    layers = np.arange(1)
    rng = np.random.default_rng(2)  # the fresh blocks: not the pool's hashes
    for a in range(0, len(hashes), 4096):
        store.finish_save(store.reserve_save(ns, 0, hashes[a : a + 4096], layers), True)
    t = time.perf_counter()
    store.drop_stale(time.monotonic() - 3600)
    sweep = time.perf_counter() - t
    leases = LeaseTable(store, ttl_s=3600)
    held = [store.entries[(ns.id, h)] for h in hashes[:-10]]
    newest = leases.create("bench", ns.id, held[-64:], 1)
    for a in range(0, len(held) - 64, 1 << 20):
        leases.create("bench", ns.id, held[a : min(a + (1 << 20), len(held) - 64)], 1)
    took = []
    for stored in (10, 0, 0, 64):
        if stored == 64:
            leases.release(newest.id)
        fresh = [rng.bytes(HASH_LEN) for _ in range(64)]
        t = time.perf_counter()
        res = store.reserve_save(ns, 0, fresh, layers)
        store.finish_save(res, True)
        took.append((time.perf_counter() - t) * 1e3)
        assert len(res.keys) == stored, len(res.keys)
        if res.keys:
            leases.create("bench", ns.id, list(map(store.entries.get, res.keys)), 1)
    return took[0], took[1], took[2], took[3], sweep * 1e3


def restart_sweep_ms(resident: int) -> float:
    """ms of the once-a-second sweep while a warm restart's check has yet to
    reach any of `resident` recovered blocks (adopted unchecked)."""
    store, ns, hashes = _bench_pool(resident, "lru")
    addrs = store.slabs.base + ns.slot_bytes * np.arange(len(hashes), dtype=np.uint64)
    assert all(store.slabs.claim(addrs.tolist(), ns.slot_bytes))
    store.adopt(ns, hashes, addrs.reshape(-1, 1), unchecked=True)
    took = []
    for _ in range(5):
        t = time.perf_counter()
        store.drop_stale(time.monotonic() - 3600)
        took.append((time.perf_counter() - t) * 1e3)
    return statistics.median(took)


def store_costs(
    blocks: list[int], evictions: list[str], reps: int, rounds: int
) -> list:
    """store_eviction_us per policy, rounds interleaved, against LRU's."""
    out = []
    for n in blocks:
        got: dict[str, list[tuple[float, float]]] = {e: [] for e in evictions}
        for _ in range(rounds):
            for ev in evictions:
                got[ev].append(store_eviction_us(n, ev, reps))
        for ev in evictions:
            save = statistics.median(x[0] for x in got[ev])
            query = statistics.median(x[1] for x in got[ev])
            out.append(
                {"blocks": n, "eviction": ev, "save_evict_us_per_block": round(save, 3)}
                | {"query_us_per_block": round(query, 3)}
            )
        lru = next(
            (r for r in out if r["eviction"] == "lru" and r["blocks"] == n), None
        )
        for r in out:
            if lru is not None and r["blocks"] == n:
                r["save_vs_lru"] = round(
                    r["save_evict_us_per_block"] / lru["save_evict_us_per_block"], 3
                )
                r["query_vs_lru"] = round(
                    r["query_us_per_block"] / lru["query_us_per_block"], 3
                )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 640, 2560])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument(
        "--eviction", nargs="+", choices=EVICTION_SETTINGS, default=["lru", "prefix"]
    )
    p.add_argument(
        "--leased-pool",
        type=int,
        metavar="BLOCKS",
        help="only time saves into a pool of BLOCKS, all but 10 leased",
    )
    p.add_argument("--json", help="output path (default: print only)")
    args = p.parse_args()
    if args.leased_pool:
        rows = []
        for ev in args.eviction:
            save, none, again, unpinned, sweep = leased_pool_save_ms(
                args.leased_pool, ev
            )
            rows.append(
                {"resident": args.leased_pool, "eviction": ev}
                | {"save_ms": round(save, 1), "none_left_ms": round(none, 1)}
                | {"again_ms": round(again, 2), "unpinned_ms": round(unpinned, 2)}
                | {"sweep_ms": round(sweep, 2)}
            )
        rows.append(
            {"resident": args.leased_pool, "eviction": "unchecked (a restart)"}
            | dict.fromkeys(("save_ms", "none_left_ms", "again_ms", "unpinned_ms"), "-")
            | {"sweep_ms": round(restart_sweep_ms(args.leased_pool), 2)}
        )
        title = (
            "Saves of 64 blocks into a pool leased but for 10; the sweep (also"
            " while a restart's check has yet to reach the blocks)"
        )
        return _report(title, "leased_pool", rows, args.json)
    costs = store_costs(args.blocks, args.eviction, args.reps, args.rounds)
    title = "Block store alone, full pool: a save of n fresh blocks evicts n"
    return _report(title, "store_costs", costs, args.json)


def _report(title: str, key: str, rows: list[dict], json_path: str | None) -> int:
    print(title)
    print(table(rows, list(rows[0])))
    if json_path:
        payload = {"command": " ".join(sys.argv), key: rows}
        print(f"JSON: {write_json('bookkeeping_eviction', payload, json_path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
