"""The block index: which (namespace, block hash) keys are resident, in which pool
slots, and whether they are complete, pinned or in flight.

Bookkeeping only; bytes move in pegaflow.server.engine through a copy engine.
A block has one slot per TP shard; it becomes visible (and evictable) only when
every layer of every shard has landed. Pinned blocks (leased or being copied)
are never evicted. The entry and its bit masks: pegaflow.cache.block_entry;
lease pins and LRU touches the query path defers: pegaflow.cache.deferred_touches.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

import numpy as np

from pegaflow.common.keys import BlockHash, Key, Namespace, PackedHashes

from .block_entry import BlockEntry, SaveReservation, layer_mask
from .deferred_touches import Deferred
from .eviction import EvictionPolicy
from .ready_index import ReadyIndex
from .slabs import SlabAllocator, SlotClass
from .slot_eviction import SlotEviction
from .store_events import EVENTS, StoreListener, overridden
from .tier_loads import TierLoads

if TYPE_CHECKING:
    from .slot_log import SlotLog

logger = logging.getLogger(__name__)

_KEY = attrgetter("key")
_NO_WAITS = np.empty(0, np.int64)  # shared: most saves wait for nothing
_NO_WAITS.flags.writeable = False
_SLOTS = attrgetter("slots")


@dataclass(slots=True)
class _Held:
    """A namespace with entries in the store, and how many."""

    ns: Namespace
    entries: int = 0


@dataclass(slots=True)
class StoreCounters:
    evictions: int = 0
    admission_rejections: int = 0
    pool_full_rejections: int = 0
    stale_dropped: int = 0


class BlockStore(TierLoads, SlotEviction):
    def __init__(self, slabs: SlabAllocator, policy: EvictionPolicy) -> None:
        self.slabs = slabs
        self.policy = policy
        self.entries: dict[Key, BlockEntry] = {}
        # Entries made not ready (a save's, a tier read's; not a restart's
        # unchecked ones: their check decides), for drop_stale to look at
        # instead of every entry (45 ms a second at 1,000,000 blocks): out
        # once published; one gone otherwise, until drop_stale sees it.
        self.unready: dict[Key, BlockEntry] = {}
        # Which block each slot holds is the allocator's map, set here as
        # slots are given (SlabAllocator.own) and cleared by every free: the
        # blocks of a slab to empty (pegaflow.cache.slab_victims).
        # Complete blocks per namespace: the prefix query probes all its hashes
        # at once (a dict lookup per hash misses the caches in a big index).
        self._ready: dict[int, ReadyIndex] = {}
        self.counters = StoreCounters()
        # Lease pins and LRU touches owed to the policy
        # (pegaflow.cache.deferred_touches):
        # paid before the policy is next asked (_settle) or changed.
        self._owed = Deferred()
        # Entries per namespace id, and the namespace: when the count drops to
        # zero the namespace's index goes and the listeners hear `emptied`.
        self._held: dict[int, _Held] = {}
        # Per event, the bound methods of the listeners that override it
        # (pegaflow.cache.store_events): the tiers, the miss breakdown, the reaper.
        self._on: dict[str, list[Callable]] = {event: [] for event in EVENTS}
        # A file-backed pool's slot rows (pegaflow.cache.slot_log): told of slots
        # allocated to blocks and of blocks published.
        self.log: SlotLog | None = getattr(slabs, "log", None)
        # A restart's recovered blocks whose check is still to come
        # (pegaflow.server.pool_check): never served; when the pool is full,
        # evicted before the policy's victims of their class (no query
        # reached them since the restart, or they would be checked).
        self.unchecked: dict[Key, BlockEntry] = {}
        # Their keys per slot class, in adoption order: eviction takes from
        # the end (the blocks the check reaches last), each pop O(1); keys
        # that left `unchecked` meanwhile are dropped as they come up.
        self._unchecked_stacks: dict[SlotClass, list[Key]] = {}
        # Called when blocks in flight landed or went (a save, a lower tier's
        # load, a restart's check, an eviction of unchecked blocks): a save
        # that deduplicated against them looks again (pegaflow.server.save_waits).
        self.on_settle: Callable[[list[BlockEntry]], None] = _nothing
        # The policy's last pass found fewer unpinned blocks than asked, and
        # none was published or unpinned since: a pass now would find none
        # either (pegaflow.cache.slot_eviction).
        self.policy_drained = False

    def add_listener(self, listener: StoreListener) -> None:
        """Tell `listener` of the events it overrides, after those before it."""
        for event in overridden(listener):
            self._on[event].append(getattr(listener, event))

    @property
    def resident_ready(self) -> int:
        return sum(map(len, self._ready.values()))

    def namespace(self, ns_id: int) -> Namespace | None:
        """The namespace of blocks held here, by id."""
        held = self._held.get(ns_id)
        return held.ns if held is not None else None

    def holds(self, ns_id: int) -> bool:
        """Whether any block of the namespace is resident, in flight or pinned."""
        return ns_id in self._held

    def _hold(self, ns: Namespace, new: int) -> None:
        held = self._held.get(ns.id)
        if held is None:
            held = self._held[ns.id] = _Held(ns)
        held.entries += new

    def _let_go(self, counts: dict[int, int]) -> None:
        """Entries removed, by namespace id; a namespace left with none loses
        its index, then `emptied` runs (it may free the namespace)."""
        for ns_id, n in counts.items():
            held = self._held[ns_id]
            held.entries -= n
            if held.entries == 0:
                del self._held[ns_id]
                self._ready.pop(ns_id, None)
                for emptied in self._on["emptied"]:
                    emptied(held.ns)

    def _pop_entry(self, key: Key) -> None:
        if self.entries.pop(key, None) is not None:
            self._let_go({key[0]: 1})

    def pin_lease(self, lease_id: int, entries: list[BlockEntry]) -> None:
        self._owed.lease(lease_id, entries)

    def unpin_lease(self, lease_id: int, entries: list[BlockEntry]) -> None:
        if not self._owed.release(lease_id):
            self.unpin(entries)

    def _settle(self) -> None:
        """The policy is about to choose victims or admissions: pay it first."""
        for entries in self._owed.take_pins():
            self.pin(entries)
        self.apply_touches()

    def _protected(self, key: Key) -> bool:
        return self.entries[key].pins > 0

    def longest_prefix(
        self, ns: Namespace, hashes: list[BlockHash]
    ) -> list[BlockEntry]:
        """Entries of the ready prefix; stops at the first block not ready."""
        return self.lookup(ns, hashes)[0]

    def lookup(
        self, ns: Namespace, hashes: list[BlockHash] | PackedHashes
    ) -> tuple[list[BlockEntry], np.ndarray]:
        """The ready prefix, and the probe past it: whether each block from the
        first miss on is ready (False for the first; empty when all hit). A
        ready block behind the miss is what the miss breakdown
        (pegaflow.cache.miss_reasons) counts as resident."""
        index = self._ready.get(ns.id)
        if index is None:
            found, rest = [], np.zeros(len(hashes), bool)
        elif isinstance(hashes, PackedHashes):
            found, rest = index.prefix(hashes)
        elif index.probes(len(hashes)) and len(set(map(len, hashes))) == 1:
            found, rest = index.prefix(PackedHashes.pack(hashes, len(hashes[0])))
        else:
            found, rest = index.prefix_listed(hashes)
        if len(found) > 1:
            found, rest = _cut_at_repeat(found, rest)
        if found:
            self._owed.hit(found, self.apply_touches)
            if len(found) < len(hashes):  # the save to come starts here
                child = (ns.id, _hash_at(hashes, len(found)))
                self.policy.expect(child, found[-1].key)
        return found, rest

    def apply_touches(self) -> None:
        """Give the policy the hits it has not seen yet, oldest first."""
        for found in self._owed.take_hits():
            self.policy.touch_many(list(map(_KEY, found)))
            for hit in self._on["hit"]:
                hit(found)

    def reserve_save(
        self, ns: Namespace, rank: int, hashes: list[BlockHash], layers: np.ndarray
    ) -> SaveReservation:
        """Pin the blocks this save must copy and give each a slot of this rank.

        One pass over the hashes does int operations only; slots come from one
        allocation (evicting in bulk when short). Under pressure, blocks beyond
        the free room must win TinyLFU admission, in request order.
        """
        mask = layer_mask(rank, layers, ns.num_layers)
        tp = ns.tp_size
        entries: list[BlockEntry] = []
        positions: list[int] = []
        slots: list[int] = []
        slotless: list[int] = []  # indexes into entries still needing a slot
        dedup = rejected = new = 0
        waits: list[int] = []  # deduplicated against blocks still landing
        waited: list[BlockEntry] = []
        refused: set[Key] = set()  # asked once per request, however repeated
        admit: Callable[[Key], bool] | None = None  # past the room, in order
        room = self.slabs.free_slots(ns.slot_class)
        table, unready = self.entries, self.unready
        get = table.get
        now = time.monotonic()  # one creation time for the request's blocks
        for pos, key in enumerate(zip(repeat(ns.id), hashes)):
            entry = get(key)
            if entry is None:
                if len(slotless) >= room:
                    if admit is None:
                        self._settle()  # the policy will ask for these
                        admit = self.policy.admitter(self._protected)
                    if key in refused or not admit(key):
                        refused.add(key)
                        self.counters.admission_rejections += 1
                        rejected += 1
                        continue
                slotless.append(len(entries))
                entry = table[key] = BlockEntry(key, [0] * tp, 0, mask, False, 1, now)
                unready[key] = entry
                new += 1
                entries.append(entry)
                positions.append(pos)
                slots.append(0)
                continue
            if (
                entry.ready
                or entry.in_flight & mask  # another save writes one of these layers
                or (entry.landed | entry.in_flight) & mask == mask
            ):
                # Also a hash repeated within this request. A save sharing a
                # layer in flight would share its bits: failing, it would clear
                # the other save's and free the slot that one still writes.
                dedup += 1
                if entry.in_flight & mask and not entry.ready:
                    waits.append(pos)  # landing: not stored until it landed
                    waited.append(entry)
                continue
            if not entry.slots[rank]:
                slotless.append(len(entries))
            entry.in_flight |= mask
            entry.pins += 1
            entries.append(entry)
            positions.append(pos)
            slots.append(entry.slots[rank])
        if waited:
            waits, waited = self._others(waits, waited, entries)
        keys = list(map(_KEY, entries))
        if new:  # before allocating: an eviction must not see ns as empty
            self._hold(ns, new)
        if slotless:
            given = self._allocate(ns.slot_class, len(slotless))
            got = given.tolist()  # may be shorter than slotless
            self.slabs.own(given, list(map(entries.__getitem__, slotless[: len(got)])))
            for i, slot in zip(slotless, got, strict=False):
                entries[i].slots[rank] = slots[i] = slot
            if self.log is not None and got:
                written = [keys[i][1] for i in slotless[: len(got)]]
                self.log.writing(ns, written, rank, np.asarray(got, np.uint64))
            if len(got) < len(slotless):
                rejected += self._unreserve(slotless[len(got) :], entries, mask)
                keep = [e.slots[rank] != 0 for e in entries]
                keys = [k for k, k_ok in zip(keys, keep, strict=True) if k_ok]
                positions = [p for p, p_ok in zip(positions, keep, strict=True) if p_ok]
                slots = [a for a, a_ok in zip(slots, keep, strict=True) if a_ok]
                entries = [e for e, e_ok in zip(entries, keep, strict=True) if e_ok]
        return SaveReservation(
            keys,
            entries,
            np.asarray(positions, np.int64),
            np.asarray(slots, np.uint64),
            dedup,
            rejected,
            rank,
            mask,
            ((1 << ns.num_layers) - 1) << (rank * ns.num_layers),
            (1 << (tp * ns.num_layers)) - 1,
            np.asarray(waits, np.int64) if waits else _NO_WAITS,
            waited,
        )

    def _others(
        self, waits: list[int], waited: list[BlockEntry], mine: list[BlockEntry]
    ) -> tuple[list[int], list[BlockEntry]]:
        """Of the blocks a save found landing, those another writer brings in
        (not a hash this request repeats); the listeners hear they are awaited."""
        ours = set(map(id, mine))
        keep = [id(e) not in ours for e in waited]
        waits = list(compress(waits, keep))
        waited = list(compress(waited, keep))
        if waited:
            for awaited in self._on["awaited"]:
                awaited(waited)
        return waits, waited

    def _unreserve(self, idx: list[int], entries: list[BlockEntry], mask: int) -> int:
        """Undo the reservation of blocks no slot could be found for."""
        for i in idx:
            entry = entries[i]
            entry.in_flight &= ~mask
            entry.pins -= 1
            self._drop_if_empty(entry.key, entry)
        self.counters.pool_full_rejections += len(idx)
        if idx and self._on["pool_full"]:
            keys = [entries[i].key for i in idx]
            for pool_full in self._on["pool_full"]:
                pool_full(keys)
        return len(idx)

    def finish_save(self, res: SaveReservation, ok: bool) -> None:
        self.apply_touches()
        if not ok:
            self._fail_save(res)
            self.on_settle(res.entries)
            return
        mask, clear, complete = res.mask, ~res.mask, res.complete
        sealed: list[BlockEntry] = []  # published now
        for entry in res.entries:
            entry.pins -= 1
            entry.in_flight &= clear
            entry.landed |= mask
            if entry.landed == complete and not entry.ready:
                sealed.append(entry)
        self.on_settle(res.entries)
        if not sealed:
            return
        self._make_ready_many(sealed)
        if self.log is not None:
            self.log.landed(sealed)
        for tell in self._on["sealed"]:
            tell(sealed)
        for ready in self._on["ready"]:
            ready(sealed)

    def _fail_save(self, res: SaveReservation) -> None:
        """A copy that failed: its pieces never landed; a block with no piece
        of this shard landed or in flight gives its slot back."""
        clear, rank = ~res.mask, res.rank
        failed: list[int] = []
        for entry in res.entries:
            entry.pins -= 1
            entry.in_flight &= clear
            if not (entry.landed | entry.in_flight) & res.shard_mask:
                failed.append(entry.slots[rank])
                entry.slots[rank] = 0
                self._drop_if_empty(entry.key, entry)
        if failed:
            self.slabs.free(np.asarray(failed, np.uint64))

    def _make_ready(self, entry: BlockEntry, cold: bool = False) -> None:
        entry.ready = True
        self.policy_drained = False  # one more block the policy may give
        self.unready.pop(entry.key, None)
        index = self._ready.get(entry.key[0])
        if index is None:
            index = self._ready[entry.key[0]] = ReadyIndex()
        index.add(entry)
        if cold:
            self.policy.insert_cold_many((entry.key,))
        else:
            self.policy.insert(entry.key)

    def _make_ready_many(self, entries: list[BlockEntry], cold: bool = False) -> None:
        """_make_ready() each entry, in order (distinct, none ready yet).
        cold: unused so far, they enter below every resident block."""
        keys = list(map(_KEY, entries))
        ns_ids = set(map(itemgetter(0), keys))  # C-level passes, no frame per key
        if len(entries) < 2 or len(ns_ids) != 1:
            for entry in entries:
                self._make_ready(entry, cold)
            return
        (ns_id,) = ns_ids
        self.policy_drained = False
        for entry in entries:
            entry.ready = True
        deque(map(self.unready.pop, keys, repeat(None)), maxlen=0)
        index = self._ready.get(ns_id)
        if index is None:
            index = self._ready[ns_id] = ReadyIndex()
        index.add_many(entries)
        if cold:
            self.policy.insert_cold_many(keys)
        else:
            self.policy.insert_many(keys)

    def _remove(self, keys: list[Key]) -> None:
        entries = list(map(self.entries.pop, keys))
        counts = Counter(key[0] for key in keys)  # in order of first sight
        freed: list[int] = []
        gone: list[Key] = []
        ready: dict[int, list[BlockEntry]] = {}
        for key, entry in zip(keys, entries, strict=True):
            if entry.ready:
                gone.append(key)
                ready.setdefault(key[0], []).append(entry)
            else:
                freed += entry.slots
        for ns_id, out in ready.items():
            self._ready[ns_id].remove_many(out)
            # A spilled block's slots stay allocated until the tier wrote them.
            kept = self._kept(out)
            if kept is None or not kept.any():
                freed += chain.from_iterable(map(_SLOTS, out))
            elif not kept.all():
                left = compress(out, (~kept).tolist())
                freed += chain.from_iterable(map(_SLOTS, left))
        if 0 in freed:  # shards never allocated
            freed = [s for s in freed if s]
        self.slabs.free(np.asarray(freed, np.uint64))
        if gone:
            for removed in self._on["removed"]:
                removed(gone)
        self._let_go(counts)

    def _kept(self, evicted: list[BlockEntry]) -> np.ndarray | None:
        """Which evicted blocks' slots a listener keeps (it frees them later)."""
        kept = None
        for evicting in self._on["evicting"]:
            mine = evicting(evicted)
            if mine is not None:
                kept = mine if kept is None else kept | mine
        return kept

    def _drop_if_empty(self, key: Key, entry: BlockEntry) -> None:
        if not any(entry.slots) and entry.pins == 0:
            self._pop_entry(key)

    def pin(self, entries: list[BlockEntry]) -> None:
        for entry in entries:
            entry.pins += 1

    def unpin(self, entries: list[BlockEntry]) -> None:
        """The one place a ready block's pins drop."""
        self.policy_drained = False
        for entry in entries:
            entry.pins -= 1
        if self.policy.parked:  # pinned blocks an eviction pass set aside
            self.policy.unpark([e.key for e in entries if not e.pins])

    def drop_stale(self, older_than: float) -> int:
        """Free incomplete blocks whose other shards or layers never came."""
        entries, unready = self.entries, self.unready
        stale = []
        for key, e in list(unready.items()):
            if e.ready or entries.get(key) is not e:  # published, or gone
                del unready[key]
            elif e.pins == 0 and e.created < older_than:
                stale.append(key)
                del unready[key]
        self._remove(stale)
        self.counters.stale_dropped += len(stale)
        return len(stale)


def _nothing(entries: list[BlockEntry]) -> None:
    pass


def _hash_at(hashes: list[BlockHash] | PackedHashes, i: int) -> BlockHash:
    if isinstance(hashes, PackedHashes):
        start = hashes.offset + i * hashes.hash_len
        return bytes(hashes.buf[start : start + hashes.hash_len])
    return hashes[i]


def _cut_at_repeat(
    found: list[BlockEntry], rest: np.ndarray
) -> tuple[list[BlockEntry], np.ndarray]:
    """The ready prefix up to its first block seen before, and the probe past
    it with the cut-off blocks (ready) in front. A real prefix holds no block
    twice (each hash covers every block before it); a request repeating one
    cached hash must not be one lease, one peer pin or one policy hit per
    copy."""
    if len(set(map(id, found))) == len(found):
        return found, rest
    seen: set[int] = set()
    for i, entry in enumerate(found):
        if id(entry) in seen:
            cut = np.ones(len(found) - i, bool)
            cut[0] = False  # the first repeat stands as the miss
            return found[:i], np.concatenate([cut, rest])
        seen.add(id(entry))
    return found, rest
