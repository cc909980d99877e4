"""Loads answered in flight (a GPU worker's done_event): the copies the
server still runs after answering, and what ends each.

The copy starts as an eager task where asyncio has them (Python 3.12): it
runs up to its launch inside the Load itself, so the answer goes out without
a turn of the event loop first (~70 us of a 64-block load's 0.6 ms before
its kernel started, on the H100 host, session 18). The engine learns a copy
failed from its connection: the caller's `hang_up` ends it, and the engine's
wait (pegaflow.client.event_wait) watches that connection. Without it the
engine would wait out its whole timeout for an event never recorded.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)

EAGER = sys.version_info >= (3, 12)


def start_copy(copy: Coroutine[Any, Any, None]) -> asyncio.Task:
    """The copy as a task, run at once up to its first wait where possible."""
    loop = asyncio.get_running_loop()  # (3.12's eager start finds none itself)
    if EAGER:
        return asyncio.Task(copy, loop=loop, eager_start=True)  # type: ignore[call-arg]
    return loop.create_task(copy)


class InFlightLoads:
    """The copies of loads already answered, held until they end (the loop
    keeps tasks only weakly)."""

    def __init__(self, counts: Any = None) -> None:
        """counts: a prometheus Counter by `outcome` (answered, failed)."""
        self._copies: set[asyncio.Future] = set()
        self._answered = self._failed = None
        if counts is not None:  # labels() costs a few us: once each
            self._answered = counts.labels("answered")
            self._failed = counts.labels("failed")

    def __len__(self) -> int:
        return len(self._copies)

    async def drain(self, timeout_s: float) -> None:
        """Until every copy held ended (a stopping server: the pool and the
        engines' mappings must outlive them), at most timeout_s."""
        if self._copies:
            await asyncio.wait(set(self._copies), timeout=timeout_s)

    def keep(
        self,
        copy: asyncio.Future,
        hang_up: Callable[[], None] | None,
        answered: bool = True,
    ) -> None:
        """Hold `copy`; should it fail, `hang_up` ends its engine's connection
        (the engine's wait sees it at once). answered: False for the copy of
        a load whose caller left before its answer."""
        self._copies.add(copy)
        copy.add_done_callback(lambda done: self._landed(done, hang_up))
        if answered and self._answered is not None:
            self._answered.inc()

    def _landed(self, copy: asyncio.Future, hang_up: Callable[[], None] | None) -> None:
        self._copies.discard(copy)
        if copy.cancelled() or copy.exception() is None:
            return
        logger.warning("a load answered in flight failed: %s", copy.exception())
        if self._failed is not None:
            self._failed.inc()
        if hang_up is not None:
            hang_up()
