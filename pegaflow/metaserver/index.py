"""(namespace, block hash) -> owner nodes, sized for millions of entries.

A numpy hash table (pegaflow.metaserver.table) maps (namespace, hash) to a row;
numpy columns per row hold up to OWNERS_PER_BLOCK owner slots and when each
advertised it. An entry is one (block, owner) pair: --max-entries bounds them.
Every operation is vectorised over its hashes or the columns, with no Python
step per hash or block. Pure bookkeeping: no clock, no I/O; the caller
passes `now`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import grpc
import numpy as np

from pegaflow.common.errors import PegaflowError
from pegaflow.common.keys import BlockHash, NamespaceDigest, PackedHashes

from . import compiled as compiled_loops
from .meta_config import MAX_BATCH_HASHES, MAX_NAMESPACES, MAX_NODES, OWNERS_PER_BLOCK
from .node_cells import NodeCells
from .nodes import NodeSlot
from .table import Keys, RowTable

logger = logging.getLogger(__name__)

Reason = Literal["ttl", "stale_node", "fenced", "left", "owner_slots", "removed"]
Plan = list[tuple[NodeSlot, int]]  # (owner slot, blocks) in prefix order
Hashes = PackedHashes | list[BlockHash]  # the wire's, or any list (tests)

W = OWNERS_PER_BLOCK
EMPTY = -1
# Eviction frees this share of --max-entries at once (oldest first), so a full
# index pays one whole-index partition per 1/32 of its size in inserts.
EVICT_CHUNK_DIVISOR = 32
_START_ROWS = 1024
# A plan over this many owner nodes or fewer walks a [nodes, blocks] matrix
# (fastest for a few: 53 against 90 us, 1,000 hashes, 2 nodes, dev VM); over
# more, the held entries (memory ∝ blocks: 65,536 hashes over 512 nodes took
# 807 MiB and 4 s the matrix way, 10 ms the entry way).
DENSE_PLAN_NODES = 8


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
        compiled: bool = True,
    ) -> None:
        """compiled: lookups and plans by metaserver.compiled's loops where
        numba is installed (the numpy code is their reference)."""
        self.max_entries = max_entries
        self.max_namespaces = max_namespaces
        self.entries = 0
        self.node_entries = np.zeros(max_nodes, np.int64)
        self._cells = NodeCells(max_nodes)
        self.counters = IndexCounters()
        self._ns_ids: dict[NamespaceDigest, int] = {}
        self._ns_blocks: dict[int, int] = {}  # blocks held per live namespace
        self._digests: dict[int, NamespaceDigest] = {}
        self._next_ns = 0
        self._owners = np.full((_START_ROWS, W), EMPTY, np.int32)
        self._times = np.full((_START_ROWS, W), np.inf)
        self._table = RowTable(compiled)
        self._table.grow_rows(_START_ROWS)
        self._compiled_plan = compiled_loops.plan() if compiled else None
        self._hwm = 0  # rows [0, hwm) were used at least once
        self._free = np.empty(0, np.int64)

    @property
    def blocks(self) -> int:
        return self._hwm - len(self._free)

    @property
    def namespaces(self) -> int:
        return len(self._ns_blocks)

    def insert(
        self, digest: NamespaceDigest, hashes: Hashes, slot: NodeSlot, now: float
    ) -> tuple[int, int]:
        """Advertise: `slot` holds these blocks. (new entries, refreshed)."""
        if not len(hashes):
            return 0, 0
        keys = _distinct(Keys.of(hashes))  # a repeated hash is one entry
        rows = self._rows_creating(self._namespace(digest), keys)
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
        given = rows[miss] * W + way[miss]
        self._cells.add(slot, given, self._owners.ravel(), self.node_entries[slot])
        self.entries += miss.size
        self.counters.inserted += miss.size
        self.counters.refreshed += keys.count - miss.size
        if self.entries > self.max_entries:
            self._evict(self.entries - self.max_entries)
        return int(miss.size), keys.count - int(miss.size)

    def remove(self, digest: NamespaceDigest, hashes: Hashes, slot: NodeSlot) -> int:
        """Withdraw: `slot` no longer holds these blocks. Entries removed."""
        rows = self._rows_found(digest, hashes)
        if rows.size == 0:
            return 0
        rows = np.unique(rows)
        at, ways = np.nonzero(self._owners[rows] == slot)
        return self._clear(rows[at] * W + ways, "removed")

    def drop_node(self, slot: NodeSlot, reason: Reason) -> int:
        """Every entry of `slot`. Entries dropped."""
        return self.drop_nodes([slot], reason)

    def drop_nodes(self, slots: list[NodeSlot], reason: Reason) -> int:
        """Every entry of these slots, in O(their entries): no pass over the
        whole index (node_cells). Entries dropped."""
        held = [s for s in slots if self.node_entries[s]]
        flat = self._cells.take(held, self._owners.ravel())
        return self._clear(flat, reason) if flat.size else 0

    def expire(self, cutoff: float, start: int = 0, stop: int | None = None) -> int:
        """Entries advertised (or refreshed) before cutoff, of rows
        [start, stop) (the caller may walk the index in slices)."""
        stop = self._hwm if stop is None else min(stop, self._hwm)
        if start >= stop:
            return 0
        flat = np.flatnonzero(self._times[start:stop].ravel() < cutoff)
        return self._clear(flat + start * W, "ttl") if flat.size else 0

    @property
    def rows_used(self) -> int:
        """Rows [0, rows_used) were used at least once (expire's range)."""
        return self._hwm

    def prefix(
        self, digest: NamespaceDigest, hashes: Hashes, exclude: NodeSlot
    ) -> Plan:
        """The longest prefix that some owner other than `exclude` holds, as
        few (owner, blocks) segments as can cover it: at each segment's start
        the owner with the longest unbroken run from there."""
        ns = self._ns_ids.get(digest)
        if ns is None or not len(hashes):
            return []
        rows = self._table.find(ns, Keys.of(hashes))
        if self._compiled_plan is not None:
            nodes, blocks = np.empty((2, len(rows)), np.int64)
            count = self._compiled_plan(rows, self._owners, exclude, nodes, blocks)
            segments = nodes[:count].tolist(), blocks[:count].tolist()
            return list(zip(*segments, strict=True))
        if rows.min() < 0:
            rows = rows[: int((rows < 0).argmax())]  # up to the first miss
        if not len(rows):
            return []
        # Column by column, not reductions along the short owner axis: numpy
        # is several times slower at those for a 1,000-hash query.
        owners = self._owners[rows]  # a copy
        if exclude >= 0:
            owners[owners == exclude] = EMPTY
        unowned = owners[:, 0].copy()  # EMPTY is -1, every bit set: AND is
        for way in range(1, W):  # EMPTY exactly where all W ways are
            unowned &= owners[:, way]
        gaps = np.flatnonzero(unowned == EMPTY)
        n = int(gaps[0]) if gaps.size else len(rows)
        if n == 0:
            return []
        owners = owners[:n]
        top = owners.max()
        if ((owners == top) | (owners == EMPTY)).all():  # one owner: one segment
            return [(int(top), n)]
        nodes = np.unique(owners[owners >= 0]).tolist()
        if len(nodes) <= DENSE_PLAN_NODES:
            return _plan_by_node(owners, nodes)
        return _plan_by_entry(owners)

    def _namespace(self, digest: NamespaceDigest) -> int:
        ns = self._ns_ids.get(digest)
        if ns is None:
            if len(self._ns_blocks) >= self.max_namespaces:
                raise TooManyNamespaces(
                    f"blocks.namespace: {self.max_namespaces} namespaces held, "
                    "the most this metaserver takes"
                )
            ns, self._next_ns = self._next_ns, self._next_ns + 1
            self._ns_ids[digest], self._digests[ns] = ns, digest
            self._ns_blocks[ns] = 0
        return ns

    def _rows_found(self, digest: NamespaceDigest, hashes: Hashes) -> np.ndarray:
        ns = self._ns_ids.get(digest)
        if ns is None or not len(hashes):
            return np.empty(0, np.int64)
        rows = self._table.find(ns, Keys.of(hashes))
        return rows[rows >= 0]

    def _rows_creating(self, ns: int, keys: Keys) -> np.ndarray:
        rows = self._table.find(ns, keys)
        new = np.flatnonzero(rows < 0)
        if new.size:
            fresh = self._alloc(new.size)
            rows[new] = fresh
            self._table.add(ns, keys.take(new), fresh)
            self._ns_blocks[ns] += new.size
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
        if not rows.size:
            return
        self._table.discard(rows)
        spaces, counts = np.unique(self._table.namespace_of(rows), return_counts=True)
        for ns, count in zip(spaces.tolist(), counts.tolist(), strict=True):
            self._ns_blocks[ns] -= count  # a step per namespace, not per block
            if not self._ns_blocks[ns]:
                del self._ns_blocks[ns], self._ns_ids[self._digests.pop(ns)]
        self._free = np.concatenate([self._free, rows.astype(np.int64)])

    def _alloc(self, count: int) -> np.ndarray:
        reuse = min(count, len(self._free))
        rows = self._free[len(self._free) - reuse :]
        self._free = self._free[: len(self._free) - reuse]
        grow = count - reuse
        if grow:
            if self._hwm + grow > len(self._owners):
                # Doubling, but never far past what --max-entries can fill.
                ceiling = self.max_entries + MAX_BATCH_HASHES
                self._grow(max(min(2 * len(self._owners), ceiling), self._hwm + grow))
            rows = np.concatenate([rows, np.arange(self._hwm, self._hwm + grow)])
            self._hwm += grow
        return rows

    def _grow(self, size: int) -> None:
        old = len(self._owners)
        owners = np.full((size, W), EMPTY, np.int32)
        times = np.full((size, W), np.inf)
        owners[:old], times[:old] = self._owners, self._times
        self._owners, self._times = owners, times
        self._table.grow_rows(size)


def _distinct(keys: Keys) -> Keys:
    """keys without repeats, first occurrences in order. Most batches have
    none: one sort of the 8-byte heads says so."""
    heads = np.sort(keys.words[:, 0])
    if keys.count < 2 or (heads[1:] != heads[:-1]).all():
        return keys
    whole = np.column_stack([keys.words, keys.lens.astype(np.uint64)])
    _, first = np.unique(whole, axis=0, return_index=True)
    return keys.take(np.sort(first))


def _plan_by_node(owners: np.ndarray, nodes: list[int]) -> Plan:
    """Runs per (node, start) from a [nodes, blocks] matrix; ties go to the
    lowest node slot."""
    n = len(owners)
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
    while i < n:  # a column's argmax per segment: cheaper than all columns'
        j = int(runs[:, i].argmax())
        got = int(runs[j, i])
        plan.append((nodes[j], got))
        i += got
    return plan


def _plan_by_entry(owners: np.ndarray) -> Plan:
    """The same plan from the held (block, owner) entries alone: sorted by
    owner (stable: blocks stay in order), each entry's unbroken run ends where
    its owner's next block is missing; ties go to the lowest node slot."""
    n = len(owners)
    rows, ways = np.nonzero(owners >= 0)  # row-major: blocks in order
    who = owners[rows, ways]
    order = np.argsort(who, kind="stable")
    o, r = who[order], rows[order]
    goes_on = np.empty(len(o), bool)
    goes_on[0] = False
    goes_on[1:] = (o[1:] == o[:-1]) & (r[1:] <= r[:-1] + 1)
    run = np.cumsum(~goes_on) - 1
    ends = np.flatnonzero(np.append(~goes_on[1:], True))
    runs = np.zeros(owners.shape, np.int64)
    runs[rows[order], ways[order]] = r[ends][run] - r + 1
    k = int(owners.max()) + 1
    score = np.where(runs > 0, runs * k + (k - 1 - owners), -1)  # longest, lowest
    best = score.argmax(axis=1)
    steps = np.arange(n)
    best_len, best_owner = runs[steps, best], owners[steps, best]
    plan: Plan = []
    i = 0
    while i < n:  # each segment takes the longest run held where it starts
        got = int(best_len[i])
        plan.append((int(best_owner[i]), got))
        i += got
    return plan
