"""The engine's own work per Save and Load, with no bytes moved.

A real Engine (block store, policy, leases, hit-rate log, descriptor tables)
over a no-op copier: what is left of a request's time is our bookkeeping, the
part that the copy kernel's speed cannot hide (issue 12). Every save brings
fresh hashes, so each block is reserved, allocated and published; with
--full (the default runs both) the pool is filled first, so every save also
evicts as many blocks as it stores. Each save's blocks are then queried and
loaded back (the load's lease bookkeeping, pins, descriptor table).

    python benchmarks/bookkeeping.py                 # 64, 640, 2560 blocks
    python benchmarks/bookkeeping.py --reps 50 --json out.json
    python benchmarks/bookkeeping.py --profile save --blocks 640   # cProfile
    python benchmarks/bookkeeping.py --pool full --ssd none evict seal

--ssd adds a real SSD tier (posix backend, files in a temp dir, the
server's default queue and writers) in that write mode: the rows then show
what its hooks (seal hand-off, eviction spills) add to a save on the loop.

Pages are 512 B (the smallest a registration may have) so the pool stays
small; the Llama-3.1-8B shape's 32 layers keep the descriptor tables its size
(a table row costs the same whatever its page's size). Copies run inline on
the loop (inline_copy_bytes is raised): a thread hop is not bookkeeping.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table, write_json  # noqa: E402
from pegaflow.cache.pool import HostPool  # noqa: E402
from pegaflow.cache.registration_checks import RegisterSpec  # noqa: E402
from pegaflow.common.geometry import LayerLayout, Segment, Transfers  # noqa: E402
from pegaflow.common.identity import CallContext, Caller  # noqa: E402
from pegaflow.common.settings import (  # noqa: E402
    EVICTION_SETTINGS,
    EngineConfig,
    EvictionSetting,
    PoolConfig,
)
from pegaflow.gds import SsdConfig, SsdTier  # noqa: E402
from pegaflow.server.engine import Engine  # noqa: E402
from pegaflow.tiers.ssd_link import SsdLink  # noqa: E402

LAYERS = 32  # Llama-3.1-8B
PAGE = 512
SLOT = LAYERS * PAGE
HASH_LEN = 32
SLAB = 1 << 20


class NullCopier:
    """A CopyEngine that moves nothing: the benchmark times our bookkeeping."""

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def event_done(self, handle: object, wait_event: int) -> bool:
        return True

    def gather(
        self,
        handle: object,
        t: Transfers,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None:
        pass

    def scatter(
        self, handle: object, t: Transfers, deadline: float | None = None
    ) -> None:
        pass

    def close(self, handle: object) -> None:
        pass


class Bench:
    """One engine, one registered worker of N * 2 engine blocks."""

    def __init__(
        self,
        n: int,
        pool_blocks: int,
        seed: int,
        ssd: str = "none",
        eviction: EvictionSetting = "lru",
    ) -> None:
        size = -(-pool_blocks * SLOT // SLAB) * SLAB
        self.pool = HostPool(
            PoolConfig(size_bytes=size, slab_bytes=SLAB, show_progress=False)
        )
        self.tier = None
        self._dir = None
        if ssd != "none":
            self._dir = tempfile.TemporaryDirectory(prefix="pegaflow-bk-")
            self.tier = SsdTier(
                SsdConfig(
                    (f"{self._dir.name}/ssd.bin",),
                    64 << 20,
                    backend="posix",
                    write_on=ssd,  # type: ignore[arg-type]
                    show_progress=False,
                )
            )
        config = EngineConfig(inline_copy_bytes=1 << 30, eviction=eviction)
        copiers = {"host": NullCopier()}
        self.engine = Engine(config, self.pool, copiers)
        if self.tier is not None:  # as the server's assembly links it
            e = self.engine
            link = SsdLink(
                self.tier, e.store, e.registry, e.metrics.ssd, self.pool.size // 2
            )
            e.add_tier(link)
        self.n = n
        self.engine_blocks = 2 * n
        # The engine's process: the server opens its memory (NullCopier moves
        # nothing) and refuses its own pid, as tests/unit/stand_in_engine.py.
        self._stand_in = subprocess.Popen(["sleep", "86400"])
        layers = tuple(
            LayerLayout(
                0,
                i * self.engine_blocks * PAGE,
                self.engine_blocks,
                PAGE,
                (Segment(0, PAGE),),
            )
            for i in range(LAYERS)
        )
        spec = RegisterSpec(
            "bench", "bench-llama", 0, 1, 1, "cpu", "host", self._stand_in.pid,
            ((1 << 20, LAYERS * self.engine_blocks * PAGE),), layers,
        )  # fmt: skip
        caller = Caller("unix", self._stand_in.pid, os.getuid())
        token = self.engine.register(spec, caller).owner_token
        self.ctx = CallContext(caller, token)
        self.rng = np.random.default_rng(seed)

    def hashes(self) -> list[bytes]:
        raw = self.rng.bytes(self.n * HASH_LEN)
        return [raw[i : i + HASH_LEN] for i in range(0, len(raw), HASH_LEN)]

    def ids(self) -> np.ndarray:
        return self.rng.choice(self.engine_blocks, self.n, replace=False)

    async def save(self, hashes: list[bytes]) -> float:
        ids = self.ids()
        t = time.perf_counter()
        res = await self.engine.save("bench", 0, ids, hashes, None, 0, self.ctx)
        dt = time.perf_counter() - t
        assert res.stored == self.n, res
        return dt

    async def load(self, hashes: list[bytes]) -> tuple[float, float]:
        t = time.perf_counter()
        hit = self.engine.query("bench", hashes, HASH_LEN, self.ctx)
        q = time.perf_counter() - t
        assert hit.num_blocks == self.n, hit
        items = [(hit.lease_id, 0, self.ids())]
        t = time.perf_counter()
        res = await self.engine.load("bench", 0, items, False, 0, self.ctx)
        dt = time.perf_counter() - t
        assert res.loaded == self.n, res
        await asyncio.sleep(0)  # deferred touches run here, as after a reply
        return q, dt

    async def fill(self) -> None:
        """Save until the pool is full: the next save must evict."""
        before = self.engine.store.counters.evictions
        while self.engine.store.counters.evictions == before:
            await self.save(self.hashes())
            await asyncio.sleep(0)

    def close(self) -> None:
        self.engine.close()
        self._stand_in.kill()
        self._stand_in.wait()
        if self.tier is not None:
            self.tier.close()
            self._dir.cleanup()
        self.pool.close()


async def _run(
    n: int,
    full: bool,
    reps: int,
    warmup: int,
    seed: int,
    ssd: str,
    eviction: EvictionSetting = "lru",
) -> dict:
    # Not full: room for every save of the run, so none evicts.
    pool_blocks = 4 * n if full else (reps + warmup + 2) * n
    bench = Bench(n, pool_blocks, seed, ssd, eviction)
    try:
        if full:
            await bench.fill()
        saves, queries, loads = [], [], []
        evictions = bench.engine.store.counters.evictions
        for i in range(warmup + reps):
            hashes = bench.hashes()
            s = await bench.save(hashes)
            await asyncio.sleep(0)
            q, ld = await bench.load(hashes)
            if i >= warmup:
                saves.append(s)
                queries.append(q)
                loads.append(ld)
        evicted = bench.engine.store.counters.evictions - evictions
        if full:
            assert evicted >= reps * n, evicted
        else:
            assert evicted == 0, evicted
    finally:
        bench.close()
    save, query, load = (statistics.median(x) * 1e6 for x in (saves, queries, loads))
    return {
        "blocks": n,
        "pool": "full" if full else "room",
        "ssd": ssd,
        "eviction": eviction,
        "save_us": round(save, 1),
        "save_us_per_block": round(save / n, 3),
        "load_us": round(load, 1),
        "load_us_per_block": round(load / n, 3),
        "query_us": round(query, 1),
        "reps": reps,
    }


def eviction_costs(rows: list[dict]) -> list[dict]:
    """Per block count and policy: what a save pays per block it evicts (the
    full pool's save less the roomy one's, per block), and full saves per
    block; each against LRU's (medians over rounds)."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["blocks"], r["ssd"], r["eviction"]), []).append(r)
    for (n, ssd, ev), rs in groups.items():
        full = [r["save_us_per_block"] for r in rs if r["pool"] == "full"]
        room = [r["save_us_per_block"] for r in rs if r["pool"] == "room"]
        if not full or not room:
            continue
        out.append(
            {
                "blocks": n,
                "ssd": ssd,
                "eviction": ev,
                "full_save_us_per_block": round(statistics.median(full), 3),
                "us_per_eviction": round(
                    statistics.median(full) - statistics.median(room), 3
                ),
            }
        )
    for row in out:
        same = (row["blocks"], row["ssd"])
        lru = next(
            (
                r
                for r in out
                if r["eviction"] == "lru" and (r["blocks"], r["ssd"]) == same
            ),
            None,
        )
        if lru is None:
            continue
        row["full_save_vs_lru"] = round(
            row["full_save_us_per_block"] / lru["full_save_us_per_block"], 3
        )
        row["eviction_vs_lru"] = round(
            row["us_per_eviction"] / max(1e-9, lru["us_per_eviction"]), 3
        )
    return out


def _profile(n: int, full: bool, op: str, reps: int, top: int, ssd: str) -> None:
    async def go() -> None:
        pool_blocks = 4 * n if full else (reps + 4) * n
        bench = Bench(n, pool_blocks, 0, ssd)
        if full:
            await bench.fill()
        prof = cProfile.Profile()
        for _ in range(reps):
            hashes = bench.hashes()
            if op == "save":
                prof.enable()
            await bench.save(hashes)
            prof.disable()
            await asyncio.sleep(0)
            if op == "load":
                prof.enable()
            await bench.load(hashes)
            prof.disable()
        bench.close()
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)

    asyncio.run(go())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 640, 2560])
    p.add_argument("--pool", choices=["room", "full", "both"], default="both")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=1, help="repeat every row")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="output path (default: print only)")
    p.add_argument("--profile", choices=["save", "load"], help="cProfile one op")
    p.add_argument("--top", type=int, default=30)
    p.add_argument(
        "--ssd",
        nargs="+",
        choices=["none", "evict", "seal"],
        default=["none"],
        help="SSD tier write modes to compare (none: no tier)",
    )
    p.add_argument(
        "--eviction",
        nargs="+",
        choices=EVICTION_SETTINGS,
        default=["lru"],
        help="L1 eviction policies to compare (rounds alternate between them)",
    )
    args = p.parse_args()
    fulls = {"room": [False], "full": [True], "both": [False, True]}[args.pool]
    if args.profile:
        for n in args.blocks:
            for full in fulls:
                for ssd in args.ssd:
                    pool = "full" if full else "room"
                    print(f"\n== {args.profile} n={n} pool={pool} ssd={ssd}")
                    _profile(n, full, args.profile, args.reps, args.top, ssd)
        return 0
    rows = []
    for _ in range(args.rounds):  # interleaved: load on a shared VM drifts
        rows += [
            asyncio.run(_run(n, full, args.reps, args.warmup, args.seed, ssd, ev))
            for n in args.blocks
            for full in fulls
            for ssd in args.ssd
            for ev in args.eviction
        ]
    print(f"Engine bookkeeping, no-op copier ({LAYERS} layers, median of {args.reps})")
    print(table(rows, list(rows[0])))
    costs = eviction_costs(rows)
    if costs:
        print("\nCost per eviction: (full save - roomy save) / blocks, medians")
        print(table(costs, list(costs[0])))
    if args.json:
        out = write_json(
            "bookkeeping",
            {
                "command": " ".join(sys.argv),
                "layers": LAYERS,
                "rows": rows,
                "eviction_costs": costs,
            },
            args.json,
        )
        print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
