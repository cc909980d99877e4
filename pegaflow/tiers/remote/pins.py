"""The owner's side of a remote read: blocks pinned for a reader, with their
slot addresses and checksums, until it releases them or the hold expires.

A pinned block is never evicted, so its slots are never freed or reused while
the reader may still be reading them (the original's open #403 is a
use-after-free exactly there). The hold the reader asks for covers its own
deadline plus a margin, and the reader reads nothing after the hold it was
granted, so the pin outlives every read of it.

A pin is named by a random 63-bit id and belongs to the host that asked for
it: Checksums and Release from anyone else find nothing, so a peer that holds
the cluster token still cannot guess another reader's pin, and a Release sent
to a restarted owner cannot free a pin that a new reader holds. A request is
pinned up to its first repeated block: one ready hash repeated 65,536 times
must not fill the pin budget, nor be hashed once per copy.

Checksums are xxh3-64 of each slot's bytes bound to the block's key
(pegaflow.tiers.remote.slot_sums.bound), computed the first time a block is
pinned, off the loop and while the reader already reads (it asks for them
with Checksums), and kept while the block stays ready: a ready block's bytes
never change.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import numpy as np

from pegaflow.cache.block_store import BlockEntry, BlockStore
from pegaflow.cache.pool import HostPool
from pegaflow.common.keys import Key, Namespace, PackedHashes

from .slot_sums import SlotHasher, bound

logger = logging.getLogger(__name__)

MAX_HOLD_S = 30.0
MAX_PINS = 4096  # pins held at once; a reader beyond it gets nothing pinned
# Peers may pin at most this share of the pool at once: the rest stays
# evictable, so a burst of readers (or one that never releases) cannot make
# this node's own saves fail for want of a slot.
MAX_PINNED_SHARE = 0.5


@dataclass(slots=True)
class Pin:
    entries: list[BlockEntry]
    expires: float  # time.monotonic()
    checksums: asyncio.Future[np.ndarray]
    nbytes: int
    reader: str  # the host that asked (grpc's peer, without the port)


@dataclass(frozen=True, slots=True)
class Pinned:
    pin_id: int  # 0: nothing pinned
    slots: np.ndarray  # [blocks, shards] uint64
    checksums: np.ndarray | None  # [blocks, shards] uint64; None: ask later
    hold_s: float


NOTHING = Pinned(0, np.zeros((0, 0), np.uint64), None, 0.0)


class PinTable:
    """Runs on the event loop; only checksum computation leaves it."""

    def __init__(self, store: BlockStore, pool: HostPool, hasher: SlotHasher) -> None:
        self._store = store
        self._pool = pool
        self._hasher = hasher
        self._pins: dict[int, Pin] = {}
        self._sums: dict[Key, np.ndarray] = {}  # per ready block, its shards' sums
        self._pinned_bytes = 0
        self._max_pinned_bytes = int(pool.size * MAX_PINNED_SHARE)
        self.expired = 0
        self.refused = 0  # pins refused: too many, or too much of the pool

    def __len__(self) -> int:
        return len(self._pins)

    async def pin(
        self, ns: Namespace, hashes: PackedHashes, hold_s: float, reader: str
    ) -> Pinned:
        if len(self._pins) >= MAX_PINS:
            self.sweep()
            if len(self._pins) >= MAX_PINS:
                self.refused += 1
                return NOTHING
        entries = self._store.lookup(ns, hashes)[0]  # cut at a repeat
        if not entries:
            return NOTHING
        per_block = ns.block_bytes
        if self._pinned_bytes + len(entries) * per_block > self._max_pinned_bytes:
            self.sweep()
            room = (self._max_pinned_bytes - self._pinned_bytes) // per_block
            if room <= 0:
                self.refused += 1
                return NOTHING
            entries = entries[:room]  # the prefix's head: the reader reads that
        nbytes = len(entries) * per_block
        self._pinned_bytes += nbytes
        hold_s = min(hold_s, MAX_HOLD_S)
        self._store.pin(entries)
        pin_id = self._new_id()
        slots = np.array([e.slots for e in entries], np.uint64)
        known = [self._sums.get(e.key) for e in entries]
        sums = asyncio.ensure_future(self._checksums(entries, slots, known, ns))
        expires = time.monotonic() + hold_s
        self._pins[pin_id] = Pin(entries, expires, sums, nbytes, reader)
        ready = np.stack(known) if all(k is not None for k in known) else None
        return Pinned(pin_id, slots, ready, hold_s)

    async def _checksums(
        self,
        entries: list[BlockEntry],
        slots: np.ndarray,
        known: list[np.ndarray | None],
        ns: Namespace,
    ) -> np.ndarray:
        missing = [i for i, s in enumerate(known) if s is None]
        if missing:  # the entries are pinned meanwhile: their bytes stay
            raw = await asyncio.to_thread(
                self._hasher.checksums, self._pool, slots[missing], ns.slot_bytes
            )
            digest = ns.digest
            fresh = bound(digest, [entries[i].key[1] for i in missing], raw)
            for i, row in zip(missing, fresh, strict=True):
                known[i] = row
                if entries[i].ready:
                    self._sums[entries[i].key] = row
        return np.stack(known)

    def _new_id(self) -> int:
        while True:
            pin_id = secrets.randbits(63)
            if pin_id and pin_id not in self._pins:
                return pin_id

    async def checksums(self, pin_id: int, reader: str) -> np.ndarray | None:
        """The pin's checksums once computed; None when the pin is gone (or
        is not this reader's)."""
        pin = self._pins.get(pin_id)
        if pin is None or pin.reader != reader:
            return None
        sums = await asyncio.shield(pin.checksums)
        return sums if pin_id in self._pins else None

    def release(self, pin_id: int, reader: str) -> bool:
        """A reader's Release: False when it holds no such pin."""
        pin = self._pins.get(pin_id)
        if pin is None or pin.reader != reader:
            return False
        self._unpin(pin_id)
        return True

    def _unpin(self, pin_id: int) -> None:
        pin = self._pins.pop(pin_id)
        self._pinned_bytes -= pin.nbytes
        if pin.checksums.done():
            self._store.unpin(pin.entries)
        else:  # the hashing thread still reads the slots: they stay until it ends
            pin.checksums.add_done_callback(lambda _: self._store.unpin(pin.entries))

    def forget(self, keys: list[Key]) -> None:
        """Blocks no longer ready here: their checksums go with them."""
        for key in keys:
            self._sums.pop(key, None)

    def sweep(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        gone = [i for i, p in self._pins.items() if p.expires <= now]
        for pin_id in gone:
            self._unpin(pin_id)
        self.expired += len(gone)
        return len(gone)

    def close(self) -> None:
        for pin_id in list(self._pins):
            self._unpin(pin_id)
