"""LRU, LRU + TinyLFU, prefix-aware eviction and prefix-aware + TinyLFU: token
hit rates of one shared pool on four traces, replayed through the real block
store and policies as benchmarks/sharing.py replays them (its Pool, traces and
replay; no bytes moved).

    python benchmarks/sharing_eviction.py --quick --requests 4000 --jobs 2
    python benchmarks/sharing_eviction.py --quick --oracle --timings served

Traces: multi-turn chat, one-turn questions over shared documents, and
sharing.py's mixed and scan traces. Pools: --fractions of each trace's distinct
blocks (1/4 and 1/8). Timings: "served" saves a request's prompt after its
prefill and its reply a block at a time as decode completes it (vLLM with
save_decode), other requests going on in between; "instant" saves right after
the query. --oracle adds prefix-aware eviction told every saved block's true
parent: the most that learning parents from arrival order could gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import sharing  # noqa: E402
from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.sharing_trace import Workload, make_trace  # noqa: E402

# Long sessions of chat, and one-turn questions over documents (long shared
# prefixes, short unique tails); the mixed and scan traces of sharing.py.
MULTITURN = {"doc_session_share": 0.0, "mean_turns": 8.0, "max_turns": 32}
SHARED_PREFIX = {
    "doc_session_share": 1.0,
    "mean_turns": 1.0,
    "user_blocks": (1, 4),
    "reply_blocks": (1, 8),
}
EVICTION_TRACES = {
    "multiturn": MULTITURN,
    "shared-prefix": SHARED_PREFIX,
    "mixed": {},
    "scan": sharing.SCAN,
}
EVICTION_POLICIES = ("lru", "tinylfu", "prefix", "prefix+tinylfu")


def run_eviction(
    workload: Workload = sharing.QUICK,
    seed: int = 0,
    fractions: tuple[float, ...] = (0.25, 0.125),
    jobs: int = 1,
    progress: bool = False,
    timings: tuple[sharing.Timing, ...] = ("served", "instant"),
    policies: tuple[str, ...] = EVICTION_POLICIES,
) -> dict[str, object]:
    """LRU, TinyLFU, prefix-aware and both, one shared pool of a fraction of
    each trace's distinct blocks (its working set), with each timing."""
    start = time.perf_counter()
    for name, overrides in EVICTION_TRACES.items():
        sharing._TRACES[name] = make_trace(
            dataclasses.replace(workload, **overrides), seed
        )
    specs: list[sharing.Spec] = []
    meta: list[dict[str, object]] = []
    for timing in timings:
        for name in EVICTION_TRACES:
            distinct = sharing.distinct_blocks(sharing._TRACES[name])
            for fraction in fractions:
                capacity = sharing.capacity_for(distinct, fraction)
                for policy in policies:
                    specs.append((name, capacity, 1, "random", policy, timing))
                    meta.append(
                        {"timing": timing, "trace": name, "cache": fraction}
                        | {"blocks": capacity, "policy": policy}
                    )
    results = sharing._run_jobs(specs, jobs, progress)
    rows = [m | r for m, r in zip(meta, results, strict=True)]
    return {
        "seed": seed,
        "workload": dataclasses.asdict(workload),
        "traces": EVICTION_TRACES,
        "decode_s_per_block": sharing.DECODE_S_PER_BLOCK,
        "prefill_s_per_block": sharing.PREFILL_S_PER_BLOCK,
        "rows": rows,
        "gains": eviction_gains(rows),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def eviction_gains(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each prefix-aware row against its baseline (LRU, or LRU + TinyLFU)."""
    same = ("timing", "trace", "cache")
    gains = []
    for row in rows:
        if not str(row["policy"]).startswith("prefix"):
            continue
        base = "tinylfu" if "tinylfu" in str(row["policy"]) else "lru"
        (ref,) = (
            r for r in rows if r["policy"] == base and all(r[k] == row[k] for k in same)
        )
        rate, ref_rate = row["token_hit_rate"], ref["token_hit_rate"]
        gains.append(
            {k: row[k] for k in (*same, "policy", "token_hit_rate")}
            | {"baseline": base, "baseline_token_hit_rate": ref_rate}
            | {"relative_gain": round(rate / max(1e-9, ref_rate) - 1, 4)}
        )
    return gains


def print_eviction(out: dict[str, object]) -> None:
    cols = ["timing", "trace", "cache", "blocks", "policy", "token_hit_rate"]
    cols += ["request_hit_rate", "evictions", "replay_s"]
    print("\nEviction policies, one shared pool")
    print(table(out["rows"], cols))
    print("\nPrefix-aware over its baseline (relative token hit rate)")
    print(table(out["gains"], list(out["gains"][0])))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small workload")
    p.add_argument("--requests", type=int, help="override the request count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fractions", default="0.25,0.125")
    p.add_argument("--jobs", type=int, default=1, help="replays run in parallel")
    p.add_argument(
        "--oracle",
        action="store_true",
        help="also prefix-aware eviction told every block's true parent",
    )
    p.add_argument("--timings", default="served,instant", help="served, instant")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", help="default benchmarks/results/sharing_eviction.json")
    args = p.parse_args()
    if os.environ.get("PYTHONHASHSEED") is None:  # TinyLFU hashes with hash()
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    workload = sharing.QUICK if args.quick else sharing.FULL
    if args.requests:
        workload = dataclasses.replace(workload, requests=args.requests)
    out = run_eviction(
        workload,
        args.seed,
        tuple(float(f) for f in args.fractions.split(",")),
        args.jobs,
        not args.no_progress,
        tuple(args.timings.split(",")),
        EVICTION_POLICIES + (("prefix-oracle",) if args.oracle else ()),
    )
    out["command"] = " ".join(sys.argv)
    path = write_json("sharing_eviction", out, args.json)
    print_eviction(out)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
