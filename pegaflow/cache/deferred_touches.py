"""What the query path owes the eviction policy, paid only when the policy is
next asked (pegaflow.cache.block_store), because prefixes of 2560 blocks are
latency-critical:

- a lease's pins: its entries are counted only when an eviction needs to
  know, so a lease released before then costs no per-block work;
- the LRU touches of hits: applied after the query's reply (a 2560-block
  touch is ~0.3 ms) and always before the policy is next asked or changed,
  so its order is the order of the requests.

Bookkeeping of lists only; the store pins and touches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .block_entry import BlockEntry


class Deferred:
    def __init__(self) -> None:
        self._pins: dict[int, list[BlockEntry]] = {}  # by lease id
        self._hits: list[list[BlockEntry]] = []  # oldest first

    def lease(self, lease_id: int, entries: list[BlockEntry]) -> None:
        self._pins[lease_id] = entries

    def release(self, lease_id: int) -> bool:
        """Whether the lease's pins were still owed: then none is to undo."""
        return self._pins.pop(lease_id, None) is not None

    def take_pins(self) -> list[list[BlockEntry]]:
        owed = list(self._pins.values())
        self._pins.clear()
        return owed

    def hit(self, found: list[BlockEntry], apply: Callable[[], None]) -> None:
        """Owe a touch of `found`; the first one owed schedules `apply` after
        the running loop's current callback, or runs it now without a loop."""
        self._hits.append(found)
        if len(self._hits) > 1:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            apply()
            return
        loop.call_soon(apply)

    def take_hits(self) -> list[list[BlockEntry]]:
        owed, self._hits = self._hits, []
        return owed
