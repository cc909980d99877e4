"""Why queried blocks missed, and the hit-rate ceiling, per namespace.

Every queried block is a hit from a tier (ram, ssd or remote) or a miss with
exactly one cause, so hits + misses by cause = queried:
- remote: the metaserver named a peer holding it, but it was not fetched (the
  peer was dead, slow, had evicted it, or sent bytes that failed their check),
- admission: TinyLFU refused it recently,
- capacity: it was evicted recently,
- pool_full: a save of it found no free slot recently (every block pinned),
- compulsory: none of those is remembered: never stored here, or refused or
  evicted longer ago than the ghost table remembers.
A ready block behind the first miss of a prefix misses because of that block
(chained hashes stop the prefix there), so it takes that block's cause; it is
also counted as `resident`, a sign that eviction broke prefixes in the middle.

The ceiling's distinct count takes only blocks seen here for the first time: a
hit was saved before, and so was a miss the ghost table remembers (evicted or
refused) or one still resident behind a prefix's first miss; the rest, first
queried before any save, are what even an infinite cache would miss. So the
ceiling is that cache's hit rate, and never below the measured one.

The query path only appends to a log. flush() (the sweeper each second, a stats
read, or a full log) replays it in order in vectorised batches, so each miss is
classified against the ghost table as it stood when the query ran.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from typing import Literal

import numpy as np

from pegaflow.common.hash64 import hash64, hash64_batches, splitmix64
from pegaflow.common.keys import Key, Namespace, PackedHashes
from pegaflow.common.settings import HitRateConfig

from .eviction import EvictionPolicy, Protected
from .hll import WindowSet, WindowStats
from .store_events import StoreListener

Cause = Literal["compulsory", "capacity", "admission", "pool_full", "remote"]
CAUSES: tuple[Cause, ...] = (
    "compulsory",
    "capacity",
    "admission",
    "pool_full",
    "remote",
)
# The ghost table keeps causes in 2 bits: 0..3. REMOTE comes from the probe.
COMPULSORY, CAPACITY, ADMISSION, POOL_FULL, REMOTE = range(5)
HIT_TIERS = ("ram", "ssd", "remote")
# (namespace id, missed block hashes) -> bool mask: which ones a peer holds. It is
# asked at flush time (<= ~1 s after the query), off the query path.
RemoteProbe = Callable[[int, list[bytes]], np.ndarray]
# Logged hashes before a flush is scheduled: ~0.5 ms of loop time on the dev VM,
# so no query waits long behind one.
_MAX_PENDING = 1 << 14


def fingerprints(ns_ids: np.ndarray, h64: np.ndarray) -> np.ndarray:
    """64-bit block keys: hash bits salted by namespace (equal hashes, other
    namespace, other key)."""
    return h64 ^ splitmix64(ns_ids)


class GhostTable:
    """Recently evicted or refused keys with the reason, in about 2**bits slots.

    Set-associative: a key's top bits name a set of WAYS slots, a key already in
    its set is updated in place, a new one takes the set's oldest slot. So a record
    survives until WAYS later new keys land in its set: about 2**bits later
    records on average, and a run of 2**bits / 8 all but once in 10**5 (the
    direct-mapped table this replaced lost one of 64 records in six runs of
    192 in 65536 slots). A slot keeps the whole fingerprint (the low 2 bits hold
    the cause), so a lookup never confuses two keys.
    """

    WAYS = 8

    def __init__(self, bits: int) -> None:
        set_bits = bits - self.WAYS.bit_length() + 1
        if set_bits < 1:
            raise ValueError(f"bits must be >= {self.WAYS.bit_length()}, got {bits}")
        self._table = np.zeros((1 << set_bits, self.WAYS), np.uint64)
        self._next_way = np.zeros(1 << set_bits, np.int64)  # FIFO cursor per set
        self._shift = np.uint64(64 - set_bits)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes + self._next_way.nbytes

    def add(self, fps: np.ndarray, causes: np.ndarray) -> None:
        keys = fps & ~np.uint64(3)
        # One slot per key even when a batch repeats it: its last record wins.
        _, last = np.unique(keys[::-1], return_index=True)
        keep = np.sort(len(keys) - 1 - last)
        keys, causes = keys[keep], causes[keep]
        sets = (keys >> self._shift).astype(np.intp)
        match = (self._table[sets] ^ keys[:, None]) < np.uint64(4)
        found = match.any(axis=1)
        ways = match.argmax(axis=1)
        new_sets = sets[~found]
        if len(new_sets):
            # The k-th new key of a set in this batch takes the cursor + k.
            order = np.argsort(new_sets, kind="stable")
            grouped = new_sets[order]
            rank = np.empty_like(order)
            rank[order] = np.arange(len(grouped)) - np.searchsorted(grouped, grouped)
            ways[~found] = (self._next_way[new_sets] + rank) % self.WAYS
            np.add.at(self._next_way, new_sets, 1)
        # Fancy assignment writes in order: a set that got more new keys than it
        # has ways keeps the latest ones.
        self._table[sets, ways] = keys | causes

    def lookup(self, fps: np.ndarray) -> np.ndarray:
        stored = self._table[(fps >> self._shift).astype(np.intp)]
        known = (stored ^ fps[:, None]) < np.uint64(4)  # equal but for the cause bits
        causes = (stored & np.uint64(3)) * known
        return causes.max(axis=1).astype(np.uint8)  # a key sits in one way at most


class RecordingPolicy:
    """An EvictionPolicy that tells the tracker what it evicts or refuses."""

    def __init__(self, inner: EvictionPolicy, tracker: HitRateTracker) -> None:
        self._inner = inner
        self._tracker = tracker
        # Bound straight through: the query path calls touch_many, no extra frame.
        self.insert = inner.insert
        self.insert_many = inner.insert_many
        self.insert_cold_many = inner.insert_cold_many
        self.touch = inner.touch
        self.touch_many = inner.touch_many
        self.remove = inner.remove
        self.expect = inner.expect
        self.victims = inner.victims
        self.unpark = inner.unpark

    @property
    def parked(self) -> Container[Key]:
        return self._inner.parked

    def evict(self, n: int, protected: Protected, park: bool = False) -> list[Key]:
        victims = self._inner.evict(n, protected, park)
        if victims:
            self._tracker.record_many(CAPACITY, victims)
        return victims

    def evict_these(self, keys: Sequence[Key]) -> None:
        self._inner.evict_these(keys)
        self._tracker.record_many(CAPACITY, list(keys))

    def admitter(self, protected: Protected) -> Callable[[Key], bool]:
        inner = self._inner.admitter(protected)

        def admit(candidate: Key) -> bool:
            admitted = inner(candidate)
            if not admitted:
                self._tracker.record(ADMISSION, candidate)
            return admitted

        return admit

    def __len__(self) -> int:
        return len(self._inner)

    def __contains__(self, key: object) -> bool:
        return key in self._inner


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    tag: str  # pegaflow.cache.instances.namespace_tag: never the namespace's name
    hits: dict[str, int]  # by tier
    misses: dict[str, int]  # by cause
    resident_misses: int
    windows: dict[str, WindowStats]

    def to_dict(self) -> dict[str, object]:
        wins = {
            label: {
                "requests": w.requests,
                "hits": w.hits,
                "unique": round(w.unique, 1),
                "hit_rate": w.hit_rate,
                "ceiling": w.ceiling,
            }
            for label, w in self.windows.items()
        }
        return {
            "tag": self.tag,
            "hits": self.hits,
            "misses": self.misses,
            "resident_misses": self.resident_misses,
            "windows": wins,
        }


@dataclass(slots=True)
class _Namespace:
    tag: str
    windows: WindowSet
    hits: np.ndarray = field(default_factory=lambda: np.zeros(3, np.int64))
    causes: np.ndarray = field(default_factory=lambda: np.zeros(5, np.int64))
    resident: int = 0


# Hashes as a query brings them: a list (gRPC), or packed (the fast path), whose
# hash64 the index probe computed already and whose bytes are never decoded
# unless a remote probe asks for the misses.
Hashes = Sequence[bytes] | PackedHashes
# A logged query: (namespace, hashes, hits, readiness of the blocks past the
# prefix, length, hits of those from ssd, hits of those from peers)
_Query = tuple[Namespace, Hashes, int, np.ndarray, "int | None", int, int]


class HitRateTracker(StoreListener):
    def __init__(
        self,
        config: HitRateConfig,
        ghost_bits: int = 20,
        clock: Callable[[], float] = time.monotonic,
        remote: RemoteProbe | None = None,
    ) -> None:
        self.config = config
        self.ghost = GhostTable(ghost_bits)
        self._clock = clock
        self.remote = remote  # set once the remote tier is up
        self._namespaces: dict[int, _Namespace] = {}
        self._log: list[tuple] = []
        self._pending = 0
        self._flush_scheduled = False

    @staticmethod
    def ghost_bits_for(pool_bytes: int) -> int:
        """Remember ~4 pools' worth of blocks (at ~1 MiB a block), 64K..16M slots."""
        blocks = max(1, pool_bytes >> 20)
        return min(24, max(16, (4 * blocks - 1).bit_length()))

    # -- the query and save paths: appends only --------------------------------
    def query(
        self,
        ns: Namespace,
        hashes: Hashes,
        hits: int,
        rest: np.ndarray,
        hash_len: int | None = None,
        ssd: int = 0,
        remote: int = 0,
    ) -> None:
        """rest: whether each block past the prefix is ready (see
        BlockStore.lookup). hits counts every tier; `ssd` of them came from the
        SSD tier, `remote` from peers."""
        self._log.append((ns, hashes, hits, rest, hash_len, ssd, remote))
        self._pending += len(hashes)
        if self._pending >= _MAX_PENDING:
            self._flush_soon()

    def record(self, cause: int, key: Key) -> None:
        self._log.append((cause, key))
        self._pending += 1

    def record_many(self, cause: int, keys: Sequence[Key]) -> None:
        self._log.extend(zip(repeat(cause), keys))
        self._pending += len(keys)

    def pool_full(self, keys: Sequence[Key]) -> None:
        """Saves refused for want of a free slot (a BlockStore event)."""
        self.record_many(POOL_FULL, keys)

    def _flush_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if not self._flush_scheduled:  # after this RPC's reply, not inside it
            self._flush_scheduled = True
            loop.call_soon(self.flush)

    # -- batch work -----------------------------------------------------------
    def flush(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        log, self._log = self._log, []
        self._pending, self._flush_scheduled = 0, False
        for is_record, run in groupby(log, key=lambda e: type(e[0]) is int):
            if is_record:
                self._remember(list(run))
            else:
                self._count(list(run), now)

    def _remember(self, run: list[tuple[int, Key]]) -> None:
        keys = [key for _, key in run]
        ns_ids = np.fromiter((k[0] for k in keys), np.uint64, len(keys))
        h64 = hash64([k[1] for k in keys])
        causes = np.fromiter((c for c, _ in run), np.uint64, len(run))
        self.ghost.add(fingerprints(ns_ids, h64), causes)

    def _count(self, run: list[_Query], now: float) -> None:
        by_ns: dict[int, list[_Query]] = {}
        for event in run:
            by_ns.setdefault(event[0].id, []).append(event)
        for ns_id, events in by_ns.items():
            state = self._namespaces.get(ns_id)
            if state is None:
                windows = WindowSet(self.config.windows_s, self.config.bucket_bits)
                state = self._namespaces[ns_id] = _Namespace(events[0][0].tag, windows)
            h64 = self._hash64(events)
            hits = sum(e[2] for e in events)
            first_seen = self._classify(state, ns_id, h64, events)
            state.windows.add(first_seen, hits, now, requests=len(h64))
            from_ssd = sum(e[5] for e in events)
            from_peers = sum(e[6] for e in events)
            state.hits[0] += hits - from_ssd - from_peers
            state.hits[1] += from_ssd
            state.hits[2] += from_peers

    def _classify(
        self, state: _Namespace, ns_id: int, h64: np.ndarray, events: list[_Query]
    ) -> np.ndarray:
        """Count the misses by cause; the hash64 of those seen for the first
        time (for the ceiling's distinct count)."""
        sizes = np.fromiter((len(e[1]) for e in events), np.int64, len(events))
        hits = np.fromiter((e[2] for e in events), np.int64, len(events))
        missed = sizes - hits
        total = int(missed.sum())
        if total == 0:
            return h64[:0]
        # Position in h64 of every missed block; first: its query's first miss.
        starts = np.cumsum(sizes) - sizes + hits
        first = np.repeat(np.cumsum(missed) - missed, missed)
        pos = np.arange(total) + np.repeat(starts, missed) - first
        ids = np.full(total, ns_id, np.uint64)
        causes = self.ghost.lookup(fingerprints(ids, h64[pos]))
        new = causes == COMPULSORY  # not stored nor offered here recently
        if self.remote is not None:
            missed_hashes = [h for e in events for h in _listed(e[1])[e[2] :]]
            causes[self.remote(ns_id, missed_hashes)] = REMOTE
        resident = self._resident(events)
        if resident is not None:
            causes = np.where(resident, causes[first], causes)
            state.resident += int(resident.sum())
            new &= ~resident
        state.causes += np.bincount(causes, minlength=len(CAUSES))
        return h64[pos][new]

    @staticmethod
    def _hash64(events: list[_Query]) -> np.ndarray:
        """hash64 of every logged hash, in order; packed queries bring theirs."""
        parts: list[np.ndarray] = []
        for packed, run in groupby(events, key=lambda e: type(e[1]) is PackedHashes):
            batch = list(run)
            if packed:
                parts += [e[1].h64 for e in batch]
                continue
            lens = {e[4] for e in batch}
            parts.append(
                hash64_batches(
                    [e[1] for e in batch], lens.pop() if len(lens) == 1 else None
                )
            )
        return np.concatenate(parts)

    @staticmethod
    def _resident(events: list[_Query]) -> np.ndarray | None:
        """Which missed blocks were ready behind their prefix's first miss;
        None when none was (the usual case)."""
        if not any(e[3].any() for e in events):
            return None
        return np.concatenate([e[3] for e in events])

    # -- reading --------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> list[NamespaceStats]:
        now = self._clock() if now is None else now
        self.flush(now)
        labels = self.config.labels
        return [
            NamespaceStats(
                s.tag,
                dict(zip(HIT_TIERS, s.hits.tolist(), strict=True)),
                dict(zip(CAUSES, s.causes.tolist(), strict=True)),
                s.resident,
                dict(zip(labels, s.windows.stats(now), strict=True)),
            )
            for s in self._namespaces.values()
        ]

    def forget(self, ns_id: int) -> None:
        """Drop a namespace's counters and windows (it was freed, or idle past
        the bound). Its logged queries are replayed first, so none of them
        brings the state back; a namespace that returns starts from zero."""
        if self._log:
            self.flush()
        self._namespaces.pop(ns_id, None)

    def __contains__(self, ns_id: int) -> bool:
        return ns_id in self._namespaces

    @property
    def nbytes(self) -> int:
        return self.ghost.nbytes + sum(
            s.windows.nbytes for s in self._namespaces.values()
        )


def _listed(hashes: Hashes) -> Sequence[bytes]:
    return hashes.list() if isinstance(hashes, PackedHashes) else hashes
