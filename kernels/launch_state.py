"""What the CUDA backend keeps between launches, per stream and per thread.

- Each stream's two descriptor tables (mapped pinned memory the kernel reads),
  used in turn: one is filled while the kernel of the other may still read
  it, an event after each launch guarding its reuse. Their lock orders
  launches on that stream alone: a launch waiting for its table (a staged
  round behind its copy) holds up no other stream's launches.
- Each thread's events for ordering one stream after another (staged rounds
  on two streams), used in rotation.

numba.cuda's objects come in from pegaflow.kernels.cuda, the one module that
imports it: tables are made by the factory it passes, events likewise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .plan import MAX_PARTS

# Events a thread rotates through: a staged round records two, and each is
# waited on within MAX_PARTS rounds, after which it may be recorded again.
MARKS = 2 * MAX_PARTS + 4


class StreamTables:
    """One stream's two tables and its launch lock."""

    __slots__ = ("lock", "tables", "turn")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: list[Any] = [None, None]
        self.turn = 1

    def next(self, rows: int, make: Callable[[int], Any]) -> Any:
        """The stream's next table (of `rows` at least, `make` builds a new
        one), once the kernel last reading it is done; call under `lock`."""
        self.turn ^= 1
        tab = self.tables[self.turn]
        if tab is not None:
            tab.done.synchronize()
        if tab is None or tab.cap < rows:
            tab = self.tables[self.turn] = make(rows)
        return tab


class EventRotation(threading.local):
    """A thread's events for ordering one stream after another."""

    def __init__(self, make_event: Callable[[], Any]) -> None:
        self._make = make_event
        self.events: list[Any] = []
        self.next = 0

    def take(self) -> Any:
        if len(self.events) < MARKS:
            self.events.append(self._make())
            return self.events[-1]
        self.next = (self.next + 1) % MARKS
        return self.events[self.next]
