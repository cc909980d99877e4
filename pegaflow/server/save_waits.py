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
    """Saves waiting for blocks other writers have in flight, each woken
    only when one of its own blocks settles (a settle of others' blocks
    costs nothing per waiter: a stalled writer can leave many waiting)."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store
        self._waiting: dict[int, list[asyncio.Future[None]]] = {}  # id(entry)
        store.on_settle = self._settled

    def _settled(self, entries: list[BlockEntry]) -> None:
        if not self._waiting:
            return
        for entry in entries:
            for fut in self._waiting.pop(id(entry), ()):
                if not fut.done():
                    fut.set_result(None)

    async def wait(
        self, entries: list[BlockEntry], mask: int, deadline: float | None
    ) -> np.ndarray:
        """Once none of `entries` is in flight on `mask`'s bits (or at the
        deadline): True for each that did not land on them (its writer
        failed, it left the store, or it is still in flight)."""
        table = self._store.entries
        loop = asyncio.get_running_loop()
        while pending := [
            e for e in entries if table.get(e.key) is e and e.in_flight & mask
        ]:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                break
            fut: asyncio.Future[None] = loop.create_future()
            for e in pending:  # `entries` holds them: their ids stay theirs
                self._waiting.setdefault(id(e), []).append(fut)
            try:
                await asyncio.wait({fut}, timeout=timeout)
            finally:
                for e in pending:
                    waiters = self._waiting.get(id(e))
                    if waiters is not None and fut in waiters:
                        waiters.remove(fut)
                        if not waiters:
                            del self._waiting[id(e)]
        landed = [table.get(e.key) is e and e.landed & mask == mask for e in entries]
        return ~np.array(landed, bool)
