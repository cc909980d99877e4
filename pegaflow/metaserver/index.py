"""(namespace, block hash) -> owner nodes, sized for millions of entries.

A dict per namespace maps a hash (the bytes object itself, no copy) to a row;
numpy columns per row hold up to OWNERS_PER_BLOCK owner slots and when each
advertised it. An entry is one (block, owner) pair: --max-entries bounds them.
Whole-index work (dropping a node, TTL, eviction) is one vectorised pass over
the columns; only blocks left with no owner cost a Python step (their dict
key). Pure bookkeeping: no clock, no I/O; the caller passes `now`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import grpc
import numpy as np

from ..errors import PegaflowError
from .config import (
    MAX_BATCH_HASHES,
    MAX_NAMESPACES,
    MAX_NODES,
    OWNERS_PER_BLOCK,
)

logger = logging.getLogger(__name__)

NamespaceDigest = bytes
BlockHash = bytes
NodeSlot = int
Reason = Literal["ttl", "stale_node", "fenced", "left", "owner_slots", "removed"]
Plan = list[tuple[NodeSlot, int]]  # (owner slot, blocks) in prefix order

W = OWNERS_PER_BLOCK
EMPTY = -1
# Eviction frees this share of --max-entries at once (oldest first), so a full
# index pays one whole-index partition per 1/32 of its size in inserts.
EVICT_CHUNK_DIVISOR = 32
_START_ROWS = 1024


class TooManyNamespaces(PegaflowError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(slots=True)
class IndexCounters:
    inserted: int = 0
    refreshed: int = 0
    evicted: int = 0  # by --max-entries, oldest first
    dropped: Counter[str] = field(default_factory=Counter)  # by Reason


class BlockIndex:
    def __init__(
        self,
        max_entries: int,
        max_nodes: int = MAX_NODES,
        max_namespaces: int = MAX_NAMESPACES,
    ) -> None:
        self.max_entries = max_entries
        self.max_namespaces = max_namespaces
        self.entries = 0
        self.node_entries = np.zeros(max_nodes, np.int64)
        self.counters = IndexCounters()
        self._ns_ids: dict[NamespaceDigest, int] = {}
        self._maps: dict[int, dict[BlockHash, int]] = {}
        self._digests: dict[int, NamespaceDigest] = {}
        self._next_ns = 0
        self._owners = np.full((_START_ROWS, W), EMPTY, np.int32)
        self._times = np.full((_START_ROWS, W), np.inf)
        self._ns = np.zeros(_START_ROWS, np.int32)
        self._hash: list[BlockHash | None] = [None] * _START_ROWS
        self._hwm = 0  # rows [0, hwm) were used at least once
        self._free = np.empty(0, np.int64)

    @property
    def blocks(self) -> int:
        return self._hwm - len(self._free)

    @property
    def namespaces(self) -> int:
        return len(self._maps)

    def insert(
        self,
        digest: NamespaceDigest,
        hashes: list[BlockHash],
        slot: NodeSlot,
        now: float,
    ) -> tuple[int, int]:
        """Advertise: `slot` holds these blocks. (new entries, refreshed)."""
        if not hashes:
            return 0, 0
        hashes = list(dict.fromkeys(hashes))  # a repeated hash is one entry
        rows = self._rows_creating(self._namespace(digest), hashes)
        owners = self._owners[rows]
        has = owners == slot
        hit = has.any(1)
        way = has.argmax(1)
        miss = np.flatnonzero(~hit)
        if miss.size:
            way[miss] = self._ways_for(rows[miss], owners[miss])
        self._owners[rows, way] = slot
        self._times[rows, way] = now
        self.node_entries[slot] += miss.size
        self.entries += miss.size
        self.counters.inserted += miss.size
        self.counters.refreshed += len(hashes) - miss.size
        if self.entries > self.max_entries:
            self._evict(self.entries - self.max_entries)
        return int(miss.size), len(hashes) - int(miss.size)

    def remove(
        self, digest: NamespaceDigest, hashes: list[BlockHash], slot: NodeSlot
    ) -> int:
        """Withdraw: `slot` no longer holds these blocks. Entries removed."""
        rows = self._rows_found(digest, hashes)
        if rows.size == 0:
            return 0
        rows = np.unique(rows)
        at, ways = np.nonzero(self._owners[rows] == slot)
        return self._clear(rows[at] * W + ways, "removed")

    def drop_node(self, slot: NodeSlot, reason: Reason) -> int:
        """Every entry of `slot`. Entries dropped."""
        if self.node_entries[slot] == 0:
            return 0
        flat = np.flatnonzero(self._owners[: self._hwm].ravel() == slot)
        return self._clear(flat, reason)

    def expire(self, cutoff: float) -> int:
        """Entries advertised (or refreshed) before cutoff."""
        flat = np.flatnonzero(self._times[: self._hwm].ravel() < cutoff)
        return self._clear(flat, "ttl") if flat.size else 0

    def prefix(
        self, digest: NamespaceDigest, hashes: list[BlockHash], exclude: NodeSlot
    ) -> Plan:
        """The longest prefix that some owner other than `exclude` holds, as
        few (owner, blocks) segments as can cover it: at each segment's start
        the owner with the longest unbroken run from there."""
        block_map = self._maps.get(self._ns_ids.get(digest, -1))
        if block_map is None:
            return []
        get, found = block_map.get, []
        for h in hashes:
            row = get(h)
            if row is None:
                break
            found.append(row)
        if not found:
            return []
        # Column by column, not reductions along the short owner axis: numpy
        # is several times slower at those for a 1,000-hash query.
        owners = self._owners[np.fromiter(found, np.intp, len(found))]  # a copy
        if exclude >= 0:
            owners[owners == exclude] = EMPTY
        unowned = owners[:, 0].copy()  # EMPTY is -1, every bit set: AND is
        for way in range(1, W):  # EMPTY exactly where all W ways are
            unowned &= owners[:, way]
        gaps = np.flatnonzero(unowned == EMPTY)
        n = int(gaps[0]) if gaps.size else len(found)
        if n == 0:
            return []
        owners = owners[:n]
        top = owners.max()
        if ((owners == top) | (owners == EMPTY)).all():  # one owner: one segment
            return [(int(top), n)]
        nodes = np.unique(owners[owners >= 0]).tolist()
        holds = np.empty((len(nodes), n), bool)  # a row per node, contiguous
        for j, node in enumerate(nodes):
            held = holds[j]
            np.equal(owners[:, 0], node, out=held)
            for way in range(1, W):
                held |= owners[:, way] == node
        steps = np.arange(n)
        gap_at = np.where(holds, n, steps)  # a gap at its own index, else n
        next_gap = np.minimum.accumulate(gap_at[:, ::-1], axis=1)[:, ::-1]
        runs = next_gap - steps  # (node, start): blocks it holds unbroken
        plan: Plan = []
        i = 0
        while i < n:
            j = int(runs[:, i].argmax())
            got = int(runs[j, i])
            plan.append((nodes[j], got))
            i += got
        return plan

    def _namespace(self, digest: NamespaceDigest) -> int:
        ns = self._ns_ids.get(digest)
        if ns is None:
            if len(self._maps) >= self.max_namespaces:
                raise TooManyNamespaces(
                    f"blocks.namespace: {self.max_namespaces} namespaces held, "
                    "the most this metaserver takes"
                )
            ns, self._next_ns = self._next_ns, self._next_ns + 1
            self._ns_ids[digest], self._digests[ns], self._maps[ns] = ns, digest, {}
        return ns

    def _rows_found(
        self, digest: NamespaceDigest, hashes: list[BlockHash]
    ) -> np.ndarray:
        block_map = self._maps.get(self._ns_ids.get(digest, -1))
        if block_map is None:
            return np.empty(0, np.int64)
        get = block_map.get
        rows = np.array([get(h, EMPTY) for h in hashes], np.int64)
        return rows[rows >= 0]

    def _rows_creating(self, ns: int, hashes: list[BlockHash]) -> np.ndarray:
        block_map = self._maps[ns]
        get = block_map.get
        rows = np.array([get(h, EMPTY) for h in hashes], np.int64)
        new = np.flatnonzero(rows < 0)
        if new.size:
            fresh = self._alloc(new.size)
            rows[new] = fresh
            new_hashes = [hashes[i] for i in new.tolist()]
            block_map.update(zip(new_hashes, fresh.tolist(), strict=True))
            self._ns[fresh] = ns
            keep = self._hash
            for row, h in zip(fresh.tolist(), new_hashes, strict=True):
                keep[row] = h
        return rows

    def _ways_for(self, rows: np.ndarray, owners: np.ndarray) -> np.ndarray:
        """A way per row for a new owner: a free one, else the one advertised
        longest ago (that owner's entry is dropped, reason owner_slots)."""
        free = owners < 0
        any_free = free.any(1)
        ways = np.where(any_free, free.argmax(1), self._times[rows].argmin(1))
        full = np.flatnonzero(~any_free)
        if full.size:
            gone = owners[full, ways[full]]
            self.node_entries -= np.bincount(gone, minlength=self.node_entries.size)
            self.entries -= full.size
            self.counters.dropped["owner_slots"] += full.size
        return ways

    def _evict(self, need: int) -> None:
        count = min(max(need, self.max_entries // EVICT_CHUNK_DIVISOR), self.entries)
        times = self._times[: self._hwm].ravel()
        oldest = np.argpartition(times, count - 1)[:count]
        self._clear(oldest, None)

    def _clear(self, flat: np.ndarray, reason: Reason | None) -> int:
        """Empty these (row * W + way) entries; rows left with no owner free
        their block. reason None: an eviction."""
        rows, ways = np.divmod(flat, W)
        gone = self._owners[rows, ways]
        live = gone >= 0
        rows, ways, gone = rows[live], ways[live], gone[live]
        if gone.size == 0:
            return 0
        self._owners[rows, ways] = EMPTY
        self._times[rows, ways] = np.inf
        self.node_entries -= np.bincount(gone, minlength=self.node_entries.size)
        self.entries -= gone.size
        if reason is None:
            self.counters.evicted += gone.size
        else:
            self.counters.dropped[reason] += gone.size
        touched = np.unique(rows)
        self._free_blocks(touched[(self._owners[touched] < 0).all(1)])
        return int(gone.size)

    def _free_blocks(self, rows: np.ndarray) -> None:
        keep, maps = self._hash, self._maps
        for row, ns in zip(rows.tolist(), self._ns[rows].tolist(), strict=True):
            block_map = maps[ns]
            del block_map[keep[row]]
            keep[row] = None
            if not block_map:
                del maps[ns], self._ns_ids[self._digests.pop(ns)]
        self._free = np.concatenate([self._free, rows.astype(np.int64)])

    def _alloc(self, count: int) -> np.ndarray:
        reuse = min(count, len(self._free))
        rows = self._free[len(self._free) - reuse :]
        self._free = self._free[: len(self._free) - reuse]
        grow = count - reuse
        if grow:
            if self._hwm + grow > len(self._ns):
                # Doubling, but never far past what --max-entries can fill.
                ceiling = self.max_entries + MAX_BATCH_HASHES
                self._grow(max(min(2 * len(self._ns), ceiling), self._hwm + grow))
            rows = np.concatenate([rows, np.arange(self._hwm, self._hwm + grow)])
            self._hwm += grow
        return rows

    def _grow(self, size: int) -> None:
        old = len(self._ns)
        owners = np.full((size, W), EMPTY, np.int32)
        times = np.full((size, W), np.inf)
        ns = np.zeros(size, np.int32)
        owners[:old], times[:old], ns[:old] = self._owners, self._times, self._ns
        self._owners, self._times, self._ns = owners, times, ns
        self._hash.extend([None] * (size - old))
