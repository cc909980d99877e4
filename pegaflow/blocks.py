"""The block index: which (namespace, block hash) keys are resident, in which pool
slots, and whether they are complete, pinned or in flight.

Bookkeeping only; bytes move in pegaflow.engine through a copy engine. A block has
one slot per TP shard; it becomes visible (and evictable) only when every layer of
every shard has landed. Pinned blocks (leased or being copied) are never evicted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from pegaflow.instances import Namespace
from pegaflow.policy import EvictionPolicy
from pegaflow.pool import SlabAllocator, SlotClass

logger = logging.getLogger(__name__)

BlockHash = bytes
Key = tuple[int, BlockHash]
# Eviction hook (the SSD tier): True when it took the slots; it frees them later.
Spill = Callable[[Key, np.ndarray], bool]
_KEY = attrgetter("key")


@dataclass(slots=True, eq=False)  # identity: compared against None in bulk
class BlockEntry:
    key: Key
    slots: np.ndarray  # uint64 address per TP shard, 0 until allocated
    landed: np.ndarray  # bool [tp_size, num_layers]
    in_flight: np.ndarray  # bool [tp_size, num_layers]
    ready: bool = False
    pins: int = 0
    created: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class SaveReservation:
    """Blocks of one Save that need copying, with their (now pinned) slots."""

    keys: list[Key]
    entries: list[BlockEntry]
    positions: np.ndarray  # index into the request's block list
    slots: np.ndarray  # uint64 slot address of this rank, per key
    deduplicated: int
    rejected: int


@dataclass(slots=True)
class StoreCounters:
    evictions: int = 0
    admission_rejections: int = 0
    pool_full_rejections: int = 0
    stale_dropped: int = 0


class BlockStore:
    def __init__(self, slabs: SlabAllocator, policy: EvictionPolicy) -> None:
        self.slabs = slabs
        self.policy = policy
        self.entries: dict[Key, BlockEntry] = {}
        # Complete blocks per namespace, keyed by bare hash: the prefix query
        # looks them up with one C-level map() and no key tuples.
        self._ready: dict[int, dict[BlockHash, BlockEntry]] = {}
        self.counters = StoreCounters()
        # Leases pin lazily: their entries are counted only when an eviction
        # needs to know, so a lease released before then costs no per-block work
        # on the query path (2560-block prefixes are latency-critical).
        self._unflushed: dict[int, list[BlockEntry]] = {}
        # Hits whose LRU touch is still owed: applied after the query's reply
        # (a 2560-block touch is ~0.3 ms) and always before the policy is next
        # asked or changed, so its order is the order of the requests.
        self._untouched: list[list[BlockEntry]] = []
        self.spill: Spill | None = None

    @property
    def resident_ready(self) -> int:
        return sum(len(table) for table in self._ready.values())

    def pin_lease(self, lease_id: int, entries: list[BlockEntry]) -> None:
        self._unflushed[lease_id] = entries

    def unpin_lease(self, lease_id: int, entries: list[BlockEntry]) -> None:
        if self._unflushed.pop(lease_id, None) is None:
            self.unpin(entries)

    def _flush_pins(self) -> None:
        for entries in self._unflushed.values():
            self.pin(entries)
        self._unflushed.clear()

    def _protected(self, key: Key) -> bool:
        return self.entries[key].pins > 0

    def longest_prefix(
        self, ns: Namespace, hashes: list[BlockHash]
    ) -> list[BlockEntry]:
        """Entries of the ready prefix; stops at the first block not ready."""
        return self.lookup(ns, hashes)[0]

    def lookup(
        self, ns: Namespace, hashes: list[BlockHash]
    ) -> tuple[list[BlockEntry], list[BlockEntry | None]]:
        """The ready prefix, and the probe past it: None where a block is not
        ready (the first always), the entry where a ready block sits behind the
        miss. The miss breakdown (pegaflow.misses) reads the second list."""
        found = list(map(self._ready.get(ns.id, {}).get, hashes))
        rest: list[BlockEntry | None] = []
        if None in found:
            cut = found.index(None)
            rest = found[cut:]
            del found[cut:]
        if found:
            self._untouched.append(found)
            if len(self._untouched) == 1:
                self._touch_soon()
        return found, rest

    def _touch_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.apply_touches()
            return
        loop.call_soon(self.apply_touches)

    def apply_touches(self) -> None:
        """Give the policy the hits it has not seen yet, oldest first."""
        owed, self._untouched = self._untouched, []
        for found in owed:
            self.policy.touch_many(list(map(_KEY, found)))

    def reserve_save(
        self, ns: Namespace, rank: int, hashes: list[BlockHash], layers: np.ndarray
    ) -> SaveReservation:
        keys: list[Key] = []
        entries: list[BlockEntry] = []
        positions: list[int] = []
        dedup = rejected = 0
        for pos, h in enumerate(hashes):
            key = (ns.id, h)
            entry = self.entries.get(key)
            if entry is not None and (
                entry.ready
                or (entry.landed[rank, layers] | entry.in_flight[rank, layers]).all()
            ):
                dedup += 1
                continue
            if entry is None:
                entry = self._admit(ns, key)
                if entry is None:
                    rejected += 1
                    continue
            if entry.slots[rank] == 0:
                slot = self._allocate(ns.slot_class)
                if slot is None:
                    self._drop_if_empty(key, entry)
                    rejected += 1
                    self.counters.pool_full_rejections += 1
                    continue
                entry.slots[rank] = slot
            entry.in_flight[rank, layers] = True
            entry.pins += 1
            keys.append(key)
            entries.append(entry)
            positions.append(pos)
        slots = np.array([e.slots[rank] for e in entries], np.uint64)
        return SaveReservation(
            keys, entries, np.asarray(positions, np.int64), slots, dedup, rejected
        )

    def finish_save(
        self, res: SaveReservation, rank: int, layers: np.ndarray, ok: bool
    ) -> None:
        self.apply_touches()
        for key, entry in zip(res.keys, res.entries, strict=True):
            entry.pins -= 1
            entry.in_flight[rank, layers] = False
            if ok:
                entry.landed[rank, layers] = True
                if not entry.ready and entry.landed.all():
                    entry.ready = True
                    self._ready.setdefault(key[0], {})[key[1]] = entry
                    self.policy.insert(key)
            elif not entry.landed[rank].any() and not entry.in_flight[rank].any():
                self.slabs.free(entry.slots[rank : rank + 1])
                entry.slots[rank] = 0
                self._drop_if_empty(key, entry)

    def _admit(self, ns: Namespace, key: Key) -> BlockEntry | None:
        if self.slabs.free_slots(ns.slot_class) == 0:
            self._flush_pins()
            self.apply_touches()
            if not self.policy.should_admit(key, self._protected):
                self.counters.admission_rejections += 1
                return None
        entry = BlockEntry(
            key,
            np.zeros(ns.tp_size, np.uint64),
            np.zeros((ns.tp_size, ns.num_layers), bool),
            np.zeros((ns.tp_size, ns.num_layers), bool),
        )
        self.entries[key] = entry
        return entry

    def _allocate(self, cls: SlotClass) -> int | None:
        """One slot, evicting LRU blocks (of any class) until one frees up."""
        while True:
            got = self.slabs.allocate(cls, 1)
            if len(got):
                return int(got[0])
            self._flush_pins()
            self.apply_touches()
            victims = self.policy.evict(1, self._protected)
            if not victims:
                return None
            self._remove(victims[0])
            self.counters.evictions += 1

    def _remove(self, key: Key) -> None:
        entry = self.entries.pop(key)
        slots = entry.slots[entry.slots != 0]
        if entry.ready:
            del self._ready[key[0]][key[1]]
        # A spilled block's slots stay allocated until the tier has copied them.
        if not (entry.ready and self.spill is not None and self.spill(key, slots)):
            self.slabs.free(slots)
        logger.debug("evicted block %s", key[1][:8].hex())

    def reserve_load(self, ns: Namespace, hashes: list[BlockHash]) -> list[BlockEntry]:
        """Pinned, in-flight entries with slots for blocks coming from a slower
        tier; stops at the first key already known or when no slot can be freed.
        In flight on every layer, a concurrent save of the key deduplicates."""
        entries: list[BlockEntry] = []
        for h in hashes:
            key = (ns.id, h)
            if key in self.entries:
                break
            entry = BlockEntry(
                key,
                np.zeros(ns.tp_size, np.uint64),
                np.zeros((ns.tp_size, ns.num_layers), bool),
                np.ones((ns.tp_size, ns.num_layers), bool),
                pins=1,
            )
            self.entries[key] = entry  # before allocating: never its own victim
            for rank in range(ns.tp_size):
                slot = self._allocate(ns.slot_class)
                if slot is None:
                    break
                entry.slots[rank] = slot
            else:
                entries.append(entry)
                continue
            self.slabs.free(entry.slots[entry.slots != 0])
            del self.entries[key]
            break
        return entries

    def finish_load(self, entries: list[BlockEntry], ok: np.ndarray) -> None:
        """Blocks that arrived become ready (visible, evictable); the rest go."""
        self.apply_touches()
        for entry, good in zip(entries, ok.tolist(), strict=True):
            entry.pins -= 1
            entry.in_flight[:] = False
            if good:
                entry.landed[:] = True
                entry.ready = True
                self._ready.setdefault(entry.key[0], {})[entry.key[1]] = entry
                self.policy.insert(entry.key)
            else:
                self.slabs.free(entry.slots)
                self.entries.pop(entry.key, None)

    def _drop_if_empty(self, key: Key, entry: BlockEntry) -> None:
        if not entry.slots.any() and entry.pins == 0:
            self.entries.pop(key, None)

    def pin(self, entries: list[BlockEntry]) -> None:
        for entry in entries:
            entry.pins += 1

    def unpin(self, entries: list[BlockEntry]) -> None:
        for entry in entries:
            entry.pins -= 1

    def drop_stale(self, older_than: float) -> int:
        """Free incomplete blocks whose other shards or layers never came."""
        stale = [
            key
            for key, e in self.entries.items()
            if not e.ready and e.pins == 0 and e.created < older_than
        ]
        for key in stale:
            self._remove(key)
        self.counters.stale_dropped += len(stale)
        return len(stale)
