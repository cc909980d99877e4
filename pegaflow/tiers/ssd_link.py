"""The L3 SSD tier wired into the engine: write-behind when a save seals a
block (or spill on L1 eviction), prefetch on an L1 miss. The bytes move in
pegaflow.gds (SsdTier); this is bookkeeping on the event loop only.

A Tier (pegaflow.tiers.protocol) that hears L1's events as a StoreListener.

Write-behind (--ssd-write-on seal): BlockStore calls `sealed(entries)` with the
blocks a save just made ready, and they go to the tier as one job straight from
their slots (SsdTier.spill_many: one lock round, one queue entry; what the
queue has no room for is dropped, counted; the save never waits), and come
back as one release per slice written, not one callback per block. The block stays
ready in L1 meanwhile: its bytes do not change once ready. If L1 evicts it
before the writer is done, its slots stay allocated until the tier's release;
if it is already on the SSD, its slots are freed at once; one that never got
queued (dropped, not admitted) is spilled on eviction as below. With
--ssd-admission seen_twice the tier's ghost list sees a block at its seal and
again at a hit or a second save (or its eviction), and writes it then.

Spill (--ssd-write-on evict, and the fallback above): BlockStore calls
`evicting(entries)` once per eviction round with the ready blocks it evicts,
and those not on the SSD yet go to the tier as one job (spill_many, as a
save's). What the tier queues keeps its slots allocated (out of the
allocator's reach) until its writer has written them (straight from the slots
where they are 4 KiB-aligned, else through a copy) and its release hands them
back to the loop, once per slice written; the rest BlockStore frees at once. A
save never waits for the SSD, so an allocation at a full pool evicts until a
round's spill is refused (queue full): one burst moves up to
--ssd-queue-blocks LRU blocks to SSD, and their slots come back as soon as the
loop runs the writers' releases.
(Spilling ahead of a low watermark, so saves find free slots at once, is
not done: with --ssd-write-on seal most victims are on the SSD already.)

Prefetch: a query that misses L1 at block i asks the tier how many of the blocks
from i on it holds. If any, the engine answers `loading` and one background load
reads them into freshly allocated, pinned L1 slots; the blocks that arrive intact
become ready L1 blocks, the rest are freed. While it runs, a query reaching the
same first missing block answers `loading` again without a second load.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, itemgetter

import numpy as np

from pegaflow.cache.block_store import BlockEntry, BlockStore
from pegaflow.cache.instances import Instance, Registry
from pegaflow.common.keys import BlockHash, Key, Namespace
from pegaflow.gds import SsdLoadResult, SsdTier

from .protocol import MISS, Lookup, Tier
from .ssd_metrics import SsdTierMetrics

logger = logging.getLogger(__name__)
_KEY = attrgetter("key")
_SLOTS = attrgetter("slots")


@dataclass(slots=True, eq=False)
class _Batch:
    """Blocks of one namespace the tier is writing from their L1 slots (one
    per SsdTier.spill_many call): keys[i]'s slots are slots[i]."""

    keys: list[Key]
    slots: np.ndarray  # uint64 [n, shards]
    block_bytes: int
    evicted: np.ndarray  # bool [n]: L1 let it go, free its slots at release
    sealed: bool = True  # write-behind, its keys in SsdLink._writing; else spilled


def _slot_table(entries: list[BlockEntry]) -> np.ndarray:
    """The entries' slot addresses as [n, shards] uint64, without a list per row."""
    shards = len(entries[0].slots)
    flat = chain.from_iterable(map(_SLOTS, entries))
    return np.fromiter(flat, np.uint64, len(entries) * shards).reshape(-1, shards)


class SsdLink(Tier):
    """Between the BlockStore (L1) and the SsdTier (L3); every method runs on
    the event loop except the tier's release callbacks, which hop back to it."""

    medium = "ssd"
    evicts_on_lookup = True

    def __init__(
        self,
        tier: SsdTier,
        store: BlockStore,
        registry: Registry,
        metrics: SsdTierMetrics,
        max_held_bytes: int,
    ) -> None:
        self.tier = tier
        # Slot bytes the writers may still read once L1 let them go: spilled,
        # or queued for write-behind (evicted or not yet), not yet released.
        # Bounded so that an allocation at a full pool always finds a victim
        # whose slot frees at once, even when the pool holds fewer blocks than
        # the spill queue: past it a seal's block is not written behind (it
        # is spilled at its eviction if there is room then) and an evicted
        # one is not spilled, each counted in spills_refused.
        self._held = 0
        self._max_held = max_held_bytes
        self._store = store
        self._registry = registry
        self._metrics = metrics
        self._namespaces: dict[int, tuple[bytes, int]] = {}  # id -> digest, bytes
        # Key being loaded -> blocks of its load from it to the end: a repeated
        # query finds its first missing block here and answers `loading` again.
        self._loading: dict[Key, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Write-behind: blocks being written from their slots; ready blocks
        # whose write was refused at the seal (not admitted, queue full), to be
        # offered again at a hit while the tier's admission is seen_twice.
        self._writing: dict[Key, tuple[_Batch, int]] = {}
        self._unwritten: dict[Key, BlockEntry] = {}
        self._write_behind = tier.config.write_on == "seal"
        self._seen_twice = self._write_behind and tier.config.admission == "seen_twice"

    def _namespace(self, ns_id: int) -> tuple[bytes, int]:
        """(on-disk namespace digest, slot bytes per shard) of a namespace id."""
        got = self._namespaces.get(ns_id)
        if got is None:
            ns = next(n for n in self._registry.namespaces.values() if n.id == ns_id)
            got = (ns.digest, ns.slot_bytes)
            self._namespaces[ns_id] = got
        return got

    def on_ssd(self, ns: Namespace, hashes: list[BlockHash], start: int) -> int:
        """How many of hashes[start:] the SSD holds, from the first (a hint:
        the tier may drop one before it is read)."""
        return self.tier.lookup(self._namespace(ns.id)[0], hashes[start:])

    def digest(self, ns_id: int) -> bytes:
        """The namespace's on-disk digest."""
        return self._namespace(ns_id)[0]

    def known(self, ns_id: int, digest: bytes, slot_bytes: int) -> None:
        """A namespace known by digest only (pegaflow.server.warm_restart)."""
        self._namespaces[ns_id] = (digest, slot_bytes)

    def forget(self, ns_id: int) -> None:
        """Drop a namespace's cached mapping (it was freed): its blocks stay
        on disk under the digest, found again when the name comes back."""
        self._namespaces.pop(ns_id, None)

    # -- KV events (pegaflow.server.block_events) --------------------------------
    def track(self, on: bool) -> None:
        """Record which blocks the SSD gains and drops, or stop."""
        self.tier.track_changes(on)

    def take_events(self) -> tuple[list[tuple[bool, int, list[BlockHash]]], bool]:
        """(stored?, namespace id, hashes) since the last call, in order, for
        namespaces this server knows (those watched are: `hashes` named
        them); and whether some were lost (the watchers then resync)."""
        runs, lost = self.tier.take_changes()
        ids = {digest: ns_id for ns_id, (digest, _) in self._namespaces.items()}
        out = []
        for stored, digest, hashes in runs:
            ns_id = ids.get(digest)
            if ns_id is not None:
                out.append((stored, ns_id, hashes))
        return out, lost

    def hashes(self, ns: Namespace) -> list[BlockHash]:
        """Every block of the namespace the SSD holds now."""
        return self.tier.hashes(self._namespace(ns.id)[0])

    # -- eviction ---------------------------------------------------------------
    def evicting(self, entries: list[BlockEntry]) -> np.ndarray:
        """L1 evicts these ready blocks of one namespace (one eviction round):
        True where their slots are kept until a write from them is done, False
        where they are free now (on the SSD already, refused, dropped)."""
        keys = list(map(_KEY, entries))
        kept = np.zeros(len(keys), bool)
        if self._unwritten:
            for key in keys:
                self._unwritten.pop(key, None)
        writing = self._writing
        if writing and not writing.keys().isdisjoint(keys):
            for i, key in enumerate(keys):  # only a round that meets a write
                w = writing.get(key)
                if w is None:
                    continue
                batch, j = w
                if not batch.evicted[j] and batch.slots[j].tolist() == entries[i].slots:
                    batch.evicted[j] = True  # the writer still reads them
                    kept[i] = True  # counted in _held since it was queued
        rest = np.flatnonzero(~kept)
        if len(rest):
            kept[rest[self._spill(keys, rest, entries)]] = True
        return kept

    def _spill(
        self, keys: list[Key], pick: np.ndarray, entries: list[BlockEntry]
    ) -> list[int]:
        """Queue keys[pick] for the SSD as one job from their slots, as many
        as the held-bytes bound lets; the positions in pick the tier took."""
        digest, slot_bytes = self._namespace(keys[0][0])
        block_bytes = slot_bytes * len(entries[0].slots)
        pick = pick[: self._room(block_bytes, len(pick))]
        if not len(pick):
            return []
        picked = [keys[i] for i in pick.tolist()]
        fits = self._within_room(digest, picked)
        if not fits:
            return []
        pick, picked = pick[:fits], picked[:fits]
        hashes = [k[1] for k in picked]
        slots = _slot_table([entries[i] for i in pick.tolist()])
        loop = asyncio.get_running_loop()
        batch = _Batch(picked, slots, block_bytes, np.zeros(0, bool), sealed=False)
        release = functools.partial(self._release, loop, self._written, batch)
        took = self.tier.spill_many(digest, hashes, slots, slot_bytes, release)
        if len(took) < len(picked):  # the writer's release comes later, on the loop
            batch.keys = [picked[i] for i in took]
            batch.slots = slots[took]
        batch.evicted = np.ones(len(took), bool)  # L1 let go: free at release
        self._held += len(took) * block_bytes
        return took

    def _room(self, block_bytes: int, want: int) -> int:
        """How many of `want` blocks the held-bytes bound lets the writers
        have; the rest are counted refused."""
        room = max(0, self._max_held - self._held) // block_bytes
        if room >= want:
            return want
        self._metrics.spills_refused.inc(want - room)
        return room

    def _within_room(self, digest: bytes, keys: list[Key]) -> int:
        """How many of keys, from the first, to offer the tier: as many as its
        queue has room for. The rest are refused in one call (counted as a
        full queue counts them) before any slot table is built for them: under
        a save burst the disk cannot absorb, that is most of them."""
        fits = min(self.tier.queue_room(), len(keys))
        if fits < len(keys):
            self.tier.refuse_many(digest, [k[1] for k in keys[fits:]])
        return fits

    @staticmethod
    def _release(
        loop: asyncio.AbstractEventLoop, then: Callable[..., None], *args: object
    ) -> None:
        """From a writer thread: the slots' bytes are written (or copied out);
        the allocator is the loop's, so `then` runs there."""
        try:
            loop.call_soon_threadsafe(then, *args)
        except RuntimeError:  # loop closed at shutdown: the pool goes with it
            logger.debug("ssd release after the loop closed")

    # -- write-behind -----------------------------------------------------------
    def sealed(self, entries: list[BlockEntry]) -> None:
        """A save made these blocks ready: queue them for the SSD, one tier
        call per namespace (a save seals blocks of one namespace)."""
        if self._write_behind:
            self._write_sealed(entries)

    def _write_sealed(self, entries: list[BlockEntry]) -> None:
        if len(set(map(itemgetter(0), map(_KEY, entries)))) > 1:  # C-level passes
            groups: dict[int, list[BlockEntry]] = {}
            for e in entries:
                groups.setdefault(e.key[0], []).append(e)
            for group in groups.values():
                self._write(group)
            return
        self._write(entries)

    def hit(self, entries: list[BlockEntry]) -> None:
        """Blocks hit in L1: a second sighting for those not yet written."""
        if not self._unwritten:  # only ever filled under seen_twice
            return
        again = [e for e in entries if self._unwritten.get(e.key) is e]
        if again:
            self._write_sealed(again)

    def _write(self, entries: list[BlockEntry]) -> None:
        keys = list(map(_KEY, entries))
        digest, slot_bytes = self._namespace(keys[0][0])
        block_bytes = slot_bytes * len(entries[0].slots)
        fits = self._room(block_bytes, len(keys))
        if fits:
            fits = self._within_room(digest, keys[:fits])
        if fits < len(keys):
            if self._seen_twice:  # offered again at a hit
                self._unwritten.update(zip(keys[fits:], entries[fits:], strict=True))
            keys, entries = keys[:fits], entries[:fits]
            if not keys:
                return
        hashes = [k[1] for k in keys]
        slots = _slot_table(entries)
        loop = asyncio.get_running_loop()
        batch = _Batch(keys, slots, block_bytes, np.zeros(0, bool))
        release = functools.partial(self._release, loop, self._written, batch)
        took = self.tier.spill_many(digest, hashes, slots, slot_bytes, release)
        self._held += len(took) * block_bytes
        if len(took) < len(keys):
            if self._seen_twice:  # offered again at a hit
                refused = np.ones(len(keys), bool)
                refused[took] = False
                self._unwritten.update(
                    (keys[i], entries[i]) for i in np.flatnonzero(refused).tolist()
                )
            if not took:
                return
            batch.keys = [keys[i] for i in took]
            batch.slots = slots[took]
        batch.evicted = np.zeros(len(batch.keys), bool)
        rows = zip(repeat(batch), range(len(took)))
        self._writing.update(zip(batch.keys, rows, strict=False))
        if self._unwritten:
            for key in batch.keys:
                self._unwritten.pop(key, None)

    def _written(self, batch: _Batch, lo: int, hi: int) -> None:
        """Blocks batch.keys[lo:hi] are written (or failed): forget them, and
        free the slots of those L1 evicted meanwhile."""
        self._held -= (hi - lo) * batch.block_bytes
        if batch.sealed:
            writing = self._writing
            for key in batch.keys[lo:hi]:
                w = writing.get(key)
                if w is not None and w[0] is batch:  # not a newer write of the key
                    del writing[key]
        gone = batch.evicted[lo:hi]
        if gone.any():
            self._store.slabs.free(batch.slots[lo:hi][gone].ravel())

    # -- prefetch ---------------------------------------------------------------
    def lookup(self, inst: Instance, hashes: list[BlockHash], start: int) -> Lookup:
        """Blocks from `start` on that the SSD holds come back into reserved
        L1 slots: `loading` them."""
        n, started = self.loading(inst.namespace, hashes, start)
        return Lookup("loading", n, started) if n else MISS

    def loading(
        self, ns: Namespace, hashes: list[BlockHash], start: int
    ) -> tuple[int, bool]:
        """(blocks of hashes[start:] coming from SSD, whether this call started
        their load); 0 when the SSD holds none of them or no slot can be had."""
        first = (ns.id, hashes[start])
        running = self._loading.get(first)
        if running is not None:
            return running, False
        digest, slot_bytes = self._namespace(ns.id)
        rest = hashes[start:]
        n = self.tier.lookup(digest, rest)
        if n == 0:
            return 0, False
        entries = self._store.reserve_load(ns, rest[:n])
        if not entries:
            return 0, False
        n = len(entries)
        keys = [e.key for e in entries]
        self._loading.update(zip(keys, range(n, 0, -1), strict=True))
        slots = np.array([e.slots for e in entries], np.uint64)
        future = self.tier.load(digest, rest[:n], slots, slot_bytes)
        finish = self._finish(
            entries, asyncio.wrap_future(future), slots.size * slot_bytes
        )
        task = asyncio.ensure_future(finish)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        logger.debug("loading %d blocks from ssd", n)
        return n, True

    async def _finish(
        self,
        entries: list[BlockEntry],
        result: asyncio.Future[SsdLoadResult],
        nbytes: int,
    ) -> None:
        ok = np.zeros(len(entries), bool)
        began = time.perf_counter()
        try:
            res = await result
            ok = res.ok
            self._metrics.prefetch_seconds.observe(res.seconds)
            # As the engine sees it: from the query that started it, queueing
            # behind other loads included.
            self.rate.observe(nbytes, time.perf_counter() - began)
        except Exception:  # a background load: log it, the blocks become misses
            logger.exception("ssd load failed")
        finally:
            for e in entries:
                self._loading.pop(e.key, None)
            self._store.finish_load(entries, ok)
        failed = len(entries) - int(ok.sum())
        if failed:
            logger.info("%d of %d blocks from ssd failed to load", failed, len(ok))

    async def close(self) -> None:
        """Finish loads in flight, then write what is queued and close the files:
        the tier reads pool slots, so this runs before the pool goes."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=10)
        await asyncio.to_thread(self.tier.close)
