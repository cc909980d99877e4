"""One shared pool vs isolated per-engine pools, LRU vs TinyLFU, measured hit
rate vs the HyperLogLog ceiling: a trace replayed through the real index, pool
and policy code (BlockStore, SlabAllocator, LRUPolicy, AdmissionPolicy,
LeaseTable, HitRateTracker), wired as pegaflow.server.engine wires them, with no bytes
moved (a fake slab base, as tests/unit/test_blocks.py does).

    python benchmarks/sharing.py --jobs 16   # 40K requests; 15 replays in parallel
    python benchmarks/sharing.py --quick     # 1.2K smaller requests, ~1 min

Equal total bytes: the shared pool holds C blocks; each of 8 isolated pools C/8.
C is a fraction of the trace's distinct blocks (--fractions); 2.25 MiB a block
(Qwen3-8B, 16 tokens, bf16) turns it into GiB. Deterministic for a seed: TinyLFU
hashes keys with Python's hash(), so the script re-runs itself with
PYTHONHASHSEED=0 unless a seed is set. benchmarks/sharing_eviction.py compares
eviction policies on these replays, also with saves that come after prefill
and decode (replay's timing "served").
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import hll_cost  # noqa: E402
from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.sharing_trace import (  # noqa: E402
    Request,
    Workload,
    exact_ceilings,
    make_trace,
)
from pegaflow.cache.block_store import BlockStore  # noqa: E402
from pegaflow.cache.leases import LeaseTable  # noqa: E402
from pegaflow.cache.miss_reasons import (  # noqa: E402
    CAUSES,
    HitRateTracker,
    RecordingPolicy,
    RemoteProbe,
)
from pegaflow.cache.prefix_eviction import make_policy  # noqa: E402
from pegaflow.cache.slabs import SlabAllocator  # noqa: E402
from pegaflow.common.keys import Namespace  # noqa: E402
from pegaflow.common.settings import HitRateConfig  # noqa: E402

SLOT = 4096  # bookkeeping only: no byte of the fake pool is touched
BLOCK_MIB = 2.25
NS = Namespace("qwen3-8b", 1, 1, 1, SLOT, (1, SLOT))
LAYERS = np.arange(1)
FULL = Workload()
QUICK = Workload(
    requests=1200,
    system_prompts=16,
    documents=400,
    system_blocks=(4, 64),
    document_blocks=(16, 128),
)
# A hot set of popular documents under bursts of one-off documents.
SCAN = {
    "scan_share": 0.5,
    "scan_burst": 50,
    "documents": 100,
    "mean_turns": 1.0,
    "doc_session_share": 0.8,
    "user_blocks": (1, 4),
    "reply_blocks": (1, 8),
}
LAYOUTS = {
    "shared": (1, "random"),
    "isolated": (8, "random"),
    "isolated-sticky": (8, "sticky"),
}


class Pool:
    """One cache: what one pegaflow-server (or one engine's private pool) holds."""

    def __init__(
        self,
        blocks: int,
        policy: str,
        clock: list[float],
        remote: RemoteProbe | None = None,
        parents: dict[bytes, bytes] | None = None,
    ) -> None:
        # "lru", "tinylfu", "prefix", "prefix+tinylfu"; "prefix-oracle": told
        # every saved block's true parent (`parents`), a bound on what learning
        # parents from arrival order can gain
        self.parents = parents
        kind = "prefix" if policy.startswith("prefix") else "lru"
        inner = make_policy(kind, max(1, blocks) if "tinylfu" in policy else 0)
        self.tracker = HitRateTracker(
            HitRateConfig(),
            HitRateTracker.ghost_bits_for(blocks << 20),
            clock=lambda: clock[0],
            remote=remote,
        )
        slabs = SlabAllocator(1 << 40, blocks * SLOT, 16 * SLOT)
        self.store = BlockStore(slabs, RecordingPolicy(inner, self.tracker))
        self.store.add_listener(self.tracker)  # as pegaflow.server.engine
        self.leases = LeaseTable(self.store, ttl_s=30.0)

    def serve(self, req: Request, owner: str) -> int:
        """Query, load (a lease), then save what was computed; the hit blocks."""
        hits = self.query(req, owner)
        self.save(req.chain[hits : req.total_len])
        return hits

    def query(self, req: Request, owner: str) -> int:
        """Query and load (a lease); the hit blocks."""
        prompt = req.prompt
        hits, rest = self.store.lookup(NS, prompt)
        self.tracker.query(NS, prompt, len(hits), rest, 32)
        if hits:
            self.leases.consumed(self.leases.create(owner, NS.id, hits, 1), 0)
        return len(hits)

    def save(self, hashes: list[bytes]) -> None:
        if self.parents is not None:
            for h in hashes:
                parent = self.parents.get(h)
                if parent is not None:
                    self.store.policy.expect((NS.id, h), (NS.id, parent))
        res = self.store.reserve_save(NS, 0, hashes, LAYERS)
        self.store.finish_save(res, True)


# timing "served": a request's computed prompt blocks are saved after its
# prefill, its reply blocks one by one as decode completes them (vLLM with
# save_decode), while other requests' queries and saves go on in between.
PREFILL_S_PER_BLOCK = 0.002  # 16 tokens at ~8K tokens/s
DECODE_S_PER_BLOCK = 0.5  # 16 tokens at ~31 ms a token
Timing = str  # "instant" (query and save back to back) or "served"


def replay(
    trace: list[Request],
    capacity: int,
    pools: int,
    routing: str,
    policy: str,
    progress: bool,
    timing: Timing = "instant",
) -> dict[str, object]:
    """Serve the trace from `pools` caches of capacity/pools blocks each."""
    clock = [0.0]
    caches: list[Pool] = []
    parents = None
    if policy == "prefix-oracle":
        parents = {
            c[j]: c[j - 1] for r in trace for c in [r.chain] for j in range(1, len(c))
        }
    for i in range(pools):  # a miss another pool could have served: "remote"
        probe = _peers(caches, i) if pools > 1 else None
        caches.append(Pool(capacity // pools, policy, clock, probe, parents))
    hit_fracs = np.zeros(len(trace))
    hit_blocks = prompt_blocks = 0
    start = time.perf_counter()
    label = f"{pools} pool(s), {routing}, {policy}"
    saves: list[tuple[float, int, int, list[bytes]]] = []  # time, seq, pool
    for i, req in enumerate(tqdm(trace, desc=label, disable=not progress, leave=False)):
        while saves and saves[0][0] <= req.time_s:
            clock[0], _, at, hashes = heapq.heappop(saves)
            caches[at].save(hashes)
        clock[0] = req.time_s
        pool = route(req, pools, routing)
        if timing == "instant":
            hits = caches[pool].serve(req, f"engine-{req.instance}")
        else:
            hits = caches[pool].query(req, f"engine-{req.instance}")
            _schedule(saves, req, pool, hits, i)
        hit_fracs[i] = hits / req.prompt_len
        hit_blocks += hits
        prompt_blocks += req.prompt_len
    while saves:
        clock[0], _, at, hashes = heapq.heappop(saves)
        caches[at].save(hashes)
    wall = time.perf_counter() - start
    out = summarize(caches, hit_fracs, wall, clock[0])
    # Full blocks of 16 tokens: the share of prompt tokens served from the cache.
    out["token_hit_rate"] = round(hit_blocks / max(1, prompt_blocks), 4)
    return out


def _schedule(
    saves: list[tuple[float, int, int, list[bytes]]],
    req: Request,
    pool: int,
    hits: int,
    seq: int,
) -> None:
    """The request's saves: its prompt after prefill, then a reply block at a
    time (seq orders equal times by arrival, then by position)."""
    t = req.time_s + PREFILL_S_PER_BLOCK * (req.prompt_len - hits)
    order = seq * 4096
    if hits < req.prompt_len:
        heapq.heappush(saves, (t, order, pool, req.chain[hits : req.prompt_len]))
    for j in range(req.prompt_len, req.total_len):
        t += DECODE_S_PER_BLOCK
        order += 1
        heapq.heappush(saves, (t, order, pool, req.chain[j : j + 1]))


def _peers(caches: list[Pool], me: int) -> RemoteProbe:
    def probe(ns_id: int, hashes: list[bytes]) -> np.ndarray:
        peers = [c.store.entries for j, c in enumerate(caches) if j != me]
        return np.fromiter(
            (any(_ready(p.get((ns_id, h))) for p in peers) for h in hashes),
            bool,
            len(hashes),
        )

    return probe


def _ready(entry: object) -> bool:
    return entry is not None and entry.ready


def route(req: Request, pools: int, routing: str) -> int:
    if pools == 1:
        return 0
    return (
        req.session % pools
        if routing == "sticky" and req.session >= 0
        else req.instance
    )


def summarize(
    caches: list[Pool],
    hit_fracs: np.ndarray,
    wall: float,
    now: float,
) -> dict[str, object]:
    flush_start = time.perf_counter()
    snaps = [c.tracker.snapshot(now)[0] for c in caches]
    flush = time.perf_counter() - flush_start
    hits = sum(s.hits["ram"] for s in snaps)
    causes = {c: sum(s.misses[c] for s in snaps) for c in CAUSES}
    queried = hits + sum(causes.values())
    day = [s.windows["1d"] for s in snaps]  # the whole trace (< 1 day)
    n = sum(w.requests for w in day)
    u = sum(min(w.unique, w.requests - w.hits) for w in day)  # as WindowStats
    return {
        "request_hit_rate": round(float(hit_fracs.mean()), 4),
        "block_hit_rate": round(hits / queried, 4),
        "requests_with_a_hit": round(float((hit_fracs > 0).mean()), 4),
        "hll_ceiling": round((n - u) / n, 4),
        # the rolling 15-minute view of the first pool, at the trace's end
        "pool0_15m_hit_rate": round(snaps[0].windows["15m"].hit_rate, 4),
        "pool0_15m_ceiling": round(snaps[0].windows["15m"].ceiling, 4),
        "miss_causes": {c: round(v / queried, 4) for c, v in causes.items()},
        "resident_misses": round(sum(s.resident_misses for s in snaps) / queried, 4),
        "evictions": sum(c.store.counters.evictions for c in caches),
        "admission_rejections": sum(
            c.store.counters.admission_rejections for c in caches
        ),
        "blocks_queried": queried,
        "replay_s": round(wall, 1),
        "tracker_snapshot_s": round(flush, 3),
    }


def capacity_for(distinct: int, fraction: float, pools: int = 8) -> int:
    """Blocks for a pool of `fraction` of the distinct blocks; a multiple of
    pools x slab so the isolated pools split it evenly."""
    unit = pools * 16
    return max(unit, int(distinct * fraction) // unit * unit)


def distinct_blocks(trace: list[Request]) -> int:
    seen: set[bytes] = set()
    for req in trace:
        seen.update(req.chain[: req.total_len])
    return len(seen)


_TRACES: dict[str, list[Request]] = {}  # filled before the workers fork
# trace, capacity, pools, routing, policy, timing
Spec = tuple[str, int, int, str, str, Timing]


def _job(spec: Spec, progress: bool) -> dict[str, object]:
    name, capacity, pools, routing, policy, timing = spec
    return replay(_TRACES[name], capacity, pools, routing, policy, progress, timing)


def _run_jobs(specs: list[Spec], jobs: int, progress: bool) -> list[dict]:
    if jobs <= 1:
        return [_job(spec, progress) for spec in specs]
    ctx = multiprocessing.get_context("fork")  # workers inherit the traces
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_job, spec, False) for spec in specs]
        bar = tqdm(total=len(futures), desc="replays", disable=not progress)
        for future in futures:
            future.add_done_callback(lambda _: bar.update())
        results = [f.result() for f in futures]
        bar.close()
    return results


def _exact(trace: list[Request], pools: list[int] | None = None) -> dict[str, float]:
    r_star, infinite = exact_ceilings(trace, pools)
    # The server's ceiling is the infinite cache's hit rate (a block is seen
    # when first saved or queried); r* over first queries only is kept beside it.
    return {
        "exact_ceiling": round(infinite, 4),
        "first_query_ceiling": round(r_star, 4),
    }


def run(
    workload: Workload = QUICK,
    seed: int = 0,
    fractions: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4),
    scan_fractions: tuple[float, ...] = (0.05, 0.1),
    jobs: int = 1,
    progress: bool = False,
    error_runs: int = 1,
) -> dict[str, object]:
    """Every experiment; the JSON document (also what the notebook plots)."""
    start = time.perf_counter()
    scan_load = dataclasses.replace(workload, **SCAN)
    _TRACES.update(mixed=make_trace(workload, seed), scan=make_trace(scan_load, seed))
    distinct = {name: distinct_blocks(t) for name, t in _TRACES.items()}
    specs: list[Spec] = []
    meta: list[dict[str, object]] = []
    for name, fracs, variants in (
        ("mixed", fractions, [(k, *v, "lru") for k, v in LAYOUTS.items()]),
        ("scan", scan_fractions, [(p, 1, "random", p) for p in ("lru", "tinylfu")]),
    ):
        for fraction in fracs:
            capacity = capacity_for(distinct[name], fraction)
            gib = round(capacity * BLOCK_MIB / 1024, 1)
            for label, pools, routing, policy in variants:
                specs.append((name, capacity, pools, routing, policy, "instant"))
                key = "layout" if name == "mixed" else "policy"
                meta.append({"trace": name, "cache": fraction, "GiB": gib, key: label})
    results = _run_jobs(specs, jobs, progress)
    mixed = _TRACES["mixed"]
    exact = {
        "shared": _exact(mixed),
        "isolated": _exact(mixed, [r.instance for r in mixed]),
        # as replay() routes: by session, requests without one by instance
        "isolated-sticky": _exact(mixed, [route(r, 8, "sticky") for r in mixed]),
        "lru": _exact(_TRACES["scan"]),
    }
    exact["tinylfu"] = exact["lru"]
    rows = [
        m | r | exact[str(m.get("layout", m.get("policy")))]
        for m, r in zip(meta, results, strict=True)
    ]
    sharing = [r for r in rows if r["trace"] == "mixed"]
    ratios = {}
    for fraction in fractions:
        by = {r["layout"]: r for r in sharing if r["cache"] == fraction}
        iso = by["isolated"]["request_hit_rate"]
        ratios[str(fraction)] = round(by["shared"]["request_hit_rate"] / iso, 2)
    return {
        "seed": seed,
        "workload": dataclasses.asdict(workload),
        "scan_workload": SCAN,
        "distinct_blocks": distinct,
        "sharing": sharing,
        "shared_over_isolated_request_hit_rate": ratios,
        "scan": [r for r in rows if r["trace"] == "scan"],
        "hll_cost": hll_cost.measure(error_runs) if error_runs else None,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def print_tables(out: dict[str, object]) -> None:
    cols = ["cache", "GiB", "layout", "request_hit_rate", "block_hit_rate"]
    cols += ["hll_ceiling", "exact_ceiling", "first_query_ceiling", "replay_s"]
    print(f"\nShared vs isolated pools ({out['distinct_blocks']['mixed']:,} blocks)")
    print(table(out["sharing"], cols))
    ratios = out["shared_over_isolated_request_hit_rate"]
    print(f"shared / isolated request hit rate, by cache size: {ratios}")
    rows = [
        {k: r[k] for k in ("cache", "GiB", "policy", "request_hit_rate")}
        | {k: r[k] for k in ("block_hit_rate", "hll_ceiling", "resident_misses")}
        | {f"miss_{c}": r["miss_causes"][c] for c in CAUSES}
        for r in out["scan"]
    ]
    print("\nScan-heavy trace, one pool (misses as shares of queried blocks)")
    print(table(rows, list(rows[0])))
    if out["hll_cost"]:
        print(f"\nHLL cost and error: {out['hll_cost']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small workload")
    p.add_argument("--requests", type=int, help="override the request count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fractions", default="0.05,0.1,0.2,0.4")
    p.add_argument("--scan-fractions", default="0.05,0.1")
    p.add_argument("--jobs", type=int, default=1, help="replays run in parallel")
    p.add_argument("--error-runs", type=int, default=None, help="10M-hash HLL runs")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", help="output (default benchmarks/results/sharing.json)")
    args = p.parse_args()
    if os.environ.get("PYTHONHASHSEED") is None:  # TinyLFU hashes with hash()
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    workload = QUICK if args.quick else FULL
    if args.requests:
        workload = dataclasses.replace(workload, requests=args.requests)
    out = run(
        workload,
        args.seed,
        tuple(float(f) for f in args.fractions.split(",")),
        tuple(float(f) for f in args.scan_fractions.split(",")),
        args.jobs,
        not args.no_progress,
        args.error_runs if args.error_runs is not None else (1 if args.quick else 5),
    )
    out["command"] = " ".join(sys.argv)
    path = write_json("sharing", out, args.json)
    print_tables(out)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
