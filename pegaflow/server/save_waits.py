"""A save's deduplication against a block still landing, made good.

A save that meets a block another writer has in flight on the same layers
(another engine's save, a lower tier's load, a restarted server's check of a
recovered block: pegaflow.server.pool_check) copies nothing of it. That writer
may still fail: its copy errors or ends past its deadline, the recovered block
fails its checksum or is evicted before its check. Answered "deduplicated" at
once, the block the engine offered would then be stored nowhere. So the save
waits, within its own deadline, for those blocks to land, and copies the ones
that did not itself (Engine.save). Waiting is on the event loop, woken by the
store whenever blocks in flight land or go (BlockStore.on_settle), never by
polling.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.block_store import BlockStore


class Landings:
    """Saves waiting for blocks other writers have in flight."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store
        self._next: asyncio.Future[None] | None = None  # the next settle
        store.on_settle = self._settled

    def _settled(self) -> None:
        fut, self._next = self._next, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(
        self, entries: list[BlockEntry], mask: int, deadline: float | None
    ) -> np.ndarray:
        """Once none of `entries` is in flight on `mask`'s bits (or at the
        deadline): True for each that did not land on them (its writer
        failed, it left the store, or it is still in flight)."""
        table = self._store.entries
        while any(table.get(e.key) is e and e.in_flight & mask for e in entries):
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                break
            if self._next is None:
                self._next = asyncio.get_running_loop().create_future()
            await asyncio.wait({self._next}, timeout=timeout)
        landed = [table.get(e.key) is e and e.landed & mask == mask for e in entries]
        return ~np.array(landed, bool)
