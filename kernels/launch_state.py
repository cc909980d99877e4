"""What the CUDA backend keeps between launches, per stream.

Each stream's two descriptor tables (mapped pinned memory the kernel reads),
used in turn: one is filled while the kernel of the other may still read it,
an event after each launch guarding its reuse. Their lock orders launches on
that stream alone: a launch waiting for its table (the kernel before last on
that stream still reading it) holds up no other stream's launches.

Tables are made by the factory pegaflow.kernels.cuda passes (the driver's
or the simulator's, pegaflow.kernels.device_driver / device_sim).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


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
