"""Synthetic request traces for benchmarks/sharing.py: 8 engines of one model,
shared system prompts, multi-turn sessions and Zipf-popular documents; and a
scan-heavy variant (a hot set under bursts of one-off documents).

Sizes are in KV blocks of 16 tokens. Block hashes are chained like vLLM's
(blake2b over the parent hash and the block's content), so a prefix shared by two
requests has the same hashes in both. Everything derives from one seed.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import numpy as np

BlockHash = bytes


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int = 40_000
    rate_per_s: float = 12.0  # the seed's shared-pool throughput, for HLL windows
    instances: int = 8
    system_prompts: int = 64
    system_blocks: tuple[int, int] = (8, 128)  # 128 .. 2K tokens
    documents: int = 4000
    document_blocks: tuple[int, int] = (32, 256)  # 0.5K .. 4K tokens
    zipf_s: float = 1.1  # popularity of system prompts and documents
    doc_session_share: float = 0.5  # sessions about a document; the rest chat
    mean_turns: float = 3.0
    max_turns: int = 16
    user_blocks: tuple[int, int] = (1, 8)
    reply_blocks: tuple[int, int] = (2, 24)
    think_time_s: float = 60.0  # mean gap between a session's turns
    # scan variant: share of requests that are one-off documents, in bursts
    scan_share: float = 0.0
    scan_burst: int = 20


@dataclass(slots=True)
class Request:
    time_s: float
    session: int
    chain: list[BlockHash]  # the session's chain; grows as later turns append
    prompt_len: int  # this turn's prompt: chain[:prompt_len]
    total_len: int  # prompt + reply: chain[:total_len] is saved after the turn
    instance: int  # where a load balancer without session affinity sends it

    @property
    def prompt(self) -> list[BlockHash]:
        return self.chain[: self.prompt_len]


def _zipf(rng: np.random.Generator, n: int, s: float, size: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return rng.choice(n, size=size, p=weights / weights.sum())


@dataclass
class _Chains:
    """Hash chains of shared content, built on first use."""

    rng: np.random.Generator
    w: Workload
    counter: int = 0
    memo: dict[tuple, list[BlockHash]] = field(default_factory=dict)
    sizes: dict[tuple, int] = field(default_factory=dict)

    def extend(self, chain: list[BlockHash], content: tuple, n: int) -> None:
        parent = chain[-1] if chain else b""
        for j in range(n):
            ident = struct.pack("<16sqq", content[0].encode(), content[1], j)
            parent = hashlib.blake2b(parent + ident, digest_size=32).digest()
            chain.append(parent)

    def fresh(self, chain: list[BlockHash], n: int) -> None:
        self.counter += 1
        self.extend(chain, ("unique", self.counter), n)

    def prefix(self, system: int, doc: int | None) -> list[BlockHash]:
        key = (system, doc)
        if key not in self.memo:
            chain = list(self.prefix(system, None)) if doc is not None else []
            kind, ident, span = (
                ("doc", doc, self.w.document_blocks)
                if doc is not None
                else ("system", system, self.w.system_blocks)
            )
            size = self.sizes.setdefault((kind, ident), int(self.rng.integers(*span)))
            self.extend(chain, (kind, ident), size)
            self.memo[key] = chain
        return self.memo[key]


def make_trace(w: Workload, seed: int) -> list[Request]:
    """Sessions arrive uniformly over the trace; turns follow after think time."""
    rng = np.random.default_rng(seed)
    chains = _Chains(rng, w)
    duration = w.requests / w.rate_per_s
    sessions = int(w.requests / w.mean_turns * 1.2) + 1
    turns = np.minimum(rng.geometric(1 / w.mean_turns, sessions), w.max_turns)
    starts = rng.uniform(0, duration, sessions)
    is_doc = rng.random(sessions) < w.doc_session_share
    systems = _zipf(rng, w.system_prompts, w.zipf_s, sessions)
    docs = _zipf(rng, w.documents, w.zipf_s, sessions)
    events = []  # (time, session, turn)
    for s in range(sessions):
        gaps = rng.exponential(w.think_time_s, turns[s])
        gaps[0] = 0.0
        for turn, t in enumerate(starts[s] + np.cumsum(gaps)):
            events.append((float(t), s, turn))
    events.sort()
    events = events[: w.requests]
    trace, open_chains = [], {}
    for t, s, _turn in events:
        chain = open_chains.get(s)
        if chain is None:
            chain = list(
                chains.prefix(int(systems[s]), int(docs[s]) if is_doc[s] else None)
            )
            open_chains[s] = chain
        chains.fresh(chain, int(rng.integers(*w.user_blocks)))
        prompt_len = len(chain)
        chains.fresh(chain, int(rng.integers(*w.reply_blocks)))
        instance = int(rng.integers(w.instances))
        trace.append(Request(t, s, chain, prompt_len, len(chain), instance))
    return _with_scans(trace, w, rng, chains) if w.scan_share > 0 else trace


def _with_scans(
    trace: list[Request], w: Workload, rng: np.random.Generator, chains: _Chains
) -> list[Request]:
    """Replace a share of requests by bursts of one-off documents: a batch job
    reading each document once (a scan through the cache)."""
    out: list[Request] = []
    i = 0
    while len(out) < len(trace):
        if rng.random() < w.scan_share / w.scan_burst:
            for _ in range(w.scan_burst):
                chain: list[BlockHash] = []
                chains.fresh(chain, int(rng.integers(*w.document_blocks)))
                n = len(chain)
                t = trace[min(i, len(trace) - 1)].time_s
                out.append(Request(t, -1, chain, n, n, int(rng.integers(w.instances))))
        else:
            out.append(trace[i])
            i += 1
    return out[: len(trace)]


def exact_ceilings(
    trace: list[Request], pools: list[int] | None = None
) -> tuple[float, float]:
    """Exact (r*, infinite-cache hit rate); with pools, per pool (isolated).

    r* = (N - U) / N counts each block's first *query* as a miss. An infinite
    cache also hits blocks that a save put there before their first query (a
    reply, queried in the next turn), so its hit rate can lie above r*: that
    is what the server's ceiling estimates (pegaflow.cache.miss_reasons).
    """
    queried: dict[int, set[BlockHash]] = {}
    saved: dict[int, set[BlockHash]] = {}
    n = first_queries = infinite_misses = 0
    for i, req in enumerate(trace):
        pool = pools[i] if pools else 0
        q, s = queried.setdefault(pool, set()), saved.setdefault(pool, set())
        prompt = req.prompt
        n += len(prompt)
        before = len(q)
        q.update(prompt)
        first_queries += len(q) - before
        infinite_misses += sum(h not in s for h in prompt)
        s.update(req.chain[: req.total_len])
    if not n:
        return 0.0, 0.0
    return (n - first_queries) / n, (n - infinite_misses) / n
