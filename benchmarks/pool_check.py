"""The check pass of a warm restart (--pool-file), in process: a pool file
filled with sealed slots (random bytes; 2 MiB, or --slot), then reopened and recovered
again and again; the seconds of pegaflow.server.warm_restart.recover(), which on a kept
file is mostly the checksum of every SEALED slot. restart.py times the whole
restart (exec, imports, mapping, gRPC) around it.

    python benchmarks/pool_check.py --size 2gb --reps 3
    python benchmarks/pool_check.py --slot 16kb    # many small slots
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_json  # noqa: E402
from pegaflow.cache.block_store import BlockStore  # noqa: E402
from pegaflow.cache.eviction import LRUPolicy  # noqa: E402
from pegaflow.cache.instances import Registry  # noqa: E402
from pegaflow.cache.pool import HostPool  # noqa: E402
from pegaflow.common.keys import Namespace  # noqa: E402
from pegaflow.common.settings import PoolConfig, parse_size  # noqa: E402
from pegaflow.server.warm_restart import Recovered, recover  # noqa: E402

BATCH = 64


def _pool(path: str, size: int) -> HostPool:
    cfg = PoolConfig(size, show_progress=False, pool_file=path)
    return HostPool(cfg)


def fill(path: str, size: int, fill: float, slot: int) -> int:
    """Blocks saved (and sealed) into a fresh pool file."""
    pool = _pool(path, size)
    store = BlockStore(pool.slabs, LRUPolicy())
    ns = Namespace("bench", 1, 1, 2, slot, (2, slot // 2, slot // 2))
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, slot, np.uint8)
    saved, target = 0, int(size * fill) // slot
    while saved < target:
        hs = [(saved + i).to_bytes(8, "little") for i in range(BATCH)]
        res = store.reserve_save(ns, 0, hs, np.arange(2))
        for addr in res.slots.tolist():
            pool.view(addr, block.size)[:] = np.roll(block, saved)
        store.finish_save(res, True)
        saved += len(res.keys)
        if len(res.keys) < BATCH:
            break
    assert pool.log is not None and pool.log.drain(600)
    pool.close()
    return saved


def check(path: str, size: int) -> dict[str, float]:
    pool = _pool(path, size)
    store = BlockStore(pool.slabs, LRUPolicy())
    start = time.perf_counter()
    report = recover(pool, store, Recovered(Registry({})), progress=False)
    seconds = time.perf_counter() - start
    pool.close()
    assert report.bad_checksum == 0 and report.unsealed == 0
    return {"blocks": report.blocks, "seconds": round(seconds, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="2gb")
    p.add_argument("--fill", type=float, default=0.8)
    p.add_argument("--slot", default="2mb", help="bytes a block (one slot)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    size, slot = parse_size(args.size), parse_size(args.slot)
    path = os.path.join(args.dir, f"bench-pool-check-{os.getpid()}.pool")
    try:
        blocks = fill(path, size, args.fill, slot)
        runs = [check(path, size) for _ in range(args.reps)]
    finally:
        os.unlink(path)
    gib = blocks * slot / (1 << 30)
    for r in runs:
        print(
            f"{r['blocks']} blocks ({gib:.2f} GiB) checked in {r['seconds']:.3f} s: "
            f"{gib / r['seconds']:.2f} GiB/s"
        )
    payload = {"command": " ".join(sys.argv), "size": size, "slot": slot, "runs": runs}
    print(write_json("pool_check", payload, args.json))


if __name__ == "__main__":
    main()
